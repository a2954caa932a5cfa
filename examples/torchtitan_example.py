"""torchtitan with safepoint flash checkpoints: the SafepointCheckpointManager.

    python examples/torchtitan_example.py [--dir DIR] [--steps 8] [--interval 4]

In a torchtitan config function, one line selects safepoint as the checkpoint backend (the
trainer builds whatever manager class ``config.checkpoint`` belongs to):

    config.checkpoint = SafepointCheckpointManager.Config(enable=True, interval=4)

torchtitan 0.3.0 does not train on a CPU-only host, so this example builds the manager from that
config the way torchtitan's Trainer does (``config.checkpoint.build(...)`` with torchtitan's
optimizer and LR scheduler containers and the ``train_state``) and drives it through the
trainer's calls: ``load()`` before training, ``save(step)`` after every step. The first run (a
child process) SIGKILLs itself two steps after the save at step ``--interval``; the second
prints ``resumed from step 4 (memory)``.
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


class TrainState:  # what torchtitan's Trainer saves as "train_state"
    def __init__(self):
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd):
        self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]


def build(workdir: str, steps: int, interval: int, **options):
    """What torchtitan's Trainer builds: a model, its optimizers and LR schedulers (torchtitan's
    containers), the train state, and the checkpoint manager from ``config.checkpoint``."""
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

    from safepoint.torchtitan import SafepointCheckpointManager

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    optimizers = default_adamw(lr=1e-2).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers,
                                                                   training_steps=steps)
    state = TrainState()
    checkpoint = SafepointCheckpointManager.Config(enable=True, interval=interval,  # the line
                                                   **options)
    manager = checkpoint.build(dataloader=None, model_parts=[model], optimizers=optimizers,
                               lr_schedulers=schedulers, states={"train_state": state},
                               sd_adapter=None, base_folder=workdir)
    return manager, model, optimizers, schedulers, state


def train(workdir: str, steps: int, interval: int, resume: bool) -> None:
    manager, model, optimizers, schedulers, state = build(workdir, steps, interval)
    if manager.load():
        source = manager.checkpointer.last_restore.source
        print(f"resumed from step {state.step} ({source})", flush=True)
    else:
        print("fresh start", flush=True)
    while state.step < steps:
        state.step += 1
        g = torch.Generator().manual_seed(state.step)
        x = torch.randn(16, 8, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        loss.backward()
        optimizers.step()
        optimizers.zero_grad()
        schedulers.step()
        state.ntokens_seen += 16
        manager.save(state.step, last_step=state.step == steps)
        if state.step == interval + 2 and not resume:
            print(f"step {state.step}: crashing (SIGKILL)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    print(f"step {state.step}: loss {loss.item():.5f}", flush=True)
    manager.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir"), ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--interval", type=int, default=4)
    ap.add_argument("--run", choices=["first", "resume"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.run:
        train(a.dir, a.steps, a.interval, a.run == "resume")
        return
    workdir = a.dir or tempfile.mkdtemp(prefix="sp-torchtitan-")
    base = [sys.executable, __file__, "--dir", workdir, "--steps", str(a.steps), "--interval",
            str(a.interval)]
    try:
        first = subprocess.run(base + ["--run", "first"])
        assert first.returncode == -signal.SIGKILL, first.returncode
        subprocess.run(base + ["--run", "resume"], check=True)
    finally:
        if a.dir is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
