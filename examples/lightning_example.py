"""Lightning with safepoint flash checkpoints: the SafepointCheckpointIO plugin.

    python examples/lightning_example.py [--dir DIR] [--epochs 4] [--crash-epoch 2] [--devices 1]
                                         [--strategy ddp|fsdp2]

A small LightningModule trains with an ordinary ModelCheckpoint (a checkpoint every epoch plus
``last.ckpt``). The plugin saves each one as a flash checkpoint: ``save_checkpoint`` returns once
the state is copied into shared memory and the node agent persists it to ``DIR/safepoint`` in the
background; at Lightning's path (``DIR/checkpoints/last.ckpt``, ...) it writes a small pointer
file to that step.

To show a crash and a resume in one command, the first run, in a child process, kills itself with
SIGKILL at the start of epoch ``--crash-epoch``; the second run calls
``trainer.fit(..., ckpt_path="last")`` as a restarted job would and prints
``resumed from step 16 (memory)``: the agent still holds the dead run's snapshot in shared memory
(after a reboot it would come from storage).

Several processes: ``--devices 2`` trains with ``Trainer(accelerator="cpu", devices=2,
strategy="ddp")`` (Lightning's launcher starts the second rank by running the same command
again). Lightning saves on rank 0; on ``fit(ckpt_path="last")`` rank 0 resumes from memory and
rank 1 from storage once the agent has committed that step: ``[rank 0] resumed from step 8
(memory)``, ``[rank 1] resumed from step 8 (storage)``.

Sharded: ``--strategy fsdp2`` (2 processes) trains with ``SafepointModelParallelStrategy``
(Lightning's ``ModelParallelStrategy``; the module shards itself with FSDP2's ``fully_shard`` in
``configure_model``). Every rank flash-saves its own shard through the plugin, and on
``fit(ckpt_path="last")`` every rank reloads its shard of the same step from memory: ``[rank 0]
resumed from step 8 (memory)``, ``[rank 1] resumed from step 8 (memory)``.
``SafepointFSDPStrategy`` (Lightning's ``FSDPStrategy``, FSDP1) is used the same way on GPUs; as
Lightning sets it up, torch's FSDP1 refuses a model on a CPU, so this CPU example shows FSDP2.
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

try:  # the unified package, else the standalone one
    import lightning.pytorch as pl
except ImportError:
    import pytorch_lightning as pl

import safepoint
from safepoint.lightning import SafepointCheckpointIO, SafepointModelParallelStrategy

BATCHES = 8  # per epoch


class Regressor(pl.LightningModule):
    def __init__(self, hidden: int = 32, lr: float = 1e-2):
        super().__init__()
        self.save_hyperparameters()  # plain values: stored without pickle
        self.net = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.GELU(),
                                       torch.nn.Dropout(0.1), torch.nn.Linear(hidden, 1))

    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 8, 0.5)}


class ShardedRegressor(Regressor):
    def configure_model(self):  # ModelParallelStrategy: the module shards itself (FSDP2)
        from torch.distributed.fsdp import fully_shard

        if not hasattr(self.net, "reshard"):  # not sharded yet
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])


class Report(pl.Callback):
    def __init__(self, crash_epoch: int):
        self.crash_epoch = crash_epoch

    def on_train_start(self, trainer, module):
        tag = f"[rank {trainer.global_rank}] " if trainer.world_size > 1 else ""
        if trainer.ckpt_path is None:
            print(f"{tag}fresh start", flush=True)
            return
        ckpt = trainer.strategy.checkpoint_io.checkpointer  # the plugin's safepoint.Checkpointer
        source = ckpt.last_load_source if ckpt is not None else "storage"  # None: not rank 0
        print(f"{tag}resumed from step {trainer.global_step} ({source})", flush=True)

    def on_train_epoch_start(self, trainer, module):
        if trainer.current_epoch == self.crash_epoch:  # every rank: the job crashes
            print(f"epoch {trainer.current_epoch}: crashing (SIGKILL)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)  # no clean-up, no teardown: a crash


def train(workdir: str, epochs: int, crash_epoch: int, resume: bool, devices: int = 1,
          strategy: str = "ddp") -> None:
    pl.seed_everything(0, verbose=False)  # the same seed on every rank
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(BATCHES * 16, 8, generator=g),
                                          torch.randn(BATCHES * 16, 1, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=16, shuffle=True)
    model = Regressor()
    how: object = "ddp" if devices > 1 else "auto"
    if strategy == "fsdp2":  # every rank saves its shard through the plugin
        how = SafepointModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)
        model = ShardedRegressor()
    trainer = pl.Trainer(
        accelerator="cpu" if devices > 1 else "auto", devices=devices, strategy=how,
        max_epochs=epochs, logger=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=workdir,
        # Flash checkpoints into DIR/safepoint; Lightning's paths hold pointers to them.
        plugins=[SafepointCheckpointIO(os.path.join(workdir, "safepoint"))],
        callbacks=[pl.callbacks.ModelCheckpoint(dirpath=os.path.join(workdir, "checkpoints"),
                                                save_last=True, save_top_k=2,
                                                monitor="train_loss"),
                   Report(crash_epoch)])
    trainer.fit(model, loader, ckpt_path="last" if resume else None)  # "last": a pointer file
    if trainer.global_rank != 0:
        return
    # fit's teardown waited until every checkpoint was committed.
    print(f"done: global step {trainer.global_step}, checkpoints "
          f"{sorted(os.listdir(os.path.join(workdir, 'checkpoints')))}, safepoint steps "
          f"{safepoint.steps(os.path.join(workdir, 'safepoint'))}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", help="working directory (default: a temporary one)")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--crash-epoch", type=int, default=2, help="0: no crash")
    ap.add_argument("--devices", type=int, default=1, help="processes (DDP when > 1)")
    ap.add_argument("--strategy", choices=("ddp", "fsdp2"), default="ddp",
                    help="fsdp2: SafepointModelParallelStrategy (sharded; 2 devices by default)")
    ap.add_argument("--child", choices=("crash", "resume"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.strategy == "fsdp2" and args.devices == 1:
        args.devices = 2
    if args.child:  # a run in a child process (Lightning's launcher runs it again per rank)
        crash = args.child == "crash"
        train(args.dir, args.epochs, args.crash_epoch if crash else -1, resume=not crash,
              devices=args.devices, strategy=args.strategy)
        return
    tmp = None if args.dir else tempfile.mkdtemp(prefix="safepoint-lightning-")
    workdir = args.dir or tmp
    try:
        child = [sys.executable, os.path.abspath(__file__), "--dir", workdir, "--epochs",
                 str(args.epochs), "--crash-epoch", str(args.crash_epoch), "--devices",
                 str(args.devices), "--strategy", args.strategy, "--child"]
        if args.crash_epoch:
            first = subprocess.run(child + ["crash"])
            print(f"first run ended by signal {-first.returncode}; restarting", flush=True)
        if args.devices == 1:
            train(workdir, args.epochs, crash_epoch=-1, resume=bool(args.crash_epoch))
        elif subprocess.run(child + ["resume"]).returncode != 0:
            sys.exit(1)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
