"""Why an S3 load is sometimes twice as slow: many loads of one state, with what each one cost.

    python bench/s3_bimodal.py [--size 1G] [--loads 20] [--controlled 10] [--anchor s5cmd]
                               [--no-doc]

Persists a --size state once with safepoint and once with the anchor (bench/s3_anchors.py), then
loads each --loads times, alternated (safepoint, anchor, anchor, safepoint, ...), back to back as
bench/tier_s3.py does ("plain"), and then --controlled times each under two set conditions:

- "idle": 4 s of nothing before the load. This VM's kernel reports free 2 MiB blocks to the
  hypervisor (virtio-balloon free page reporting, /sys/module/page_reporting): memory freed a
  second or more ago is given back to the host, and the next first touch of it faults on the
  host as well.
- "recycled": just before the load a buffer of the state's size is mapped (huge pages), written
  once and unmapped, so that the load's fresh memory is memory the guest touched a moment ago.

For every load it records the time; the memory the guest reported to the host since the previous
load ended and during the load (reported_kib); /proc/vmstat deltas (THP faults and fallbacks,
compaction stalls); CPU seconds of radosgw, the OSD and the client; and, for safepoint, its own
request trace (SAFEPOINT_S3_TRACE, src/storage/s3/s3_client.h): GETs, new connections, per-request
time to first byte and total, and the time each reader thread spent between its requests
(faulting the destination in, verifying checksums). Rewrites the "tier-s3-bimodal" block of
docs/benchmarks.md (in the "Object storage tiers: S3" section).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import mmap
import os
import resource
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402
from run import GiB, machine, parse_size, write_doc_section  # noqa: E402
from s3_anchors import ANCHORS, Job, Safepoint, curl_base, endpoint  # noqa: E402
from tier_s3 import percentile, start_cluster, stop_cluster  # noqa: E402

REPORTED = "/sys/module/page_reporting/parameters/reported_kib"
VMSTAT_KEYS = ("thp_fault_alloc", "thp_fault_fallback", "compact_stall", "compact_success",
               "pgfault")
HUGE = 2 << 20


def reported_kib() -> int:
    try:
        with open(REPORTED) as f:
            return int(f.read())
    except OSError:
        return -1


def vmstat() -> dict:
    out = {}
    with open("/proc/vmstat") as f:
        for line in f:
            k, v = line.split()
            if k in VMSTAT_KEYS:
                out[k] = int(v)
    return out


def daemon_pids() -> dict:
    """radosgw's and the OSD's pids, from the pid files of the cluster of CEPH_CONF."""
    conf = os.environ.get("CEPH_CONF", "")
    pids = {}
    for name, f in (("radosgw", "client.rgw.pid"), ("osd", "osd.0.pid")):
        try:
            with open(os.path.join(os.path.dirname(conf), "run", f)) as fh:
                pids[name] = int(fh.read())
        except (OSError, ValueError):
            pass
    return pids


def cpu_seconds(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return float("nan")


def client_cpu() -> float:
    s = resource.getrusage(resource.RUSAGE_SELF)
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def recycle(nbytes: int) -> None:
    """Maps, writes and unmaps a huge-page buffer of nbytes: the next large allocation gets
    memory the guest touched a moment ago."""
    libc = ctypes.CDLL(None)
    m = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    aligned = (base + HUGE - 1) & ~(HUGE - 1)
    libc.madvise(ctypes.c_void_p(aligned), ctypes.c_size_t(nbytes), 14)  # MADV_HUGEPAGE
    ctypes.memset(aligned, 1, nbytes)
    del base
    m.close()


def trace_summary(path: str, t0: float, t1: float) -> dict:
    """safepoint's GETs that started in [t0, t1] (CLOCK_MONOTONIC seconds) from its trace."""
    rows = []
    with open(path) as f:
        for line in f:
            p = line.rstrip("\n").split("\t")
            if len(p) != 14 or p[3] != "GET":
                continue
            start, end = int(p[0]) / 1e6, int(p[1]) / 1e6
            if t0 <= start <= t1:
                rows.append((start, end, int(p[2]), int(p[5]), int(p[7]), int(p[10]) / 1e6,
                             int(p[11]) / 1e6))
    if not rows:
        return {}
    big = [r for r in rows if r[3] >= 1 << 20]
    by_tid: dict = {}
    for r in sorted(rows):
        by_tid.setdefault(r[2], []).append(r)
    between = 0.0
    for rs in by_tid.values():
        between += sum(max(0.0, b[0] - a[1]) for a, b in zip(rs, rs[1:]))
    return {"gets": len(rows), "new_connections": sum(r[4] for r in rows),
            "threads": len(by_tid),
            "first_byte_p50": statistics.median(r[5] for r in big) if big else 0,
            "first_byte_max": max(r[5] for r in big) if big else 0,
            "get_p50": statistics.median(r[6] for r in big) if big else 0,
            "get_max": max(r[6] for r in big) if big else 0,
            "between_requests_s": between}


def measure(c, nbytes: int, condition: str, last_end: list, trace: str) -> dict:
    if condition == "idle":
        time.sleep(4)
    elif condition == "recycled":
        recycle(nbytes)
    pids = daemon_pids()
    r0, v0, c0 = reported_kib(), vmstat(), client_cpu()
    d0 = {k: cpu_seconds(p) for k, p in pids.items()}
    t0 = time.monotonic()
    seconds = c.get()
    t1 = time.monotonic()
    r1, v1, c1 = reported_kib(), vmstat(), client_cpu()
    row = {"contender": c.name, "condition": condition, "seconds": seconds,
           "reported_before_mib": (r0 - last_end[0]) / 1024 if last_end[0] >= 0 else None,
           "reported_during_mib": (r1 - r0) / 1024,
           "client_cpu_s": c1 - c0, "loadavg": os.getloadavg()[0]}
    row.update({f"{k}": cpu_seconds(p) - d0[k] for k, p in pids.items()})
    row.update({k: v1[k] - v0[k] for k in VMSTAT_KEYS if k in v0})
    if c.name == "safepoint" and trace:
        row.update(trace_summary(trace, t0, t1))
    last_end[0] = reported_kib()
    print("  " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                           for k, v in row.items()), flush=True)
    return row


def render(rows: list, args, nbytes: int, anchor: str) -> str:
    def stats(sel: list) -> str:
        xs = [r["seconds"] for r in sel]
        if not xs:
            return "-"
        return (f"{percentile(xs, 50):.2f} / {percentile(xs, 95):.2f} "
                f"({min(xs):.2f}-{max(xs):.2f}, n={len(xs)})")

    def mean(sel: list, k: str) -> str:
        xs = [r[k] for r in sel if r.get(k) is not None]
        return f"{statistics.mean(xs):.2f}" if xs else "-"

    lines = [f"`bench/s3_bimodal.py --size {args.size} --loads {args.loads} --controlled "
             f"{args.controlled} --anchor {anchor}`, {datetime.date.today().isoformat()}, on "
             f"{machine()}: {nbytes / GiB:g} GiB persisted once by each, then loaded again and "
             "again, safepoint and the anchor alternated. Seconds: p50 / p95 (min-max, n). "
             "Reported: MiB of free memory the guest gave back to the hypervisor (free page "
             "reporting) between the previous load's end and this load's start. CPU: seconds "
             "during the load (radosgw, the OSD, the client process with its children); means.",
             "",
             "| contender | condition | load s p50 / p95 | reported MiB | radosgw CPU s | "
             "OSD CPU s | client CPU s |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for cond in ("plain", "idle", "recycled"):
        for name in ("safepoint", anchor):
            sel = [r for r in rows if r["contender"] == name and r["condition"] == cond]
            if sel:
                lines.append(f"| {name} | {cond} | {stats(sel)} | "
                             f"{mean(sel, 'reported_before_mib')} | {mean(sel, 'radosgw')} | "
                             f"{mean(sel, 'osd')} | {mean(sel, 'client_cpu_s')} |")
    sp = [r for r in rows if r["contender"] == "safepoint" and "gets" in r]
    if sp:
        lines += ["", "safepoint's own requests per load (its trace; means over the loads of "
                  "each condition): GETs, new connections, time to first byte and total of a "
                  "16 MiB GET (median / max), seconds the reader threads spent between requests "
                  "(faulting the destination in, verifying), summed over the threads.", "",
                  "| condition | GETs | new conns | first byte p50/max s | GET p50/max s | "
                  "between requests s |", "|---|---:|---:|---:|---:|---:|"]
        for cond in ("plain", "idle", "recycled"):
            sel = [r for r in sp if r["condition"] == cond]
            if sel:
                lines.append(f"| {cond} | {mean(sel, 'gets')} | {mean(sel, 'new_connections')} | "
                             f"{mean(sel, 'first_byte_p50')}/{mean(sel, 'first_byte_max')} | "
                             f"{mean(sel, 'get_p50')}/{mean(sel, 'get_max')} | "
                             f"{mean(sel, 'between_requests_s')} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1G")
    ap.add_argument("--loads", type=int, default=20, help="plain loads of each")
    ap.add_argument("--controlled", type=int, default=10, help="idle and recycled loads of each")
    ap.add_argument("--anchor", default="s5cmd", choices=sorted(ANCHORS))
    ap.add_argument("--bucket", default="safepoint-bench")
    ap.add_argument("--dir", default=os.path.join(os.path.dirname(HERE), "build", "bench"))
    ap.add_argument("--tag", default="", help="suffix of the results file's name")
    ap.add_argument("--no-doc", action="store_true")
    ap.add_argument("--render", metavar="JSON", help="only render the block from a results file")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    if args.render:
        import json

        with open(args.render) as f:
            saved = json.load(f)
        rows, nbytes = saved["rows"], saved["nbytes"]
        for k in ("size", "loads", "controlled", "anchor"):
            setattr(args, k, saved[k])
        section = render(rows, args, nbytes, args.anchor)
        print(section)
        if not args.no_doc:
            write_doc_section("tier-s3-bimodal", "Object storage tiers: S3", section)
        return
    trace = os.path.join(args.dir, f"s3-bimodal{args.tag}.trace")
    if os.path.exists(trace):
        os.unlink(trace)
    os.environ["SAFEPOINT_S3_TRACE"] = trace
    torch.set_num_threads(os.cpu_count() or 1)
    cluster = None
    if not all(os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID",
                                           "AWS_SECRET_ACCESS_KEY")):
        cluster = start_cluster()
    rows: list = []
    try:
        subprocess.run(curl_base() + ["-X", "PUT", f"{endpoint()}/{args.bucket}"],
                       capture_output=True)
        job = Job(args.bucket, parse_size(args.size))
        sp, an = Safepoint(job), ANCHORS[args.anchor](job)
        if an.error:
            raise SystemExit(f"{args.anchor}: {an.error}")
        try:
            sp.put()
            an.put()
            sp.get()  # warm-up
            an.get()
            last_end = [reported_kib()]
            plan = [("plain", i) for i in range(args.loads)]
            plan += [(c, i) for i in range(args.controlled) for c in ("idle", "recycled")]
            for cond, i in plan:
                for c in ((sp, an) if i % 2 == 0 else (an, sp)):
                    rows.append(measure(c, job.nbytes, cond, last_end, trace))
        finally:
            sp.cleanup()
            an.cleanup()
            nbytes = job.nbytes
            job.close()
    finally:
        if cluster:
            stop_cluster(cluster)
    import json

    with open(os.path.join(args.dir, f"s3-bimodal{args.tag}.json"), "w") as f:
        json.dump({"rows": rows, "nbytes": nbytes, "size": args.size, "loads": args.loads,
                   "controlled": args.controlled, "anchor": args.anchor}, f)
    section = render(rows, args, nbytes, args.anchor)
    print(section)
    if not args.no_doc:
        write_doc_section("tier-s3-bimodal", "Object storage tiers: S3", section)


if __name__ == "__main__":
    main()
