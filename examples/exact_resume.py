"""Exact resume of the data position with another data-parallel size: DDP on the CPU (gloo).

    python examples/exact_resume.py [--ckpt DIR] [--steps 20] [--crash-at 7] [--ranks 2]
                                    [--resume-ranks 3]          # starts the ranks itself
    torchrun --nproc-per-node 2 examples/exact_resume.py --ckpt DIR --crash-at 7
    torchrun --nproc-per-node 3 examples/exact_resume.py --ckpt DIR   # resumes with 3 ranks

The data position is part of the state: ``safepoint.data.GlobalBatchSampler`` keeps the job's
global sample cursor (epoch, samples consumed, seed). Every global step consumes the next 12
samples of the epoch's order, a permutation drawn from (seed, epoch); each rank trains on its
contiguous share (6 of them with 2 ranks, 4 with 3). ``seed_for_step`` seeds each rank's
generators from (seed, step, rank) at the start of every step.

Started without torchrun, ``main()`` launches 2 ranks; rank 1 kills itself with SIGKILL right
after step ``--crash-at``, the launcher stops the other rank and starts 3 ranks, which resume
from that step (from storage: the node agent persisted the 2 ranks' snapshots when the world
size changed) and train to ``--steps``. Every rank appends the sample ids it trained on to a
log; at the end the launcher checks that each global step trained on exactly the samples an
uninterrupted run's step would have (``GlobalBatchSampler`` with one rank, from the start).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
from typing import Optional

import torch
import torch._dynamo  # noqa: F401  (DDP imports it when built: once here, before forking ranks)
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny_gpt  # noqa: E402

import safepoint  # noqa: E402
from safepoint.data import GlobalBatchSampler, seed_for_step  # noqa: E402

SAMPLES, GLOBAL_BATCH, CONTEXT, SEED = 100, 12, 32, 0


class Sequences(Dataset):
    """SAMPLES token sequences, each a pure function of its index; an item is (index, x, y)."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int):
        x, y = tiny_gpt.batch(i, batch_size=1, context=CONTEXT)
        return i, x[0], y[0]


def train(ckpt_dir: str, steps: int, crash_at: Optional[int], log_dir: Optional[str]) -> None:
    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the env
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(tiny_gpt.TinyGPT(dim=64, layers=2, context=CONTEXT))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = Sequences()
    # The data-parallel rank and size come from torch.distributed; 12 % world must be 0.
    sampler = GlobalBatchSampler(data, global_batch_size=GLOBAL_BATCH, seed=SEED)
    loader = DataLoader(data, batch_sampler=sampler, generator=torch.Generator())
    state = {"model": model, "optim": opt, "data": sampler}

    with safepoint.Checkpointer(ckpt_dir, persist_every=5, keep=2) as ckpt:
        start = ckpt.restore(state)  # the cursor comes back with the step it was saved with
        if start is None:
            print(f"[rank {rank}] fresh start", flush=True)
            start = 0
        else:
            print(f"[rank {rank}] resumed from step {start} ({ckpt.last_load_source}); "
                  f"{world} ranks, epoch {sampler.epoch}, {sampler.consumed} samples consumed",
                  flush=True)

        step, loss = start, torch.tensor(float("nan"))
        log = open(os.path.join(log_dir, f"rank-{rank}.jsonl"), "a") if log_dir else None
        while step < steps:
            for ids, x, y in loader:  # to the end of the epoch, from the restored cursor
                step += 1
                seed_for_step(SEED, step, rank)  # dropout, augmentation: a function of the step
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                opt.zero_grad(set_to_none=True)
                loss.backward()  # DDP averages the ranks' gradients
                opt.step()
                ckpt.save(step, state)  # the sampler's cursor goes with the step
                if log:
                    log.write(json.dumps({"step": step, "rank": rank, "world": world,
                                          "ids": ids.tolist()}) + "\n")
                    log.flush()
                if step == crash_at:
                    dist.barrier()  # (for the demo) every rank has saved this step
                    if rank == 1:
                        print(f"[rank 1] step {step}: saved; crashing (SIGKILL)", flush=True)
                        os.kill(os.getpid(), signal.SIGKILL)
                if step == steps:
                    break
        ckpt.wait()
        if rank == 0:
            print(f"[rank 0] done: step {steps}, loss {loss.item():.4f}, committed steps "
                  f"{safepoint.steps(ckpt_dir)}", flush=True)
    dist.destroy_process_group()


def _rank(index: int, ckpt_dir: str, steps: int, crash_at: Optional[int], log_dir: str) -> None:
    os.environ.update(RANK=str(index), LOCAL_RANK=str(index))
    torch.set_num_threads(1)  # a small model, several ranks on one CPU: one thread each
    train(ckpt_dir, steps, crash_at, log_dir)


def launch(ckpt_dir: str, steps: int, crash_at: Optional[int], nprocs: int,
           log_dir: str) -> bool:
    """Runs the ranks until they end; False when one died (the others are then stopped)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(nprocs))
    try:
        mp.start_processes(_rank, args=(ckpt_dir, steps, crash_at, log_dir), nprocs=nprocs,
                           start_method="fork")
        return True
    except mp.ProcessExitedException as e:
        print(f"rank {e.error_index} died ({e}); the launcher stopped the group", flush=True)
        return False


def check(log_dir: str, steps: int) -> bool:
    """Whether every global step trained on the samples of an uninterrupted run's step."""
    got: dict[int, dict[int, list[int]]] = {}
    for name in sorted(os.listdir(log_dir)):
        with open(os.path.join(log_dir, name)) as f:
            for line in f:
                e = json.loads(line)
                got.setdefault(e["step"], {})[e["rank"]] = e["ids"]  # a resumed step: the last
    uninterrupted = GlobalBatchSampler(SAMPLES, GLOBAL_BATCH, rank=0, world_size=1, seed=SEED)
    same = True
    for step in range(1, steps + 1):
        want = uninterrupted.local_batch()
        uninterrupted.advance()
        trained = [i for r in sorted(got.get(step, {})) for i in got[step][r]]
        same = same and trained == want
    return same


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", help="checkpoint directory (default: a temporary one)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--crash-at", type=int, default=7, help="0: no crash")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--resume-ranks", type=int, default=3)
    args = ap.parse_args()
    if "LOCAL_RANK" in os.environ:  # started by torchrun: this process is one rank
        if not args.ckpt:
            ap.error("under torchrun, --ckpt DIR is needed (the same directory for every rank)")
        torch.set_num_threads(1)
        train(args.ckpt, args.steps, args.crash_at or None, None)
        return
    tmp = tempfile.mkdtemp(prefix="safepoint-example-")
    ckpt_dir = args.ckpt or os.path.join(tmp, "ckpt")
    log_dir = os.path.join(tmp, "ids")
    os.makedirs(log_dir)
    try:
        if not args.crash_at:
            if not launch(ckpt_dir, args.steps, None, args.ranks, log_dir):
                sys.exit(1)
        elif not launch(ckpt_dir, args.steps, args.crash_at, args.ranks, log_dir):
            print(f"restarting with {args.resume_ranks} ranks", flush=True)
            if not launch(ckpt_dir, args.steps, None, args.resume_ranks, log_dir):
                sys.exit(1)
        same = check(log_dir, args.steps)
        print(f"every global step trained on the samples of an uninterrupted run: {same}",
              flush=True)
        if not same:
            sys.exit(1)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
