"""The Hugging Face Trainer with safepoint flash checkpoints: SafepointCallback.

    python examples/hf_example.py [--dir DIR] [--steps 12] [--crash-at 6] [--ranks 1]

A tiny GPT-2 (built from a config, nothing downloaded) trains with the ordinary ``Trainer``.
``SafepointCallback(every_n_steps=2)`` saves model, optimizer, scheduler, generator and trainer
state every 2 steps as a flash checkpoint (the save returns once the state is in shared memory;
the node agent persists it to ``DIR/safepoint``); ``save_strategy="no"`` keeps the Trainer from
writing its own ``checkpoint-*`` directories.

To show a crash and a resume in one command, the first run, in a child process, kills itself with
SIGKILL right after the save of step ``--crash-at``; the second run resumes with
``trainer.train(resume_from_checkpoint=cb.prepare_resume(trainer))`` as a restarted job would and
prints ``resumed from step 6 (memory)``: the agent still holds the dead run's snapshot in shared
memory (after a reboot it would come from storage). The resumed run skips the batches already
seen and restores the generators where the Trainer does, so it continues bit for bit.

Several ranks: ``--ranks 2`` runs each job as 2 DDP processes (CPU, gloo), started as
``torchrun --nproc-per-node 2`` would start them (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT);
the training code is the same. Every rank saves its part of each step, the ranks of the killed
job die after the same save, and ``prepare_resume`` is a collective: the ranks agree on the
newest step every rank can load, and each prints ``[rank R] resumed from step 6 (memory)``.
With ``TrainingArguments(fsdp=True, fsdp_config={"fsdp_version": 2})`` (accelerate turns FSDP
on only on GPUs) each rank saves its DTensor shards.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

import torch
from transformers import (GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback,
                          TrainingArguments)

import safepoint
from safepoint.hf import SafepointCallback


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, length: int = 16, vocab: int = 128):
        self.ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class CrashAt(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:  # SafepointCallback (listed first) has saved it
            print(f"step {state.global_step}: saved; crashing (SIGKILL)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)  # no clean-up: a crash


def train(workdir: str, steps: int, crash_at: int) -> None:
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    tag = f"[rank {os.environ['RANK']}] " if ranks > 1 else ""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2,
                                       n_head=2, bos_token_id=0, eos_token_id=0))
    args = TrainingArguments(output_dir=os.path.join(workdir, "trainer"), max_steps=steps,
                             per_device_train_batch_size=8, learning_rate=3e-3,
                             save_strategy="no",  # safepoint checkpoints instead
                             report_to=[], logging_steps=4, use_cpu=True,
                             ddp_backend="gloo" if ranks > 1 else None, disable_tqdm=True)
    cb = SafepointCallback(os.path.join(workdir, "safepoint"), every_n_steps=2)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(),
                      callbacks=[cb] + ([CrashAt(crash_at)] if crash_at else []))
    resume = cb.prepare_resume(trainer)  # None: nothing saved yet, a fresh start
    if resume is None:
        print(f"{tag}fresh start", flush=True)
    else:
        print(f"{tag}resumed from step {cb.resumed_step} ({cb.resumed_from})", flush=True)
    out = trainer.train(resume_from_checkpoint=resume)
    # on_train_end waited until every persisted step was committed.
    print(f"{tag}done: step {trainer.state.global_step}, loss {out.training_loss:.4f}, "
          f"committed steps {safepoint.steps(os.path.join(workdir, 'safepoint'))}", flush=True)
    if ranks > 1:  # gloo's threads may outlive the process group (see examples/fsdp2.py)
        os._exit(0)


def run_job(workdir: str, steps: int, crash_at: int, ranks: int) -> list[int]:
    """Runs one job of this script (--child) as `ranks` processes, started as torchrun would
    start them; returns their exit codes."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--dir", workdir,
           "--steps", str(steps), "--crash-at", str(crash_at)]
    if ranks == 1:
        return [subprocess.run(cmd).returncode]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen(cmd, env=dict(
        os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(ranks),
        LOCAL_WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        OMP_NUM_THREADS="1")) for r in range(ranks)]
    return [p.wait() for p in procs]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", help="working directory (default: a temporary one)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--crash-at", type=int, default=6, help="0: no crash")
    ap.add_argument("--ranks", type=int, default=1, help="processes per job (DDP when > 1)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:  # a run in a child process (the first one crashes), or one rank of it
        train(args.dir, args.steps, args.crash_at)
        return
    tmp = None if args.dir else tempfile.mkdtemp(prefix="safepoint-hf-")
    workdir = args.dir or tmp
    try:
        if args.crash_at:
            codes = run_job(workdir, args.steps, args.crash_at, args.ranks)
            print(f"first run ended by signal {-codes[0]}; restarting", flush=True)
        if args.ranks == 1:
            train(workdir, args.steps, crash_at=0)
        elif run_job(workdir, args.steps, 0, args.ranks) != [0] * args.ranks:
            sys.exit(1)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
