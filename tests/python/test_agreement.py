"""Restore agreement: ranks never resume from different steps (2 ranks, gloo, real processes)."""

import os

import pytest

import safepoint
from conftest import run_ranks
from processes import job_dir, kill_agents
from safepoint import _core

WORKER = os.path.join(os.path.dirname(__file__), "workloads", "agree_worker.py")


def run_phase(tmp_path, job, phase, tag):
    store = tmp_path / f"store-{tag}"
    return run_ranks([[WORKER, store, tmp_path / "ckpt", tmp_path / "shm", job, r, phase]
                      for r in range(2)])


@pytest.fixture
def job(tmp_path):
    (tmp_path / "shm").mkdir()
    name = f"agree-{os.getpid()}-{abs(hash(str(tmp_path))) % 10**6}"
    yield name
    kill_agents(tmp_path / "shm", name)


def test_ranks_agree_on_a_step_every_rank_has(tmp_path, job):
    run_phase(tmp_path, job, "save", "a")
    assert safepoint.steps(tmp_path / "ckpt") == [1, 2, 3]
    outs = run_phase(tmp_path, job, "load", "b")
    # Rank 0 holds step 4 in memory, rank 1 does not: both resume from step 3, from memory.
    assert [o["step"] for o in outs] == [3, 3]
    assert all(o["ok"] for o in outs)
    assert [o["source"] for o in outs] == ["memory", "memory"]


def test_all_ranks_fall_back_together(tmp_path, job):
    run_phase(tmp_path, job, "save", "a")
    # Damage rank 1's copies of step 3: its image on storage and its memory snapshots (a slot
    # holds the same image after its control block), one byte of tensor "w" each.
    img, offset, nbytes = _core.tensor_extent(str(tmp_path / "ckpt"), 3, 1, "w")
    assert nbytes == 4000
    for path in [img] + sorted(job_dir(tmp_path / "shm", job).glob("rank-00001.slot-*")):
        at = offset + 100 + (_core.SLOT_HEADER_BYTES if ".slot-" in str(path) else 0)
        with open(path, "r+b") as f:
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0xFF]))
    outs = run_phase(tmp_path, job, "load", "b")
    # Step 3 is unreadable for rank 1 everywhere, step 2 only exists on storage (both memory
    # slots were damaged): both ranks resume from step 2.
    assert [o["step"] for o in outs] == [2, 2]
    assert all(o["ok"] for o in outs)
    assert any("fall back" in w for w in outs[0]["warnings"] + outs[1]["warnings"])


def test_hot_reload_agrees_in_one_collective(tmp_path, job):
    outs = run_phase(tmp_path, job, "hot", "a")
    assert [o["step"] for o in outs] == [3, 3]
    assert all(o["ok"] for o in outs)
    assert [o["source"] for o in outs] == ["memory", "memory"]
    # Every rank has the newest step in memory: one all-gather of fixed-size tensors agrees on
    # it (no pickled all_gather_object, no confirming all_reduce).
    assert [o["calls"] for o in outs] == [
        {"all_gather_object": 0, "all_reduce": 0, "all_gather": 1}] * 2
