"""SafepointCheckpointIO with Lightning's DDP strategy: 2 CPU processes (gloo).

This file run as a script is a job: ``Trainer(accelerator="cpu", devices=2, strategy="ddp")``,
whose launcher starts the second rank by running the same command again. Three jobs: an
uninterrupted reference, a job whose ranks SIGKILL themselves at the start of epoch 2 (after the
flash checkpoint of its last step), and a job resumed with ``trainer.fit(ckpt_path="last")``.
``ModelCheckpoint(every_n_train_steps=4, save_top_k=2, monitor=..., save_last=True)``: the
resumed job must end bit for bit where the reference ended (weights, optimizer state, on both
ranks), rank 0 must resume from memory and rank 1 from storage (the same step), and the
checkpoint directory must hold what Lightning keeps (the same top-2 and ``last.ckpt`` as the
reference), each naming a step on storage, and no other step.

Lightning's own ``FSDPStrategy`` never loads through a CheckpointIO: the plugin's refusal of it
is tested by calling the plugin through an ``FSDPStrategy``. The sharded strategies the plugin
works with (``SafepointFSDPStrategy``, ``SafepointModelParallelStrategy``) are tested in
test_lightning_sharded.py.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import pytest

pl = pytest.importorskip("pytorch_lightning")
import torch  # noqa: E402
from conftest import free_port, start_script  # noqa: E402
from workloads.bitexact import assert_bit_identical as tensors_equal  # noqa: E402

import test_lightning as single  # noqa: E402  (its module and loader: 32 samples, batches of 4)

import safepoint  # noqa: E402
from safepoint.lightning import SafepointCheckpointIO, read_pointer  # noqa: E402

BATCHES, EPOCHS, KILL_EPOCH = 4, 4, 2  # batches per epoch and rank; the kill follows step 8
HANG = 240  # seconds: only a guard against a hung process


class Tiny(single.Tiny):
    def training_step(self, batch, _):  # the loss ModelCheckpoint monitors: the same on all ranks
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss


class KillAtEpoch(pl.Callback):
    """Every rank SIGKILLs itself when epoch `epoch` starts (the checkpoint of the previous
    step is saved: every rank passed trainer.save_checkpoint's barrier)."""

    def __init__(self, epoch):
        self.epoch = epoch

    def on_train_epoch_start(self, trainer, module):
        if trainer.current_epoch == self.epoch:
            os.kill(os.getpid(), signal.SIGKILL)


class Report(pl.Callback):
    def on_train_start(self, trainer, module):
        io = trainer.strategy.checkpoint_io
        source = "none"
        if trainer.ckpt_path is not None:
            source = io.checkpointer.last_load_source if io.checkpointer else "storage"
        print(f"RESUMED rank {trainer.global_rank} step {trainer.global_step} {source}",
              flush=True)


def job_args(argv, *extra):
    """The job's command line (``extra``: more options), after seeding every rank alike."""
    ap = argparse.ArgumentParser()
    for name in ("--root", "--dirpath", "--shm", "--job", "--out", *extra):
        ap.add_argument(name)
    ap.add_argument("--kill-epoch", type=int, default=-1)
    ap.add_argument("--resume", action="store_true")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    pl.seed_everything(1, verbose=False)
    return a


def job_trainer(a, strategy, *callbacks):
    """The job's Trainer: 2 CPU ranks, the plugin, ModelCheckpoint with every option tested."""
    plugin = SafepointCheckpointIO(a.root, job=a.job, shm_dir=a.shm)
    return pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=EPOCHS, plugins=[plugin],
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[pl.callbacks.ModelCheckpoint(dirpath=a.dirpath, every_n_train_steps=BATCHES,
                                                save_top_k=2, monitor="train_loss",
                                                save_last=True),
                   KillAtEpoch(a.kill_epoch), Report(), *callbacks])


def worker(argv) -> None:
    a = job_args(argv)
    trainer = job_trainer(a, "ddp")
    module = Tiny()
    trainer.fit(module, single.loader(), ckpt_path="last" if a.resume else None)
    torch.save({"model": {k: v.detach().clone() for k, v in module.state_dict().items()},
                "optimizer": trainer.optimizers[0].state_dict(),
                "global_step": trainer.global_step}, f"{a.out}.{trainer.global_rank}.pt")
    job_exit(trainer)


def job_exit(trainer) -> None:
    """Ends a rank once fit has returned (the plugin's teardown, inside fit, waited for every
    save's commit and closed the Checkpointer) and its state is written; rank 0 (the process the
    test starts) first waits for the rank its launcher started, as at a normal end of the job.
    os._exit skips the interpreter's finalization, which took 1.5 to 5 CPU-seconds per process
    (torch's and Lightning's modules) and which the tests do not check."""
    for proc in getattr(trainer.strategy.launcher, "procs", []):
        proc.wait()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def start_job(*args, script=__file__):
    """This file (or `script`, test_lightning_sharded.py's) as a job of 2 ranks."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK"):
        env.pop(k, None)
    return start_script(script, *args, env=env)


def pointers(dirpath) -> dict:
    return {name: read_pointer(os.path.join(dirpath, name))["step"]
            for name in sorted(os.listdir(dirpath))}


def test_ddp_two_ranks_sigkill_then_fit_ckpt_last_is_bit_identical(tmp_path, shm):
    job = f"plm{os.getpid()}"
    ref = start_job("--root", tmp_path / "ref", "--dirpath", tmp_path / "ref-ckpts", "--shm",
                    shm, "--job", job + "r", "--out", tmp_path / "ref-out")
    root, dirpath = tmp_path / "sp", tmp_path / "ckpts"
    common = ["--root", root, "--dirpath", dirpath, "--shm", shm, "--job", job]
    killed = start_job(*common, "--kill-epoch", KILL_EPOCH, "--out", tmp_path / "unused")
    _, err = killed.communicate(timeout=HANG)
    assert killed.returncode == -signal.SIGKILL, err[-3000:]
    ref_out, ref_err = ref.communicate(timeout=HANG)
    assert ref.returncode == 0, ref_err[-3000:]
    assert read_pointer(dirpath / "last.ckpt")["global_step"] == BATCHES * KILL_EPOCH

    resumed = start_job(*common, "--resume", "--out", tmp_path / "out")
    out, err = resumed.communicate(timeout=HANG)
    assert resumed.returncode == 0, f"{out}\n{err[-3000:]}"
    step = BATCHES * KILL_EPOCH
    assert f"RESUMED rank 0 step {step} memory" in out, out
    assert f"RESUMED rank 1 step {step} storage" in out, out
    check_like_reference(tmp_path, root, dirpath)


def check_like_reference(tmp_path, root, dirpath) -> None:
    """The resumed job (`out`) ended bit for bit where the reference (`ref-out`) ended, on both
    ranks, and ModelCheckpoint kept the same top-2 and last.ckpt as the reference; each pointer
    names a committed step, and every other step was deleted."""
    for rank in range(2):
        want = torch.load(f"{tmp_path / 'ref-out'}.{rank}.pt")
        got = torch.load(f"{tmp_path / 'out'}.{rank}.pt")
        assert got["global_step"] == want["global_step"] == BATCHES * EPOCHS
        tensors_equal(got, want, f"rank {rank}")
    got, want = pointers(dirpath), pointers(tmp_path / "ref-ckpts")
    assert sorted(got) == sorted(want) and len(got) == 3 and "last.ckpt" in got, (got, want)
    assert sorted(set(got.values())) == safepoint.steps(root), (got, safepoint.steps(root))
    assert sorted(set(want.values())) == safepoint.steps(tmp_path / "ref"), want


def test_fsdp_strategy_is_refused_naming_the_way_out(tmp_path):
    from pytorch_lightning.strategies import FSDPStrategy, Strategy

    plugin = SafepointCheckpointIO(tmp_path / "sp", mode="sync")
    strategy = FSDPStrategy()
    strategy.checkpoint_io = plugin
    with pytest.raises(safepoint.InvalidArgumentError, match="FSDPStrategy.*SafepointFSDPStrategy"):
        # What FSDPStrategy.save_checkpoint does with state_dict_type="full" on rank 0.
        Strategy.save_checkpoint(strategy, {"state_dict": {}}, str(tmp_path / "a.ckpt"))
    assert not os.path.exists(tmp_path / "a.ckpt")


def test_other_ranks_wait_until_the_step_rank_0_resumes_is_committed(tmp_path, monkeypatch):
    """Rank 0 may resume a step from memory while the agent still persists it: a rank reading
    from storage waits for the commit (and says so when it never comes)."""
    import threading

    root = tmp_path / "sp"
    writer = SafepointCheckpointIO(root, mode="sync", include_rng=False)
    writer.save_checkpoint({"global_step": 1, "w": torch.ones(3)}, tmp_path / "a.ckpt")
    doc = read_pointer(tmp_path / "a.ckpt")
    (tmp_path / "b.ckpt").write_text((tmp_path / "a.ckpt").read_text().replace(
        f'"step": {doc["step"]}', f'"step": {doc["step"] + 1}'))
    reader = SafepointCheckpointIO(root, mode="sync", include_rng=False, commit_timeout=60)
    monkeypatch.setattr(reader, "_global_rank", lambda: 1)
    later = threading.Timer(0.5, safepoint.save,
                            (root, doc["step"] + 1, {"global_step": 2, "w": torch.full((3,), 2.)}))
    later.start()
    try:
        got = reader.load_checkpoint(tmp_path / "b.ckpt")  # not committed yet when called
    finally:
        later.join()
    assert got["global_step"] == 2 and torch.equal(got["w"], torch.full((3,), 2.))
    (tmp_path / "c.ckpt").write_text((tmp_path / "a.ckpt").read_text().replace(
        f'"step": {doc["step"]}', f'"step": {doc["step"] + 5}'))
    reader.commit_timeout = 0.2
    with pytest.raises(safepoint.NotFoundError, match="commit_timeout"):
        reader.load_checkpoint(tmp_path / "c.ckpt")


if __name__ == "__main__":
    worker(sys.argv[1:])
