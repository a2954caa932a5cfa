"""The DeepSpeed adapter (safepoint.deepspeed.SafepointCheckpointEngine) with the real DeepSpeed
on its CPU accelerator (gloo), 1 and 2 ranks, ZeRO stages 0 and 1.

Each rank is a process running this file as a worker: a first run trains 3 steps, saves through
``engine.save_checkpoint`` (flash: the state is in shared memory when it returns), records the
state it saved, trains 3 more steps, records where it ended and SIGKILLs itself; the agent
keeps the snapshot. A second run ``load_checkpoint``s, must get back the saved state bit for
bit (weights, optimizer state, global step) with each rank's own files from memory, trains the
same 3 steps and must end bit for bit where the killed run ended.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

import pytest

deepspeed = pytest.importorskip("deepspeed")
import torch  # noqa: E402
from conftest import communicate, free_port, start_script  # noqa: E402
from workloads.bitexact import first_difference  # noqa: E402

SAVE_AT, END_AT = 3, 6
HANG = 240  # seconds: only a guard against a hung process


# --- the workload (the worker processes) ---------------------------------------------------------

def make_engine(zero: int):
    from deepspeed.ops.op_builder import ShareMemCommBuilder

    # DeepSpeed's CPU accelerator JIT-compiles a shared-memory all-reduce for inference at
    # init (minutes on a cold cache); training and checkpoints do not use it.
    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    cfg = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**6,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}},
           "zero_optimization": {"stage": zero}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=cfg)
    return engine


def train(engine, rank: int, steps: range) -> None:
    for i in steps:
        g = torch.Generator().manual_seed(1000 * i + rank)
        loss = engine(torch.randn(4, 8, generator=g)).pow(2).mean()
        engine.backward(loss)
        engine.step()


def state_of(engine) -> dict:
    opt = engine.optimizer
    opt = getattr(opt, "optimizer", opt)  # ZeRO wraps the torch optimizer
    return {"model": {k: v.detach().clone() for k, v in engine.module.state_dict().items()},
            "optimizer": [{k: v.clone() for k, v in s.items() if torch.is_tensor(v)}
                          for s in opt.state.values()],
            "global_steps": engine.global_steps}


def worker(argv) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir"), ap.add_argument("--shm"), ap.add_argument("--job")
    ap.add_argument("--zero", type=int), ap.add_argument("--resume", action="store_true")
    a = ap.parse_args(argv)
    import deepspeed.comm as dist

    from safepoint.deepspeed import SafepointCheckpointEngine

    engine = make_engine(a.zero)
    rank = dist.get_rank()
    engine.checkpoint_engine = SafepointCheckpointEngine(job=a.job, shm_dir=a.shm)
    ref = os.path.join(a.dir, f"ref-rank{rank}.pt")
    if not a.resume:
        train(engine, rank, range(SAVE_AT))
        engine.save_checkpoint(os.path.join(a.dir, "ds"))
        saved = state_of(engine)
        train(engine, rank, range(SAVE_AT, END_AT))
        torch.save({"saved": saved, "end": state_of(engine)}, ref)
        dist.barrier()
        os.kill(os.getpid(), signal.SIGKILL)
    path, _ = engine.load_checkpoint(os.path.join(a.dir, "ds"))
    ckpt = engine.checkpoint_engine.checkpointer
    loaded = state_of(engine)
    train(engine, rank, range(SAVE_AT, END_AT))
    want = torch.load(ref)
    print(json.dumps({"path": path, "source": ckpt.last_restore.source,
                      "loaded": first_difference(loaded, want["saved"]),
                      "end": first_difference(state_of(engine), want["end"]),
                      "steps": loaded["global_steps"]}), flush=True)
    engine.checkpoint_engine.close()


# --- tests ---------------------------------------------------------------------------------------

def run_world(world: int, args: list, timeout: float = HANG) -> list:
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
        procs.append(start_script(__file__, *args, env=env))
    return [(r.returncode, r.stdout, r.stderr)
            for r in (communicate(p, timeout) for p in procs)]


@pytest.mark.parametrize("world,zero", [(1, 0), (2, 1)])
def test_save_sigkill_load_checkpoint_resumes_bit_identical(tmp_path, shm, world, zero):
    args = ["--dir", tmp_path, "--shm", shm, "--job", f"ds{os.getpid()}-{world}",
            "--zero", zero]
    for rc, _, err in run_world(world, args):
        assert rc == -signal.SIGKILL, err[-3000:]
    # What DeepSpeed sees on disk: its `latest` file and pointers where its files would be.
    from safepoint.deepspeed import read_pointer

    ds = tmp_path / "ds"
    assert (ds / "latest").read_text() == f"global_step{SAVE_AT}"
    doc = read_pointer(ds / f"global_step{SAVE_AT}" / "mp_rank_00_model_states.pt")
    assert doc is not None and doc["rank"] == 0 and doc["root"] == str(ds / "safepoint")
    for rc, out, err in run_world(world, args + ["--resume"]):
        assert rc == 0, err[-3000:]
        got = json.loads(out.strip().splitlines()[-1])
        # bit for bit: the state saved, then where the killed run ended
        assert got["loaded"] is None and got["end"] is None and got["steps"] == SAVE_AT, got
        assert got["source"] == "memory", got  # each rank's own files: hot reload


def test_load_of_a_torch_checkpoint_names_the_way_out(tmp_path):
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

    from safepoint.deepspeed import SafepointCheckpointEngine

    plain = tmp_path / "model.pt"
    torch.save({"w": torch.ones(2)}, plain)
    eng = SafepointCheckpointEngine(tmp_path / "sp", mode="sync")
    with pytest.raises(Exception, match="TorchCheckpointEngine"):
        eng.load(str(plain))
    with pytest.raises(FileNotFoundError):
        eng.load(str(tmp_path / "missing.pt"))
    # sync mode without DeepSpeed's engine: create, save, commit, load through a pointer
    info = CheckpointCommitInfo(tag="t1", save_dir=str(tmp_path / "ck"), save_latest=True)
    eng.create(info)
    os.makedirs(tmp_path / "ck" / "t1")
    eng.save({"w": torch.arange(4.0), "shape": torch.Size([2, 2])}, str(tmp_path / "ck/t1/a.pt"))
    assert eng.commit(info)
    import safepoint

    assert safepoint.steps(tmp_path / "sp") == [1]
    got = SafepointCheckpointEngine(mode="sync").load(str(tmp_path / "ck/t1/a.pt"))
    assert torch.equal(got["w"], torch.arange(4.0)) and got["shape"] == torch.Size([2, 2])


def _save_tag(eng, save_dir, tag, value):
    """One DeepSpeed save of one file, as save_checkpoint makes it (create, save, commit), then
    DeepSpeed's `latest`."""
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

    info = CheckpointCommitInfo(tag=tag, save_dir=str(save_dir), save_latest=True)
    eng.create(info)
    os.makedirs(save_dir / tag, exist_ok=True)
    eng.save({"w": torch.full((4,), float(value))},
             str(save_dir / tag / "mp_rank_00_model_states.pt"))
    assert eng.commit(info)
    (save_dir / "latest").write_text(tag)


def test_pointer_directories_of_pruned_steps_are_removed(tmp_path, shm):
    """Retention deletes the steps past `keep`; their tag directories (pointers) go with them,
    except other files a user put there."""
    import safepoint
    from safepoint.deepspeed import SafepointCheckpointEngine

    ds = tmp_path / "ds"
    eng = SafepointCheckpointEngine(job=f"dsprune{os.getpid()}", shm_dir=shm, keep=2)
    _save_tag(eng, ds, "global_step1", 1)
    (ds / "global_step1" / "notes.txt").write_text("mine")
    for step in range(2, 8):
        _save_tag(eng, ds, f"global_step{step}", step)
    eng.close()
    assert safepoint.steps(ds / "safepoint") == [6, 7]
    assert sorted(p.name for p in ds.iterdir() if p.is_dir()) == [
        "global_step1", "global_step6", "global_step7", "safepoint"]
    assert [p.name for p in (ds / "global_step1").iterdir()] == ["notes.txt"]
    got = SafepointCheckpointEngine(mode="sync").load(
        str(ds / "global_step6" / "mp_rank_00_model_states.pt"))
    assert torch.equal(got["w"], torch.full((4,), 6.0))


def test_errors_name_the_tag_and_the_tags_that_can_be_loaded(tmp_path):
    from safepoint import _core
    from safepoint.deepspeed import SafepointCheckpointEngine
    from safepoint.errors import NotFoundError

    ds = tmp_path / "ds"
    eng = SafepointCheckpointEngine(tmp_path / "sp", mode="sync")
    for step, tag in enumerate(("warmup", "epoch1", "epoch2"), 1):
        _save_tag(eng, ds, tag, step)
    _core.delete_step(str(tmp_path / "sp"), 1)  # as retention would
    with pytest.raises(NotFoundError) as e:
        SafepointCheckpointEngine(mode="sync").load(
            str(ds / "warmup" / "mp_rank_00_model_states.pt"))
    msg = str(e.value)
    assert "tag 'warmup' cannot be loaded" in msg, msg
    assert "the tags of " in msg and msg.endswith("that can be loaded: epoch1, epoch2"), msg


_KEPT = []  # the engine of a script that keeps it to the end


def left_open_worker(save_dir: str, shm: str, job: str, how: str) -> None:
    """Saves twice in flash mode and leaves without close(): with the engine alive (kept), after
    dropping it (dropped), or by an exception (raise)."""
    from pathlib import Path

    from safepoint.deepspeed import SafepointCheckpointEngine

    eng = SafepointCheckpointEngine(job=job, shm_dir=shm, keep=1)
    for step in (1, 2):
        _save_tag(eng, Path(save_dir), f"global_step{step}", step)
    if how == "kept":
        _KEPT.append(eng)
    if how == "raise":
        raise RuntimeError("the training loop failed")


@pytest.mark.parametrize("how", ["kept", "dropped", "raise"])
def test_an_engine_left_open_is_closed_at_exit_unless_the_program_crashed(tmp_path, shm, how):
    """Without checkpoint_engine.close(), a script that ends normally closes the engine at
    exit (every save committed, the snapshots leave shared memory, no leak warnings, and with
    the engine still there the pointers of pruned steps go); one that ends by an uncaught
    exception leaves the snapshots for a restarted process's hot reload."""
    import safepoint

    ds, job = tmp_path / "ds", f"dsexit{os.getpid()}{how}"
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore")
    got = communicate(start_script(__file__, "--left-open", ds, shm, job, how, env=env), HANG)
    rc, err = got.returncode, got.stderr
    assert rc == (1 if how == "raise" else 0), err[-3000:]
    assert "leak" not in err, err[-3000:]
    slots = [f for _, _, files in os.walk(shm) for f in files if ".slot-" in f]
    if how != "raise":
        assert slots == [], slots
        assert safepoint.steps(ds / "safepoint") == [2]
        tags = sorted(p.name for p in ds.iterdir() if p.is_dir() and p.name != "safepoint")
        # Dropped, the engine cannot clean up at exit: its next save (another run's) does.
        assert tags == ["global_step2"] if how == "kept" else "global_step2" in tags
    else:
        assert slots, "the snapshots were dropped on a crash"
        assert "the training loop failed" in err


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if sys.argv[1] == "--left-open":
        left_open_worker(*sys.argv[2:])
    else:
        worker(sys.argv[1:])
