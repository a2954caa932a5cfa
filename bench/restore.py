"""safepoint benchmarks: hot restore from memory (issue 14) against a memcpy of the same bytes.

    make bench                      # or: python bench/restore.py [--sizes 256M,2G,issue14] [--runs 5]

Rewrites the "Hot restore from memory" section of docs/benchmarks.md. In one run, on one state:
``Checkpointer.restore(state)`` from the newest snapshot in shared memory into the tensors the
state already has (every byte verified), against a parallel memcpy of the same bytes into warm
memory (one flat ``Tensor.copy_`` on all cores, the issue's reference) and tensor by tensor into
the same targets; and ``Checkpointer.load()`` (new tensors) against a memcpy into freshly
allocated MADV_HUGEPAGE memory. Median of several rounds after a warm-up; contenders alternate.
"""

from __future__ import annotations

import gc
import mmap
import os
import statistics
import sys
import time

import torch

import safepoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run import (  # noqa: E402  (bench/run.py: the storage benchmark's helpers)
    GiB,
    _same_tree,
    ISSUE14,
    bench_arguments,
    gbps,
    issue14_state,
    llm_like_state,
    machine,
    parse_size,
    publish,
    state_bytes,
    tensors_of,
)


def bench_state(label: str, state, runs: int, workdir: str) -> dict:
    n = state_bytes(state)
    flat = list(tensors_of(state).values())
    target_list = [t.clone() for t in flat]  # warm: written once
    target = _same_tree(state, iter(target_list))
    src = torch.empty(n, dtype=torch.uint8).fill_(1)
    dst = torch.empty(n, dtype=torch.uint8).fill_(0)
    res = {"label": label, "bytes": n, "tensors": len(flat),
           **{k: [] for k in ("memcpy", "memcpy_tensors", "restore", "load", "memcpy_fresh")}}
    job = f"restore-bench-{os.getpid()}-{len(label)}"
    with safepoint.Checkpointer(os.path.join(workdir, "ckpt"), job=job, shm_dir=workdir,
                                persist_every=10**9) as ckpt:
        ckpt.save(1, state)
        ckpt.save(2, state)  # both slots created and written once

        def memcpy():
            t0 = time.perf_counter()
            dst.copy_(src)
            return time.perf_counter() - t0

        def memcpy_tensors():
            t0 = time.perf_counter()
            for s, d in zip(flat, target_list):
                d.copy_(s)
            return time.perf_counter() - t0

        def restore():
            t0 = time.perf_counter()
            step = ckpt.restore(target)
            seconds = time.perf_counter() - t0
            assert step == 2 and ckpt.last_load_source == "memory", ckpt.last_load_source
            return seconds

        def load():
            gc.collect()
            t0 = time.perf_counter()
            got = ckpt.load()
            seconds = time.perf_counter() - t0
            assert got is not None and ckpt.last_load_source == "memory"
            del got
            return seconds

        def memcpy_fresh():
            t0 = time.perf_counter()
            m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            m.madvise(mmap.MADV_HUGEPAGE)
            d = torch.frombuffer(m, dtype=torch.uint8)
            d.copy_(src)
            seconds = time.perf_counter() - t0
            del d
            m.close()
            return seconds

        order = [("memcpy", memcpy), ("restore", restore), ("memcpy_tensors", memcpy_tensors),
                 ("load", load), ("memcpy_fresh", memcpy_fresh)]
        for r in range(runs + 1):
            print(f"[{label}] round {r}/{runs}", flush=True)
            for name, fn in (order if r % 2 == 0 else order[::-1]):
                t = fn()
                if r:
                    res[name].append(t)
    return res


def render(results, runs) -> str:
    med = statistics.median
    lines = [f"Measured {time.strftime('%Y-%m-%d')} on {machine()}.",
             f"Command: `make bench` (`python bench/restore.py`); median of {runs} rounds after a "
             "warm-up round, contenders alternated. `Checkpointer.restore(state)` reads the newest "
             "snapshot in shared memory and, in one parallel pass, copies each 256 KiB piece "
             "into the state's own tensor and checksums it while it is in cache (every chunk "
             "verified). Goal (issue 14): restore <= 1.2x the flat memcpy into warm memory.", ""]
    lines.append("| state | bytes | tensors | memcpy warm (flat) | memcpy warm (per tensor) | "
                 "restore | restore / memcpy | load (new tensors) | memcpy into fresh memory | "
                 "load / fresh memcpy |")
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        n = r["bytes"]
        m, mt, rs = med(r["memcpy"]), med(r["memcpy_tensors"]), med(r["restore"])
        ld, mf = med(r["load"]), med(r["memcpy_fresh"])
        goal = "met" if rs <= 1.2 * m else "missed"
        lines.append(f"| {r['label']} | {n / GiB:.2f} GiB | {r['tensors']:,} | {m:.3f} s "
                     f"({gbps(n, m):.1f} GB/s) | {mt:.3f} s | {rs:.3f} s ({gbps(n, rs):.1f} GB/s) | "
                     f"{rs / m:.2f}x ({goal}) | {ld:.3f} s | {mf:.3f} s | {ld / mf:.2f}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    import shutil
    import tempfile

    args = bench_arguments(__doc__)
    if args.sizes == "256M,2G":
        args.sizes = "256M,2G,issue14"
    results = []
    for s in (x.strip() for x in args.sizes.split(",") if x.strip()):
        workdir = tempfile.mkdtemp(dir=args.dir)
        try:
            if s == "issue14":
                state, label = issue14_state(), ISSUE14
            else:
                state, label = llm_like_state(parse_size(s)), s.replace("M", " MiB").replace("G", " GiB")
            results.append(bench_state(label, state, args.runs, workdir))
            del state
            gc.collect()
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    publish(args, "restore", "Hot restore from memory", render(results, args.runs), results)


if __name__ == "__main__":
    main()
