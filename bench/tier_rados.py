"""safepoint's rados:// tier against `rados bench` on the same cluster, in the same run.

    scripts/with-ceph.sh .venv/bin/python bench/tier_rados.py [--size 1G] [--runs 2] [--no-doc]

Needs a Ceph cluster: the environment of scripts/with-ceph.sh (SAFEPOINT_TEST_RADOS_URI,
CEPH_CONF, CEPH_ARGS), or CEPH_CONF/CEPH_ARGS of a real cluster plus --uri rados://POOL/PREFIX.
Rewrites the "Object storage tiers: RADOS" section of docs/benchmarks.md.

- Persist: ``safepoint.save(uri, step, state)`` of a state of one float32 tensor of --size bytes
  (a fresh step each time; durable and committed when it returns), in GB/s of image bytes.
- Load: ``safepoint.load(uri, step)`` of that step (every checksum verified), GB/s.
- Reference: ``rados bench -p POOL 10 write --no-cleanup`` (4 MiB objects, 16 in flight, the
  tool's defaults) and ``rados bench -p POOL 10 seq`` of what it wrote, then cleanup.
- ``rados put`` / ``rados get`` of the same bytes (the state's tensor as a file in tmpfs), through
  libradosstriper (``--striper``: a RADOS object holds at most osd_max_object_size, 128 MiB, so
  a state of 1 GiB is striped over 4 MiB objects, as the tool drives it), back into tmpfs.
Contenders alternate each round (safepoint, rados bench, rados put/get; the next round in the
reverse order); medians over the rounds.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import statistics
import subprocess
import sys
import time

import torch

import safepoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run import GiB, MiB, parse_size, write_doc_section  # noqa: E402


def rados_bench(pool: str, mode: str, seconds: int = 10) -> float:
    """Bandwidth of `rados bench` in bytes/s."""
    cmd = ["rados", "bench", "-p", pool, str(seconds), mode]
    if mode == "write":
        cmd.append("--no-cleanup")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {out.stderr[-2000:]}")
    m = re.search(r"Bandwidth \(MB/sec\):\s+([\d.]+)", out.stdout)
    if not m:
        raise SystemExit(f"no bandwidth in the output of {' '.join(cmd)}:\n{out.stdout[-2000:]}")
    return float(m.group(1)) * MiB


def rados_put_get(pool: str, path: str, nbytes: int) -> tuple[float, float]:
    """Seconds of `rados --striper put` of `path` and of `rados --striper get` of it back into
    tmpfs; the object is removed afterwards."""
    obj = f"bench-put-{os.getpid()}"
    back = path + ".get"
    times = []
    for cmd in (["rados", "-p", pool, "--striper", "put", obj, path],
                ["rados", "-p", pool, "--striper", "get", obj, back]):
        t0 = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        times.append(time.perf_counter() - t0)
        if out.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed: {out.stderr[-2000:]}")
    got = os.path.getsize(back)
    os.unlink(back)
    subprocess.run(["rados", "-p", pool, "--striper", "rm", obj], capture_output=True, timeout=300)
    if got != nbytes:
        raise SystemExit(f"rados get returned {got} bytes of {nbytes}")
    return times[0], times[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1G", help="state size (e.g. 512M, 1G)")
    ap.add_argument("--runs", type=int, default=2, help="rounds (medians are reported)")
    ap.add_argument("--uri", default=os.environ.get("SAFEPOINT_TEST_RADOS_URI", ""),
                    help="rados://POOL/PREFIX (default: $SAFEPOINT_TEST_RADOS_URI)")
    ap.add_argument("--no-doc", action="store_true",
                    help="print, do not rewrite docs/benchmarks.md")
    args = ap.parse_args()
    if not args.uri.startswith("rados://"):
        raise SystemExit("no rados:// URI: run under scripts/with-ceph.sh or pass --uri")
    pool = args.uri[len("rados://"):].split("/", 1)[0]
    size = parse_size(args.size)
    base = args.uri.rstrip("/") + f"/bench-{os.getpid()}"

    state = {"w": torch.arange(size // 4, dtype=torch.float32)}
    results = {"persist": [], "load": [], "rados_write": [], "rados_seq": [], "mem_load": [],
               "rados_put": [], "rados_get": []}
    state_file = f"/dev/shm/sp-tier-rados-{os.getpid()}.bin"
    state["w"].numpy().tofile(state_file)
    step = 0

    def ours() -> None:
        nonlocal step
        step += 1
        t0 = time.perf_counter()
        info = safepoint.save(base, step, state)
        t_save = time.perf_counter() - t0
        t0 = time.perf_counter()
        got_step, back = safepoint.load(base, step)
        t_load = time.perf_counter() - t0
        assert got_step == step and torch.equal(back["w"], state["w"])
        del back
        results["persist"].append(info["bytes"] / t_save)
        results["load"].append(info["bytes"] / t_load)
        print(f"  safepoint: persist {info['bytes'] / t_save / 1e9:.3f} GB/s, "
              f"load {info['bytes'] / t_load / 1e9:.3f} GB/s", flush=True)

    def theirs() -> None:
        w = rados_bench(pool, "write")
        r = rados_bench(pool, "seq")
        subprocess.run(["rados", "-p", pool, "cleanup"], capture_output=True, timeout=300)
        results["rados_write"].append(w)
        results["rados_seq"].append(r)
        print(f"  rados bench: write {w / 1e9:.3f} GB/s, seq {r / 1e9:.3f} GB/s", flush=True)

    def put_get() -> None:
        p, g = rados_put_get(pool, state_file, size)
        results["rados_put"].append(size / p)
        results["rados_get"].append(size / g)
        print(f"  rados put/get: put {size / p / 1e9:.3f} GB/s, get {size / g / 1e9:.3f} GB/s",
              flush=True)

    def in_memory() -> None:
        # The same load from mem:// (no storage at all): what building the state costs here.
        safepoint.save(f"mem://tier-rados-{os.getpid()}", step + 1000, state)
        t0 = time.perf_counter()
        _, back = safepoint.load(f"mem://tier-rados-{os.getpid()}", step + 1000)
        results["mem_load"].append(size / (time.perf_counter() - t0))
        del back

    try:
        for i in range(args.runs):
            print(f"round {i + 1}/{args.runs}", flush=True)
            for f in ((ours, theirs, put_get) if i % 2 == 0 else (put_get, theirs, ours)):
                f()
            in_memory()
    finally:
        os.unlink(state_file)

    med = {k: statistics.median(v) for k, v in results.items()}
    gb = lambda x: f"{x / 1e9:.3f}"  # noqa: E731
    day = datetime.date.today().isoformat()
    section = (
        f"`bench/tier_rados.py`, {day}: a {size / GiB:g} GiB state (one float32 tensor) saved with "
        f"`safepoint.save` to `rados://` and loaded with `safepoint.load`, against `rados bench` "
        f"(4 MiB objects, 16 in flight) on the same cluster in the same run; medians of "
        f"{args.runs} rounds. The cluster is scripts/ceph-cluster.sh's: one BlueStore OSD on a "
        f"sparse file in /var/tmp, pool size 1, on a 2-core VM shared with other work, so the "
        f"figures say how close safepoint comes to what this cluster can do, not what Ceph "
        f"does on real hardware.\n\n"
        f"| | safepoint (GB/s) | anchor (GB/s) | ratio |\n|---|---|---|---|\n"
        f"| persist vs `rados bench write` | {gb(med['persist'])} | {gb(med['rados_write'])} | "
        f"{med['persist'] / med['rados_write']:.2f} |\n"
        f"| load vs `rados bench seq` | {gb(med['load'])} | {gb(med['rados_seq'])} | "
        f"{med['load'] / med['rados_seq']:.2f} |\n"
        f"| persist vs `rados --striper put` of the same bytes | {gb(med['persist'])} | "
        f"{gb(med['rados_put'])} | {med['persist'] / med['rados_put']:.2f} |\n"
        f"| load vs `rados --striper get` of the same bytes | {gb(med['load'])} | "
        f"{gb(med['rados_get'])} | {med['load'] / med['rados_get']:.2f} |\n"
        f"| load from `mem://` (no storage) | {gb(med['mem_load'])} | | |\n\n"
        f"safepoint's persist includes building the image (CRC32C of every byte) and the commit "
        f"(COMMIT record, listing); its load verifies every checksum and reads into freshly "
        f"allocated memory (page faults on cores the OSD also uses), where `rados bench` reuses "
        f"its buffers: the `mem://` row is the same load without storage. "
        f"Data objects are 8 MiB (`chunk_size`); save and load move whole data objects, 16 in "
        f"flight (`StorageCapabilities::preferred_io_size`, `io_parallelism`).\n"
    )
    print(section)
    if not args.no_doc:
        write_doc_section("tier-rados-bench", "Object storage tiers: RADOS", section)
        print("wrote docs/benchmarks.md")


if __name__ == "__main__":
    main()
