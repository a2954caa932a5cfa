"""safepoint benchmark: storage tiers (docs/guide.md, "Storage tiers").

    make bench-tiers            # or: python bench/tiers.py [--sizes 1G] [--runs 3]

Rewrites the "Storage tiers" section of docs/benchmarks.md. One Checkpointer with `path` on
this machine's disk and lower tiers that take every step, in this order: a second directory on
the same disk, then the object stores that are configured (SAFEPOINT_TEST_S3_URI, then
SAFEPOINT_TEST_RADOS_URI, which `scripts/with-ceph.sh` exports for a throwaway single-host Ceph;
`make bench-tiers` runs inside it). For each run: a save of the state, then the times from its
commit on `path` until it is committed on each lower tier (the agent's own `last_lag_seconds`,
and the time the benchmark saw the COMMIT appear), and the agent's copy throughput. References
in the same run: the same step's files copied with `cp` and `sync FILE...`, and with `dd`
O_DIRECT (what the disk gives a plain copy), and `safepoint cp` of the step from `path` to each
tier's kind of storage (the copy path without the agent).
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

import torch

import safepoint
from safepoint import Checkpointer, Tier

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run import GiB, MiB, bench_arguments, publish  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "common"))
from processes import kill_agents  # noqa: E402


def make_state(nbytes: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    n = nbytes // 4 // 16
    return {f"layer{i}": torch.randn(n, generator=g) for i in range(16)}


def cli() -> str:
    return shutil.which("safepoint") or os.path.join(os.path.dirname(sys.executable), "safepoint")


def wait_committed(uri: str, step: int, limit: float = 600) -> float:
    t0 = time.perf_counter()
    while step not in safepoint.steps(uri):
        if time.perf_counter() - t0 > limit:
            raise SystemExit(f"step {step} never reached {uri}")
        time.sleep(0.01)
    return time.perf_counter()


def bench(args, nbytes: int, runs: int, work: str) -> dict:
    shm = tempfile.mkdtemp(prefix="sp-tiers-shm-", dir="/dev/shm")
    path = os.path.join(work, "nvme")
    lower = [os.path.join(work, "shared")]
    for var in ("SAFEPOINT_TEST_S3_URI", "SAFEPOINT_TEST_RADOS_URI"):
        if os.environ.get(var):
            lower.append(f"{os.environ[var]}/bench-tiers-{uuid.uuid4().hex[:8]}")
    out: dict = {"tiers": lower, "lag": {u: [] for u in lower}, "seen": {u: [] for u in lower},
                 "copy_gbps": {u: [] for u in lower}, "cp_sync": [], "dd_direct": [],
                 "safepoint_cp": {}}
    out["load"] = [os.getloadavg()[0]]
    ck = Checkpointer(path, job="bench-tiers", shm_dir=shm, keep=2,
                      tiers=[Tier(u, keep=2) for u in lower])
    try:
        for run in range(1, runs + 1):
            state = make_state(nbytes, run)
            ck.save(run, state)
            ck.wait()
            committed = time.perf_counter()
            for u in lower:
                out["seen"][u].append(wait_committed(u, run) - committed)
            while any(t.get("in_flight_step") is not None or t.get("pending_step") is not None
                      for t in ck.status()["tiers"]):
                time.sleep(0.01)
            for t in ck.status()["tiers"]:
                out["lag"][t["uri"]].append(t["last_lag_seconds"])
                out["copy_gbps"][t["uri"]].append(
                    t["last_copy_bytes"] / GiB / max(t["last_copy_seconds"], 1e-9))
            # What the disk does for a plain copy of the same files: cp, then `sync FILE...`
            # (fsyncs just those: a global sync would also wait for whatever else this machine
            # has dirty), and dd with O_DIRECT in 64 MiB blocks, one file after the other.
            src = os.path.join(path, f"step-{run:020d}")
            dst = os.path.join(work, f"cp-{run}")
            t0 = time.perf_counter()
            subprocess.run(["cp", "-r", src, dst], check=True)
            subprocess.run(["sync", dst, *[os.path.join(dst, f) for f in os.listdir(dst)]],
                           check=True)
            out["cp_sync"].append(time.perf_counter() - t0)
            shutil.rmtree(dst)
            os.mkdir(dst)
            t0 = time.perf_counter()
            for f in sorted(os.listdir(src)):
                subprocess.run(["dd", f"if={os.path.join(src, f)}", f"of={os.path.join(dst, f)}",
                                "bs=64M", "iflag=direct", "oflag=direct", "conv=fsync",
                                "status=none"], check=True)
            out["dd_direct"].append(time.perf_counter() - t0)
            shutil.rmtree(dst)
        # The copy path without the agent: safepoint cp of the newest step to each lower tier's
        # storage kind (a fresh prefix / directory).
        for u in lower:
            target = (os.path.join(work, "cp-target") if "://" not in u
                      else f"{u}-cp-{uuid.uuid4().hex[:6]}")
            t0 = time.perf_counter()
            subprocess.run([cli(), "cp", path, target, "--step", str(runs)], check=True,
                           capture_output=True)
            out["safepoint_cp"][u] = time.perf_counter() - t0
        out["bytes"] = ck.status()["tiers"][0]["last_copy_bytes"]
        out["load"].append(os.getloadavg()[0])
    finally:
        ck.close()
        kill_agents(shm)
        shutil.rmtree(shm, ignore_errors=True)
    return out


def render(r: dict, runs: int, size_label: str) -> str:
    med = statistics.median
    gb = r["bytes"] / GiB
    lines = [f"{size_label} state (16 float32 tensors), {runs} runs, medians; every tier takes "
             "every step. Lag: from the step's commit on `path` until its COMMIT on the tier "
             "(the agent's `last_lag_seconds`; in brackets, from the return of `wait()` until "
             "this benchmark saw it listed). The agent copies tier by tier: each tier copies "
             "from the one above it once the step committed there, so a tier's lag includes "
             "the lags of the tiers above it.", "",
             "| tier | copies from | lag (s) | agent's copy GB/s | `safepoint cp` from path (s) "
             "| reference |",
             "|---|---|---:|---:|---:|---|"]
    cp, dd = med(r["cp_sync"]), med(r["dd_direct"])
    kinds = [u.split("://")[0] if "://" in u else "file" for u in r["tiers"]]
    for i, u in enumerate(r["tiers"]):
        kind = kinds[i]
        above = "`path` (file)" if i == 0 else kinds[i - 1]
        ref = "see the object-store sections for the store's own limits"
        if kind == "file":
            ref = (f"the same files with `cp -r` + fsync: {cp:.2f} s ({gb / cp:.2f} GB/s); "
                   f"with `dd` O_DIRECT: {dd:.2f} s ({gb / dd:.2f} GB/s); agent copy at "
                   f"{med(r['copy_gbps'][u]) / (gb / min(cp, dd)):.0%} of the faster")
        lines.append(f"| {kind} | {above} | {med(r['lag'][u]):.2f} ({med(r['seen'][u]):.2f}) | "
                     f"{med(r['copy_gbps'][u]):.2f} | {r['safepoint_cp'][u]:.2f} | {ref} |")
    lines += ["", f"Measured {time.strftime('%Y-%m-%d')} on this 2-core VM (one virtual disk; "
              "the object store, when present, is a single-host Ceph with one OSD on the same "
              "disk), shared with other work: the 1-minute load average was "
              f"{r['load'][0]:.1f} at the start and {r['load'][-1]:.1f} at the end, and the "
              "object stores' figures move with it from run to run."]
    return "\n".join(lines) + "\n"


def main() -> None:
    args = bench_arguments(__doc__)
    size = args.sizes.split(",")[0].strip() if args.sizes != "256M,2G" else "1G"
    nbytes = int(size[:-1]) * (GiB if size.endswith("G") else MiB)
    work = tempfile.mkdtemp(dir=args.dir)
    try:
        r = bench(args, nbytes, args.runs, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    label = size.replace("G", " GiB").replace("M", " MiB")
    publish(args, "tiers", "Storage tiers", render(r, args.runs, label), r)


if __name__ == "__main__":
    main()
