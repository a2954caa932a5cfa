"""safepoint benchmark: peer replication (docs/replication.md) on nodes made of network namespaces.

    make bench-replication          # or (root): python bench/replication.py [--size 256M]

Rewrites the "Peer replication" section of docs/benchmarks.md. Nodes are tests/common/nodes.py's
network namespaces, each with its own /dev/shm, on one bridge (veth pairs): every byte a node
sends goes through the host's kernel TCP stack, on the same 2 shared cores that run the ranks
and the agents. One rank per node. In one run, with references measured in the same run:

1. **Link references**: iperf3 (one stream node0 -> node1, and three at once in a ring, as the
   mirror's pushes go) and ``ucx_perftest -t ucp_am_bw`` (UCX_TLS=tcp) node0 -> node1.
2. **Replication throughput**: 3 nodes, ``redundancy="mirror"``, ``replication_bandwidth=0``,
   --size of state per rank; from save() return until ``wait()`` returned (the newest snapshot
   is on its peer), and the agent's own push seconds and bytes (``status()["replication"]``).
   The same on 4 nodes with ``"ec:2+1"``.
3. **Blocking time** of save with redundancy and without (a second Checkpointer of another job
   in the same processes, saves alternated A B B A).
4. **Restore after a node loss**: node 1 is killed (its processes and /dev/shm), replaced by an
   empty node, the job restarts and restores: node 1's rank from its peer's memory; then node 1
   is lost again and the job restarts without redundancy, so that node 1's rank reads the same
   step from storage (page cache dropped).
5. **Training slowdown**: 3-node DDP (gloo) on examples/tiny_gpt.py, blocks of steps without
   checkpoints, with a flash save every step, with a flash save every step and mirror.
6. **lm-resiliency 0.2.0** (GEMINI's in-memory peer checkpoint over Gloo), when installed: the
   same state and nodes, save blocking time, time to replicated, recovery after a node loss.
7. **Memory per node**: the bytes in each node's /dev/shm (slots, replicas) and the agent's
   ``held_bytes``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, "tests", "common"))

from run import MiB, drop_caches, machine, parse_size, publish, run_took  # noqa: E402
from nodes import Cluster, Job, unavailable  # noqa: E402

WORKER = os.path.join(HERE, "workloads", "repl_worker.py")
# `make bench-replication` installs lm-resiliency here (pip --target --no-deps: it would pull
# another torch) when the environment lacks it; appended, so the environment's packages win.
LMRES_DEPS = os.path.join(REPO, "build", "bench", "lmres-deps")
if os.path.isdir(LMRES_DEPS):
    sys.path.append(LMRES_DEPS)
GB = 1e9
med = statistics.median


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --- link references ---------------------------------------------------------------------------

iperf_cpu: list[float] = []  # CPU seconds (sender + receiver) per GB of every iperf3 stream


def iperf(c: Cluster, pairs: list[tuple[int, int]], seconds: float = 3.0) -> list[float]:
    """Bytes/s of one iperf3 TCP stream per (src, dst) pair, all at once."""
    servers = [c[d].popen(["iperf3", "-s", "-1", "-p", str(5201 + i)], stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL) for i, (_, d) in enumerate(pairs)]
    time.sleep(0.5)
    clients = [c[s].popen(["iperf3", "-c", c[d].addr, "-p", str(5201 + i), "-t", str(seconds),
                           "-J"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for i, (s, d) in enumerate(pairs)]
    out = []
    for p in clients:
        o, e = p.communicate(timeout=60)
        d = json.loads(o)
        if "error" in d:
            raise RuntimeError(f"iperf3: {d['error']}")
        out.append(d["end"]["sum_received"]["bits_per_second"] / 8)
        cpu = d["end"].get("cpu_utilization_percent", {})
        sent = d["end"]["sum_received"]["bytes"]
        secs = d["end"]["sum_received"]["seconds"]
        iperf_cpu.append((cpu.get("host_total", 0) + cpu.get("remote_total", 0)) / 100 * secs
                         / (sent / GB))
    for s in servers:
        s.wait(timeout=30)
    return out


_ucx_port = 13336


def ucx_perftest(c: Cluster, size: int = 4 * MiB, iters: int = 100) -> dict:
    """ucx_perftest -t ucp_am_bw node0 -> node1 over TCP (UCX's own MB = 2^20 bytes)."""
    env = dict(os.environ, UCX_TLS="tcp", UCX_NET_DEVICES="eth0")
    global _ucx_port
    _ucx_port += 1
    port = str(_ucx_port)
    server = c[1].popen(["ucx_perftest", "-p", port], env=env, stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL)
    time.sleep(1.5)
    r = c[0].run(["ucx_perftest", c[1].addr, "-p", port, "-t", "ucp_am_bw", "-s", str(size),
                  "-n", str(iters), "-w", "5", "-f"], env=env, timeout=120)
    try:
        server.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    line = [ln for ln in r.stdout.splitlines() if ln.strip() and ln.strip()[0].isdigit()]
    if r.returncode != 0 or not line:
        raise RuntimeError(f"ucx_perftest failed ({r.returncode}): {r.stdout[-500:]} {r.stderr[-500:]}")
    f = line[-1].split()
    return {"bytes_per_s": float(f[5]) * MiB, "msg": size, "iters": iters}


def shm_write(c: Cluster, nbytes: int) -> dict:
    """Write rates into node 0's /dev/shm (a tmpfs of its own), 8 MiB writes: into a new,
    fallocate'd file (pages the kernel has to find and zero: what a receiver pays when it writes
    a replica into a new file) and again into the same file (pages that exist)."""
    buf = bytearray(os.urandom(1 << 20)) * 8
    path = c[0].shm / "bench-first-touch"
    out = {}
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for kind in ("fresh", "rewrite"):
            if kind == "fresh":
                os.posix_fallocate(fd, 0, nbytes)
            os.lseek(fd, 0, os.SEEK_SET)
            t0 = time.perf_counter()
            left = nbytes
            while left > 0:
                left -= os.write(fd, memoryview(buf)[:min(len(buf), left)])
            out[kind] = nbytes / (time.perf_counter() - t0)
    finally:
        os.close(fd)
        os.unlink(path)
    return out


def agent_cpu(c: Cluster) -> list[dict]:
    """CPU seconds (user + system) of every safepointd in the nodes, with its command line."""
    tick = os.sysconf("SC_CLK_TCK")
    out = []
    for node in c:
        for pid in node.processes():
            try:
                cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
                if "safepointd" not in cmd:
                    continue
                f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out.append({"node": node.name, "cmd": cmd[-300:], "cpu_s": (int(f[11]) + int(f[12])) / tick})
    return out


def ucx_ring(c: Cluster, size: int = 4 * MiB, iters: int = 40) -> list[float]:
    """ucx_perftest am_bw node i -> i+1 for every node at once (as the pushes go): bytes/s of
    each."""
    global _ucx_port
    env = dict(os.environ, UCX_TLS="tcp", UCX_NET_DEVICES="eth0")
    n = len(c)
    ports = []
    servers = []
    for i in range(n):
        _ucx_port += 1
        ports.append(str(_ucx_port))
        servers.append(c[(i + 1) % n].popen(["ucx_perftest", "-p", ports[i]], env=env,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    time.sleep(1.5)
    clients = [c[i].popen(["ucx_perftest", c[(i + 1) % n].addr, "-p", ports[i], "-t",
                           "ucp_am_bw", "-s", str(size), "-n", str(iters), "-w", "5", "-f"],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for i in range(n)]
    out = []
    for p in clients:
        o, e = p.communicate(timeout=120)
        line = [ln for ln in o.splitlines() if ln.strip() and ln.strip()[0].isdigit()]
        if p.returncode != 0 or not line:
            raise RuntimeError(f"ucx_perftest ring failed ({p.returncode}): {o[-300:]} {e[-300:]}")
        out.append(float(line[-1].split()[5]) * MiB)
    for s in servers:
        try:
            s.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(s.pid, signal.SIGKILL)
            s.wait()
    return out


def links(c: Cluster, nbytes: int, first: bool = True) -> dict:
    """The references, measured twice per cluster (before and after its replication runs):
    ucx_perftest spins while it waits, so on these shared cores it varies from run to run."""
    out: dict = {}
    n = len(c)
    out["iperf_one"] = iperf(c, [(0, 1)], 2.0)[0]
    out["iperf_ring"] = iperf(c, [(i, (i + 1) % n) for i in range(n)], 2.0)
    out["ucx_runs"], out["ucx_errors"] = [], []
    for _ in range(3):
        try:
            out["ucx_runs"].append(ucx_perftest(c, iters=40)["bytes_per_s"])
        except Exception as e:  # noqa: BLE001 - reported
            out["ucx_errors"].append(str(e))
    try:
        out["ucx_ring"] = ucx_ring(c)
    except Exception as e:  # noqa: BLE001 - reported
        out["ucx_errors"].append(str(e))
    if first:
        out["shm"] = shm_write(c, nbytes)
    return out


# --- memory per node ---------------------------------------------------------------------------

def shm_dirs(shm: str) -> dict:
    """Allocated bytes under a /dev/shm, per top directory (a job's), split into replica files
    (those being received included), spares (pruned replica files the store keeps to reuse their
    pages) and the rest (slots, control files). bench/memory.py sums it per node."""
    use: dict = {}
    for root, _, files in os.walk(shm):
        rel = os.path.relpath(root, shm)
        top = rel.split(os.sep)[0]
        in_replicas = "replicas" in rel.split(os.sep)
        for f in files:
            try:
                b = os.lstat(os.path.join(root, f)).st_blocks * 512
            except OSError:
                continue
            kind = ("spares" if f.startswith(".spare-") else "replicas") if in_replicas \
                else "slots"
            use.setdefault(top, {"slots": 0, "replicas": 0, "spares": 0})[kind] += b
    return use


def shm_usage(c: Cluster) -> list[dict]:
    """Per node: shm_dirs of its /dev/shm."""
    return [{"node": node.name, "dirs": shm_dirs(node.shm)} for node in c]


# --- save / restore with a redundancy ----------------------------------------------------------

def expect_all(job: Job, kind: str, what: str) -> list[dict]:
    """Every rank's `kind` line; when that fails, the job is killed and the ranks' stderr raised."""
    try:
        return job.expect_all(kind)
    except BaseException:
        job.kill()
        raise RuntimeError(f"{what} failed:\n" + "\n".join(r.stderr() for r in job.ranks))


def restart_loading(job: Job, args, a: dict, name: str, redundancy, what: str):
    """The job again, loading its newest step (with `redundancy`): the job and what each rank
    loaded."""
    job = job.restart(["load", json.dumps({"size": args.size, "ckpt": a["ckpt_on"],
                                           "job": name, "redundancy": redundancy})])
    return job, expect_all(job, "loaded", what)


def save_restore(c: Cluster, redundancy: str, args, work: str, with_off: bool,
                 restore: bool) -> dict:
    tag = redundancy.replace(":", "").replace("+", "p") + f"-{len(c)}n"
    name = f"bench-{tag}-{os.getpid()}"
    a = {"size": args.size, "runs": args.runs, "warmup": 2, "redundancy": redundancy,
         "ckpt_on": os.path.join(work, f"ckpt-{tag}"), "job_on": name}
    if with_off:
        a.update(ckpt_off=os.path.join(work, f"ckpt-{tag}-off"), job_off=name + "-off")
    out: dict = {"redundancy": redundancy, "nodes": len(c)}
    log(f"{redundancy}: save job on {len(c)} nodes")
    job = Job(c, WORKER, ["save", json.dumps(a)])
    saved = expect_all(job, "saved", "save job")
    out["saved"] = saved
    out["shm"] = shm_usage(c)
    out["agents"] = agent_cpu(c)
    if not restore:
        job.kill()
        return out
    step = saved[0]["step"]
    log(f"{redundancy}: node 1 lost; restore from peers")
    c[1].kill()
    c.replace(1)
    job, out["peer"] = restart_loading(job, args, a, name, redundancy, "peer restore")
    out["rebuilt"] = agent_rebuilds(c[1])
    log(f"{redundancy}: node 1 lost again; restore without redundancy (storage for node 1)")
    job.kill()
    c[1].kill()
    c.replace(1)
    out["cache"] = drop_caches([a["ckpt_on"]])
    job, out["storage"] = restart_loading(job, args, a, name, None, "storage restore")
    job.kill()
    out["step"] = step
    return out


def agent_rebuilds(node) -> list[dict]:
    """The agent log's "rebuilt N bytes from peers X in T s" lines of a node."""
    import re

    out = []
    for p in node.shm.glob("safepoint-*/agent.log"):
        for m in re.finditer(r"rank (\d+) step (\d+): rebuilt (\d+) bytes from peers (\S+) in "
                             r"([\d.]+) s", p.read_text(errors="replace")):
            out.append({"rank": int(m[1]), "step": int(m[2]), "bytes": int(m[3]),
                        "peers": m[4], "seconds": float(m[5])})
    return out


def train(c: Cluster, args, work: str, gemini: bool, pin: bool = False) -> dict:
    """3-node DDP, blocks of steps per mode. `pin`: each rank (and its threads) on CPU 0, the
    node agents on CPU 1, so that the agents' work does not take the ranks' core: what is left
    of the slowdown is what they share (memory bandwidth, the kernel's network stack)."""
    t = "pinned-" if pin else ""
    a = {"dim": args.dim, "layers": args.layers, "batch": 8, "steps": args.train_steps,
         "blocks": args.train_blocks, "redundancy": "mirror", "pin": pin,
         "ckpt_on": os.path.join(work, f"train-{t}on"),
         "job_on": f"bench-train-{t}{os.getpid()}",
         "ckpt_off": os.path.join(work, f"train-{t}off"),
         "job_off": f"bench-train-{t}off-{os.getpid()}",
         "gemini": gemini, "gemini_folder": os.path.join(work, f"gemini-train-{t}"),
         "gemini_run_id": f"train-{t}{os.getpid()}"}
    log(f"training: DDP on 3 nodes{' (ranks on CPU 0, agents on CPU 1)' if pin else ''}")
    job = Job(c, WORKER, ["train", json.dumps(a)])
    try:
        out = job.expect_all("trained")
        job.wait()
    except BaseException:
        job.kill()
        raise RuntimeError("train job failed:\n" + "\n".join(r.stderr() for r in job.ranks))
    return {"ranks": out, "args": a, "agents": agent_cpu(c)}


def run_gemini(c: Cluster, args, work: str) -> dict:
    a = {"size": args.size, "runs": args.runs, "warmup": 1,
         "folder": os.path.join(work, "gemini"), "run_id": f"gemini-{os.getpid()}"}
    out: dict = {}
    log("lm-resiliency: save job")
    job = Job(c, WORKER, ["gemini", json.dumps(a)])
    lines = [read_json_line(r, ("gemini_saved", "gemini_error")) for r in job.ranks]
    out["saved"] = lines
    if any(k != "gemini_saved" for k, _ in lines):
        job.kill()
        return out
    log("lm-resiliency: node 1 lost, SIGTERM to the others, restart")
    t0 = time.perf_counter()
    c[1].kill()
    for r in job.ranks:
        if r.node.index != 1 and r.proc.poll() is None:
            # the rank is the nsenter's child: signal the python process in the node
            for pid in r.node.processes():
                try:
                    if b"repl_worker.py" in open(f"/proc/{pid}/cmdline", "rb").read():
                        os.kill(pid, signal.SIGTERM)
                except OSError:
                    pass
    codes = []
    for r in job.ranks:
        if r.node.index == 1:
            continue
        try:
            codes.append(r.proc.wait(timeout=60))
        except subprocess.TimeoutExpired:
            codes.append("hung")
    out["flush_s"] = time.perf_counter() - t0
    out["exit_codes"] = codes
    out["flush_stderr"] = [r.stderr()[-1500:] for r in job.ranks if r.node.index != 1]
    c.replace(1)
    out["cache"] = drop_caches([a["folder"]])
    job = job.restart(["gemini-load", json.dumps(a)])
    out["loaded"] = [read_json_line(r, ("gemini_loaded",)) for r in job.ranks]
    try:
        job.wait(timeout=120)
    except BaseException:  # noqa: BLE001
        job.kill()
    out["load_stderr"] = [r.stderr()[-1500:] for r in job.ranks]
    return out


def read_json_line(r, kinds=None) -> tuple[str, dict]:
    """The next "KIND {json}" line of a rank (of one of `kinds`, if given); ("exited",
    {"stderr": ...}) if the rank ended first."""
    while True:
        fields = r.out.next()
        if fields is None:
            return "exited", {"stderr": r.stderr()[-2000:]}
        if fields and (kinds is None or fields[0] in kinds) and len(fields) > 1 and \
                fields[1].startswith("{"):
            return fields[0], json.loads(" ".join(fields[1:]))


# --- report ------------------------------------------------------------------------------------

def per_rep_max(saved: list[dict], mode: str, key: str) -> list[float]:
    """Per repetition, the slowest rank's figure."""
    cols = [s["results"][mode][key] for s in saved]
    return [max(v) for v in zip(*cols)]


def fmt_range(v: list[float], digits: int = 3) -> str:
    return f"{med(v):.{digits}f} ({min(v):.{digits}f}–{max(v):.{digits}f})"


def render(res: dict, args, conditions: str) -> str:
    L: list[str] = []
    L.append(f"Measured {datetime.date.today().isoformat()} on {machine()}.")
    L.append(f"Command: `make bench-replication` (`python bench/replication.py --size "
             f"{args.size // MiB}M --runs {args.runs}`). {conditions}")
    L.append("")
    L.append("Nodes are network namespaces (tests/common/nodes.py), each with its own /dev/shm, "
             "joined by veth pairs on one bridge: every byte between nodes goes through the "
             "host kernel's TCP stack, on the same 2 cores that run every rank, agent and "
             "iperf3. One rank per node, one torch thread per rank. Figures are medians "
             f"(range) of {args.runs} repetitions after a warm-up; per repetition the slowest "
             "rank's figure.")
    L.append("")
    L.append("### Link references (same run)")
    L.append("")
    L.append("Measured on each cluster, before its replication runs (and, on the 3-node "
             "cluster, again after them). iperf3: TCP, 2 s; the ring is one stream per node "
             "(node i -> i+1) at once, as the pushes go. `ucx_perftest -t ucp_am_bw` "
             "(the transfer the agents use: UCP active messages) node0 -> node1 with "
             "UCX_TLS=tcp, 4 MiB messages, 3 runs (median, range): it polls while it waits, so "
             "on these shared, loaded cores it varies most.")
    L.append("")
    L.append("| cluster | iperf3 1 stream GB/s | iperf3 ring, per stream GB/s | ring sum GB/s | "
             "ucx_perftest am_bw GB/s | ucx_perftest ring, per stream GB/s |")
    L.append("|---|---:|---:|---:|---:|---:|")
    refs: dict = {}
    for key, label, n in (("links", "3 nodes, before", 3), ("links_after", "3 nodes, after", 3),
                          ("links4", "4 nodes, before", 4)):
        lk = res.get(key)
        if not lk:
            continue
        ring, ucx = lk["iperf_ring"], lk.get("ucx_runs") or []
        refs.setdefault(n, {"one": [], "ring": [], "ucx": []})
        refs[n]["one"].append(lk["iperf_one"])
        refs[n]["ring"].extend(ring)
        refs[n]["ucx"].extend(ucx)
        u = (f"{med(ucx) / GB:.2f} ({min(ucx) / GB:.2f}–{max(ucx) / GB:.2f})" if ucx else
             f"failed: {'; '.join(lk.get('ucx_errors', []))[:200]}")
        ur = lk.get("ucx_ring") or []
        refs[n].setdefault("ucx_ring", []).extend(ur)
        urs = f"{med(ur) / GB:.2f} ({min(ur) / GB:.2f}–{max(ur) / GB:.2f})" if ur else "–"
        L.append(f"| {label} | {lk['iperf_one'] / GB:.2f} | {med(ring) / GB:.2f} "
                 f"({min(ring) / GB:.2f}–{max(ring) / GB:.2f}) | {sum(ring) / GB:.2f} | {u} | "
                 f"{urs} |")
    if res.get("iperf_cpu"):
        ic = res["iperf_cpu"]
        L.append("")
        L.append(f"iperf3's own CPU time (sender + receiver, its `cpu_utilization_percent`) per "
                 f"GB moved: {med(ic):.2f} s (range {min(ic):.2f}–{max(ic):.2f}).")
    sh = (res.get("links") or {}).get("shm") or {}
    if sh:
        L.append("")
        L.append(f"Writing {args.size // MiB} MiB (8 MiB write() calls) into a node's /dev/shm: "
                 f"into a new fallocate'd file {sh['fresh'] / GB:.2f} GB/s, into the same file "
                 f"again {sh['rewrite'] / GB:.2f} GB/s (the fallocate itself not timed). A "
                 "receiver writes a replica into the file of one it pruned (a spare) when it "
                 "keeps one: only when `max_shm_bytes` leaves room for it (docs/operations.md, "
                 "\"Host memory\"); this bench sets no cap, so every push gets fresh pages.")

    # throughput, blocking, time to protected
    L.append("")
    L.append("### Replication throughput, blocking time, time until protected")
    L.append("")
    L.append("Every rank saves at once (each node pushes its snapshot to the next node(s) while "
             "receiving from its predecessor(s)), `replication_bandwidth=0`, `persist=False` "
             "(nothing goes to storage in these saves). **push** = the agent's own `seconds` and "
             "`bytes` of the rank's last push (`status()[\"replication\"][\"ranks\"]`); **until "
             "protected** = from save() return until `wait()` returned (the snapshot is on its "
             "peers). References: the same cluster's iperf3 ring stream (all nodes send at "
             "once), a lone iperf3 stream, and ucx_perftest (medians of the measurements above). "
             "Two warm-up rounds, so that both slots of every rank have been written once "
             "(the first saves are listed below the table). **agents' CPU s per GB sent**: the "
             "CPU time (user + system) of the replicating job's agents over the timed saves "
             "(each agent sends its rank's snapshot and receives another's) per GB they sent: "
             "a sender's and a receiver's work per GB, as iperf3's figure above; "
             "`make bench-interference` breaks it down.")
    L.append("")
    L.append("| redundancy | nodes | state a rank | blocking save, off | blocking save, on | "
             "until protected s | push s | sent a rank | push GB/s | vs iperf3 ring stream | "
             "vs 1 iperf3 stream | vs ucx_perftest | vs ucx_perftest ring stream | "
             "agents' CPU s per GB sent |")
    L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    firsts = []
    for key in ("mirror", "ec", "mirror4"):
        r = res.get(key)
        if not r or "saved" not in r:
            continue
        ref = refs.get(r["nodes"], {})
        ring = med(ref["ring"]) if ref.get("ring") else None
        one = med(ref["one"]) if ref.get("one") else None
        ucx = med(ref["ucx"]) if ref.get("ucx") else None
        ucxr = med(ref["ucx_ring"]) if ref.get("ucx_ring") else None
        saved = r["saved"]
        nbytes = saved[0]["bytes"]
        # the agents' CPU time over the timed saves (after the warm-ups; each agent sends its
        # rank's snapshot and receives its predecessor's), per GB sent
        tot = sum(len(x["results"]["on"]["block"]) * x["push"].get("bytes", 0) for x in saved)
        cpu = sum(x.get("agent_cpu_runs_s") or 0 for x in saved)
        cpu_per_gb = f"{cpu / (tot / GB):.2f}" if tot and cpu else "–"
        on_b = per_rep_max(saved, "on", "block")
        off_b = per_rep_max(saved, "off", "block") if "off" in saved[0]["results"] else None
        prot = per_rep_max(saved, "on", "protected")
        push_s = per_rep_max(saved, "on", "push_s")
        sent = max(max(s["results"]["on"]["push_bytes"]) for s in saved)
        rate = sent / med(push_s)
        flags = all(all(s["results"]["on"]["protected_flag"]) for s in saved)
        vs = lambda x: f"{rate / x:.0%}" if x else "–"  # noqa: E731
        L.append(f"| `{r['redundancy']}` | {r['nodes']} | {nbytes / MiB:.0f} MiB | "
                 f"{fmt_range(off_b) if off_b else '–'} | {fmt_range(on_b)} | {fmt_range(prot)} | "
                 f"{fmt_range(push_s)} | {sent / MiB:.0f} MiB | {rate / GB:.2f} | "
                 f"{vs(ring)} | {vs(one)} | {vs(ucx)} | {vs(ucxr)} | {cpu_per_gb} |")
        if not flags:
            firsts.append(f"`{r['redundancy']}` on {r['nodes']} nodes: some pushes were not "
                          "protected at their step.")
        for m in saved[0]["results"]:
            fb = per_rep_max(saved, m, "first_block") if "first_block" in saved[0]["results"][m] \
                else []
            fp = per_rep_max(saved, m, "first_protected") if fb else []
            if fb:
                firsts.append(f"`{r['redundancy']}` on {r['nodes']} nodes, redundancy "
                              f"{m}: the first two saves (each into a slot not written before) "
                              f"blocked {', '.join(f'{x:.3f}' for x in fb)} s, protected after "
                              f"{', '.join(f'{x:.3f}' for x in fp)} s.")
    if firsts:
        L.append("")
        L.extend(f"- {f}" for f in firsts)
    # restore
    L.append("")
    L.append("### Restore after losing a node")
    L.append("")
    L.append("Node 1 is killed (every process, its /dev/shm) and replaced by an empty node; the "
             "job restarts. **peer**: with redundancy, node 1's rank rebuilds its snapshot from "
             "peer memory (the agent fetches it into a slot, then a hot reload). **storage**: "
             "node 1 lost again, the job restarts without redundancy and node 1's rank reads "
             "the same step from storage (page cache dropped before). `restore()` seconds of "
             "the replaced node's rank (and, for reference, of a surviving rank, from its own "
             "memory); every restored state was compared with what was saved.")
    L.append("")
    L.append("`restore()` is collective (the ranks agree on a step, then check that every rank "
             "read it): a survivor's figure includes waiting for node 1's rank; node 1's "
             "agent's own rebuild time (its log) is listed below the table.")
    L.append("")
    L.append("| redundancy | step | node 1 from peers s | node 1 from storage s | storage / peers | "
             "peer GB/s | node 1's `last_restore.seconds` (peer / storage) | survivor (memory) "
             "s | Checkpointer() on the new node s | sources (peer run) | bit-identical |")
    L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")
    for key in ("mirror", "ec"):
        r = res.get(key)
        if not r or "peer" not in r:
            continue
        p1, s1 = r["peer"][1], r["storage"][1]
        nbytes = r["saved"][1]["bytes"]
        ok = all(x.get("equal") for x in r["peer"] + r["storage"])
        srcs = ", ".join(f"{x['source']}" for x in r["peer"])
        ssrc = s1["source"]
        L.append(f"| `{r['redundancy']}` | {p1['step']} | {p1['restore_s']:.3f} "
                 f"({p1['source']}, from {p1['peers']}) | {s1['restore_s']:.3f} ({ssrc}) | "
                 f"{s1['restore_s'] / p1['restore_s']:.2f}x | {nbytes / p1['restore_s'] / GB:.2f} | "
                 f"{p1['seconds']:.3f} / {s1['seconds']:.3f} | "
                 f"{r['peer'][0]['restore_s']:.3f} | {p1['start_s']:.3f} | {srcs} | "
                 f"{'yes' if ok else 'NO'} |")
    for key in ("mirror", "ec"):
        r = res.get(key)
        for rb in (r or {}).get("rebuilt", []):
            L.append("")
            L.append(f"- `{r['redundancy']}`: node 1's agent rebuilt rank {rb['rank']}'s step "
                     f"{rb['step']} ({rb['bytes'] / MiB:.0f} MiB) from {rb['peers']} in "
                     f"{rb['seconds']:.3f} s ({rb['bytes'] / rb['seconds'] / GB:.2f} GB/s): "
                     "fetch, checks, (ec) decode, into the slot; the rest of node 1's restore "
                     "is the agreement and the verified copy into the live tensors.")
    # memory
    L.append("")
    L.append("### Memory per node")
    L.append("")
    L.append("Allocated bytes in each node's /dev/shm after the last save (the replicated job's "
             "directory: its two slots per rank, the replicas it holds for other nodes, and the "
             "spares: files of pruned replicas the store keeps, when `max_shm_bytes` leaves room "
             "(none here), so that the next push reuses their pages instead of fresh ones the "
             "kernel must zero), and the agent's `held_bytes` (spares included); S = one "
             "rank's snapshot image.")
    L.append("")
    L.append("| redundancy | node | slots MiB | replicas MiB | spares MiB | held_bytes MiB | "
             "replicas / S | expected replicas / S | (replicas + spares) / S |")
    L.append("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for key in ("mirror", "ec", "mirror4"):
        r = res.get(key)
        if not r or "shm" not in r:
            continue
        exp = {"mirror": "1", "ec:2+1": "1.5"}.get(r["redundancy"], "?")
        img = r["saved"][0]["bytes"]
        for n, s in zip(r["shm"], r["saved"]):
            job = [v for k, v in n["dirs"].items() if "-off" not in k and "train" not in k]
            slots = sum(v["slots"] for v in job)
            reps = sum(v["replicas"] for v in job)
            spares = sum(v.get("spares", 0) for v in job)
            L.append(f"| `{r['redundancy']}` | {n['node']} | {slots / MiB:.0f} | "
                     f"{reps / MiB:.0f} | {spares / MiB:.0f} | "
                     f"{(s.get('held_bytes') or 0) / MiB:.0f} | "
                     f"{reps / img:.2f} | {exp} | {(reps + spares) / img:.2f} |")
    # training
    t = res.get("train")
    tp = res.get("train_pinned")
    if t and "ranks" in t:
        L.append("")
        L.append("### Training slowdown (3-node DDP)")
        L.append("")
        rk = t["ranks"]
        a = t["args"]
        L.append(f"examples/tiny_gpt.py (dim {a['dim']}, {a['layers']} layers, "
                 f"{rk[0]['params'] / 1e6:.1f} M parameters; model + AdamW state "
                 f"{rk[0]['state_bytes'] / MiB:.0f} MiB a rank), DDP over gloo, batch 8 x 64 "
                 f"tokens a rank; {a['blocks']} blocks of {a['steps']} steps per mode, modes "
                 "alternated (A B C, C B A, ...), a save every step with `persist=False`; the first "
                 "step of each block is not counted. Step time = forward, backward, optimizer "
                 "step and the save call (the slowest rank's median; DDP keeps the ranks in "
                 "step).")
        L.append("")
        L.append("Two jobs, one after the other on fresh nodes: **shared cores**: the 3 ranks and "
                 "the 6 node agents (a flash-only and a mirror job per node) on the machine's 2 "
                 "cores as the scheduler places them, so an agent's CPU time is taken from the "
                 "ranks; **pinned**: every rank (and its threads) on CPU 0, every agent (all its "
                 "threads, `sched_setaffinity` right after the Checkpointers started them) on CPU "
                 "1, so that what is left of the slowdown is what the agents share with the "
                 "ranks: memory bandwidth, caches and the kernel's network stack (a veth frame is "
                 "processed on the sending CPU). The 3 ranks share one core when pinned, so "
                 "their step is slower than with 2 cores; the comparison is each job's own "
                 "'none'.")
        L.append("")
        pin_ok = tp and "ranks" in tp
        L.append("**rank CPU s** = the rank process's own CPU time (user + system, all its "
                 "threads) a step, the median of the slowest rank: work the same step costs "
                 "more of (cache and memory-bandwidth interference, kernel work done in the "
                 "rank's context) shows there, waiting does not.")
        L.append("")
        if pin_ok:
            L.append("| mode | shared cores: step s | vs no checkpoint | save call s | rank CPU s "
                     "| pinned: step s | vs no checkpoint | save call s | rank CPU s |")
            L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        else:
            L.append("| mode | step s | vs no checkpoint | save call s | rank CPU s |")
            L.append("|---|---:|---:|---:|---:|")

        def cols(rows: list, m: str) -> str:
            base = max(x["step_s"]["none"] for x in rows)
            st = max(x["step_s"][m] for x in rows)
            sv = max(x["save_s"][m] for x in rows)
            cpu = [(x.get("cpu_s") or {}).get(m) for x in rows]
            c = f"{max(cpu):.3f}" if None not in cpu else "–"
            return f"{st:.3f} | {st / base:.3f}x | {sv:.4f} | {c}"

        for m in rk[0]["step_s"]:
            if m not in ("none", "flash", "flash+mirror") and pin_ok:
                continue
            row = f"| {m} | {cols(rk, m)} |"
            if pin_ok:
                row += f" {cols(tp['ranks'], m)} |"
            L.append(row)
        for label, tt in (("shared cores", t), ("pinned", tp if pin_ok else None)):
            if not tt:
                continue
            ag = tt.get("agents") or []
            ta = tt["args"]
            on = sum(x["cpu_s"] for x in ag if ta["job_on"] in x["cmd"])
            off = sum(x["cpu_s"] for x in ag if ta["job_off"] in x["cmd"])
            nsteps = ta["blocks"] * ta["steps"]
            if ag:
                L.append("")
                L.append(f"{label}: CPU time of the node agents over the whole job (all nodes): "
                         f"the mirror job's agents {on:.1f} s, the flash-only job's {off:.1f} s, "
                         f"for {nsteps} saves each: {on / nsteps:.3f} s vs {off / nsteps:.3f} s "
                         "a save.")
        if pin_ok:
            r0 = tp["ranks"]
            L.append("")
            L.append(f"Pinning read back at the end of the pinned job: ranks on CPUs "
                     f"{sorted({c for x in r0 for c in x['rank_cpus']})}, agents on CPUs "
                     f"{sorted({c for x in r0 for cs in x['agent_cpus'] for c in cs})} "
                     f"({sum(len(x['agent_cpus']) for x in r0)} agents).")
        pushes = rk[0].get("pushes")
        if pushes:
            L.append("")
            L.append(f"Rank 0's agent in the mirror mode (shared cores): pushes ok {pushes[0]}, "
                     f"superseded {pushes[1]}, failed {pushes[2]}"
                     + (f"; pinned: {tp['ranks'][0]['pushes'][0]}, "
                        f"{tp['ranks'][0]['pushes'][1]}, {tp['ranks'][0]['pushes'][2]}"
                        if pin_ok and tp["ranks"][0].get("pushes") else "")
                     + " (a push is superseded when the rank overwrites the slot before it is "
                     "sent; pushes coalesce to the newest snapshot).")
        if rk[0].get("gemini_error"):
            L.append("")
            L.append(f"lm-resiliency on these 3 ranks: `{rk[0]['gemini_error']}`")
    # gemini
    g = res.get("gemini")
    L.append("")
    L.append("### lm-resiliency 0.2.0 (GEMINI in-memory peer checkpoint over Gloo)")
    L.append("")
    if res.get("gemini_note"):
        L.append(res["gemini_note"])
        L.append("")
    if g:
        saved = g.get("saved", [])
        if saved and all(k == "gemini_saved" for k, _ in saved):
            rs = [v for _, v in saved]
            blk = [max(v) for v in zip(*[x["results"]["block"] for x in rs])]
            prot = [max(v) for v in zip(*[x["results"]["protected"] for x in rs])]
            ok = all(all(x["results"]["ok"]) for x in rs)
            L.append(f"Same state ({res['ec']['saved'][0]['bytes'] / MiB:.0f} MiB a rank) on "
                     f"the 4 nodes of the ec run (fresh nodes), `InMemoryCheckpointManager` (replication_jump=1: "
                     "ranks pair up 0<->1, 2<->3, each sends its shard to its partner over "
                     "Gloo send/recv in 16 MiB chunks; pin_memory=False, disk_flush_interval=0). "
                     "blocking = `save()` (a copy into its own process memory, then the "
                     "replication starts on a thread); protected = `finalize_replication()` "
                     "returned (the partner holds it).")
            L.append("")
            L.append("| engine | blocking s | until protected s | replicated | lost node's rank "
                     "restored in s |")
            L.append("|---|---:|---:|---|---:|")
            lo = [v for k, v in g.get("loaded", []) if k == "gemini_loaded" and "error" not in v]
            rec = f"{lo[1]['seconds']:.3f} (its partner's flush, from disk)" if len(lo) > 1 else "–"
            L.append(f"| lm-resiliency (4 ranks, pairs) | {fmt_range(blk)} | {fmt_range(prot)} | "
                     f"{'yes' if ok else 'NO'} | {rec} |")
            ec = res.get("ec")
            if ec and "saved" in ec:
                L.append(f"| safepoint `ec:2+1` (same 4 nodes) | "
                         f"{fmt_range(per_rep_max(ec['saved'], 'on', 'block'))} | "
                         f"{fmt_range(per_rep_max(ec['saved'], 'on', 'protected'))} | yes | "
                         f"{restored(ec)} |")
            m4 = res.get("mirror4")
            if m4 and "saved" in m4:
                L.append(f"| safepoint `mirror` (same 4 nodes) | "
                         f"{fmt_range(per_rep_max(m4['saved'], 'on', 'block'))} | "
                         f"{fmt_range(per_rep_max(m4['saved'], 'on', 'protected'))} | yes | – |")
            mr = res.get("mirror")
            if mr and "saved" in mr:
                L.append(f"| safepoint `mirror` (3 nodes, above) | "
                         f"{fmt_range(per_rep_max(mr['saved'], 'on', 'block'))} | "
                         f"{fmt_range(per_rep_max(mr['saved'], 'on', 'protected'))} | yes | "
                         f"{restored(mr)} |")
            L.append("")
            L.append(f"Recovery: node 1 killed; the other ranks got SIGTERM (lm-resiliency's "
                     f"handler flushes its own and its partner's shard to `disk_folder`, here a "
                     f"directory all nodes share) and exited {g.get('exit_codes')} after "
                     f"{g.get('flush_s', 0):.2f} s; the replaced node joined, the job restarted, "
                     f"page cache dropped, `load()` (every rank reads its shard from disk: "
                     f"the restart ended the processes that held the in-memory copies):")
            L.append("")
            for k, v in g.get("loaded", []):
                if "error" in v or k != "gemini_loaded":
                    L.append(f"- rank {g['loaded'].index((k, v))}: {k} "
                             f"`{(v.get('error') or v.get('stderr', ''))[-400:]}`")
                else:
                    L.append(f"- rank {v['rank']}: step {v['step']}, `load()` {v['seconds']:.3f} s "
                             f"(from disk; constructing the manager before: "
                             f"{v['start_s']:.3f} s), equal to what was saved: {v['equal']}")
        else:
            for k, v in saved:
                L.append(f"- {k}: `{(v.get('error') or v.get('stderr', ''))[-600:]}`")
    for k, e in res.get("errors", {}).items():
        L.append("")
        L.append(f"**{k} failed in this run:** `{e[-800:]}`")
    return "\n".join(L) + "\n"


def restored(r: dict) -> str:
    if "peer" not in r:
        return "–"
    p = r["peer"][1]
    return f"{p['restore_s']:.3f} ({p['source']})"


def load_conditions() -> str:
    load1, load5, _ = os.getloadavg()
    rev = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True).stdout.strip()
    return (f"Repository at {rev or '?'}. Load average at the start {load1:.2f} (1 min) / "
            f"{load5:.2f} (5 min) on {os.cpu_count()} cores; other jobs shared the machine.")


def fresh(c: Cluster) -> None:
    """Every node replaced: no agent, slot or replica of an earlier stage left."""
    for i in range(len(c)):
        c.replace(i)


def stage(res: dict, key: str, fn, *a) -> None:
    t0 = time.perf_counter()
    try:
        res[key] = fn(*a)
    except Exception as e:  # noqa: BLE001 - one failed stage must not lose the others
        traceback.print_exc()
        res.setdefault("errors", {})[key] = f"{type(e).__name__}: {e}"
    log(f"{key}: {time.perf_counter() - t0:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=parse_size, default=parse_size("256M"),
                    help="state a rank (default 256M)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--train-steps", type=int, default=8, help="steps per block and mode")
    ap.add_argument("--train-blocks", type=int, default=6, help="blocks per mode")
    ap.add_argument("--shm", default="3g", help="each node's /dev/shm size")
    ap.add_argument("--skip", default="", help="comma list of: ec, train, gemini")
    ap.add_argument("--dir", default=os.path.join(REPO, "build", "bench"))
    ap.add_argument("--no-doc", action="store_true")
    args = ap.parse_args()
    why = unavailable()
    if why:
        raise SystemExit(f"bench/replication.py needs nodes: {why}")
    skip = set(filter(None, args.skip.split(",")))
    import importlib.util

    have_gemini = "gemini" not in skip and importlib.util.find_spec("lm_resiliency") is not None
    os.makedirs(args.dir, exist_ok=True)
    conditions = load_conditions()
    t0 = time.perf_counter()
    work = tempfile.mkdtemp(prefix="replication-", dir=args.dir)
    res: dict = {}
    if not have_gemini:
        res["gemini_note"] = ("lm-resiliency is not installed (`pip install --no-deps "
                              "lm-resiliency==0.2.0`): not measured.")
    try:
        with Cluster(3, shm_size=args.shm) as c:
            stage(res, "links", links, c, args.size)
            stage(res, "mirror", save_restore, c, "mirror", args, work, True, True)
            fresh(c)
            stage(res, "links_after", links, c, args.size, False)
            if "train" not in skip:
                stage(res, "train", train, c, args, work, have_gemini)
                fresh(c)
                stage(res, "train_pinned", train, c, args, work, False, True)
        if "ec" not in skip:
            with Cluster(4, shm_size=args.shm) as c:
                stage(res, "links4", links, c, args.size, False)
                stage(res, "ec", save_restore, c, "ec:2+1", args, work, False, True)
                fresh(c)
                stage(res, "mirror4", save_restore, c, "mirror", args, work, False, False)
                if have_gemini:
                    fresh(c)
                    stage(res, "gemini", run_gemini, c, args, work)
    finally:
        subprocess.run(["rm", "-rf", work], check=False)
    res["iperf_cpu"] = iperf_cpu
    conditions += run_took(t0)
    section = render(res, args, conditions)
    publish(args, "replication", "Peer replication", section, res)


if __name__ == "__main__":
    main()
