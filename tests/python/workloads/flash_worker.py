"""A training process for tests/python/test_flash.py: snapshots a deterministic state every step.

The state of a step is a pure function of (seed, step, numel) (``make_state``), so a test can
check any loaded copy bit for bit. The worker prints one line per event, flushed at once:

    READY <pid>                    the Checkpointer is connected
    LOADED <step> <source> EXACT   (--resume) what ckpt.load() returned; MISMATCH if it differs
    FRESH                          (--resume) nothing to load
    BEGIN <step>                   about to call save(step)
    SAVED <step>                   save(step) returned
    IDLE                           done saving (--steps N, N >= 0); reads commands from stdin:
                                     close  -> wait(), close(), prints CLOSED, exits 0
                                     exit   -> exits at once without closing (like a crash)
                                     status -> prints STATUS <json>

Run as a script: python flash_worker.py --path P --job J --shm-dir D [options].
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

from bitexact import first_difference


@functools.lru_cache(maxsize=2)
def _base(seed: int, numel: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**31), 2**31 - 1, (numel,), dtype=torch.int32, generator=g)


def make_state(seed: int, step: int, numel: int) -> dict:
    """The state of `step`: a big int32 tensor (cheap to derive per step), small float tensors of
    several dtypes and non-tensor values; every byte depends on (seed, step)."""
    import torch

    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return {
        "w": _base(seed, numel) + step,  # int32 arithmetic wraps: still a pure function
        "model": {"b": torch.randn(257, generator=g),
                  "h": torch.randn(3, 5, generator=g).to(torch.float64),
                  "e": torch.randn(4, 4, generator=g).to(torch.bfloat16)},
        "step": step,
        "meta": {"seed": seed, "tag": f"step-{step}", "lr": 1.0 / (step + 1)},
    }


def say(*fields) -> None:
    """One line in one write, so that a kill never cuts it."""
    sys.stdout.write(" ".join(map(str, fields)) + "\n")
    sys.stdout.flush()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--path", required=True)
    ap.add_argument("--job", required=True)
    ap.add_argument("--shm-dir", required=True)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--numel", type=int, default=1 << 16)
    ap.add_argument("--persist-every", type=int, default=1)
    ap.add_argument("--keep", type=int, default=3)
    ap.add_argument("--start", type=int, default=1, help="first step when nothing is loaded")
    ap.add_argument("--steps", type=int, default=-1, help="saves to make; -1: forever")
    ap.add_argument("--resume", action="store_true", help="load first and continue after it")
    args = ap.parse_args()

    import safepoint

    ckpt = safepoint.Checkpointer(args.path, job=args.job, shm_dir=args.shm_dir,
                                  persist_every=args.persist_every, keep=args.keep)
    print("READY", os.getpid(), flush=True)
    step = args.start
    if args.resume:
        loaded = ckpt.load()
        if loaded is None:
            print("FRESH", flush=True)
        else:
            got_step, state = loaded
            diff = first_difference(state, make_state(args.seed, got_step, args.numel))
            verdict = "EXACT" if diff is None else "MISMATCH"
            print("LOADED", got_step, ckpt.last_load_source, verdict, flush=True)
            if diff is not None:
                print("DIFF", diff, flush=True)
            step = got_step + 1
    made = 0
    while args.steps < 0 or made < args.steps:
        state = make_state(args.seed, step, args.numel)
        say("BEGIN", step)
        ckpt.save(step, state)
        say("SAVED", step)
        step += 1
        made += 1
    print("IDLE", flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "close":
            ckpt.wait()
            ckpt.close()
            print("CLOSED", flush=True)
            return 0
        if cmd == "exit":
            sys.stdout.flush()
            os._exit(0)  # no clean close: the agent sees the process die
        if cmd == "status":
            print("STATUS", json.dumps(ckpt.status(), default=str), flush=True)
    os._exit(0)  # stdin closed: like a crash


if __name__ == "__main__":
    sys.exit(main())
