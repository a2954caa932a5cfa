"""The Hugging Face Trainer with safepoint flash checkpoints: SafepointCallback.

    python examples/hf_example.py [--dir DIR] [--steps 12] [--crash-at 6]

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
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
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
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2,
                                       n_head=2, bos_token_id=0, eos_token_id=0))
    args = TrainingArguments(output_dir=os.path.join(workdir, "trainer"), max_steps=steps,
                             per_device_train_batch_size=8, learning_rate=3e-3,
                             save_strategy="no",  # safepoint checkpoints instead
                             report_to=[], logging_steps=4, use_cpu=True, disable_tqdm=True)
    cb = SafepointCallback(os.path.join(workdir, "safepoint"), every_n_steps=2)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(),
                      callbacks=[cb] + ([CrashAt(crash_at)] if crash_at else []))
    resume = cb.prepare_resume(trainer)  # None: nothing saved yet, a fresh start
    if resume is None:
        print("fresh start", flush=True)
    else:
        print(f"resumed from step {cb.resumed_step} ({cb.resumed_from})", flush=True)
    out = trainer.train(resume_from_checkpoint=resume)
    # on_train_end waited until every persisted step was committed.
    print(f"done: step {trainer.state.global_step}, loss {out.training_loss:.4f}, "
          f"committed steps {safepoint.steps(os.path.join(workdir, 'safepoint'))}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", help="working directory (default: a temporary one)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--crash-at", type=int, default=6, help="0: no crash")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:  # the first run, which crashes
        train(args.dir, args.steps, args.crash_at)
        return
    tmp = None if args.dir else tempfile.mkdtemp(prefix="safepoint-hf-")
    workdir = args.dir or tmp
    try:
        if args.crash_at:
            child = subprocess.run([sys.executable, os.path.abspath(__file__), "--child",
                                    "--dir", workdir, "--steps", str(args.steps),
                                    "--crash-at", str(args.crash_at)])
            print(f"first run ended by signal {-child.returncode}; restarting", flush=True)
        train(workdir, args.steps, crash_at=0)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
