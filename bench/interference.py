"""safepoint benchmark: interference, as CPU time per GB the node agent spends on its background
work, next to a standard tool moving the same bytes in the same run.

    make bench-interference         # or (root): python bench/interference.py [--size 256M]

Rewrites the "Interference" section of docs/benchmarks.md. On a 2-core machine shared by the
ranks and the agents, what the agents cost the training is first of all CPU time; this counts
it (utime + stime of the agent process, every thread, from /proc) per GB moved:

1. **Persist to local disk**: one rank (this process), ``Checkpointer(dedupe=False)``, saves of
   --size state with ``persist=True`` and ``wait()``: the agent writes the whole image to the
   checkpoint directory (build/bench, the local disk) each time. Next to it ``dd`` writing the
   same number of bytes from a file in /dev/shm (as the agent writes from its shared-memory
   slot), 8 MiB blocks, with ``oflag=direct`` (as the agent writes) and buffered with
   ``conv=fsync``; dd's CPU from its rusage.
2. **Peer replication**: 3 nodes (tests/common/nodes.py network namespaces), ``redundancy=
   "mirror"``, ``persist=False``: every node pushes its rank's snapshot to the next node while
   it receives its predecessor's, so the agents' CPU time over the timed saves divided by the
   bytes sent is sender + receiver per GB, as iperf3's ``cpu_utilization_percent`` (host +
   remote) per GB of three streams in a ring on the same nodes. With perf installed, a flat
   profile of the agents over the timed saves, grouped.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "workloads"))
sys.path.insert(0, os.path.join(REPO, "tests", "common"))

from run import MiB, machine, parse_size, publish, run_took  # noqa: E402
from nodes import Cluster, Job, unavailable  # noqa: E402
from replication import fmt_range, log, med, stage  # noqa: E402  (bench/replication.py's)

WORKER = os.path.join(HERE, "workloads", "repl_worker.py")
GB = 1e9


def proc_cpu(pid: int) -> float:
    """utime + stime of a process (all its threads), seconds."""
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def agent_pids(job: str, pids=None) -> list[int]:
    out = []
    for pid in pids if pids is not None else filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if any(c.endswith(b"safepointd") for c in cmd) and job.encode() in cmd:
            out.append(int(pid))
    return out


# --- 1. persist ---------------------------------------------------------------------------------

def dd(src: str, dst: str, flags: list[str]) -> dict:
    """dd src -> dst (8 MiB blocks): seconds and CPU seconds (its rusage)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(["dd", f"if={src}", f"of={dst}", "bs=8M", *flags],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise RuntimeError(f"dd {flags} failed: {p.stderr.read().decode()[-300:]}")
    p.stderr.close()
    return {"s": time.perf_counter() - t0, "cpu_s": ru.ru_utime + ru.ru_stime,
            "user_s": ru.ru_utime, "sys_s": ru.ru_stime}


def persist(args, work: str) -> dict:
    import safepoint
    import torch
    from repl_worker import bump, make_state

    torch.set_num_threads(1)
    st = make_state(args.size, 0)
    job = f"bench-interf-{os.getpid()}"
    ck = safepoint.Checkpointer(os.path.join(work, "persist"), job=job, dedupe=False, keep=2)
    try:
        pids = agent_pids(job)
        if len(pids) != 1:
            raise RuntimeError(f"expected one agent of job {job}, found {pids}")
        agent = pids[0]
        out: dict = {"agent": [], "dd_direct": [], "dd_buffered": []}
        step = 0
        # The agent's CPU time is counted in clock ticks (10 ms; a 256 MiB persist takes 2-3):
        # taken over all timed persists at once, from before the first to after the last (the
        # status requests between them included), so that the rounding is one tick in all.
        c0 = 0.0
        for i in range(1 + args.runs):
            step += 1
            bump(st, step)
            if i == 1:
                c0 = proc_cpu(agent)
            t0 = time.perf_counter()
            ck.save(step, st, persist=True)
            ck.wait()
            t1 = time.perf_counter()
            s = ck.status()
            if s["last_persisted_step"] != step:
                raise RuntimeError(f"step {step} not persisted: {s}")
            if i == 0:
                continue  # warm-up: the first write of each slot, the directory, the files
            out["agent"].append({"s": t1 - t0, "bytes": s["last_persist_bytes"],
                                 "persist_s": s["last_persist_seconds"]})
        out["agent_cpu_s"] = proc_cpu(agent) - c0
        out["agent_ticks"] = round(out["agent_cpu_s"] * os.sysconf("SC_CLK_TCK"))
        nbytes = out["agent"][-1]["bytes"]
        out["bytes"] = nbytes
        # dd: the same bytes, from a file in /dev/shm, into the same directory
        src = os.path.join("/dev/shm", f"bench-interf-{os.getpid()}")
        dst = os.path.join(work, "dd.out")
        subprocess.run(["dd", "if=/dev/urandom", f"of={src}", "bs=1M",
                        f"count={(nbytes + MiB - 1) // MiB}"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for i in range(1 + args.runs):
                for kind, flags in (("dd_direct", ["oflag=direct"]),
                                    ("dd_buffered", ["conv=fsync"])):
                    if os.path.exists(dst):
                        os.unlink(dst)
                    r = dd(src, dst, flags)
                    if i > 0:
                        out[kind].append(r)
            out["dd_bytes"] = os.path.getsize(dst)
        finally:
            os.unlink(src)
            if os.path.exists(dst):
                os.unlink(dst)
        return out
    finally:
        ck.close()


# --- 2. replication -----------------------------------------------------------------------------

def iperf_ring(c: Cluster, seconds: float) -> list[dict]:
    """One iperf3 TCP stream node i -> i+1 per node, all at once: per stream bytes, seconds and
    CPU percent of the sender (host) and the receiver (remote)."""
    n = len(c)
    servers = [c[(i + 1) % n].popen(["iperf3", "-s", "-1", "-p", str(5301 + i)],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
               for i in range(n)]
    time.sleep(0.5)
    clients = [c[i].popen(["iperf3", "-c", c[(i + 1) % n].addr, "-p", str(5301 + i), "-t",
                           str(seconds), "-J"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) for i in range(n)]
    out = []
    for p in clients:
        o, _ = p.communicate(timeout=60)
        d = json.loads(o)
        if "error" in d:
            raise RuntimeError(f"iperf3: {d['error']}")
        e = d["end"]
        out.append({"bytes": e["sum_received"]["bytes"], "s": e["sum_received"]["seconds"],
                    "cpu": e.get("cpu_utilization_percent", {})})
    for s in servers:
        s.wait(timeout=30)
    return out


# A sample goes to the group of the first of its frames (leaf first) that matches one: a sample
# in a lock release or an interrupt return (no group) goes to what called it.
GROUPS = [  # (group, regex on the frame's symbol, regex on its shared object)
    ("CRC32C (checksums, ISA-L)", r"crc32|Crc32c", r"libisal"),
    ("kernel: copies between socket buffers and user memory, and into replica files",
     r"_copy_from_iter|_copy_to_iter|copy_user|copy_page_to_iter|copy_page_from_iter|"
     r"copy_folio_from_iter|skb_copy_datagram", None),
    ("memcpy in user space (UCX: rendezvous fragments into the receive buffer)",
     r"__memmove|__memcpy|^memcpy", None),
    ("kernel: page allocation and freeing, faults and mappings (replica files, slots)",
     r"clear_page|fault|shmem_|folio|zap_|unmap|mmap|alloc_pages|tlb", None),
    ("kernel: TCP/IP and veth (send, and the receiving side's softirq on the sending CPU)",
     r"tcp_|ip_|dev_|netif|veth|skb|sock|softirq|net_rx|inet|napi|sendmsg|recvmsg|nf_", None),
    ("UCX itself (progress, protocol)", None, r"libuc[pts]"),
    ("kernel: poll, scheduling, wake-ups", r"poll|schedule|futex|finish_task_switch|switch_to|"
     r"wake|hrtimer", None),
]


def classify(frames: list[tuple[str, str]]) -> str:
    for sym, dso in frames:
        for name, srx, drx in GROUPS:
            if (srx and re.search(srx, sym)) or (drx and re.search(drx, dso)):
                return name
    return "other (the agent's own code, other syscalls)"


def profile_summary(data: str, pids: list[int]) -> dict:
    """perf script of `data` (system-wide, with kernel call chains): the share of the samples of
    processes `pids` per group."""
    r = subprocess.run(["perf", "script", "-i", data, "-F", "pid,tid,ip,sym,dso"],
                       capture_output=True, text=True)
    groups: dict = {}
    n = 0
    frames: list = []
    mine = False

    def flush() -> None:
        nonlocal n, frames
        if frames and mine:
            g = classify(frames)
            groups[g] = groups.get(g, 0) + 1
            n += 1
        frames = []

    for ln in r.stdout.splitlines():
        m = re.match(r"\s+[0-9a-f]+\s+(.*?)\s+\((.*)\)\s*$", ln)
        if m:
            frames.append((m[1], m[2]))
            continue
        flush()
        head = re.match(r"\s*(\d+)/\d+\s*$", ln)
        if head:
            mine = int(head[1]) in pids
    flush()
    return {"groups": {g: 100.0 * v / n for g, v in groups.items()} if n else {}, "samples": n}


def replicate(c: Cluster, args, work: str, tag: str, profile: Optional[str],
              pids: Optional[list[int]] = None) -> list[dict]:
    """A mirror job on the nodes: its ranks' "saved" lines; with `profile`, perf records the
    machine into that file meanwhile and `pids` gets the three agents' pids. (System-wide, not
    `perf record -p`: that follows only the threads an agent has when perf attaches, and an agent
    found right after its start has not started its replication threads yet.)"""
    name = f"bench-interf-{tag}-{os.getpid()}"
    a = {"size": args.size, "runs": args.repl_runs, "warmup": 2, "redundancy": "mirror",
         "ckpt_on": os.path.join(work, f"repl-{tag}"), "job_on": name}
    job = Job(c, WORKER, ["save", json.dumps(a)])
    perf = None
    try:
        if profile:
            perf = subprocess.Popen(["perf", "record", "-a", "-F", "499", "-g", "-o", profile],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            found: list[int] = []
            t0 = time.time()
            while len(found) < len(c) and time.time() - t0 < 60:
                found = [p for n in c for p in agent_pids(name, n.processes())]
                time.sleep(0.05)
            if len(found) != len(c):
                raise RuntimeError(f"agents of {name}: found {found}")
            if pids is not None:
                pids.extend(found)
        return job.expect_all("saved")
    finally:
        if perf:
            perf.send_signal(signal.SIGINT)
            perf.wait(timeout=60)
        job.kill()


def replication(args, work: str) -> dict:
    """The agents' CPU per GB replicated next to iperf3's on the same 3 nodes; then, on fresh
    nodes, the same saves again under perf (not in the figure: sampling costs the agents
    CPU time)."""
    out: dict = {}
    with Cluster(3, shm_size=args.shm) as c:
        log("replication: iperf3 ring")
        out["iperf"] = [iperf_ring(c, 3.0)]
        log("replication: mirror on 3 nodes")
        out["saved"] = replicate(c, args, work, "a", None)
        for i in range(len(c)):
            c.replace(i)
        out["iperf"].append(iperf_ring(c, 3.0))
        if shutil.which("perf") and not args.no_profile:
            log("replication: again, under perf")
            for i in range(len(c)):
                c.replace(i)
            data = os.path.join(work, "agents.perf")
            pids: list[int] = []
            out["saved_profiled"] = replicate(c, args, work, "p", data, pids)
            out["profile"] = profile_summary(data, pids)
    return out


# --- report -------------------------------------------------------------------------------------

def render(res: dict, args, conditions: str) -> str:
    L: list[str] = []
    L.append(f"Measured {time.strftime('%Y-%m-%d')} on {machine()}.")
    L.append(f"Command: `make bench-interference` (`python bench/interference.py --size "
             f"{args.size // MiB}M --runs {args.runs}`). {conditions}")
    L.append("")
    L.append("CPU time (user + system, every thread of the process, from /proc or rusage) per "
             "GB moved, medians (range) of the timed repetitions; the agent's next to a "
             "standard tool moving the same bytes in the same run. On this 2-core machine "
             "every CPU-second an agent spends is taken from the ranks (see \"Training slowdown "
             "(3-node DDP)\" under Peer replication for the step time with the agents on a core "
             "of their own).")
    p = res.get("persist")
    if p and "agent" in p:
        L.append("")
        L.append("### Persist to local disk")
        L.append("")
        nb = p["bytes"]
        L.append(f"One rank, {nb / MiB:.0f} MiB image, `persist=True` and `wait()`, "
                 f"`dedupe=False` (every save writes the whole image), {args.runs} saves after "
                 "a warm-up. dd: the same bytes from a file in /dev/shm into the same "
                 "directory, 8 MiB blocks (dd's read from /dev/shm is a copy the agent does not "
                 "make: it writes from its slot's mapping). Buffered dd's figure leaves out the "
                 "kernel's writeback threads, which do the buffered write's I/O.")
        L.append("")
        L.append("| writer | CPU s per GB | GB/s | CPU s per GB / dd O_DIRECT's |")
        L.append("|---|---:|---:|---:|")
        ag = [p["agent_cpu_s"] / (sum(x["bytes"] for x in p["agent"]) / GB)]
        ddd = [x["cpu_s"] / (p["dd_bytes"] / GB) for x in p["dd_direct"]]
        ddb = [x["cpu_s"] / (p["dd_bytes"] / GB) for x in p["dd_buffered"]]
        base = med(ddd)
        for name, v, rate in (
                ("safepoint agent (persist, O_DIRECT)", ag,
                 [x["bytes"] / x["persist_s"] / GB for x in p["agent"] if x["persist_s"]]),
                ("dd oflag=direct", ddd, [p["dd_bytes"] / x["s"] / GB for x in p["dd_direct"]]),
                ("dd buffered, conv=fsync", ddb,
                 [p["dd_bytes"] / x["s"] / GB for x in p["dd_buffered"]])):
            cpu = (fmt_range(v, 2) if len(v) > 1
                   else f"{v[0]:.3f} (all {len(p['agent'])} persists)")
            L.append(f"| {name} | {cpu} | {fmt_range(rate, 2) if rate else '–'} | "
                     f"{med(v) / base:.2f}x |")
        L.append("")
        L.append("The agent's GB/s is its own `last_persist_seconds` (write and commit). Its "
                 "CPU time comes from /proc in clock ticks of 10 ms (a persist takes a few), so "
                 f"it is taken over all {len(p['agent'])} timed persists at once: "
                 f"{p['agent_ticks']} ticks, one tick of rounding in all.")
    r = res.get("replication")
    if r and "saved" in r:
        L.append("")
        L.append("### Peer replication")
        L.append("")
        saved = r["saved"]
        sent = sum(len(x["results"]["on"]["block"]) * x["push"]["bytes"] for x in saved)
        cpu = sum(x["agent_cpu_runs_s"] for x in saved)
        per_gb = cpu / (sent / GB)
        ip = [s for run in r["iperf"] for s in run]
        ipc = [(s["cpu"].get("host_total", 0) + s["cpu"].get("remote_total", 0)) / 100 * s["s"]
               / (s["bytes"] / GB) for s in ip]
        ips = [s["cpu"].get("host_total", 0) / 100 * s["s"] / (s["bytes"] / GB) for s in ip]
        ipr = [s["cpu"].get("remote_total", 0) / 100 * s["s"] / (s["bytes"] / GB) for s in ip]
        push_s = [max(v) for v in zip(*[x["results"]["on"]["push_s"] for x in saved])]
        nb = saved[0]["push"]["bytes"]
        L.append(f"3 nodes, `redundancy=\"mirror\"`, {nb / MiB:.0f} MiB a rank, "
                 f"`persist=False`, {len(saved[0]['results']['on']['block'])} saves after two "
                 "warm-ups (each followed by `wait()`): every node sends its rank's snapshot "
                 "to the next node while it receives its predecessor's, so the agents' CPU time "
                 "over these saves (all three agents, the save itself included: the agent's "
                 "part of it is small next to the push) per GB sent counts a sender and a "
                 "receiver per GB, as iperf3's sender + receiver CPU per GB of one stream per "
                 "node in the same ring (3 s, before and after; its `cpu_utilization_percent`). "
                 "Checksums on: every chunk carries its CRC32C, which the receiver checks "
                 "(a mirror sender sends the ones the snapshot recorded, docs/replication.md).")
        L.append("")
        L.append("| mover | CPU s per GB (sender + receiver) | sender | receiver | GB/s a stream "
                 "| CPU s per GB / iperf3's |")
        L.append("|---|---:|---:|---:|---:|---:|")
        L.append(f"| safepoint agents (mirror push, UCX over TCP) | {per_gb:.2f} | – | – | "
                 f"{nb / med(push_s) / GB:.2f} (push {fmt_range(push_s, 3)} s) | "
                 f"{per_gb / med(ipc):.2f}x |")
        L.append(f"| iperf3 (ring) | {fmt_range(ipc, 2)} | {fmt_range(ips, 2)} | "
                 f"{fmt_range(ipr, 2)} | "
                 f"{fmt_range([s['bytes'] / s['s'] / GB for s in ip], 2)} | 1.00x |")
        L.append("")
        tgt = 0.5
        L.append(f"Target: the agent at most {tgt} CPU s per GB replicated: "
                 f"{'**met**' if per_gb <= tgt else '**missed**'} ({per_gb:.2f}, "
                 f"{per_gb / tgt:.2f}x the target).")
        prof = r.get("profile")
        if prof:
            L.append("")
            L.append(f"Where the agents' CPU time goes: the same saves again on fresh nodes "
                     "under `perf record -a -F 499 -g`, the three agents' samples "
                     f"({prof['samples']} "
                     "samples; a sample counts for the group of its first frame, leaf first, "
                     "that matches one, so a lock release or an interrupt return counts for "
                     "what called it):")
            L.append("")
            L.append("| group | share of the agents' samples |")
            L.append("|---|---:|")
            for g, v in sorted(prof["groups"].items(), key=lambda kv: -kv[1]):
                L.append(f"| {g} | {v:.1f}% |")
    for k, e in res.get("errors", {}).items():
        L.append("")
        L.append(f"**{k} failed in this run:** `{e[-800:]}`")
    return "\n".join(L) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=parse_size, default=parse_size("256M"),
                    help="state a rank (default 256M)")
    ap.add_argument("--runs", type=int, default=5, help="timed persists and dd runs")
    ap.add_argument("--repl-runs", type=int, default=8, help="timed replicated saves")
    ap.add_argument("--shm", default="3g", help="each node's /dev/shm size")
    ap.add_argument("--no-profile", action="store_true", help="no perf record of the agents")
    ap.add_argument("--skip", default="", help="comma list of: persist, replication")
    ap.add_argument("--dir", default=os.path.join(REPO, "build", "bench"))
    ap.add_argument("--no-doc", action="store_true")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    os.makedirs(args.dir, exist_ok=True)
    load1, load5, _ = os.getloadavg()
    rev = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True).stdout.strip()
    conditions = (f"Repository at {rev or '?'}. Load average at the start {load1:.2f} (1 min) / "
                  f"{load5:.2f} (5 min) on {os.cpu_count()} cores; other jobs shared the "
                  "machine.")
    t0 = time.perf_counter()
    work = tempfile.mkdtemp(prefix="interference-", dir=args.dir)
    res: dict = {}
    try:
        if "persist" not in skip:
            stage(res, "persist", persist, args, work)
        if "replication" not in skip:
            why = unavailable()
            if why:
                res.setdefault("errors", {})["replication"] = f"needs nodes: {why}"
            else:
                stage(res, "replication", replication, args, work)
    finally:
        subprocess.run(["rm", "-rf", work], check=False)
    conditions += run_took(t0)
    publish(args, "interference", "Interference", render(res, args, conditions), res)


if __name__ == "__main__":
    main()
