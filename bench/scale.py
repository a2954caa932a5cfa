"""The scale harness (issue 32, `make bench-scale`; docs/benchmarks.md, "Scale"): what storage
requests, metadata and time a job costs as it grows from W = 8 to 4,096 ranks on N = 1 to 256
nodes, with the real client library, real agents and real storage.

Each simulated node is one `scale_driver save` process (bench/scale_driver.cc) playing W/N ranks
as threads, with its own shm directory and so its own agent, every node writing the one
checkpoint directory. Every rank saves --steps steps of a --bytes state, each persisted by its
node's agent (retention: --keep), waits for the last step to commit and closes; the agents then
exit by themselves (every rank closed; any left is sent SIGTERM, then SIGKILL). Then the job
restores: one `scale_driver restore` per node, each loading its ranks' shards one after the
other through LoadShard (what `safepoint.load` calls), counting each rank's requests.

Measured, from the agents' own counters (their STATUS reply's `storage_requests`, summed over
every agent of the job): storage requests per committed step by op, metadata bytes per committed
step; split into image publishes (one `put` per image persisted, from the agents' event logs),
the other requests of persist and commit (listing, the header reads and stats of commit
checks, the COMMIT record and job records) and retention (`delete`, `cleanup`). Writes (`create`,
`write`) are the images' and the few small records' together. Time: from the last image of a
step durable to its COMMIT record's commit time (POSIX only: the images' mtimes; steps that
retention kept), and, for every store, from the last rank's save of the last step to every
rank's wait returning. Restore: the whole job's requests (sum over ranks), per rank, its wall
time (all nodes' restores at once) and the slowest rank's.

Storage: POSIX always (a directory under --dir); S3 and RADOS where the throwaway Ceph is up
($SAFEPOINT_TEST_S3_URI / $SAFEPOINT_TEST_RADOS_URI, which scripts/with-ceph.sh exports), else
skipped, saying so.

    python bench/scale.py [--configs 8x1,64x8,...] [--stores posix,s3,rados] [--steps 4]
                          [--keep 2] [--bytes 1048576] [--out build/bench/scale.json]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPS = ("list", "head", "get", "create", "write", "put", "delete", "cleanup")
# Every (W, N) of the issue with W >= N. What this 2-core, 24 GiB machine runs in reasonable
# time by default is DEFAULT_CONFIGS (docs/benchmarks.md, "Scale", says what is left out, why).
ALL_CONFIGS = [(w, n) for w in (8, 64, 512, 4096) for n in (1, 8, 64, 256) if w >= n]
# Left out by default: W = 4,096 on one node (one agent persisting 4 GiB a step, each of its 4,096
# persists listing a step directory of up to 4,096 images: well over a quarter of an hour here).
DEFAULT_CONFIGS = [c for c in ALL_CONFIGS if c != (4096, 1)]


def find_binary(build_dir: str, name: str) -> str:
    for cand in (os.path.join(build_dir, name), os.path.join(ROOT, ".venv", "bin", name)):
        if os.access(cand, os.X_OK):
            return cand
    found = shutil.which(name)
    if not found:
        sys.exit(f"scale: {name} not found in {build_dir} (make build-tests builds it)")
    return found


def agents_of(shm_dir: str) -> list[int]:
    """Live safepointd processes whose command line names `shm_dir`."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if argv and os.path.basename(argv[0]) == b"safepointd" and shm_dir.encode() in argv:
            out.append(int(pid))
    return out


def stop_agents(shm_dir: str, grace: float = 30.0, own_exit: float = 10.0) -> int:
    """Shuts down every agent of `shm_dir`: those that do not exit by themselves within
    `own_exit` (every rank closed: the agent finishes and exits) are sent SIGTERM, and SIGKILL
    after `grace`; returns how many had to be sent a signal."""
    deadline = time.monotonic() + own_exit
    while time.monotonic() < deadline and agents_of(shm_dir):
        time.sleep(0.05)
    pids = agents_of(shm_dir)
    for p in pids:
        try:
            os.kill(p, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and agents_of(shm_dir):
        time.sleep(0.05)
    for p in agents_of(shm_dir):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(pids)


def add(into: dict, counts: dict) -> None:
    for k, v in counts.items():
        if isinstance(v, (int, float)):
            into[k] = into.get(k, 0) + v


def read_events(path: str) -> list[dict]:
    events = []
    for p in (path + ".1", path):
        if os.path.exists(p):
            with open(p) as f:
                for line in f:
                    try:
                        events.append(json.loads(line))
                    except ValueError:
                        pass
    return events


class AgentLogKeeper:
    """Keeps the agents' logs of a run (--keep-agent-logs): an agent unlinks its log at a clean
    exit, so while the run goes each node's log is hard-linked (same file system: the shm
    directory's) into `dest`, named by node."""

    def __init__(self, shms: list[str], dest: str):
        self.shms, self.dest = shms, dest
        os.makedirs(dest, exist_ok=True)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(0.05):
            for i, shm in enumerate(self.shms):
                for log in glob.glob(os.path.join(shm, "*", "agent.log")):
                    target = os.path.join(self.dest, f"node{i}-agent.log")
                    if not os.path.exists(target):
                        try:
                            os.link(log, target)
                        except OSError:
                            pass

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def run_config(w: int, n: int, store: str, base_uri: Optional[str], args, driver: str,
               agent: str) -> dict:
    """One job of w ranks on n nodes against one store; returns its measurements."""
    per_node = w // n
    work = tempfile.mkdtemp(prefix=f"scale-{w}x{n}-", dir=args.dir)
    tag = uuid.uuid4().hex[:8]
    uri = os.path.join(work, "ckpt") if store == "posix" else f"{base_uri}/scale-{w}x{n}-{tag}"
    job = f"scale-{w}x{n}-{tag}"
    # Short shm paths: the agent's socket lives under shm_dir/<job>/ (a length limit).
    shms = [tempfile.mkdtemp(prefix="sps-", dir=args.shm_base) for _ in range(n)]
    # The commit relay (the agents' membership, as the Python layer gives it): on by default
    # where the job spans nodes, as in a training job; --no-relay measures storage alone.
    relay = args.relay and n > 1
    peers = os.path.join(work, "peers")
    if relay:
        os.makedirs(peers)
    logs = [os.path.join(work, f"events-{i}.jsonl") for i in range(n)]
    result: dict = {"W": w, "N": n, "store": store, "ranks_per_node": per_node,
                    "steps": args.steps, "keep": args.keep, "bytes": args.bytes}
    keeper = None
    if getattr(args, "keep_agent_logs", None):
        # Beside the shm directories (a hard link needs the same file system).
        logs_dir = os.path.join(args.shm_base or tempfile.gettempdir(),
                                f"{args.keep_agent_logs}-{job}")
        keeper = AgentLogKeeper(shms, logs_dir)
        result["agent_logs"] = logs_dir
    try:
        t0 = time.time()
        procs = []
        for i in range(n):
            cmd = [driver, "save", "--storage", uri, "--job", job, "--shm-dir", shms[i],
                   "--agent", agent, "--event-log", logs[i], "--world", str(w),
                   "--rank-base", str(i * per_node), "--ranks", str(per_node),
                   "--steps", str(args.steps), "--keep", str(args.keep),
                   "--bytes", str(args.bytes), "--timeout", str(args.timeout)]
            if relay:
                cmd += ["--peers", peers, "--node-index", str(i), "--nodes", str(n)]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True))
        outs = []
        for i, p in enumerate(procs):
            try:
                out, err = p.communicate(timeout=args.timeout)
            except subprocess.TimeoutExpired as e:
                for q in procs:
                    q.kill()
                raise RuntimeError(f"node {i}: save did not finish in {args.timeout} s") from e
            if p.returncode != 0:
                raise RuntimeError(f"node {i}: save failed ({p.returncode}): {err.strip()[-2000:]}")
            outs.append(json.loads(out.strip().splitlines()[-1]))
        result["save_wall_s"] = time.time() - t0
        # The agents exit once every rank of their node closed; stop any left (and count them).
        result["agents_left_running"] = sum(stop_agents(s) for s in shms)

        # Requests: the sum over every agent of the job (each one's own counters).
        agent_req: dict = {}
        for o in outs:
            for counts in o["agent_status"].get("storage_requests", {}).values():
                add(agent_req, counts)
        result["agent_requests"] = agent_req
        result["relay"] = relay
        relays = [o["agent_status"].get("commit_relay") for o in outs]
        if relay and all(relays):
            result["relay_counters"] = {k: sum(r[k] for r in relays) for k in relays[0]
                                        if k != "committer"}
        events = [e for log in logs for e in read_events(log)]
        persists = [e for e in events if e.get("event") == "persist" and e.get("tier", 0) == 0
                    and not e.get("superseded") and e.get("bytes", 0) > 0]
        committed_steps = sorted({e["step"] for e in events
                                  if e.get("event") == "commit" and e.get("tier", 0) == 0})
        failures = [e for e in events if e.get("event") == "failure"]
        result["images_persisted"] = len(persists)
        result["committed_steps"] = len(committed_steps)
        result["failures"] = len(failures)
        if failures:
            result["failure_sample"] = failures[:3]
        steps = max(1, len(committed_steps))
        per_step = {k: agent_req.get(k, 0) / steps for k in OPS + ("requests", "metadata_bytes")}
        per_step["image_publishes"] = len(persists) / steps
        per_step["retention"] = per_step["delete"] + per_step["cleanup"]
        per_step["commit_and_metadata"] = (per_step["requests"] - per_step["retention"]
                                           - per_step["create"] - per_step["write"]
                                           - per_step["image_publishes"])
        result["per_committed_step"] = per_step

        # Time: last save of the last step -> every rank's wait returned (all stores).
        result["last_save_to_committed_s"] = (max(o["waited"] for o in outs)
                                              - max(o["last_step_saved"] for o in outs))
        commits = subprocess.run([driver, "commits", "--storage", uri], capture_output=True,
                                 text=True, timeout=args.timeout)
        records = json.loads(commits.stdout)["commits"] if commits.returncode == 0 else []
        lags = []
        if store == "posix":
            for r in records:
                imgs = glob.glob(os.path.join(uri, f"step-{r['step']:020d}", "*.img"))
                if len(imgs) >= w:
                    newest = max(os.stat(p).st_mtime_ns for p in imgs)
                    lags.append((r["commit_time_ns"] - newest) / 1e9)
        result["durable_to_commit_s"] = {"steps": len(lags), "max": max(lags) if lags else None,
                                         "mean": sum(lags) / len(lags) if lags else None}

        # Restore, twice: each rank finding the newest step itself (LoadShard without a step,
        # what safepoint.load does), and the job finding it once (one process: StepsWithCommit
        # and NewestCommitted), every rank then loading that step against the COMMIT record the
        # lookup read, handed to it (LoadShard with the record: the ranks read no COMMIT).
        result["restore"] = restore_job(driver, uri, w, n, args)
        record = os.path.join(work, "newest-commit-record")
        newest = subprocess.run([driver, "newest", "--storage", uri, "--record-out", record],
                                capture_output=True, text=True, timeout=args.timeout)
        if newest.returncode != 0:
            raise RuntimeError(f"newest: {newest.stderr.strip()[-2000:]}")
        lookup = json.loads(newest.stdout.strip().splitlines()[-1])
        shared = restore_job(driver, uri, w, n, args, record=record)
        shared["lookup"] = lookup["total"]
        shared["lookup_s"] = lookup["seconds"]
        job = dict(shared["job"])
        add(job, lookup["total"])
        shared["job_with_lookup"] = job
        result["restore_shared"] = shared
        return result
    finally:
        if keeper is not None:
            keeper.close()
        for s in shms:
            stop_agents(s, grace=5, own_exit=0)
            shutil.rmtree(s, ignore_errors=True)
        if not args.keep_files:
            shutil.rmtree(work, ignore_errors=True)
            # Object stores: the steps retention left stay under their unique prefix of the
            # throwaway cluster.


def restore_job(driver: str, uri: str, w: int, n: int, args, step: Optional[int] = None,
                record: Optional[str] = None) -> dict:
    """Every rank of the job loads its shard: one process per node (at most --restore-procs at
    once), its ranks one after the other (exact requests per rank). `record`: a file holding the
    COMMIT record the job's lookup read, which every rank loads its image against."""
    per_node = w // n

    def restore(i: int) -> dict:
        cmd = [driver, "restore", "--storage", uri, "--world", str(w),
               "--rank-base", str(i * per_node), "--ranks", str(per_node),
               "--bytes", str(args.bytes)]
        if step is not None:
            cmd += ["--step", str(step)]
        if record is not None:
            cmd += ["--record", record]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        if p.returncode != 0:
            raise RuntimeError(f"node {i}: restore failed: {p.stderr.strip()[-2000:]}")
        return json.loads(p.stdout.strip().splitlines()[-1])

    t1 = time.time()
    with ThreadPoolExecutor(max_workers=min(n, args.restore_procs)) as pool:
        restores = list(pool.map(restore, range(n)))
    wall = time.time() - t1
    job_req: dict = {}
    for r in restores:
        add(job_req, r["total"])
    ranks = [pr for r in restores for pr in r["per_rank"]]
    keys = OPS + ("requests", "metadata_bytes")
    return {
        "wall_s": wall,
        "slowest_rank_s": max(pr["seconds"] for pr in ranks),
        "mean_rank_s": sum(pr["seconds"] for pr in ranks) / len(ranks),
        "steps": sorted({pr["step"] for pr in ranks}),
        "job": job_req,
        "per_rank_mean": {k: job_req.get(k, 0) / len(ranks) for k in keys},
        "per_rank_max": {k: max(pr[k] for pr in ranks) for k in keys},
        "per_rank_min": {k: min(pr[k] for pr in ranks) for k in keys},
    }


def fmt(v, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}" if v != int(v) or digits > 1 else str(int(v))
    return str(v)


def tables(results: list[dict]) -> str:
    out = []
    for w in sorted({r["W"] for r in results}):
        rows = [r for r in results if r["W"] == w and "error" not in r]
        out.append(f"\n#### W = {w}\n")
        out.append("Save, per committed step (sum over every agent of the job):\n")
        out.append("| store | N | requests | image publishes | commit + metadata | retention "
                   "| list | head | get | create | write | put | delete | metadata KiB "
                   "| durable -> commit (s) | last save -> committed (s) |")
        out.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            p = r["per_committed_step"]
            lag = r["durable_to_commit_s"]["max"]
            out.append("| " + " | ".join([
                r["store"] + ("" if r.get("relay", r["N"] > 1) or r["N"] == 1 else " (no relay)"),
                str(r["N"]), fmt(p["requests"]), fmt(p["image_publishes"]),
                fmt(p["commit_and_metadata"]), fmt(p["retention"]), fmt(p["list"]),
                fmt(p["head"]), fmt(p["get"]), fmt(p["create"]), fmt(p["write"]), fmt(p["put"]),
                fmt(p["delete"]), fmt(p["metadata_bytes"] / 1024), fmt(lag, 3),
                fmt(r["last_save_to_committed_s"], 3)]) + " |")
        out.append("\nRestore of the whole job, every rank through LoadShard: `each` = every "
                   "rank finds the newest step itself (as `safepoint.load` does), `once` = one "
                   "lookup for the job (one List, one COMMIT read), then every rank loads that "
                   "step against the record the lookup read, handed to it:\n")
        out.append("| store | N | how | job requests | job list | job head | job get "
                   "| per rank (min-max) | per rank list/head/get | metadata KiB | wall (s) "
                   "| slowest rank (s) |")
        out.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            for how, s in (("each", r.get("restore")), ("once", r.get("restore_shared"))):
                if s is None:
                    continue
                j = s.get("job_with_lookup", s["job"])
                lo, hi, m = s["per_rank_min"], s["per_rank_max"], s["per_rank_mean"]
                out.append("| " + " | ".join([
                    r["store"], str(r["N"]), how, str(j.get("requests", 0)),
                    str(j.get("list", 0)), str(j.get("head", 0)), str(j.get("get", 0)),
                    f"{lo['requests']}-{hi['requests']}",
                    f"{fmt(m['list'])}/{fmt(m['head'])}/{fmt(m['get'])}",
                    fmt(j.get("metadata_bytes", 0) / 1024), fmt(s["wall_s"], 2),
                    fmt(s["slowest_rank_s"], 3)]) + " |")
        for r in results:
            if r["W"] == w and "error" in r:
                out.append(f"\n{r['store']} N = {r['N']}: failed: {r['error']}")
    return "\n".join(out)


def parse_configs(text: str) -> list[tuple[int, int]]:
    if text == "all":
        return ALL_CONFIGS
    out = []
    for part in text.split(","):
        w, n = (int(x) for x in part.lower().split("x"))
        if w < n or w % n:
            sys.exit(f"scale: {part}: W must be a multiple of N")
        out.append((w, n))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default=",".join(f"{w}x{n}" for w, n in DEFAULT_CONFIGS),
                    help="WxN,... (or 'all': every W in 8,64,512,4096 and N in 1,8,64,256)")
    ap.add_argument("--stores", default="posix,s3,rados")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--keep", type=int, default=2)
    ap.add_argument("--bytes", type=int, default=1 << 20)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--restore-procs", type=int, default=8)
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build", "py"))
    ap.add_argument("--dir", default=None, help="where POSIX checkpoints go (default: /tmp)")
    ap.add_argument("--shm-base", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    ap.add_argument("--out", default=os.path.join(ROOT, "build", "bench", "scale.json"))
    ap.add_argument("--keep-files", action="store_true")
    ap.add_argument("--keep-agent-logs", metavar="PREFIX", default=None,
                    help="keep every node's agent log of each run in --shm-base/PREFIX-JOB (an "
                    "agent removes its log at a clean exit)")
    ap.add_argument("--no-relay", dest="relay", action="store_false",
                    help="no commit relay: the agents commit through storage alone")
    ap.add_argument("--tables", nargs="+", metavar="JSON",
                    help="print the tables of earlier result files (merged) and exit")
    args = ap.parse_args()
    if args.tables:
        merged = []
        for path in args.tables:
            with open(path) as f:
                merged += json.load(f)["results"]
        print(tables(merged))
        return 0

    driver = find_binary(args.build_dir, "scale_driver")
    agent = find_binary(args.build_dir, "safepointd")
    stores = []
    for s in args.stores.split(","):
        if s == "posix":
            stores.append(("posix", None))
            continue
        var = {"s3": "SAFEPOINT_TEST_S3_URI", "rados": "SAFEPOINT_TEST_RADOS_URI"}[s]
        if os.environ.get(var):
            stores.append((s, os.environ[var]))
        else:
            print(f"scale: skipping {s}: no throwaway Ceph (${var} unset; `make bench-scale` "
                  "runs under scripts/with-ceph.sh, which starts one where it can)", flush=True)
    results = []
    for w, n in parse_configs(args.configs):
        for store, base in stores:
            t = time.time()
            print(f"scale: W={w} N={n} {store} ...", end=" ", flush=True)
            try:
                r = run_config(w, n, store, base, args, driver, agent)
                p = r["per_committed_step"]
                print(f"{time.time() - t:.0f} s: {p['requests']:.0f} requests/step, restore "
                      f"{r['restore']['job'].get('requests', 0)} requests", flush=True)
            except Exception as e:  # noqa: BLE001 - one config's failure is reported, not fatal
                r = {"W": w, "N": n, "store": store, "error": str(e)}
                print(f"failed: {e}", flush=True)
            results.append(r)
            os.makedirs(os.path.dirname(args.out), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump({"results": results, "steps": args.steps, "keep": args.keep,
                           "bytes": args.bytes}, f, indent=1)
    print(tables(results))
    print(f"\nscale: results in {args.out}")
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
