"""The Python layer at scale, and DCP side by side (issue 32 items 1 and 6;
`make bench-scale-torch`, docs/benchmarks.md, "Python layer and DCP, W = 2..64").

For each W, W real processes (gloo over the loopback, CPU tensors) hold a small DDP-like state
per rank: a replicated 64 KiB "model" (the same on every rank) and a rank-local 256 KiB
"optimizer shard" (its key names the rank, DCP's convention for a tensor one rank holds).

- safepoint: each rank makes a ``Checkpointer`` (keep=3; one agent serves the node) and saves
  --saves steps, each ``save()`` + ``wait()`` (persisted and committed: durable, like DCP's
  synchronous save), then closes (the snapshots leave memory). A fresh set of W processes
  then restores the newest step from storage into zeroed targets (``restore(state)``, the
  default shared reads) --restores times, checking every byte.
- DCP: ``torch.distributed.checkpoint.save`` of the same state to a directory per step with
  its ``FileSystemWriter`` (one file per rank, fsync), then in a fresh set of processes
  ``dcp.load`` of the newest into zeroed targets with its ``FileSystemReader``. Same root
  directory, same file system.

Measured in every process, the same way for both:
- time: each operation starts after a barrier; its time is the slowest rank's. Save: the
  median over the saves after the first (the first plans: safepoint gathers the replicas'
  tensor lists, DCP its save plan, which it caches from then on); restore/load: the median.
- collectives: every torch.distributed collective and point-to-point function is wrapped (the
  module attributes, which both libraries call through); each outermost call counts once, with
  its time. Per save (the steady-state saves) and per restore.
- storage requests: a second run of each phase under ``strace -f`` (every rank, and with it the
  agent a rank starts: it is a descendant), counting the file system calls that name a path under
  the checkpoint root or act on a descriptor opened there (``strace -y``), between the first
  rank's start marker and the last rank's end marker (a ``stat`` of a marker path each rank makes
  around its measured operations): opens, stats, directory reads (getdents64), reads, writes,
  renames/links, unlinks, fsyncs, mkdirs. The same syscalls for both libraries; the timing runs
  are not traced.

    python bench/scale_torch.py [--ws 2,4,8,16,32,64] [--saves 4] [--restores 3]
                                [--count-ws 2,...] [--no-count] [--libs safepoint,dcp]
                                [--out build/bench/scale_torch.json]

(--libs safepoint: safepoint alone, e.g. to measure it before and after a change; the table's
DCP columns are then "-".)

Prints a Markdown table (ratios against DCP in the same run) and writes every number as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from typing import Any, Optional

from collective_count import CollectiveCounter
from run import free_port
from scale import stop_agents  # bench/scale.py: the same shutdown of a job's agents

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = 64 << 10  # bytes of the replicated model
SHARD = 256 << 10  # bytes of each rank's own shard
MARK_BEGIN, MARK_END = ".scale-torch-begin", ".scale-torch-end"

# Each syscall strace reports -> the kind of request it is.
KINDS = {
    "open": "open", "openat": "open", "creat": "open",
    "stat": "stat", "lstat": "stat", "newfstatat": "stat", "statx": "stat", "access": "stat",
    "faccessat": "stat", "faccessat2": "stat", "fstat": "stat",
    "getdents64": "list", "getdents": "list",
    "read": "read", "pread64": "read", "readv": "read", "preadv": "read", "preadv2": "read",
    "write": "write", "pwrite64": "write", "writev": "write", "pwritev": "write",
    "pwritev2": "write", "copy_file_range": "write", "fallocate": "write", "ftruncate": "write",
    "rename": "rename", "renameat": "rename", "renameat2": "rename", "link": "rename",
    "linkat": "rename",
    "unlink": "unlink", "unlinkat": "unlink", "rmdir": "unlink",
    "fsync": "fsync", "fdatasync": "fsync", "sync_file_range": "fsync", "syncfs": "fsync",
    "mkdir": "mkdir", "mkdirat": "mkdir",
}
P2P = ("send", "recv", "isend", "irecv", "batch_isend_irecv")
KIND_ORDER = ("open", "stat", "list", "read", "write", "rename", "unlink", "fsync", "mkdir")


# -- one rank ------------------------------------------------------------------------------------

def _state(step: int, rank: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(MODEL // 4, generator=g)},
            "opt": {f"shard{rank}": torch.full((SHARD // 4,), float(rank * 1000 + step))},
            "step": step}


def _zeros(tree: Any) -> Any:
    import torch

    if isinstance(tree, dict):
        return {k: _zeros(v) for k, v in tree.items()}
    return torch.zeros_like(tree) if isinstance(tree, torch.Tensor) else 0


def _equal(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def _mark(root: str, name: str) -> None:
    try:
        os.stat(os.path.join(root, name))  # absent: one traced stat, the marker
    except OSError:
        pass


def rank_main(argv: list[str]) -> None:
    lib, phase, root, shm, job, port, rank_s, world_s, n_s = argv
    rank, world, n = int(rank_s), int(world_s), int(n_s)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    counting = CollectiveCounter(on=False)
    ops: list[dict] = []
    ok = True
    if lib == "safepoint":
        import safepoint

        path = os.path.join(root, "sp")
        with safepoint.Checkpointer(path, job=job, shm_dir=shm, keep=3) as ck:
            newest = max(safepoint.steps(path)) if phase != "save" else 0
            dist.barrier()
            _mark(root, MARK_BEGIN)
            if phase == "save":
                for step in range(1, n + 1):
                    state = _state(step, rank)
                    ops.append(counting.measure(
                        lambda s=step, st=state: (ck.save(s, st), ck.wait())))
            else:
                for _ in range(n):
                    target = _zeros(_state(0, rank))
                    got: list = []
                    ops.append(counting.measure(lambda g=got, t=target: g.append(ck.restore(t))))
                    ok = ok and got[0] == newest and _equal(target, _state(newest, rank))
            dist.barrier()
            _mark(root, MARK_END)
    else:
        import torch.distributed.checkpoint as dcp

        if phase == "save":
            dist.barrier()
            _mark(root, MARK_BEGIN)
            for step in range(1, n + 1):
                state = _state(step, rank)
                where = os.path.join(root, "dcp", f"step-{step}")
                ops.append(counting.measure(
                    lambda st=state, d=where: dcp.save(st, storage_writer=dcp.FileSystemWriter(d))))
            if rank == 0:
                with open(os.path.join(root, "dcp", "newest"), "w") as f:
                    f.write(str(n))
        else:
            with open(os.path.join(root, "dcp", "newest")) as f:
                newest = int(f.read())
            dist.barrier()
            _mark(root, MARK_BEGIN)
            for _ in range(n):
                target = _zeros(_state(0, rank))
                where = os.path.join(root, "dcp", f"step-{newest}")
                ops.append(counting.measure(
                    lambda t=target, d=where: dcp.load(t, storage_reader=dcp.FileSystemReader(d))))
                ok = ok and _equal(target, _state(newest, rank))
        dist.barrier()
        _mark(root, MARK_END)
    print(json.dumps({"rank": rank, "ops": ops, "ok": ok}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


# -- the driver ----------------------------------------------------------------------------------

def launch(lib: str, phase: str, w: int, root: str, shm: str, job: str, n: int,
           trace_dir: Optional[str], timeout: float) -> list[dict]:
    """Runs the W ranks of one phase; with trace_dir, each under strace. The JSON of each rank."""
    port = str(free_port())
    procs = []
    files = []
    for r in range(w):
        argv = [sys.executable, os.path.abspath(__file__), "--rank", lib, phase, root, shm, job,
                port, str(r), str(w), str(n)]
        if trace_dir:
            argv = ["strace", "-f", "-y", "-qq", "-ttt", "-e",
                    "trace=" + ",".join(sorted(KINDS) + ["execve", "clone", "clone3", "fork",
                                                         "vfork"]), "-o",
                    os.path.join(trace_dir, f"{lib}-{phase}-{r}.trace")] + argv
        out = tempfile.TemporaryFile("w+")
        err = tempfile.TemporaryFile("w+")
        files.append((out, err))
        procs.append(subprocess.Popen(argv, stdout=out, stderr=err, text=True, cwd=ROOT))
    # A rank's last line is its JSON; under strace the strace process also waits for the agent
    # that rank started (a descendant): once every rank printed, the agent is stopped.
    deadline = time.monotonic() + timeout

    def printed(out: Any) -> bool:
        out.seek(0)
        lines = out.read().strip().splitlines()
        return bool(lines) and lines[-1].startswith('{"rank"')

    while not all(p.poll() is not None or printed(o) for p, (o, _) in zip(procs, files)):
        if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
            break
        time.sleep(0.2)
    if lib == "safepoint":
        stop_agents(shm, grace=10, own_exit=20)
    results = []
    for p, (out, err) in zip(procs, files):
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        out.seek(0)
        err.seek(0)
        text = out.read()
        if p.returncode != 0:
            raise RuntimeError(f"{lib} {phase} W={w}: a rank failed:\n{text}\n"
                               f"{err.read()[-3000:]}")
        results.append(json.loads(text.strip().splitlines()[-1]))
    return results


_LINE = re.compile(r"^(\d+)\s+(\d+\.\d+)\s+([a-z0-9_]+)\((.*)$")


def count_requests(trace_dir: str, prefix: str, root: str) -> dict:
    """The file system calls under `root` in the traces of `prefix`, between the first begin
    marker and the last end marker, by kind: the ranks' (the process each trace starts with)
    and, apart, the agent's (every other process: safepointd and its threads)."""
    events = []
    begins, ends = [], []
    for name in os.listdir(trace_dir):
        if not name.startswith(prefix):
            continue
        rank_pid = None
        with open(os.path.join(trace_dir, name), errors="replace") as f:
            for line in f:
                m = _LINE.match(line)
                if not m:
                    continue
                pid, t, call, rest = m.group(1), float(m.group(2)), m.group(3), m.group(4)
                rank_pid = rank_pid or pid
                if MARK_BEGIN in rest:
                    begins.append(t)
                elif MARK_END in rest:
                    ends.append(t)
                elif root in rest and call in KINDS:
                    events.append((t, KINDS[call], pid, name))
    lo, hi = min(begins), max(ends)
    agents = _agent_pids(trace_dir, prefix)
    out: dict = {}
    for who, keep in (("ranks", lambda p: p not in agents), ("agent", lambda p: p in agents)):
        counts = Counter(kind for t, kind, pid, _ in events if lo <= t <= hi and keep(pid))
        out[who] = {k: counts.get(k, 0) for k in KIND_ORDER}
        out[who]["total"] = sum(counts.values())
    out["total"] = out["ranks"]["total"] + out["agent"]["total"]
    return out


_CLONE = re.compile(r"^(clone3?|fork|vfork)\(.*\)\s+=\s+(\d+)")


def _agent_pids(trace_dir: str, prefix: str) -> set[str]:
    """The pids (processes and threads: strace -f names each thread by its id) of the agent: the
    process that exec'd safepointd and everything it cloned from then on."""
    children: dict[str, list[str]] = {}
    roots: set[str] = set()
    for name in os.listdir(trace_dir):
        if not name.startswith(prefix):
            continue
        with open(os.path.join(trace_dir, name), errors="replace") as f:
            for line in f:
                m = _LINE.match(line)
                if not m:
                    continue
                pid, call = m.group(1), m.group(3)
                if call == "execve" and "safepointd" in m.group(4).split(",")[0]:
                    roots.add(pid)
                    children[pid] = []  # what it cloned before the exec is not the agent
                c = _CLONE.match(call + "(" + m.group(4))
                if c:
                    children.setdefault(pid, []).append(c.group(2))
    out: set[str] = set()
    todo = list(roots)
    while todo:
        p = todo.pop()
        if p not in out:
            out.add(p)
            todo.extend(children.get(p, []))
    return out


def job_numbers(outs: list[dict], skip_first: bool) -> dict:
    """The slowest rank's time per operation (median over operations), collectives per
    operation (rank 0's, every rank runs the same) and their time (slowest rank, median)."""
    n = len(outs[0]["ops"])
    first = 1 if skip_first and n > 1 else 0
    times = [max(o["ops"][i]["seconds"] for o in outs) for i in range(first, n)]
    coll = [max(o["ops"][i]["collective_seconds"] for o in outs) for i in range(first, n)]
    calls = [outs[0]["ops"][i]["calls"] for i in range(first, n)]
    # point-to-point messages (safepoint's shared reads) apart: they move data to the ranks that
    # need it; the collectives are every other call
    p2p = [max(sum(c in P2P for c in o["ops"][i]["calls"]) for o in outs)
           for i in range(first, n)]
    # the bytes a rank received in the collectives (the most of any rank; p2p apart)
    received = [max(sum(b for c, b in zip(o["ops"][i]["calls"], o["ops"][i]["received"])
                        if c not in P2P) for o in outs) for i in range(first, n)]
    # each collective's time (the slowest rank's, median over operations), in call order
    def own(o: dict, i: int) -> list:  # a rank's collectives of operation i, p2p apart
        op = o["ops"][i]
        return [sec for c, sec in zip(op["calls"], op["call_seconds"]) if c not in P2P]

    names = [c for c in calls[0] if c not in P2P]
    split = [(c, statistics.median(max(own(o, i)[j] for o in outs) for i in range(first, n)))
             for j, c in enumerate(names)]
    return {"seconds": statistics.median(times), "collective_seconds": statistics.median(coll),
            "collective_split": split,
            "collective_bytes": statistics.median(received),
            "collectives": statistics.mean(sum(c not in P2P for c in cs) for cs in calls),
            "p2p_max_per_rank": statistics.mean(p2p),
            "calls": Counter(c for cs in calls for c in cs),
            "first_seconds": max(o["ops"][0]["seconds"] for o in outs),
            "first_calls": outs[0]["ops"][0]["calls"],
            "ok": all(o["ok"] for o in outs)}


def run_w(w: int, args: argparse.Namespace, count: bool) -> dict:
    base = tempfile.mkdtemp(prefix=f"sct{w}-", dir=args.dir)
    result: dict = {"w": w}
    try:
        for traced in ([False, True] if count else [False]):
            root = os.path.join(base, "traced" if traced else "timed")
            os.makedirs(os.path.join(root, "dcp"))
            trace_dir = os.path.join(base, "traces") if traced else None
            if trace_dir:
                os.makedirs(trace_dir, exist_ok=True)
            shm = tempfile.mkdtemp(prefix="sct-")
            job = f"sct{w}-{os.getpid()}-{int(traced)}"
            try:
                for lib in args.libs:
                    for phase, n in (("save", args.saves), ("restore", args.restores)):
                        t0 = time.monotonic()
                        outs = launch(lib, phase, w, root, shm, job, n, trace_dir, args.timeout)
                        key = f"{lib}_{phase}"
                        if traced:
                            result[key]["requests"] = count_requests(
                                trace_dir, f"{lib}-{phase}-", root)
                        else:
                            result[key] = job_numbers(outs, skip_first=phase == "save")
                        print(f"  W={w:3} {lib:9} {phase:7} {'traced' if traced else 'timed':6}"
                              f" {time.monotonic() - t0:5.1f} s", flush=True)
            finally:
                stop_agents(shm, grace=10, own_exit=0)
                shutil.rmtree(shm, ignore_errors=True)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
        else:
            print(f"  kept {base}")
    return result


def table(results: list[dict]) -> str:
    head = ("| W | save, safepoint | vs DCP | restore, safepoint | vs DCP | collectives per save "
            "(sp / DCP) | per restore (sp / DCP) | their time per save, per restore (sp) | "
            "collective bytes a rank receives per restore (sp / DCP) | "
            "requests per save (sp / DCP) | per restore (sp / DCP) |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|")
    rows = [head]
    for r in results:
        none = {"seconds": float("nan"), "collectives": float("nan")}  # a library not run
        ss, sr, ds, dr = (r["safepoint_save"], r["safepoint_restore"], r.get("dcp_save", none),
                          r.get("dcp_restore", none))

        def req(x: dict, per: float) -> str:
            q = x.get("requests")
            return f"{q['total'] / per:.0f}" if q else "-"

        rows.append(
            f"| {r['w']} | {ss['seconds'] * 1e3:.1f} ms | {ss['seconds'] / ds['seconds']:.2f}x "
            f"| {sr['seconds'] * 1e3:.1f} ms | {sr['seconds'] / dr['seconds']:.2f}x "
            f"| {ss['collectives']:g} / {ds['collectives']:g} "
            f"| {sr['collectives']:g} / {dr['collectives']:g} "
            f"| {ss['collective_seconds'] * 1e3:.1f} ms, {sr['collective_seconds'] * 1e3:.1f} ms "
            f"| {sr['collective_bytes']:,.0f} / {dr.get('collective_bytes', float('nan')):,.0f} "
            f"| {req(ss, SAVES[0])} / {req(ds, SAVES[0])} "
            f"| {req(sr, RESTORES[0])} / {req(dr, RESTORES[0])} |")
    return "\n".join(rows)


SAVES = [4]
RESTORES = [3]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ws", default="2,4,8,16,32,64")
    p.add_argument("--count-ws", default=None, help="the W also traced (default: every W)")
    p.add_argument("--no-count", action="store_true", help="no strace runs")
    p.add_argument("--saves", type=int, default=4)
    p.add_argument("--restores", type=int, default=3)
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: $TMPDIR)")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--keep", action="store_true", help="keep the checkpoints and traces")
    p.add_argument("--libs", default="safepoint,dcp", help="the libraries measured")
    p.add_argument("--out", default=os.path.join(ROOT, "build", "bench", "scale_torch.json"))
    args = p.parse_args()
    SAVES[0], RESTORES[0] = args.saves, args.restores
    args.libs = [x for x in ("safepoint", "dcp") if x in args.libs.split(",")]
    if not args.no_count and shutil.which("strace") is None:
        print("scale_torch: strace not found: storage requests not counted", flush=True)
        args.no_count = True
    ws = [int(x) for x in args.ws.split(",")]
    count_ws = set(ws if args.count_ws is None else (int(x) for x in args.count_ws.split(",")))
    results = []
    for w in ws:
        results.append(run_w(w, args, count=not args.no_count and w in count_ws))
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"saves": args.saves, "restores": args.restores, "model_bytes": MODEL,
                       "shard_bytes": SHARD, "results": results}, f, indent=1, default=dict)
    print(table(results))
    for r in results:
        print(f"W={r['w']}: " + "; ".join(
            f"{k} {dict(r[k]['calls'])} requests {r[k].get('requests')}"
            for k in ("safepoint_save", "safepoint_restore", "dcp_save", "dcp_restore")
            if k in r))
    bad = [r["w"] for r in results if not all(r[k]["ok"] for k in
                                              ("safepoint_restore", "dcp_restore") if k in r)]
    if bad:
        sys.exit(f"scale_torch: a restore was not bit-exact at W = {bad}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        rank_main(sys.argv[2:])
    else:
        main()
