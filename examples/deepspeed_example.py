"""DeepSpeed with safepoint flash checkpoints: the SafepointCheckpointEngine.

    python examples/deepspeed_example.py [--dir DIR] [--steps 6] [--save-at 3]

A small model trains with a DeepSpeed engine (ZeRO stage 1, DeepSpeed's CPU accelerator when no
GPU is there). After ``deepspeed.initialize`` one line makes its checkpoints go through safepoint:

    engine.checkpoint_engine = SafepointCheckpointEngine()

``engine.save_checkpoint(DIR)`` then returns once the state is copied into shared memory; the
node agent persists it to ``DIR/safepoint`` and DeepSpeed's own layout (``DIR/latest``,
``DIR/global_step3/...``) holds small pointer files to it. To show a crash and a resume in one
command, the first run (a child process) saves at step ``--save-at`` and SIGKILLs itself two
steps later; the second run calls ``engine.load_checkpoint(DIR)`` as a restarted job would and
prints ``resumed from step 3 (memory)``.
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

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # this example runs on any host


def train(workdir: str, steps: int, save_at: int, resume: bool) -> None:
    import deepspeed
    import torch
    from deepspeed.ops.op_builder import ShareMemCommBuilder

    from safepoint.deepspeed import SafepointCheckpointEngine

    # Skips the CPU accelerator's JIT-built inference all-reduce (not used for training).
    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    cfg = {"train_micro_batch_size_per_gpu": 16, "steps_per_print": 10**6,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
           "zero_optimization": {"stage": 1}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=cfg)
    engine.checkpoint_engine = SafepointCheckpointEngine()  # the one line
    ckpt_dir = os.path.join(workdir, "ds")
    if resume:
        engine.load_checkpoint(ckpt_dir)
        source = engine.checkpoint_engine.checkpointer.last_restore.source
        print(f"resumed from step {engine.global_steps} ({source})", flush=True)
    else:
        print("fresh start", flush=True)
    while engine.global_steps < steps:
        g = torch.Generator().manual_seed(engine.global_steps)
        x = torch.randn(16, 8, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x), x.sum(1, keepdim=True))
        engine.backward(loss)
        engine.step()
        if engine.global_steps == save_at and not resume:
            engine.save_checkpoint(ckpt_dir)  # flash: returns after the copy into memory
        if engine.global_steps == save_at + 2 and not resume:
            print(f"step {engine.global_steps}: crashing (SIGKILL)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    print(f"step {engine.global_steps}: loss {loss.item():.5f}", flush=True)
    engine.checkpoint_engine.close()  # waits until every save is committed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir"), ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--save-at", type=int, default=3)
    ap.add_argument("--run", choices=["first", "resume"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.run:
        train(a.dir, a.steps, a.save_at, a.run == "resume")
        return
    workdir = a.dir or tempfile.mkdtemp(prefix="sp-deepspeed-")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port))
    base = [sys.executable, __file__, "--dir", workdir, "--steps", str(a.steps), "--save-at",
            str(a.save_at)]
    try:
        first = subprocess.run(base + ["--run", "first"], env=env)
        assert first.returncode == -signal.SIGKILL, first.returncode
        subprocess.run(base + ["--run", "resume"], env=env, check=True)
    finally:
        if a.dir is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
