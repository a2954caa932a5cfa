"""Checks and measures the GPU path of flash snapshots in one short run (run it whenever a GPU
is lent): device-to-host bandwidth of Checkpointer.save against a plain copy into pinned memory
(the link's limit measured in the same run), then a hot reload and an in-place restore into GPU
tensors, each checked bit for bit. Prints a markdown table and one JSON line; exits 0 with a
message where CUDA is absent.

    python bench/gpu_check.py [--gib 2] [--tensors 200] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--tensors", type=int, default=200)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="checkpoint directory (default: a temporary one)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: CUDA is not available here; nothing to check")
        return 0
    import safepoint

    dev = torch.device("cuda")
    per = int(args.gib * (1 << 30)) // args.tensors // 4
    g = torch.Generator(device=dev).manual_seed(0)
    state = {f"t{i}": torch.randn(per, device=dev, generator=g) for i in range(args.tensors)}
    nbytes = sum(t.numel() * 4 for t in state.values())
    torch.cuda.synchronize()

    # The limit: one pinned buffer, the same tensors copied with non_blocking copies.
    pinned = torch.empty(nbytes // 4, dtype=torch.float32, pin_memory=True)
    plain = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        off = 0
        for t in state.values():
            pinned[off:off + t.numel()].copy_(t, non_blocking=True)
            off += t.numel()
        torch.cuda.synchronize()
        plain.append(time.perf_counter() - t0)

    root = args.dir or tempfile.mkdtemp(prefix="sp-gpu-")
    ck = safepoint.Checkpointer(os.path.join(root, "ckpt"), job=f"gpucheck-{os.getpid()}",
                                persist_every=1 << 30)
    try:
        ck.save(0, state)  # first save creates and registers the slots
        saves = []
        for step in range(1, args.reps + 1):
            t0 = time.perf_counter()
            ck.save(step, state)
            saves.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        step, snap = ck.load()
        reload_s = time.perf_counter() - t0
        ok = step == args.reps and all(torch.equal(snap[k], v.cpu()) for k, v in state.items())
        target = {k: torch.empty_like(v) for k, v in state.items()}
        t0 = time.perf_counter()
        ck.restore(target)
        torch.cuda.synchronize()
        restore_s = time.perf_counter() - t0
        ok = ok and all(torch.equal(target[k], v) for k, v in state.items())
    finally:
        ck.close()
    gbs = lambda s: nbytes / s / 1e9  # noqa: E731
    from safepoint import _staging

    res = {"device": torch.cuda.get_device_name(), "bytes": nbytes, "tensors": args.tensors,
           "slots_pinned": len(_staging._pinned),
           "pinned_copy_gbs": gbs(statistics.median(plain)), "save_gbs": gbs(statistics.median(saves)),
           "save_vs_pinned": statistics.median(saves) / statistics.median(plain),
           "hot_reload_gbs": gbs(reload_s), "restore_to_gpu_gbs": gbs(restore_s), "bit_exact": ok}
    print(f"| {res['device']} | {nbytes / 2**30:.2f} GiB, {args.tensors} tensors | "
          f"pinned copy {res['pinned_copy_gbs']:.1f} GB/s | save {res['save_gbs']:.1f} GB/s "
          f"({res['save_vs_pinned']:.2f}x the pinned copy's time) | hot reload "
          f"{res['hot_reload_gbs']:.1f} GB/s | restore into GPU {res['restore_to_gpu_gbs']:.1f} GB/s "
          f"| bit-exact {ok} |")
    print(json.dumps(res))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
