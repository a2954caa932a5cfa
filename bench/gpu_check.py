"""Checks and measures the GPU path of flash snapshots in one short run (run it whenever a GPU
is lent; issue 21, item 7). For each configuration (default: 4 GiB in 200 tensors and 1 GiB in
2,000 tensors), against the link's limit measured in the same run:

- **save**: ``Checkpointer.save`` blocking time against a plain device-to-host copy of the same
  tensors into one pinned buffer (``non_blocking`` copies, one synchronize); goal <= 1.25x;
- **restore from memory**: ``Checkpointer.restore`` of the snapshot in shared memory into GPU
  tensors, against a host-to-device copy of the same bytes from one pinned buffer;
- **restore from storage**: a persisted step restored into GPU tensors by
  ``safepoint.restore(path, state)``, pipelined through pinned buffers (safepoint._device_fill;
  the files' pages dropped from the page cache first:
  drop_caches, or fadvise where this process may not; the table says which), against the same
  host-to-device copy;
- **first restore and first save after a restart**: the same restore, and a save, each with
  the slots unregistered from CUDA first, as in a process that restarted after a crash (each
  registers the slot before copying);
- **hot reload**: ``Checkpointer.load`` into new CPU memory.

Every restore is checked bit for bit. Prints one markdown table row per configuration and one
JSON line; exits 0 with a message where CUDA is absent. ``--device cpu`` runs the same flow on
CPU tensors (no pinned memory) to check the script itself on a machine without a GPU.

    python bench/gpu_check.py [--configs 4:200,1:2000] [--reps 3] [--device cuda|cpu] [--warm]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run import drop_caches  # noqa: E402  (bench/run.py's)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def unregister(dev: torch.device) -> None:
    """Unregisters the slots from CUDA and clears safepoint's record of them, as in a process
    that restarted after a crash."""
    from safepoint import _staging

    if dev.type == "cuda":
        cudart = torch.cuda.cudart()
        for address in list(_staging._pinned):
            cudart.cudaHostUnregister(address)
    _staging._pinned.clear()
    _staging._views.clear()


def timed_restore(ck, target: dict, dev: torch.device) -> float:
    """Seconds of a restore from memory into `target` (zeroed first)."""
    for t in target.values():
        t.zero_()
    sync(dev)
    t0 = time.perf_counter()
    ck.restore(target)
    sync(dev)
    return time.perf_counter() - t0


def one_config(gib: float, tensors: int, reps: int, dev: torch.device, root: str,
               cold: bool = True) -> dict:
    import safepoint

    per = int(gib * (1 << 30)) // tensors // 4
    g = torch.Generator(device=dev).manual_seed(tensors)
    state = {f"t{i}": torch.randn(per, device=dev, generator=g) for i in range(tensors)}
    nbytes = sum(t.numel() * 4 for t in state.values())
    sync(dev)
    pin = dev.type == "cuda"
    host = torch.empty(nbytes // 4, dtype=torch.float32, pin_memory=pin)

    def d2h() -> float:
        t0 = time.perf_counter()
        off = 0
        for t in state.values():
            host[off:off + t.numel()].copy_(t, non_blocking=pin)
            off += t.numel()
        sync(dev)
        return time.perf_counter() - t0

    def h2d(targets: dict) -> float:
        t0 = time.perf_counter()
        off = 0
        for t in targets.values():
            t.copy_(host[off:off + t.numel()], non_blocking=pin)
            off += t.numel()
        sync(dev)
        return time.perf_counter() - t0

    d2h_s = [d2h() for _ in range(reps)]
    target = {k: torch.empty_like(v) for k, v in state.items()}
    h2d_s = [h2d(target) for _ in range(reps)]

    path = os.path.join(root, f"ckpt-{tensors}")
    ck = safepoint.Checkpointer(path, job=f"gpucheck-{os.getpid()}-{tensors}",
                                persist_every=1 << 30)
    ok = True
    try:
        ck.save(0, state)  # the first save creates (and registers) the slots
        saves = []
        for step in range(1, reps + 1):
            t0 = time.perf_counter()
            ck.save(step, state)
            saves.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        step, snap = ck.load()
        reload_s = time.perf_counter() - t0
        ok &= step == reps and all(torch.equal(snap[k], v.cpu()) for k, v in state.items())
        del snap
        restores = []
        for _ in range(reps):
            restores.append(timed_restore(ck, target, dev))
            ok &= ck.last_load_source == "memory"
            ok &= all(torch.equal(target[k], v) for k, v in state.items())
        # The first restore of a process that did not save (a restart after a crash): the
        # slot is not registered with CUDA in it yet, so the restore registers it first.
        unregister(dev)
        first_s = timed_restore(ck, target, dev)
        ok &= ck.last_load_source == "memory"
        ok &= all(torch.equal(target[k], v) for k, v in state.items())
        # The first save of a restarted process registers its slot too.
        unregister(dev)
        sync(dev)
        t0 = time.perf_counter()
        ck.save(reps + 1, state)
        first_save_s = time.perf_counter() - t0
        # A persisted step for the restore from storage.
        ck.save(reps + 2, state, persist=True)
        ck.wait()
    finally:
        ck.close()
    for t in target.values():
        t.zero_()
    cold_how = drop_caches([path]) if cold else "warm"
    sync(dev)
    t0 = time.perf_counter()
    got = safepoint.restore(path, target)
    sync(dev)
    storage_s = time.perf_counter() - t0
    ok &= got == reps + 2 and all(torch.equal(target[k], v) for k, v in state.items())
    shutil.rmtree(path, ignore_errors=True)

    def gbs(s: float) -> float:
        return nbytes / s / 1e9

    d2h_m, h2d_m = statistics.median(d2h_s), statistics.median(h2d_s)
    save_m, restore_m = statistics.median(saves), statistics.median(restores)
    return {"gib": gib, "tensors": tensors, "bytes": nbytes,
            "d2h_pinned_gbs": gbs(d2h_m), "h2d_pinned_gbs": gbs(h2d_m),
            "save_gbs": gbs(save_m), "save_vs_d2h": save_m / d2h_m,
            "first_save_gbs": gbs(first_save_s), "first_save_vs_d2h": first_save_s / d2h_m,
            "restore_memory_gbs": gbs(restore_m), "restore_memory_vs_h2d": restore_m / h2d_m,
            "first_restore_gbs": gbs(first_s), "first_restore_vs_h2d": first_s / h2d_m,
            "restore_storage_gbs": gbs(storage_s), "restore_storage_vs_h2d": storage_s / h2d_m,
            "storage_read": cold_how, "hot_reload_gbs": gbs(reload_s), "bit_exact": bool(ok)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--configs", default="4:200,1:2000",
                    help="comma list of GIB:TENSORS (default 4:200,1:2000)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dir", default=None, help="checkpoint directory (default: a temporary one)")
    ap.add_argument("--warm", action="store_true",
                    help="do not drop the page cache before the restore from storage")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: CUDA is not available here; nothing to check (--device cpu checks the "
              "script itself)")
        return 0
    dev = torch.device(args.device)
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (dry run)"
    root = args.dir or tempfile.mkdtemp(prefix="sp-gpu-")
    results = []
    print("| device | state | pinned D2H | save | save vs D2H (goal <= 1.25x) | "
          "first save after a restart | vs D2H | pinned H2D | "
          "restore from memory | vs H2D | first restore after a restart | vs H2D | "
          "restore from storage | vs H2D | hot reload to CPU | bit-exact |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for spec in args.configs.split(","):
        gib, tensors = spec.split(":")
        r = one_config(float(gib), int(tensors), args.reps, dev, root, cold=not args.warm)
        results.append(r)
        print(f"| {name} | {r['gib']:g} GiB, {r['tensors']} tensors | "
              f"{r['d2h_pinned_gbs']:.1f} GB/s | {r['save_gbs']:.1f} GB/s | "
              f"{r['save_vs_d2h']:.2f}x | {r['first_save_gbs']:.1f} GB/s | "
              f"{r['first_save_vs_d2h']:.2f}x | {r['h2d_pinned_gbs']:.1f} GB/s | "
              f"{r['restore_memory_gbs']:.1f} GB/s | {r['restore_memory_vs_h2d']:.2f}x | "
              f"{r['first_restore_gbs']:.1f} GB/s | {r['first_restore_vs_h2d']:.2f}x | "
              f"{r['restore_storage_gbs']:.1f} GB/s ({r['storage_read']}) | "
              f"{r['restore_storage_vs_h2d']:.2f}x | {r['hot_reload_gbs']:.1f} GB/s | "
              f"{r['bit_exact']} |", flush=True)
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({"device": name, "torch": torch.__version__, "results": results}))
    return 0 if all(r["bit_exact"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
