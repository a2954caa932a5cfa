"""Preemption under the framework integrations (issue 36, item 1): a SIGTERM stops the
framework's loop after the preemption save, and (``on_preemption="exit"``, the default) the
process then ends as SIGTERM would have ended it, saying so in one line on stderr.

Hugging Face: the Trainer runs in a separate process (this file run as a script is the worker)
with ``SafepointCallback(every_n_steps=1000)``, a schedule that never saves on its own; a callback
sends the process SIGTERM at the end of step 5. The callback saves step 6 (the next step end),
the Trainer stops, and the process dies by SIGTERM at ``on_train_end``; with
``on_preemption="return"`` ``trainer.train()`` returns after step 6 instead.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
import torch  # noqa: E402
from conftest import run_script  # noqa: E402
from processes import kill_agents  # noqa: E402
from test_hf import Tokens  # noqa: E402  (the HF tests' tiny data set)

import safepoint  # noqa: E402
from safepoint.hf import SafepointCallback  # noqa: E402

HANG = 240  # seconds: only a guard against a hung process
SIGNAL_AT = 5


class SigtermAt(transformers.TrainerCallback):
    """Sends its own process SIGTERM at the end of step `at`, as a scheduler would."""

    def __init__(self, at):
        self.at = at

    def on_step_end(self, args, state, control, **kwargs):
        print(f"step {state.global_step}", flush=True)
        if state.global_step == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


def hf_worker(argv) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    ap = argparse.ArgumentParser()
    for name in ("--root", "--shm", "--job", "--work", "--on-preemption"):
        ap.add_argument(name)
    a = ap.parse_args(argv)
    cb = SafepointCallback(a.root, every_n_steps=1000, job=a.job, shm_dir=a.shm,
                           on_preemption=a.on_preemption)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1,
                                       n_head=2, bos_token_id=0, eos_token_id=0))
    args = TrainingArguments(output_dir=a.work, max_steps=200, per_device_train_batch_size=4,
                             save_strategy="no", report_to=[], use_cpu=True, seed=0,
                             disable_tqdm=True, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(),
                      callbacks=[cb, SigtermAt(SIGNAL_AT)])
    trainer.train()
    print(f"train returned at step {trainer.state.global_step}, preempted {cb.preempted}",
          flush=True)
    sys.stderr.flush()
    os._exit(0)


@pytest.mark.parametrize("on_preemption", ["exit", "return"])
def test_hf_trainer_stops_after_the_preemption_save(tmp_path, shm, on_preemption):
    job = f"hfp{os.getpid()}{on_preemption}"
    root = tmp_path / "sp"
    try:
        got = run_script(__file__, "hf", "--root", root, "--shm", shm, "--job", job,
                         "--work", tmp_path / "w", "--on-preemption", on_preemption,
                         timeout=HANG)
    finally:
        kill_agents(shm, job)
    out = f"stdout:\n{got.stdout[-3000:]}\nstderr:\n{got.stderr[-3000:]}"
    at = SIGNAL_AT + 1  # the step end after the signal
    steps = [int(line.split()[1]) for line in got.stdout.splitlines() if line.startswith("step ")]
    assert steps[-1] == at, out  # the Trainer stopped after the preemption save
    assert safepoint.steps(root) == [at], out  # committed; the schedule saved nothing else
    if on_preemption == "exit":
        assert got.returncode == -signal.SIGTERM, out
        assert "train returned" not in got.stdout, out  # the script's rest did not run
        assert (f"safepoint: SIGTERM: step {at} is committed to {root}; the Trainer stopped; "
                "ending the process as SIGTERM does") in got.stderr, out
    else:
        assert got.returncode == 0, out
        assert f"train returned at step {at}, preempted True" in got.stdout, out
        assert (f"safepoint: SIGTERM: step {at} is committed to {root}; ckpt.preempted is True"
                in got.stderr), out


if __name__ == "__main__":
    if sys.argv[1] == "hf":
        hf_worker(sys.argv[2:])
