"""The Hugging Face Trainer on 2 ranks (DDP, CPU/gloo) with SafepointCallback.

    python examples/hf_trainer_ddp.py [--dir DIR] [--steps 12] [--crash-at 6]

The training script is the ordinary single-process one (examples/hf_example.py); what makes it
multi-rank is the launch: ``torchrun --nproc-per-node 2 examples/hf_trainer_ddp.py --rank-run
--dir DIR`` (or ``accelerate launch``). This example starts the 2 ranks itself, as torchrun
would (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so that it runs as one command. Every rank
flash-saves its part of every 2nd step (the replicated model and optimizer reach storage once,
each rank's generator states its own); ``cb.prepare_resume(trainer)`` is a collective: the
ranks agree on the newest step every rank can load.

The first job's ranks kill themselves with SIGKILL right after the save of step ``--crash-at``;
the second job resumes, each rank printing ``[rank R] resumed from step 6 (memory)``.

FSDP2 instead of DDP: ``TrainingArguments(..., fsdp=True, fsdp_config={"fsdp_version": 2})``;
the callback then saves each rank's DTensor shards (accelerate turns FSDP on only on GPUs).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_example import CrashAt, Tokens  # noqa: E402

import safepoint  # noqa: E402
from safepoint.hf import SafepointCallback  # noqa: E402


def train(workdir: str, steps: int, crash_at: int) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2,
                                       n_head=2, bos_token_id=0, eos_token_id=0))
    args = TrainingArguments(output_dir=os.path.join(workdir, "trainer"), max_steps=steps,
                             per_device_train_batch_size=4, learning_rate=3e-3,
                             save_strategy="no",  # safepoint checkpoints instead
                             report_to=[], use_cpu=True, ddp_backend="gloo", disable_tqdm=True)
    cb = SafepointCallback(os.path.join(workdir, "safepoint"), every_n_steps=2)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(),
                      callbacks=[cb] + ([CrashAt(crash_at)] if crash_at else []))
    resume = cb.prepare_resume(trainer)  # every rank: the same step, or None (a fresh start)
    if resume is None:
        print(f"[rank {rank}] fresh start", flush=True)
    else:
        print(f"[rank {rank}] resumed from step {cb.resumed_step} ({cb.resumed_from})", flush=True)
    trainer.train(resume_from_checkpoint=resume)
    if rank == 0:
        print(f"done: step {trainer.state.global_step}, committed steps "
              f"{safepoint.steps(os.path.join(workdir, 'safepoint'))}", flush=True)
    sys.stdout.flush()
    os._exit(0)  # gloo's threads may outlive the process group (see examples/fsdp2.py)


def launch(workdir: str, steps: int, crash_at: int) -> list[int]:
    """Starts 2 ranks as torchrun would and waits for them; returns their exit codes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                   LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank-run",
                                       "--dir", workdir, "--steps", str(steps),
                                       "--crash-at", str(crash_at)], env=env))
    return [p.wait() for p in procs]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", help="working directory (default: a temporary one)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--crash-at", type=int, default=6, help="0: no crash")
    ap.add_argument("--rank-run", action="store_true", help="run as one rank (under torchrun)")
    args = ap.parse_args()
    if args.rank_run:
        train(args.dir, args.steps, args.crash_at)
        return
    tmp = None if args.dir else tempfile.mkdtemp(prefix="safepoint-hf-ddp-")
    workdir = args.dir or tmp
    try:
        if args.crash_at:
            codes = launch(workdir, args.steps, args.crash_at)
            print(f"first job's ranks ended with {codes}; restarting", flush=True)
        codes = launch(workdir, args.steps, 0)
        sys.exit(0 if codes == [0, 0] else 1)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
