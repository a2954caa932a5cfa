"""SafepointCallback with 2 processes (CPU, gloo): the real Trainer under DDP and FSDP2.

Each test starts the two ranks of a job as torchrun would (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, a free MASTER_PORT); this file run as a script is the rank. Three jobs: an
uninterrupted reference, a job whose ranks both SIGKILL themselves right after the flash save of
step 6 (mid-epoch), and a job resumed with ``cb.prepare_resume(trainer)``. Every rank's final
model and optimizer state (its shards, under FSDP2) must equal the reference's bit for bit, and
both ranks must resume from the same step, from memory.

FSDP2 on the CPU: accelerate 1.15 turns its FSDP plugin on only for accelerators (on a CPU run
it silently trains with DDP), so the FSDP2 worker makes accelerate keep the plugin on a
multi-CPU run (``_fsdp_on_cpu``); the Trainer, accelerate's ``fully_shard`` preparation and
the callback are the real ones.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
import torch  # noqa: E402
from conftest import free_port, start_script  # noqa: E402
from workloads.bitexact import assert_bit_identical as tensors_equal  # noqa: E402

import safepoint  # noqa: E402
from safepoint.hf import SafepointCallback  # noqa: E402

STEPS, EVERY, KILL_AT = 8, 2, 6  # 2 ranks x 4 samples a step, 32 samples: 4 steps an epoch
HANG = 240  # seconds: only a guard against a hung process


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=32, length=12, vocab=64):
        self.ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(5))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _fsdp_on_cpu() -> None:
    """Keeps accelerate's FSDP plugin on for a multi-CPU (gloo) run (see the module doc)."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    init = AcceleratorState.__init__

    def patched(self, *args, fsdp_plugin=None, **kw):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kw)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    AcceleratorState.__init__ = patched


def make_trainer(out_dir, callbacks, fsdp: bool):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2,
                                       n_head=2, resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.2,
                                       bos_token_id=0, eos_token_id=0))
    kw = {}
    if fsdp:
        kw = dict(fsdp=True, fsdp_config={"fsdp_version": 2, "reshard_after_forward": True,
                                          "transformer_layer_cls_to_wrap": ["GPT2Block"]})
    args = TrainingArguments(output_dir=str(out_dir), max_steps=STEPS,
                             per_device_train_batch_size=4, learning_rate=1e-2,
                             lr_scheduler_type="linear", save_strategy="no", report_to=[],
                             logging_steps=1, use_cpu=True, ddp_backend="gloo", seed=0,
                             disable_tqdm=True, dataloader_num_workers=0, **kw)
    return Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)


def local_state(trainer) -> dict:
    """This rank's model and optimizer tensors (a DTensor's local shard)."""
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    opt = trainer.optimizer.state_dict()
    return {"model": {k: local(v).detach().clone() for k, v in trainer.model.state_dict().items()},
            "optimizer": {str(k): {n: local(v).clone() for n, v in s.items()}
                          for k, s in opt["state"].items()},
            "global_step": trainer.state.global_step}


class Kill(transformers.TrainerCallback):
    def __init__(self, at):
        self.at = at

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at:  # SafepointCallback, listed first, has saved it
            os.kill(os.getpid(), signal.SIGKILL)


def worker(argv) -> None:
    ap = argparse.ArgumentParser()
    for name in ("--root", "--shm", "--job", "--out", "--work"):
        ap.add_argument(name)
    ap.add_argument("--kill-at", type=int)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--fsdp", action="store_true")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    if a.fsdp:
        _fsdp_on_cpu()
    cb = SafepointCallback(a.root, every_n_steps=EVERY, keep=10, job=a.job, shm_dir=a.shm)
    trainer = make_trainer(a.work, [cb, *([Kill(a.kill_at)] if a.kill_at else [])], a.fsdp)
    resume = cb.prepare_resume(trainer) if a.resume else None
    trainer.train(resume_from_checkpoint=resume)
    rank = int(os.environ["RANK"])
    torch.save(local_state(trainer), f"{a.out}.{rank}.pt")
    print("RESUMED", cb.resumed_step, cb.resumed_from, type(trainer.model_wrapped).__name__,
          flush=True)
    sys.stdout.flush()
    os._exit(0)  # gloo threads may outlive the process group (see examples/fsdp2.py)


def start_job(*args) -> list:
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                   LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1")
        procs.append(start_script(__file__, *args, env=dict(env, PYTHONWARNINGS="ignore")))
    return procs


def finish(procs, killed=False) -> list[str]:
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=HANG)
        if killed:
            assert p.returncode == -signal.SIGKILL, err[-3000:]
        else:
            assert p.returncode == 0, f"{out}\n{err[-3000:]}"
        outs.append(out)
    return outs


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp2"])
def test_two_ranks_sigkill_then_resume_is_bit_identical(tmp_path, shm, fsdp):
    flag = ["--fsdp"] if fsdp else []
    job = f"hfm{os.getpid()}{int(fsdp)}"
    ref = start_job("--root", tmp_path / "ref", "--shm", shm, "--job", job + "r",
                    "--out", tmp_path / "ref-out", "--work", tmp_path / "w0", *flag)
    root = tmp_path / "sp"
    common = ["--root", root, "--shm", shm, "--job", job, "--work", tmp_path / "w1", *flag]
    finish(start_job(*common, "--kill-at", KILL_AT, "--out", tmp_path / "unused"), killed=True)
    ref_outs = finish(ref)
    wrapper = "FSDPGPT2LMHeadModel" if fsdp else "DistributedDataParallel"
    assert all(f"RESUMED None None {wrapper}" in o for o in ref_outs), ref_outs
    # Both ranks died after saving step 6; the agent persists their snapshots (emergency flush).
    end = time.monotonic() + HANG
    while KILL_AT not in safepoint.steps(root):
        assert time.monotonic() < end, "the agent never committed the killed job's last save"
        time.sleep(0.05)

    outs = finish(start_job(*common, "--resume", "--out", tmp_path / "out"))
    assert all(f"RESUMED {KILL_AT} memory {wrapper}" in o for o in outs), outs
    for rank in range(2):
        want = torch.load(f"{tmp_path / 'ref-out'}.{rank}.pt")
        got = torch.load(f"{tmp_path / 'out'}.{rank}.pt")
        assert got["global_step"] == want["global_step"] == STEPS
        tensors_equal(got, want, f"rank {rank}")
    assert safepoint.steps(root) == list(range(EVERY, STEPS + 1, EVERY))


def test_deepspeed_and_sync_with_several_ranks_are_refused_naming_the_way_out(tmp_path):
    class Args:
        world_size, should_save, deepspeed = 1, True, "ds_config.json"

    cb = SafepointCallback(tmp_path / "sp", every_n_steps=1)
    with pytest.raises(safepoint.InvalidArgumentError, match="DeepSpeed.*FSDP2"):
        cb.on_train_begin(Args(), None, None)
    Args.deepspeed, Args.world_size = None, 2
    sync = SafepointCallback(tmp_path / "sp", mode="sync")
    with pytest.raises(safepoint.InvalidArgumentError, match="use mode='flash'"):
        sync.on_train_begin(Args(), None, None)


def test_fsdp1_is_refused_naming_fsdp2(tmp_path, monkeypatch):
    from torch.distributed import fsdp

    class Fake(torch.nn.Module):
        pass

    monkeypatch.setattr(fsdp, "FullyShardedDataParallel", Fake)

    class Args:
        world_size, should_save, deepspeed = 1, True, None

    cb = SafepointCallback(tmp_path / "sp", every_n_steps=1)
    with pytest.raises(safepoint.InvalidArgumentError, match="fsdp_version': 2"):
        cb.on_train_begin(Args(), None, None, model=torch.nn.Sequential(Fake()))


if __name__ == "__main__":
    worker(sys.argv[1:])
