"""Plain PyTorch with safepoint flash checkpoints, in one process.

    python examples/plain_pytorch.py [--ckpt DIR] [--steps 30] [--crash-at 12]

``train()`` is an ordinary training loop: a small GPT-style model, AdamW and an LR schedule,
flash-saved every step with the generator states (``save()`` returns once the state is copied
into shared memory; the node agent persists every 10th step to DIR in the background), resumed
in place with ``restore()``.

To show a crash and a resume in one command, ``main()`` first runs ``train()`` in a child
process that kills itself with SIGKILL right after saving step ``--crash-at``, then runs it
again, as a restarted job would: it prints ``resumed from step 12 (memory)``, because the agent
still holds the snapshot in shared memory (after a reboot it would come from storage).

``kill -TERM`` (a scheduler preempting the job) on a run, e.g. ``--steps 3000 --crash-at 0``:
the next ``save()`` persists its step, and once it is committed the process ends as SIGTERM
would have ended it (exit status 143), printing ``safepoint: SIGTERM: step N is committed to
DIR; ending the process as SIGTERM does (...)``; the loop checks nothing. Run it again with the
same ``--ckpt``: it resumes from step N (docs/guide.md, "Preemption").
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
from typing import Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny_gpt  # noqa: E402

import safepoint  # noqa: E402


def train(ckpt_dir: str, steps: int, crash_at: Optional[int] = None) -> float:
    torch.manual_seed(0)
    model = tiny_gpt.TinyGPT(dim=64, layers=2, context=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    # Objects with state_dict()/load_state_dict() go in as they are. The data of a step is a
    # function of the step (tiny_gpt.batch), so the step is the data position; a stateful
    # sampler or data loader would be one more entry here.
    state = {"model": model, "optim": opt, "sched": sched}

    with safepoint.Checkpointer(ckpt_dir, persist_every=10, keep=2) as ckpt:
        start = ckpt.restore(state)  # loads in place: memory first, then storage; None if empty
        if start is None:
            print("fresh start", flush=True)
            start = 0
        else:
            print(f"resumed from step {start} ({ckpt.last_load_source})", flush=True)

        loss = torch.tensor(float("nan"))
        for step in range(start + 1, steps + 1):
            x, y = tiny_gpt.batch(step, batch_size=8, context=32)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            ckpt.save(step, state, include_rng=True)  # blocks only for the copy into memory
            if step == crash_at:
                print(f"step {step}: saved; crashing (SIGKILL)", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)  # no clean-up, no close(): a crash
        ckpt.wait()  # every persisted step is committed on storage
    return loss.item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", help="checkpoint directory (default: a temporary one)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--crash-at", type=int, default=12, help="0: no crash")
    args = ap.parse_args()
    torch.set_num_threads(1)  # a model this small trains faster on one thread than on several
    tmp = None if args.ckpt else tempfile.mkdtemp(prefix="safepoint-example-")
    ckpt_dir = args.ckpt or os.path.join(tmp, "ckpt")
    try:
        if args.crash_at:
            # The first run, in a child process, dies with SIGKILL after step --crash-at.
            child = multiprocessing.get_context("fork").Process(
                target=train, args=(ckpt_dir, args.steps, args.crash_at))
            child.start()
            child.join()
            print(f"first run ended by signal {-child.exitcode}; restarting", flush=True)
        loss = train(ckpt_dir, args.steps)  # the restart: resumes where the first run left off
        print(f"done: step {args.steps}, loss {loss:.4f}, committed steps "
              f"{safepoint.steps(ckpt_dir)}", flush=True)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
