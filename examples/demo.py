"""safepoint demo: train a small GPT-style model, checkpoint it, and inspect the checkpoints.

    make demo

Trains for a few steps, saving the model and optimizer state every few steps with
safepoint.save (durable when it returns), then loads the newest step into a fresh model and
shows that training continues exactly where it left off; finally shows the checkpoints with the
safepoint CLI (ls, inspect, verify).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny_gpt  # noqa: E402

import safepoint  # noqa: E402

STEPS, EVERY = 12, 4


def cli(*args: str) -> None:
    exe = shutil.which("safepoint") or os.path.join(os.path.dirname(sys.executable), "safepoint")
    print(f"\n$ safepoint {' '.join(args)}")
    subprocess.run([exe, *args], check=False)


def main() -> None:
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    root = tempfile.mkdtemp(prefix="safepoint-demo-")
    path = os.path.join(root, "ckpt")
    model, opt = tiny_gpt.make(seed=0)
    print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters; "
          f"checkpoint directory {path}")

    losses = {}
    for step in range(1, STEPS + 1):
        losses[step] = tiny_gpt.train_step(model, opt, step)
        if step % EVERY == 0:
            t0 = time.perf_counter()
            safepoint.save(path, step, {"model": model.state_dict(), "optim": opt.state_dict(),
                                        "step": step})
            print(f"step {step:3d}  loss {losses[step]:.4f}  saved in "
                  f"{(time.perf_counter() - t0) * 1e3:.1f} ms (durable)")
        else:
            print(f"step {step:3d}  loss {losses[step]:.4f}")

    # Resume from step 8 in a fresh model and check that steps 9.. are bit-identical.
    resume_at = STEPS - EVERY
    fresh, fresh_opt = tiny_gpt.make(seed=123)
    step, state = safepoint.load(path, resume_at)
    fresh.load_state_dict(state["model"])
    fresh_opt.load_state_dict(state["optim"])
    print(f"\nresumed a fresh model from step {step}:")
    same = True
    for s in range(step + 1, STEPS + 1):
        loss = tiny_gpt.train_step(fresh, fresh_opt, s)
        match = loss == losses[s]
        same &= match
        print(f"step {s:3d}  loss {loss:.4f}  {'== original run' if match else '!= ORIGINAL RUN'}")
    print("resumed run is bit-identical to the original" if same else "MISMATCH")

    cli("ls", path)
    cli("inspect", path, "--step", str(STEPS))
    cli("verify", path, "--all")
    shutil.rmtree(root)
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
