"""SafepointCheckpointIO with Lightning's sharded strategies: 2 CPU processes (gloo).

``SafepointFSDPStrategy`` (Lightning's ``FSDPStrategy``, FSDP1) and
``SafepointModelParallelStrategy`` (Lightning's ``ModelParallelStrategy``, FSDP2 ``fully_shard``
in ``configure_model``): every rank saves its shard through the plugin. This file run as a
script is a job: ``Trainer(accelerator="cpu", devices=2, strategy=...)``, whose launcher starts
the second rank by running the same command again. As in test_lightning_multirank.py: an
uninterrupted reference, a job whose ranks SIGKILL themselves at the start of epoch 2 (after the
flash checkpoint of its last step), and a job resumed with ``trainer.fit(ckpt_path="last")``,
under ``ModelCheckpoint(every_n_train_steps=4, save_top_k=2, monitor=..., save_last=True)``. The
resumed job must end bit for bit where the reference ended (each rank's model and optimizer
shards), both ranks must resume the same step from memory (hot reload), and the checkpoint
directory must hold what Lightning keeps (the reference's top-2 and ``last.ckpt``), each naming
a step on storage, and no other step.

FSDP1 on the CPU: Lightning's ``FSDPStrategy`` passes FSDP the device's index as ``device_id``
(None for a CPU), and torch 2.13's FSDP1 then refuses a CPU model ("FSDP needs a non-CPU
accelerator device"); given ``device_id=torch.device("cpu")`` it trains on gloo. So the FSDP1
worker patches exactly that (``_fsdp1_on_cpu``: FSDP gets the CPU device when Lightning passes
none) and the job prints the class that wraps the module, which the test checks. (Lightning's own
check that refuses ``accelerator="cpu"`` for FSDP applies to ``FSDPStrategy`` itself, not to a
subclass, so it needs no patch.) FSDP2 (``fully_shard``) runs on the CPU as it is.
"""

from __future__ import annotations

import os
import signal
import sys

import pytest

pl = pytest.importorskip("pytorch_lightning")
import test_lightning as single  # noqa: E402  (its module and loader: 32 samples, batches of 4)
import test_lightning_multirank as ddp  # noqa: E402  (its job's callbacks)
import torch  # noqa: E402

import safepoint  # noqa: E402
from safepoint import lightning as spl  # noqa: E402
from safepoint.lightning import SafepointCheckpointIO, read_pointer  # noqa: E402

BATCHES, EPOCHS, KILL_EPOCH = ddp.BATCHES, ddp.EPOCHS, ddp.KILL_EPOCH
HANG = ddp.HANG


class Sharded(ddp.Tiny):
    """FSDP2: the module shards itself in configure_model over the data-parallel mesh."""

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        if self.device_mesh is not None and not hasattr(self.net, "reshard"):
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])


def _fsdp1_on_cpu() -> None:
    """FSDP1 gets the CPU device when Lightning passes it none (see the module doc)."""
    import torch.distributed.fsdp as fsdp

    base = fsdp.FullyShardedDataParallel

    class CpuFSDP(base):
        def __init__(self, module, *args, device_id=None, **kwargs):
            super().__init__(module, *args, device_id=device_id or torch.device("cpu"), **kwargs)

    fsdp.FullyShardedDataParallel = CpuFSDP


class Wrapped(pl.Callback):
    def on_train_start(self, trainer, module):
        from torch.distributed.tensor import DTensor

        model = trainer.strategy.model
        kinds = sorted({type(p).__name__ for p in model.parameters()})
        wrapper = type(model).__mro__[1].__name__  # FSDP1: the test's CpuFSDP derives from it
        state = trainer.strategy.lightning_module_state_dict()
        dtensors = all(isinstance(v, DTensor) for v in state.values())
        print(f"WRAPPED rank {trainer.global_rank} {wrapper} {type(module.net).__name__} {kinds}"
              f" dtensor-state {dtensors}",
              flush=True)


def shards(trainer) -> dict:
    """This rank's shards of the model and optimizer state (DTensors' local tensors)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.tensor import DTensor

    def local(x):
        if isinstance(x, DTensor):
            return x.to_local().detach().clone()
        if isinstance(x, torch.Tensor):
            return x.detach().clone()
        if isinstance(x, dict):
            return {k: local(v) for k, v in x.items()}
        if isinstance(x, list):
            return [local(v) for v in x]
        return x

    opts = StateDictOptions(full_state_dict=False)
    model, opt = trainer.strategy.model, trainer.optimizers[0]
    return {"model": local(get_model_state_dict(model, options=opts)),
            "optimizer": local(get_optimizer_state_dict(model, opt, options=opts))}


def worker(argv) -> None:
    a = ddp.job_args(argv, "--strategy")
    if a.strategy == "fsdp":
        _fsdp1_on_cpu()
        strategy, module = spl.SafepointFSDPStrategy(), ddp.Tiny()
    else:
        strategy = spl.SafepointModelParallelStrategy(data_parallel_size=2,
                                                      tensor_parallel_size=1)
        module = Sharded()
    trainer = ddp.job_trainer(a, strategy, Wrapped())
    trainer.fit(module, single.loader(), ckpt_path="last" if a.resume else None)
    torch.save({**shards(trainer), "global_step": trainer.global_step},
               f"{a.out}.{trainer.global_rank}.pt")
    ddp.job_exit(trainer)


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
def test_sharded_two_ranks_sigkill_then_fit_ckpt_last_is_bit_identical(tmp_path, shm, strategy):
    job = f"pls{strategy}{os.getpid()}"
    ref = ddp.start_job("--strategy", strategy, "--root", tmp_path / "ref", "--dirpath",
                        tmp_path / "ref-ckpts", "--shm", shm, "--job", job + "r", "--out",
                        tmp_path / "ref-out", script=__file__)
    root, dirpath = tmp_path / "sp", tmp_path / "ckpts"
    common = ["--strategy", strategy, "--root", root, "--dirpath", dirpath, "--shm", shm,
              "--job", job]
    killed = ddp.start_job(*common, "--kill-epoch", KILL_EPOCH, "--out", tmp_path / "unused",
                           script=__file__)
    _, err = killed.communicate(timeout=HANG)
    assert killed.returncode == -signal.SIGKILL, err[-3000:]
    ref_out, ref_err = ref.communicate(timeout=HANG)
    assert ref.returncode == 0, ref_err[-3000:]
    doc = read_pointer(dirpath / "last.ckpt")
    assert doc["global_step"] == BATCHES * KILL_EPOCH and doc["world_size"] == 2, doc
    # The module really is sharded: FSDP1 wraps it, FSDP2 made its parameters DTensors.
    for rank in range(2):
        if strategy == "fsdp":
            assert (f"WRAPPED rank {rank} FullyShardedDataParallel Sequential ['Parameter'] "
                    "dtensor-state True") in ref_out, ref_out
        else:
            assert (f"WRAPPED rank {rank} Tiny FSDPSequential ['DTensor'] dtensor-state "
                    "True") in ref_out, ref_out

    resumed = ddp.start_job(*common, "--resume", "--out", tmp_path / "out", script=__file__)
    out, err = resumed.communicate(timeout=HANG)
    assert resumed.returncode == 0, f"{out}\n{err[-3000:]}"
    step = BATCHES * KILL_EPOCH
    for rank in range(2):  # every rank resumed the same step, its own shard from memory
        assert f"RESUMED rank {rank} step {step} memory" in out, out
    ddp.check_like_reference(tmp_path, root, dirpath)


class FakeStrategy:
    def __init__(self, rank, world):
        self.global_rank, self.world_size = rank, world


def test_sharded_pointers_need_the_same_world_and_strategy(tmp_path):
    """A sharded step names its world size in the pointer: the DDP plugin alone, or another
    number of ranks, is refused naming the way out (safepoint.restore reshards)."""
    plugin = SafepointCheckpointIO(tmp_path / "sp", mode="sync", include_rng=False)
    plugin.save_checkpoint({"global_step": 1, "state_dict": {"w": torch.ones(2)}},
                           tmp_path / "a.ckpt")
    doc = read_pointer(tmp_path / "a.ckpt")
    assert "world_size" not in doc
    sharded = dict(doc, world_size=2)
    (tmp_path / "b.ckpt").write_text(__import__("json").dumps(sharded))
    with pytest.raises(safepoint.InvalidArgumentError, match="2 ranks.*SafepointFSDPStrategy"):
        plugin.load_checkpoint(tmp_path / "b.ckpt")
    flash = SafepointCheckpointIO(tmp_path / "sp")
    with pytest.raises(safepoint.InvalidArgumentError, match="saved in shards by 2.*has 4"):
        flash._load_sharded(tmp_path / "b.ckpt", FakeStrategy(0, 4), None)
    with pytest.raises(safepoint.InvalidArgumentError, match="one full state by 1.*has 2"):
        flash._load_sharded(tmp_path / "a.ckpt", FakeStrategy(0, 2), None)
    with pytest.raises(safepoint.InvalidArgumentError, match="mode='flash'"):
        plugin._load_sharded(tmp_path / "b.ckpt", FakeStrategy(0, 2), None)
    with pytest.raises(FileNotFoundError, match="not found"):
        flash._load_sharded(tmp_path / "missing.ckpt", FakeStrategy(0, 2), None)
    torch.save({"w": torch.ones(2)}, tmp_path / "torch.ckpt")
    with pytest.raises(safepoint.InvalidArgumentError, match="not a pointer file.*FakeStrategy"):
        flash._load_sharded(tmp_path / "torch.ckpt", FakeStrategy(0, 2), None)


def test_sharded_strategies_refuse_full_state_dicts_and_other_checkpoint_ios():
    with pytest.raises(safepoint.InvalidArgumentError, match="state_dict_type='sharded'"):
        spl.SafepointFSDPStrategy(state_dict_type="full")
    with pytest.raises(safepoint.InvalidArgumentError, match="save_distributed_checkpoint=True"):
        spl.SafepointModelParallelStrategy(save_distributed_checkpoint=False)
    strategy = spl.SafepointFSDPStrategy()
    with pytest.raises(safepoint.InvalidArgumentError, match="plugins=\\[SafepointCheckpointIO"):
        strategy.save_checkpoint({}, "x.ckpt")
    assert isinstance(strategy, pl.strategies.FSDPStrategy)
    assert isinstance(spl.SafepointModelParallelStrategy(),
                      pl.strategies.ModelParallelStrategy)


if __name__ == "__main__":
    worker(sys.argv[1:])
