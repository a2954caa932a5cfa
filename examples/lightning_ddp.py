"""Lightning's DDP strategy on 2 CPU processes with the SafepointCheckpointIO plugin.

    python examples/lightning_ddp.py [--dir DIR] [--epochs 4] [--crash-epoch 2]

The LightningModule of examples/lightning_example.py trains with ``Trainer(accelerator="cpu",
devices=2, strategy="ddp", plugins=[SafepointCheckpointIO(...)])``; Lightning's launcher starts
the second rank. ``ModelCheckpoint(every_n_train_steps=4, save_last=True)`` checkpoints every 4
steps: rank 0 flash-saves (the state is the same on every rank) and writes the pointer files.

The first job's ranks kill themselves with SIGKILL when epoch ``--crash-epoch`` starts; the
second job runs ``trainer.fit(..., ckpt_path="last")``: rank 0 resumes from the snapshot the node
agent kept in memory, rank 1 from storage once the agent has committed that step; both print
``[rank R] resumed from step 8 (SOURCE)``.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lightning_example import BATCHES, Regressor, pl  # noqa: E402

import safepoint  # noqa: E402
from safepoint.lightning import SafepointCheckpointIO  # noqa: E402


class Report(pl.Callback):
    def __init__(self, crash_epoch: int):
        self.crash_epoch = crash_epoch

    def on_train_start(self, trainer, module):
        rank = trainer.global_rank
        if trainer.ckpt_path is None:
            print(f"[rank {rank}] fresh start", flush=True)
            return
        ckpt = trainer.strategy.checkpoint_io.checkpointer  # rank 0's safepoint.Checkpointer
        source = ckpt.last_load_source if ckpt is not None else "storage"
        print(f"[rank {rank}] resumed from step {trainer.global_step} ({source})", flush=True)

    def on_train_epoch_start(self, trainer, module):
        if trainer.current_epoch == self.crash_epoch:  # every rank: a crash of the job
            os.kill(os.getpid(), signal.SIGKILL)


def train(workdir: str, epochs: int, crash_epoch: int, resume: bool) -> None:
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)  # the same seed on every rank
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(BATCHES * 4, 8, generator=g),
                                          torch.randn(BATCHES * 4, 1, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=epochs, logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=workdir,
        plugins=[SafepointCheckpointIO(os.path.join(workdir, "safepoint"))],
        callbacks=[pl.callbacks.ModelCheckpoint(dirpath=os.path.join(workdir, "checkpoints"),
                                                every_n_train_steps=4, save_last=True),
                   Report(crash_epoch)])
    trainer.fit(Regressor(), loader, ckpt_path="last" if resume else None)
    if trainer.global_rank == 0:
        print(f"done: global step {trainer.global_step}, safepoint steps "
              f"{safepoint.steps(os.path.join(workdir, 'safepoint'))}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", help="working directory (default: a temporary one)")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--crash-epoch", type=int, default=2, help="0: no crash")
    ap.add_argument("--job", choices=("crash", "resume"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.job:  # one job of 2 ranks (Lightning's launcher runs this command again for rank 1)
        train(args.dir, args.epochs, args.crash_epoch if args.job == "crash" else -1,
              resume=args.job == "resume" and bool(args.crash_epoch))
        return
    tmp = None if args.dir else tempfile.mkdtemp(prefix="safepoint-lightning-ddp-")
    workdir = args.dir or tmp
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "LOCAL_RANK")}
    job = [sys.executable, os.path.abspath(__file__), "--dir", workdir, "--epochs",
           str(args.epochs), "--crash-epoch", str(args.crash_epoch)]
    try:
        if args.crash_epoch:
            first = subprocess.run(job + ["--job", "crash"], env=env)
            print(f"first job ended by signal {-first.returncode}; restarting", flush=True)
        sys.exit(subprocess.run(job + ["--job", "resume"], env=env).returncode)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
