"""A training run with flash checkpoints: the process the demo kills and restarts.

    python examples/train.py --ckpt DIR --steps N [--job JOB] [--persist-every K]

Resumes from the newest checkpoint (memory first, then storage), trains to step N with a
snapshot every step, and prints one JSON line per event (resumed / saved / done).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

T_START = time.perf_counter()

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny_gpt  # noqa: E402

import safepoint  # noqa: E402


def emit(**event) -> None:
    print(json.dumps(event), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--job", default=None)
    ap.add_argument("--persist-every", type=int, default=5)
    ap.add_argument("--dim", type=int, default=256)
    args = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))

    model, opt = tiny_gpt.make(seed=0, dim=args.dim)
    ckpt = safepoint.Checkpointer(args.ckpt, job=args.job, persist_every=args.persist_every)
    start = 1
    t0 = time.perf_counter()
    loaded = ckpt.load()
    if loaded is not None:
        step, state = loaded
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start = step + 1
        emit(event="resumed", step=step, source=ckpt.last_load_source,
             load_seconds=time.perf_counter() - t0, since_process_start=time.perf_counter() - T_START)
    else:
        emit(event="fresh", since_process_start=time.perf_counter() - T_START)

    for step in range(start, args.steps + 1):
        loss = tiny_gpt.train_step(model, opt, step)
        t = time.perf_counter()
        ckpt.save(step, {"model": model.state_dict(), "optim": opt.state_dict(), "step": step})
        emit(event="saved", step=step, loss=loss, blocking_seconds=time.perf_counter() - t)
    ckpt.wait()
    st = ckpt.status()
    ckpt.close()
    emit(event="done", newest_committed=st["newest_committed"], weights=weights_digest(model))


def weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 of every parameter's bytes: equal digests mean bit-identical weights."""
    h = hashlib.sha256()
    for name, p in model.state_dict().items():
        h.update(name.encode())
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


if __name__ == "__main__":
    main()
