"""Restore agreement: ranks never resume from different steps (2 ranks, gloo, real processes)."""

import os
import signal

import pytest

import safepoint
from conftest import run_ranks

WORKER = os.path.join(os.path.dirname(__file__), "workloads", "agree_worker.py")


def run_phase(tmp_path, job, phase, tag):
    store = tmp_path / f"store-{tag}"
    return run_ranks([[WORKER, store, tmp_path / "ckpt", tmp_path / "shm", job, r, phase]
                      for r in range(2)])


def kill_agent(shm, job):
    for d in os.listdir(shm):
        if d.endswith("-" + job):
            with open(os.path.join(shm, d, "agent.lock")) as f:
                pid = int(f.read().strip() or 0)
            if pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


@pytest.fixture
def job(tmp_path):
    (tmp_path / "shm").mkdir()
    name = f"agree-{os.getpid()}-{abs(hash(str(tmp_path))) % 10**6}"
    yield name
    kill_agent(tmp_path / "shm", name)


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
    # Damage rank 1's copies of step 3: its memory snapshot and its image on storage.
    shm_job = next(d for d in os.listdir(tmp_path / "shm") if d.endswith("-" + job))
    for slot in (0, 1):
        path = tmp_path / "shm" / shm_job / f"rank-00001.slot-{slot}"
        data = bytearray(path.read_bytes())
        # The image starts after the 4 KiB control block; flip a byte of its tensor data.
        data[4096 + 8192 + 100] ^= 0xFF
        path.write_bytes(bytes(data))
    img = tmp_path / "ckpt" / "step-00000000000000000003" / "rank-00001.img"
    raw = bytearray(img.read_bytes())
    raw[8192 + 100] ^= 0xFF
    img.write_bytes(bytes(raw))
    outs = run_phase(tmp_path, job, "load", "b")
    # Step 3 is unreadable for rank 1 everywhere, step 2 only exists on storage (both memory
    # slots were damaged): both ranks resume from step 2.
    assert [o["step"] for o in outs] == [2, 2]
    assert all(o["ok"] for o in outs)
    assert any("fall back" in w for w in outs[0]["warnings"] + outs[1]["warnings"])
