"""DDP with safepoint flash checkpoints: 2 ranks on the CPU (gloo).

    python examples/ddp.py [--ckpt DIR] [--steps 30] [--crash-at 12]   # starts 2 ranks itself
    torchrun --nproc-per-node 2 examples/ddp.py --ckpt DIR              # or under torchrun

``train()`` is an ordinary DDP loop: every rank flash-saves its state every step (the node
agent persists every 10th step; a step is committed on storage once every rank's image is
there). ``restore()`` first makes all ranks agree on the newest step that every rank can load,
so ranks never resume from different steps.

Started without torchrun, ``main()`` launches the 2 ranks (torch.multiprocessing), and rank 1
kills itself with SIGKILL right after step ``--crash-at``; like torchrun, the launcher then
stops the other rank and starts the group again, where every rank prints
``[rank R] resumed from step 12 (memory)`` (a rank whose step raised when its peer died leaves
the ``with`` block through the exception, which keeps its snapshots for hot reload). Under
torchrun the first command
fails when rank 1 crashes; running it again resumes (``--crash-at 0``: no crash). (torchrun's
own ``--max-restarts`` restart fails in gloo's connectFullMesh with torch 2.13, with or without
safepoint.)
"""

from __future__ import annotations

import argparse
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny_gpt  # noqa: E402

import safepoint  # noqa: E402


def train(ckpt_dir: str, steps: int, crash_at: Optional[int] = None) -> None:
    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the env
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(tiny_gpt.TinyGPT(dim=64, layers=2, context=32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    state = {"model": model, "optim": opt, "sched": sched}

    # rank and world_size come from torch.distributed; one agent per node serves all its ranks.
    with safepoint.Checkpointer(ckpt_dir, persist_every=10, keep=2) as ckpt:
        start = ckpt.restore(state)  # the step every rank can load, from its fastest copy
        if start is None:
            print(f"[rank {rank}] fresh start", flush=True)
            start = 0
        else:
            print(f"[rank {rank}] resumed from step {start} ({ckpt.last_load_source})", flush=True)

        loss = torch.tensor(float("nan"))
        for step in range(start + 1, steps + 1):
            # Each rank trains on its own batch of the step (a pure function of step and rank).
            x, y = tiny_gpt.batch(step * world + rank, batch_size=8, context=32)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()  # DDP all-reduces the gradients
            opt.step()
            sched.step()
            ckpt.save(step, state, include_rng=True)  # each rank: its copy into shared memory
            if step == crash_at:
                dist.barrier()  # (for the demo) both ranks have saved this step
                if rank == 1:
                    print(f"[rank 1] step {step}: saved; crashing (SIGKILL)", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
        ckpt.wait()
        if rank == 0:
            print(f"[rank 0] done: step {steps}, loss {loss.item():.4f}, committed steps "
                  f"{safepoint.steps(ckpt_dir)}", flush=True)
    dist.destroy_process_group()


def _rank(index: int, ckpt_dir: str, steps: int, crash_at: Optional[int]) -> None:
    os.environ.update(RANK=str(index), LOCAL_RANK=str(index))
    torch.set_num_threads(1)  # a small model, several ranks on one CPU: one thread each
    train(ckpt_dir, steps, crash_at)


def launch(ckpt_dir: str, steps: int, crash_at: Optional[int], nprocs: int = 2) -> bool:
    """Runs the ranks until they end; False when one died (the others are then stopped)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(nprocs))
    try:
        mp.start_processes(_rank, args=(ckpt_dir, steps, crash_at), nprocs=nprocs,
                           start_method="fork")
        return True
    except mp.ProcessExitedException as e:
        print(f"rank {e.error_index} died ({e}); the launcher stopped the group", flush=True)
        return False


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", help="checkpoint directory (default: a temporary one)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--crash-at", type=int, default=12, help="0: no crash")
    args = ap.parse_args()
    if "LOCAL_RANK" in os.environ:  # started by torchrun: this process is one rank
        if not args.ckpt:
            ap.error("under torchrun, --ckpt DIR is needed (the same directory for every rank)")
        torch.set_num_threads(1)  # a small model, several ranks on one CPU: one thread each
        train(args.ckpt, args.steps, args.crash_at or None)
        return
    tmp = None if args.ckpt else tempfile.mkdtemp(prefix="safepoint-example-")
    ckpt_dir = args.ckpt or os.path.join(tmp, "ckpt")
    try:
        if args.crash_at:
            if launch(ckpt_dir, args.steps, args.crash_at):
                return  # it ended without crashing
            print("restarting the group", flush=True)
        if not launch(ckpt_dir, args.steps, None):
            sys.exit(1)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
