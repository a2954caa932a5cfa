"""The Lightning adapter (safepoint.lightning.SafepointCheckpointIO) with the real Lightning.

The kill test trains a tiny model with dropout and a shuffled loader in separate processes (this
file run as a script is the worker): once uninterrupted, once SIGKILLed right after the flash
checkpoint at the end of epoch 2, and once resumed with ``trainer.fit(ckpt_path="last")``. The
resumed state must equal the checkpoint bit for bit (weights, optimizer state, global step), it
must come from memory (the agent kept the snapshot), and the resumed run must end bit for bit
where the uninterrupted one ended.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import pytest

pl = pytest.importorskip("pytorch_lightning")
import torch  # noqa: E402
from workloads.bitexact import assert_bit_identical as tensors_equal  # noqa: E402
from conftest import run_script, start_script  # noqa: E402

import safepoint  # noqa: E402
from safepoint.lightning import SafepointCheckpointIO, read_pointer  # noqa: E402

BATCHES, EPOCHS, KILL_EPOCH = 8, 4, 2  # the kill lands after the save at global step 16
HANG = 240  # seconds: only a guard against a hung process


# --- the workload (also used by the worker processes) -------------------------------------------

class Tiny(pl.LightningModule):
    def __init__(self, hidden: int = 16, lr: float = 0.01):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, hidden), torch.nn.ReLU(),
                                       torch.nn.Dropout(0.2), torch.nn.Linear(hidden, 1))

    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)}


def loader():
    g = torch.Generator().manual_seed(7)
    data = torch.utils.data.TensorDataset(torch.randn(BATCHES * 4, 6, generator=g),
                                          torch.randn(BATCHES * 4, 1, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)


def make_trainer(plugin, dirpath, callbacks=(), **ckpt_kw):
    kw = dict(every_n_epochs=1, save_last=True, save_top_k=-1)
    kw.update(ckpt_kw)
    return pl.Trainer(max_epochs=EPOCHS, plugins=[plugin], logger=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0,
                      callbacks=[pl.callbacks.ModelCheckpoint(dirpath=dirpath, **kw), *callbacks])


def snapshot(module, trainer) -> dict:
    return {"state_dict": {k: v.detach().clone() for k, v in module.state_dict().items()},
            "optimizer": trainer.optimizers[0].state_dict(), "global_step": trainer.global_step}


class KillAfterSave(SafepointCheckpointIO):
    """The real plugin; the process SIGKILLs itself once the `last` checkpoint of the kill epoch
    is saved (save_checkpoint returned: the snapshot is in shared memory, maybe not persisted)."""

    kill_at = None

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        super().save_checkpoint(checkpoint, path, storage_options)
        if checkpoint["global_step"] == self.kill_at and os.path.basename(path) == "last.ckpt":
            os.kill(os.getpid(), signal.SIGKILL)


class Probe(pl.Callback):
    """Records the state Lightning restored, before training continues."""

    def __init__(self, out):
        self.out = out

    def on_train_start(self, trainer, module):
        safepoint.save(self.out, 0, snapshot(module, trainer))


def worker(argv) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root"), ap.add_argument("--dirpath"), ap.add_argument("--shm")
    ap.add_argument("--job"), ap.add_argument("--out"), ap.add_argument("--probe")
    ap.add_argument("--kill-at", type=int), ap.add_argument("--resume", action="store_true")
    a = ap.parse_args(argv)
    pl.seed_everything(1, verbose=False)
    plugin = KillAfterSave(a.root, job=a.job, shm_dir=a.shm)
    plugin.kill_at = a.kill_at
    module = Tiny()
    callbacks = [Probe(a.probe)] if a.probe else []
    trainer = make_trainer(plugin, a.dirpath, callbacks)
    source = []
    orig_load = plugin.load_checkpoint

    def load_and_note(*args, **kw):
        out = orig_load(*args, **kw)
        source.append(plugin.checkpointer.last_load_source if plugin.checkpointer else "storage")
        return out

    plugin.load_checkpoint = load_and_note
    trainer.fit(module, loader(), ckpt_path="last" if a.resume else None)
    safepoint.save(a.out, 0, snapshot(module, trainer))
    print("SOURCE", source[0] if source else "none", flush=True)


# --- tests -----------------------------------------------------------------------------------------



def test_flash_sigkill_then_fit_ckpt_last_resumes_bit_identical(tmp_path, shm):
    job = f"pl{os.getpid()}"
    # The uninterrupted reference run goes alongside the run that is killed.
    ref = start_script(__file__, "--root", tmp_path / "ref", "--dirpath",
                       tmp_path / "ref-ckpts", "--shm", shm, "--job", job + "r", "--out",
                       tmp_path / "ref-out")
    root, dirpath = tmp_path / "sp", tmp_path / "ckpts"
    common = ["--root", root, "--dirpath", dirpath, "--shm", shm, "--job", job]
    killed = run_script(__file__, *common, "--kill-at", BATCHES * KILL_EPOCH, "--out",
                        tmp_path / "unused", timeout=HANG)
    _, ref_err = ref.communicate(timeout=HANG)
    assert ref.returncode == 0, ref_err[-3000:]
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    last = read_pointer(dirpath / "last.ckpt")
    assert last is not None and last["global_step"] == BATCHES * KILL_EPOCH
    # The agent persists the dead process's snapshot (emergency flush) and keeps it in memory.
    end = time.monotonic() + HANG
    while last["step"] not in safepoint.steps(root):
        assert time.monotonic() < end, "the agent never committed the killed run's last save"
        time.sleep(0.05)
    _, saved = safepoint.load(root, last["step"])

    resumed = run_script(__file__, *common, "--resume", "--probe", tmp_path / "probe",
                         "--out", tmp_path / "out", timeout=HANG)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "SOURCE memory" in resumed.stdout, resumed.stdout  # hot reload from the agent's copy

    # What Lightning restored is what was saved, bit for bit.
    _, probe = safepoint.load(tmp_path / "probe")
    assert probe["global_step"] == saved["global_step"] == BATCHES * KILL_EPOCH
    tensors_equal(probe["state_dict"], saved["state_dict"], "state_dict")
    tensors_equal(probe["optimizer"], saved["optimizer_states"][0], "optimizer")
    # And the resumed run ends exactly where the uninterrupted run ended.
    _, want = safepoint.load(tmp_path / "ref-out")
    _, got = safepoint.load(tmp_path / "out")
    assert got["global_step"] == want["global_step"] == BATCHES * EPOCHS
    tensors_equal(got, want, "final")

    # Every pointer names a committed step; no step is left that no pointer names.
    pointers = {p.name: read_pointer(p) for p in dirpath.iterdir() if p.suffix == ".ckpt"}
    assert sorted(pointers) == sorted(
        [f"epoch={e}-step={BATCHES * (e + 1)}.ckpt" for e in range(EPOCHS)] + ["last.ckpt"])
    named = {d["step"] for d in pointers.values()}
    assert set(safepoint.steps(root)) == named
    for name, doc in pointers.items():
        step, state = safepoint.load(root, doc["step"])
        assert state["global_step"] == doc["global_step"], name


def test_sync_mode_follows_top_k_and_loads_best(tmp_path):
    root, dirpath = tmp_path / "sp", tmp_path / "ckpts"
    pl.seed_everything(3, verbose=False)
    plugin = SafepointCheckpointIO(root, mode="sync")
    module = Tiny()
    trainer = make_trainer(plugin, dirpath, every_n_epochs=None, every_n_train_steps=4,
                           monitor="train_loss", save_top_k=2, save_last="link")
    trainer.fit(module, loader())
    cb = trainer.checkpoint_callback
    files = sorted(p.name for p in dirpath.iterdir())
    assert len(files) == 3 and "last.ckpt" in files, files  # two best plus the `last` link
    assert os.path.islink(dirpath / "last.ckpt")
    named = {read_pointer(dirpath / f)["step"] for f in files if f != "last.ckpt"}
    assert set(safepoint.steps(root)) == named and len(named) == 2  # removed ones are deleted
    # Durable pointers load without the plugin's process state: a fresh plugin loads `best`.
    state = SafepointCheckpointIO(mode="sync").load_checkpoint(cb.best_model_path)
    assert state["global_step"] == read_pointer(cb.best_model_path)["global_step"]
    assert state["hyper_parameters"] == {"hidden": 16, "lr": 0.01}
    fresh = Tiny()
    fresh.load_state_dict(state["state_dict"])
    best_step = state["global_step"]
    assert best_step % 4 == 0 and best_step <= BATCHES * EPOCHS


def test_non_plain_values_need_allow_pickle(tmp_path):
    ns = argparse.Namespace(width=3)
    ckpt = {"global_step": 5, "epoch": 0, "state_dict": {"w": torch.ones(2)},
            "hyper_parameters": {"args": ns}}
    plain = SafepointCheckpointIO(tmp_path / "sp", mode="sync")
    with pytest.raises(safepoint.InvalidArgumentError,
                       match=r"hyper_parameters\.args.*allow_pickle"):
        plain.save_checkpoint(ckpt, tmp_path / "a.ckpt")
    assert not (tmp_path / "a.ckpt").exists()
    trusted = SafepointCheckpointIO(tmp_path / "sp", mode="sync", allow_pickle=["argparse.Namespace"])
    trusted.save_checkpoint(ckpt, tmp_path / "a.ckpt")
    back = trusted.load_checkpoint(tmp_path / "a.ckpt")
    assert back["hyper_parameters"]["args"] == ns and torch.equal(back["state_dict"]["w"], torch.ones(2))
    with pytest.raises(safepoint.Error):  # weights_only never unpickles
        trusted.load_checkpoint(tmp_path / "a.ckpt", weights_only=True)
    with pytest.raises(safepoint.Error):  # nor does a plugin that was not told to
        plain.load_checkpoint(tmp_path / "a.ckpt")


def test_bad_input_is_refused_clearly(tmp_path):
    io = SafepointCheckpointIO(tmp_path / "sp", mode="sync")
    with pytest.raises(safepoint.InvalidArgumentError, match="mode must be"):
        SafepointCheckpointIO(mode="async")
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint({"global_step": 1}, tmp_path / "x.ckpt", storage_options={"a": 1})
    with pytest.raises(FileNotFoundError, match="missing.ckpt"):
        io.load_checkpoint(tmp_path / "missing.ckpt")
    torch.save({"state_dict": {}}, tmp_path / "torch.ckpt")
    with pytest.raises(safepoint.InvalidArgumentError, match="not a safepoint checkpoint"):
        io.load_checkpoint(tmp_path / "torch.ckpt")
    with pytest.raises(safepoint.InvalidArgumentError, match="inside the safepoint directory"):
        io.save_checkpoint({"global_step": 1}, tmp_path / "sp" / "x.ckpt")
    (tmp_path / "adir.ckpt").mkdir()
    with pytest.raises(safepoint.InvalidArgumentError, match="is a directory"):
        io.save_checkpoint({"global_step": 1}, tmp_path / "adir.ckpt")
    with pytest.raises(safepoint.InvalidArgumentError, match="local path"):
        SafepointCheckpointIO("s3://bucket/run")
    # A pointer to a step that was never committed names the step.
    io.save_checkpoint({"global_step": 1, "epoch": 0}, tmp_path / "a.ckpt")
    step = read_pointer(tmp_path / "a.ckpt")["step"]
    safepoint.lightning.delete_step(str(tmp_path / "sp"), step)
    with pytest.raises(safepoint.NotFoundError, match=f"names step {step} "):
        io.load_checkpoint(tmp_path / "a.ckpt")


if __name__ == "__main__":
    worker(sys.argv[1:])
