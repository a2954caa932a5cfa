"""A preemptible DDP job: a SIGTERM loses nothing. 2 ranks on the CPU (gloo).

    python examples/preemptible.py [--ckpt DIR] [--steps 30] [--preempt-at 12]  # starts 2 ranks
    torchrun --nproc-per-node 2 examples/preemptible.py --ckpt DIR             # or torchrun

``train()`` calls ``ckpt.save(step, state)`` every step; only every 5th step is copied into
shared memory (``snapshot_every=5``) and every 10th persisted. When the scheduler's SIGTERM (or
SIGUSR1) reaches the ranks, their next ``save`` copies and persists that step, whatever the
schedule, on every rank the same step; once it is committed each rank ends as SIGTERM would
have ended it (``safepoint [rank R]: SIGTERM: step 13 is committed to ...`` on stderr), which is
what the scheduler waits for. The loop checks nothing. The next run resumes from exactly that
step.

Started without torchrun, ``main()`` launches the 2 ranks (torch.multiprocessing) and, once
rank 0 has saved step ``--preempt-at``, sends SIGTERM to both, as torchrun does when its own
SIGTERM arrives; the ranks preempt at the next step (13), and the group started again prints
``[rank R] resumed from step 13 (memory)``. Under torchrun, ``kill -TERM`` torchrun's pid
(or let Slurm or Kubernetes do it), then run the same command again.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import sys
import tempfile
from typing import Any, Optional

import torch
import torch._dynamo  # noqa: F401  (DDP imports it when built: once here, before forking ranks)
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny_gpt  # noqa: E402

import safepoint  # noqa: E402


def train(ckpt_dir: str, steps: int, expect_start: Optional[int] = None,
          reached: Any = None) -> None:
    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the env
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(tiny_gpt.TinyGPT(dim=64, layers=2, context=32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"model": model, "optim": opt}

    # Made in the main thread: SIGTERM and SIGUSR1 become a preemption notice (the handlers
    # chain to any installed before, and are put back when the block ends). The save after
    # the notice persists its step on every rank; once it is committed the process ends as
    # the signal would have ended it (on_preemption="return" would return instead).
    with safepoint.Checkpointer(ckpt_dir, snapshot_every=5, persist_every=10, keep=2) as ckpt:
        start = ckpt.restore(state) or 0
        print(f"[rank {rank}] " + (f"resumed from step {start} ({ckpt.last_load_source})"
                                   if start else "fresh start"), flush=True)
        if expect_start is not None and start != expect_start:
            sys.exit(f"[rank {rank}] resumed from step {start}, not {expect_start}")

        loss = torch.tensor(float("nan"))
        for step in range(start + 1, steps + 1):
            x, y = tiny_gpt.batch(step * world + rank, batch_size=8, context=32)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            ckpt.save(step, state, include_rng=True)  # a copy on due steps; all ranks call it
            if reached is not None and rank == 0 and step == reached[2]:
                reached[0].set()  # (for the demo) the launcher now sends SIGTERM ...
                reached[1].wait()  # ... and rank 0 goes on once it has
        ckpt.wait()
        if rank == 0:
            print(f"[rank 0] done: step {steps}, loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


def _rank(index: int, ckpt_dir: str, steps: int, expect_start: Optional[int],
          reached: Any) -> None:
    os.environ.update(RANK=str(index), LOCAL_RANK=str(index))
    torch.set_num_threads(1)  # a small model, several ranks on one CPU: one thread each
    train(ckpt_dir, steps, expect_start, reached)


def launch(ckpt_dir: str, steps: int, preempt_at: Optional[int] = None,
           expect_start: Optional[int] = None, nprocs: int = 2) -> None:
    """Runs the ranks until they end; with `preempt_at`, SIGTERMs them (as torchrun would)
    once rank 0 saved that step, and expects each to end by SIGTERM (after its step is
    committed), else each to exit 0."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(nprocs))
    fork = mp.get_context("fork")
    reached = (fork.Event(), fork.Event(), preempt_at) if preempt_at else None
    ctx = mp.start_processes(_rank, args=(ckpt_dir, steps, expect_start, reached),
                             nprocs=nprocs, start_method="fork", join=False)
    if reached is not None:
        reached[0].wait()
        print(f"launcher: SIGTERM to the ranks after step {preempt_at}", flush=True)
        for p in reversed(ctx.processes):  # one after the other, rank 1 first
            os.kill(p.pid, signal.SIGTERM)
        reached[1].set()
    for i, p in enumerate(ctx.processes):  # (not ctx.join(): it ends the others at a failure)
        p.join()
        want = -signal.SIGTERM if preempt_at else 0
        if p.exitcode != want:
            sys.exit(f"launcher: rank {i} ended with {p.exitcode}, not {want}")
    if preempt_at:
        print("launcher: both ranks ended by SIGTERM", flush=True)


def main() -> None:
    torchrun = "LOCAL_RANK" in os.environ  # started by torchrun: this process is one rank
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=torchrun,
                    help="checkpoint directory, the same for every rank (default: a temporary "
                         "one; required under torchrun)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--preempt-at", type=int, default=12, help="0: no preemption")
    args = ap.parse_args()
    if torchrun:
        torch.set_num_threads(1)  # a small model, several ranks on one CPU: one thread each
        return train(args.ckpt, args.steps)
    tmp = None if args.ckpt else tempfile.mkdtemp(prefix="safepoint-example-")
    ckpt_dir = args.ckpt or os.path.join(tmp, "ckpt")
    try:
        expect = None
        if args.preempt_at:
            launch(ckpt_dir, args.steps, preempt_at=args.preempt_at)
            expect = safepoint.steps(ckpt_dir)[-1]
            print(f"preempted; committed steps {safepoint.steps(ckpt_dir)}; restarting",
                  flush=True)
        launch(ckpt_dir, args.steps, expect_start=expect)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
