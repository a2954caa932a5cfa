"""The torchtitan adapter (safepoint.torchtitan.SafepointCheckpointManager) with the real
torchtitan 0.3.0: built from its config class (``Config.build``, as torchtitan's Trainer builds
``config.checkpoint``), driven through the manager's own entry points (``save`` every step,
``load``, ``close``) with torchtitan's optimizer and LR scheduler containers and a ``Stateful``
train state. torchtitan itself does not train on a CPU-only host (it picks "cuda" as its device
there), hence no ``torchtitan.train`` run.

A first process trains 6 steps with ``interval=4`` (the manager saves step 4), records the
state at step 4 and at the end, and SIGKILLs itself; a second one ``load``s (from memory: hot
reload), must get step 4 back bit for bit and, after 2 more steps, end bit for bit where the
killed run ended.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

import pytest

pytest.importorskip("torchtitan")
import torch  # noqa: E402
from conftest import REPO, run_script  # noqa: E402
from workloads.bitexact import first_difference  # noqa: E402

sys.path.insert(0, os.path.join(REPO, "examples"))
from torchtitan_example import build as example_build  # noqa: E402

SAVE_EVERY, END_AT = 4, 6
HANG = 240


def build(folder, job=None, shm=None, **kw):
    """The example's model, torchtitan containers, train state and manager (folder "ckpt")."""
    return example_build(str(folder), END_AT, SAVE_EVERY, job=job, shm_dir=shm, folder="ckpt",
                         **kw)


def step_once(model, opts, scheds, ts) -> None:
    ts.step += 1
    g = torch.Generator().manual_seed(ts.step)
    loss = model(torch.randn(16, 8, generator=g)).pow(2).mean()
    loss.backward()
    opts.step()
    opts.zero_grad()
    scheds.step()
    ts.ntokens_seen += 16


def snapshot(model, opts, scheds, ts) -> dict:
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "optim": [{k: v.clone() for k, v in s.items()} for s in opts.optimizers[0]
                      .state.values()],
            "lr": scheds.schedulers[0].get_last_lr(), "step": ts.step, "tokens": ts.ntokens_seen}


def worker(argv) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir"), ap.add_argument("--shm"), ap.add_argument("--job")
    ap.add_argument("--resume", action="store_true")
    a = ap.parse_args(argv)
    mgr, *parts = build(a.dir, a.job, a.shm)
    ref = os.path.join(a.dir, "ref.pt")
    if not a.resume:
        assert mgr.load() is False  # a fresh run: nothing to load
        saved = None
        while parts[-1].step < END_AT:
            step_once(*parts)
            if mgr.save(parts[-1].step):
                saved = snapshot(*parts)
        torch.save({"saved": saved, "end": snapshot(*parts)}, ref)
        os.kill(os.getpid(), signal.SIGKILL)
    assert mgr.load() is True
    loaded = snapshot(*parts)
    while parts[-1].step < END_AT:
        step_once(*parts)
        mgr.save(parts[-1].step)
    want = torch.load(ref)
    print(json.dumps({"source": mgr.checkpointer.last_restore.source,
                      "loaded": first_difference(loaded, want["saved"]),
                      "end": first_difference(snapshot(*parts), want["end"]),
                      "step": loaded["step"]}))
    mgr.close()


def test_save_sigkill_load_resumes_bit_identical(tmp_path, shm):
    args = ["--dir", tmp_path, "--shm", shm, "--job", f"tt{os.getpid()}"]
    first = run_script(__file__, *args, timeout=HANG)
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    second = run_script(__file__, *args, "--resume", timeout=HANG)
    assert second.returncode == 0, second.stderr[-3000:]
    got = json.loads(second.stdout.strip().splitlines()[-1])
    # from memory, bit for bit the state saved, then where the killed run ended
    assert got == {"source": "memory", "loaded": None, "end": None, "step": SAVE_EVERY}


def test_unsupported_options_are_refused_by_name():
    from safepoint.torchtitan import SafepointCheckpointManager

    for name in ("last_save_in_hf", "create_seed_checkpoint"):
        with pytest.raises(ValueError, match=f"checkpoint.{name} is not supported"):
            SafepointCheckpointManager.Config(enable=True, **{name: True},
                                              last_save_model_only=True)


def test_disabled_manager_does_nothing_and_load_step_is_exact(tmp_path, shm):
    from safepoint.torchtitan import SafepointCheckpointManager

    off = SafepointCheckpointManager.Config(enable=False).build(
        dataloader=None, model_parts=[], optimizers=None, lr_schedulers=None, states={},
        base_folder=str(tmp_path))
    assert off.save(4) is False and off.load() is False
    mgr, model, opts, scheds, ts = build(tmp_path, f"tt{os.getpid()}x", shm, persist_every=1)
    for _ in range(SAVE_EVERY):
        step_once(model, opts, scheds, ts)
        mgr.save(ts.step, last_step=ts.step == SAVE_EVERY)
    import safepoint

    assert safepoint.steps(tmp_path / "ckpt") == [SAVE_EVERY]  # last_step: committed on return
    with pytest.raises(FileNotFoundError, match="step 3"):
        mgr.load(step=3)
    mgr.close()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    worker(sys.argv[1:])
