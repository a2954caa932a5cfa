"""safepoint benchmark: the s3:// tier against the best S3 clients, on the same gateway, same run.

    python bench/tier_s3.py [--size 1G,4G] [--runs 5,3] [--only NAME,...] [--no-doc]

Rewrites the "Object storage tiers: S3" section of docs/benchmarks.md. It needs an S3 gateway:
with AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY set it uses that one (bucket
--bucket, created when missing); otherwise (root) it starts a throwaway Ceph cluster with
scripts/ceph-cluster.sh (one OSD, radosgw) and stops it at the end.

For each --size, after a warm-up round (not counted), --runs rounds; in each round every
contender persists the state and loads it back, in an order that rotates from round to round
(drift hits all alike). The contenders are safepoint (``safepoint.save`` to ``s3://`` until
durable, ``safepoint.load`` with every checksum verified and the tensors built) and the anchors of
bench/s3_anchors.py: curl --parallel, s5cmd, boto3's transfer manager, s3torchconnector's DCP
writer/reader and its S3Reader, DCP over s3fs. The table gives medians, p50/p95 where there are
enough runs, and each contender's ratio against the fastest anchor of the same run (the anchor
with the lowest median: for persist and load separately).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import torch  # noqa: E402
from run import GiB, MiB, machine, parse_size, publish  # noqa: E402
from s3_anchors import ANCHORS, PARALLEL, Job, Safepoint, curl_base, endpoint  # noqa: E402

GB = 1e9


def start_cluster() -> str:
    d = tempfile.mkdtemp(prefix="sp-bench-s3-", dir="/var/tmp")
    subprocess.run(["bash", os.path.join(REPO, "scripts", "ceph-cluster.sh"), "start", d],
                   check=True)
    env = subprocess.run(["bash", os.path.join(REPO, "scripts", "ceph-cluster.sh"), "env", d],
                         check=True, capture_output=True, text=True).stdout
    for line in env.splitlines():
        k, _, v = line.removeprefix("export ").partition("=")
        os.environ[k] = v.strip("'")
    return d


def stop_cluster(d: str) -> None:
    subprocess.run(["bash", os.path.join(REPO, "scripts", "ceph-cluster.sh"), "stop", d],
                   check=False)


def cpu_busy() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]
    return sum(v) - idle, sum(v)


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of xs."""
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))]


def bench_size(args, nbytes: int, runs: int, names: list[str], warm_up: bool) -> dict:
    job = Job(args.bucket, nbytes)
    contenders = [Safepoint(job)] + [ANCHORS[n](job) for n in names if n != "safepoint"]
    out = {"nbytes": job.nbytes, "runs": runs, "labels": {}, "errors": {}, "persist": {},
           "load": {}}
    b0, t0 = cpu_busy()
    load0 = os.getloadavg()[0]
    try:
        for c in contenders:
            out["labels"][c.name] = c.label
            out["persist"][c.name], out["load"][c.name] = [], []
        for rnd in range(-1 if warm_up else 0, runs):  # round -1: warm-up
            k = max(rnd, 0) % len(contenders)
            order = contenders[k:] + contenders[:k]
            for c in order:
                if c.error:
                    continue
                try:
                    p = c.put()
                    g = c.get()
                except Exception as e:  # noqa: BLE001 - reported in the table
                    c.error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}"
                    print(f"  {c.name}: {c.error}", flush=True)
                    continue
                finally:
                    c.cleanup()
                if rnd >= 0:
                    out["persist"][c.name].append(p)
                    out["load"][c.name].append(g)
                print(f"  {job.nbytes / GiB:g} GiB round {rnd + 1}/{runs} {c.name}: "
                      f"persist {p:.2f} s, load {g:.2f} s", flush=True)
    finally:
        job.close()
    b1, t1 = cpu_busy()
    out["errors"] = {c.name: c.error for c in contenders if c.error}
    out["cpu_busy"] = (b1 - b0) / max(1, t1 - t0)
    out["loadavg"] = [load0, os.getloadavg()[0]]
    return out


def render(results: list[dict], args, own_cluster: bool, took: float) -> str:
    lines = [f"Measured {datetime.date.today().isoformat()} on {machine()}.",
             f"Command: `python bench/tier_s3.py --size {args.size} --runs {args.runs}`; "
             "a warm-up round (the first size only), then rounds in which every contender "
             "persists the state "
             "and loads it back, the order rotating from round to round. Gateway: Ceph 16.2 "
             "radosgw (beast) on 127.0.0.1 over one BlueStore OSD on a file of the same virtual "
             "disk, pool size 1"
             + (" (a cluster started for the run by scripts/ceph-cluster.sh)" if own_cluster
                else "")
             + ", on the same 2 cores as the clients: the gateway, the OSD and the client "
             f"compete for them. The run took {took / 60:.0f} min.",
             "State: fp32 tensors of 64 MiB. safepoint: default s3:// options (16 MiB parts, "
             "8 connections); persist = `safepoint.save` until durable (CompleteMultipartUpload "
             "and COMMIT done); load = `safepoint.load` (16 MiB ranged GETs, 8 in flight, "
             "checksums verified, tensors built, into fresh memory). The anchors (bench/"
             "s3_anchors.py) move the same bytes with 16 MiB parts and 8 in flight, from and to "
             "tmpfs files (curl, s5cmd, boto3), a buffer allocated inside the timing "
             "(S3Reader) or tensors allocated before it (the DCP readers).",
             "",
             "Seconds: median (p50/p95 with 10 runs or more, else min-max). The ratio is "
             "the fastest anchor's median time over the contender's (above 1: faster than "
             "that anchor); the fastest anchor is picked per size, for persist and load "
             "separately.", ""]
    for res in results:
        nbytes, runs = res["nbytes"], res["runs"]
        anchors = [n for n in res["load"] if n != "safepoint" and res["load"][n]]
        med = {k: {n: statistics.median(v) for n, v in res[k].items() if v}
               for k in ("persist", "load")}
        best = {k: min(anchors, key=lambda n: med[k][n]) if anchors else None
                for k in ("persist", "load")}
        lines.append(f"**{nbytes / GiB:g} GiB** ({nbytes // (64 * MiB)} tensors), {runs} runs; "
                     f"CPU busy {res['cpu_busy']:.0%} during the runs, load average "
                     f"{res['loadavg'][0]:.1f} before, {res['loadavg'][1]:.1f} after. Fastest "
                     f"anchor: {best['persist']} (persist), {best['load']} (load).")
        lines.append("")
        lines.append("| contender | persist s | GB/s | vs fastest | load s | GB/s | vs fastest |")
        lines.append("|---|---:|---:|---:|---:|---:|---:|")

        def cell(xs: list[float]) -> str:
            m = statistics.median(xs)
            if len(xs) >= 10:
                return f"{m:.2f} ({percentile(xs, 50):.2f}/{percentile(xs, 95):.2f})"
            return f"{m:.2f} ({min(xs):.2f}-{max(xs):.2f})"

        for n in ["safepoint"] + anchors:
            if not res["load"].get(n):
                continue
            row = [res["labels"][n]]
            for k in ("persist", "load"):
                xs = res[k][n]
                ratio = med[k][best[k]] / med[k][n] if best[k] else float("nan")
                row += [cell(xs), f"{nbytes / med[k][n] / GB:.2f}", f"{ratio:.2f}x"]
            lines.append("| " + " | ".join(row) + " |")
        for n, e in res["errors"].items():
            lines.append("")
            lines.append(f"{res['labels'].get(n, n)} did not run: {e}")
        lines.append("")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1G,4G", help="state sizes, comma-separated")
    ap.add_argument("--runs", default="5,3", help="rounds per size (one value or one per size)")
    ap.add_argument("--only", default=",".join(["safepoint"] + list(ANCHORS)),
                    help="contenders to run (safepoint always runs)")
    ap.add_argument("--bucket", default="safepoint-bench")
    ap.add_argument("--dir", default=os.path.join(REPO, "build", "bench"))
    ap.add_argument("--no-warm-up", action="store_true",
                    help="no warm-up round (a gateway warmed by an earlier run)")
    ap.add_argument("--no-doc", action="store_true")
    ap.add_argument("--render", metavar="JSON",
                    help="only render the section from a results file of an earlier run")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    if args.render:
        with open(args.render) as f:
            saved = json.load(f)
        args.size, args.runs = saved["size"], saved["runs_arg"]
        section = render(saved["results"], args, saved["own_cluster"], saved["took"])
        publish(args, "tier-s3", "Object storage tiers: S3", section, saved)
        return
    sizes = [parse_size(s) for s in args.size.split(",")]
    runs = [int(r) for r in args.runs.split(",")]
    runs = runs * len(sizes) if len(runs) == 1 else runs
    if len(runs) != len(sizes) or min(runs) < 1:
        raise SystemExit("--runs: one positive count, or one per size")
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n != "safepoint" and n not in ANCHORS]
    if unknown:
        raise SystemExit(f"unknown contenders {unknown}; known: {list(ANCHORS)}")
    torch.set_num_threads(os.cpu_count() or 1)
    cluster = None
    if not all(os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID",
                                           "AWS_SECRET_ACCESS_KEY")):
        cluster = start_cluster()
    t0 = time.perf_counter()
    try:
        subprocess.run(curl_base() + ["-X", "PUT", f"{endpoint()}/{args.bucket}"],
                       capture_output=True)  # exists: fine
        results = [bench_size(args, n, r, names, i == 0 and not args.no_warm_up)
                   for i, (n, r) in enumerate(zip(sizes, runs))]
    finally:
        if cluster:
            stop_cluster(cluster)
    took = time.perf_counter() - t0
    section = render(results, args, cluster is not None, took)
    publish(args, "tier-s3", "Object storage tiers: S3", section,
            {"results": results, "own_cluster": cluster is not None, "size": args.size,
             "runs_arg": args.runs, "took": took, "parallel": PARALLEL})


if __name__ == "__main__":
    main()
