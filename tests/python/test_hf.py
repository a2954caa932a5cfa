"""The Hugging Face adapter (safepoint.hf.SafepointCallback) with the real transformers Trainer.

The kill test trains a tiny GPT-2 (dropout on, shuffled data, linear LR decay) in separate
processes (this file run as a script is the worker): once uninterrupted, once SIGKILLed right
after the flash save of step 6 (mid-epoch), and once resumed with
``trainer.train(resume_from_checkpoint=cb.prepare_resume(trainer))``. The resumed model,
optimizer, scheduler and global step must equal the save bit for bit, come from memory (the
agent kept the dead process's snapshot), and the resumed run must end bit for bit where the
uninterrupted run ended.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
import torch  # noqa: E402
from workloads.bitexact import assert_bit_identical as tensors_equal  # noqa: E402
from conftest import run_script, start_script  # noqa: E402

import safepoint  # noqa: E402
from safepoint.hf import SafepointCallback  # noqa: E402

STEPS, EVERY, KILL_AT = 12, 2, 6  # 8 batches an epoch: the kill is mid-epoch, the end in epoch 2
HANG = 240  # seconds: only a guard against a hung process


# --- the workload (also used by the worker processes) -------------------------------------------

class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=32, length=12, vocab=64):
        g = torch.Generator().manual_seed(5)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def make_trainer(out_dir, callbacks, steps=STEPS):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1,
                                       n_head=2, resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.2,
                                       bos_token_id=0, eos_token_id=0))
    args = TrainingArguments(output_dir=str(out_dir), max_steps=steps, per_device_train_batch_size=4,
                             learning_rate=1e-2, lr_scheduler_type="linear", save_strategy="no",
                             report_to=[], logging_steps=1, use_cpu=True, seed=0,
                             disable_tqdm=True, dataloader_num_workers=0)
    return Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)


def snapshot(trainer) -> dict:
    return {"model": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
            "optimizer": trainer.optimizer.state_dict(),
            "scheduler": trainer.lr_scheduler.state_dict(),
            "global_step": trainer.state.global_step}


class Kill(transformers.TrainerCallback):
    """SIGKILLs its own process at the end of step `at` (after SafepointCallback saved it)."""

    def __init__(self, at):
        self.at = at

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at:
            os.kill(os.getpid(), signal.SIGKILL)


class Probe(transformers.TrainerCallback):
    """Records what the Trainer holds once resumed, before it trains on."""

    def __init__(self, out):
        self.out, self.trainer = out, None

    def on_train_begin(self, args, state, control, **kwargs):
        safepoint.save(self.out, 0, snapshot(self.trainer))


def worker(argv) -> None:
    ap = argparse.ArgumentParser()
    for name in ("--root", "--shm", "--job", "--out", "--probe", "--work"):
        ap.add_argument(name)
    ap.add_argument("--kill-at", type=int)
    ap.add_argument("--resume", action="store_true")
    a = ap.parse_args(argv)
    cb = SafepointCallback(a.root, every_n_steps=EVERY, keep=10, job=a.job, shm_dir=a.shm)
    extra = [Kill(a.kill_at)] if a.kill_at else []
    probe = Probe(a.probe) if a.probe else None
    trainer = make_trainer(a.work, [cb, *extra, *([probe] if probe else [])])
    if probe:
        probe.trainer = trainer
    resume = cb.prepare_resume(trainer) if a.resume else None
    trainer.train(resume_from_checkpoint=resume)
    safepoint.save(a.out, 0, snapshot(trainer))
    print("RESUMED", cb.resumed_step, cb.resumed_from, flush=True)
    # The callback's on_train_end waited for every commit and closed the Checkpointer, and
    # safepoint.save has written the output: skip the interpreter's finalization (torch's and
    # transformers' modules, seconds of CPU), as test_hf_multirank's ranks do.
    sys.stderr.flush()
    os._exit(0)


# --- tests -----------------------------------------------------------------------------------------



def start_worker(*args) -> subprocess.Popen:
    return start_script(__file__, *args)


def run_worker(*args) -> subprocess.CompletedProcess:
    return run_script(__file__, *args, timeout=HANG)


def test_flash_sigkill_then_resume_is_bit_identical(tmp_path, shm):
    job = f"hf{os.getpid()}"
    # The uninterrupted reference run goes alongside the run that is killed.
    ref = start_worker("--root", tmp_path / "ref", "--shm", shm, "--job", job + "r",
                       "--out", tmp_path / "ref-out", "--work", tmp_path / "w0")
    root = tmp_path / "sp"
    common = ["--root", root, "--shm", shm, "--job", job, "--work", tmp_path / "w1"]
    killed = run_worker(*common, "--kill-at", KILL_AT, "--out", tmp_path / "unused")
    ref_out, ref_err = ref.communicate(timeout=HANG)
    assert ref.returncode == 0, ref_err[-3000:]
    assert "RESUMED None None" in ref_out  # nothing to resume from
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    # The agent persists the dead process's snapshot (emergency flush) and keeps it in memory.
    end = time.monotonic() + HANG
    while KILL_AT not in safepoint.steps(root):
        assert time.monotonic() < end, "the agent never committed the killed run's last save"
        time.sleep(0.05)
    _, saved = safepoint.load(root, KILL_AT)

    resumed = run_worker(*common, "--resume", "--probe", tmp_path / "probe", "--out", tmp_path / "out")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"RESUMED {KILL_AT} memory" in resumed.stdout, resumed.stdout

    _, probe = safepoint.load(tmp_path / "probe")
    assert probe["global_step"] == saved["global_step"] == KILL_AT
    tensors_equal(probe["model"], saved["model"], "model")
    tensors_equal(probe["optimizer"], saved["optimizer"], "optimizer")
    tensors_equal(probe["scheduler"], saved["scheduler"], "scheduler")

    _, want = safepoint.load(tmp_path / "ref-out")
    _, got = safepoint.load(tmp_path / "out")
    assert got["global_step"] == want["global_step"] == STEPS
    tensors_equal(got, want, "final")
    assert safepoint.steps(root) == list(range(EVERY, STEPS + 1, EVERY))


def test_sync_mode_on_save_and_resume_in_process(tmp_path):
    """mode="sync" saving on the Trainer's own on_save; a second Trainer resumes in process."""
    from transformers import IntervalStrategy

    root = tmp_path / "sp"
    cb = SafepointCallback(root, mode="sync")
    trainer = make_trainer(tmp_path / "w", [cb], steps=4)
    trainer.args.save_strategy = IntervalStrategy.STEPS
    trainer.args.save_steps = 2
    trainer.train()
    assert safepoint.steps(root) == [2, 4]
    assert sorted(os.listdir(tmp_path / "w")) == ["checkpoint-2", "checkpoint-4"]  # the Trainer's own
    _, state = safepoint.load(root, 4)
    assert state["global_step"] == 4 and '"global_step": 4' in state["trainer_state"]
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(state["model"][k], v), k

    cb2 = SafepointCallback(root, mode="sync")
    t2 = make_trainer(tmp_path / "w2", [cb2], steps=6)
    resume = cb2.prepare_resume(t2)
    assert cb2.resumed_step == 4 and cb2.resumed_from == "storage"
    t2.train(resume_from_checkpoint=resume)
    assert t2.state.global_step == 6 and not os.path.exists(resume)
    # The Trainer's own checkpoint directories still resume through its own code.
    t3 = make_trainer(tmp_path / "w3", [SafepointCallback(tmp_path / "sp3", mode="sync")], steps=4)
    t3.train(resume_from_checkpoint=str(tmp_path / "w" / "checkpoint-2"))
    assert t3.state.global_step == 4


def test_bad_input_is_refused_clearly(tmp_path):
    with pytest.raises(safepoint.InvalidArgumentError, match="every_n_steps"):
        SafepointCallback(tmp_path, every_n_steps=0)
    with pytest.raises(safepoint.InvalidArgumentError, match="mode must be"):
        SafepointCallback(tmp_path, mode="async")
    cb = SafepointCallback(tmp_path / "sp", mode="sync")
    trainer = make_trainer(tmp_path / "w", [])
    with pytest.raises(safepoint.InvalidArgumentError, match="not one of the trainer's callbacks"):
        cb.prepare_resume(trainer)
    trainer.add_callback(cb)
    assert cb.prepare_resume(trainer) is None  # nothing saved yet: train from scratch
    safepoint.save(tmp_path / "sp", 3, {"weights": torch.ones(2)})  # not the callback's layout
    with pytest.raises(safepoint.CorruptionError, match="not a SafepointCallback checkpoint"):
        cb.prepare_resume(trainer)


if __name__ == "__main__":
    worker(sys.argv[1:])
