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


def test_rows_state_the_newest_steps_and_the_rest_comes_in_a_second_round(tmp_path):
    # The agreement's rows are fixed (ROW int64 per rank): the lister states its newest STORED
    # committed steps; when every one fails, the rest comes from it in one broadcast. Checked on
    # a 1-rank gloo group, in a process of its own.
    import subprocess
    import sys

    script = f"""
import torch.distributed as dist
from safepoint import _agreement as a
dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
g = dist.new_group(backend="gloo")
stored = {{s: [s % 2] for s in range(1, 21)}}  # 20 steps, on storage 0 or 1 alternately
mine = a.Statement(False, None, None, {{21: 7, 3: None}}, True, stored, 20)
agreed = a.agree(g, 1, mine, ["file:///p", "file:///t"], None)
assert not agreed.hot and agreed.more and agreed.in_memory == {{21}}
assert agreed.steps == {{21}} | set(range(20 - a.STORED + 1, 21)), agreed.steps
assert agreed.committed[20] == ["file:///p"] and agreed.shared_uri(19) == "file:///t"
tried = []
got = a.load_newest_agreed(g, agreed.steps, lambda s: tried.append(s) or (s if s == 2 else None),
                           agreed.older)
assert got == 2 and tried == list(range(21, 1, -1)), tried
# An asked-for step: the row states it alone; a hot reload the lister's newest committed step
# overrides only when the newest is asked for.
agreed = a.agree(g, 1, a.Statement(True, 5, 9, {{5: 9}}, False, stored, 20), ["file:///p"], 5)
assert agreed.hot and agreed.steps == {{5}} and not agreed.more
agreed = a.agree(g, 1, a.Statement(True, 5, 9, {{5: 9}}, False, stored, 20), ["file:///p"], None)
assert not agreed.hot
# Attempts are unsigned 64-bit ids: every one survives the int64 row.
agreed = a.agree(g, 1, a.Statement(True, 5, 2**64 - 1, {{5: 2**64 - 1}}, False), ["p"], None)
assert agreed.hot and agreed.in_memory == {{5}}
# Torn down before exit: a gloo group left to the interpreter's exit can abort the process
# ("terminate called without an active exception", seen under load).
dist.destroy_process_group()
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]



def test_the_listers_commit_record_rides_in_the_rows(tmp_path):
    # The lister's COMMIT record of the newest step travels in the agreement's one all-gather,
    # so that the other ranks read their images against it and read no record; it names the
    # storage it was read from and its step, and is handed over only for those.
    import subprocess
    import sys

    from safepoint import _agreement as a

    # The slot holds the largest record of a step this world saves, up to 4 KiB (W <= 249);
    # beyond, its header alone (the bytes follow in a broadcast: the next test).
    assert a.record_words(1) == 2 + 16 and a.record_words(249) > 2 and a.record_words(250) == 2
    script = f"""
import torch.distributed as dist
from safepoint import _agreement as a
dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
g = dist.new_group(backend="gloo")
stores = ["file:///p", "file:///t"]
data = bytes(range(1, 122))  # 121 bytes: not a multiple of 8
mine = a.Statement(False, None, None, {{}}, True, {{6: [0], 7: [1]}}, 7, None, (7, 1, data))
agreed = a.agree(g, 1, mine, stores, None)
assert agreed.record(7, "file:///t") == data
assert agreed.record(7, "file:///p") is None and agreed.record(6, "file:///p") is None
# Another step asked for: the record is not the one it needs, and is not carried.
assert a.agree(g, 1, mine, stores, 6).record(7, "file:///t") is None
# A record larger than the slot (of a step a larger world saved) is not carried.
big = a.Statement(False, None, None, {{}}, True, {{7: [0]}}, 7, None, (7, 0, bytes(200)))
assert a.agree(g, 1, big, stores, None).record(7, "file:///p") is None
# No record (the lister found none): nothing.
assert a.agree(g, 1, a.Statement(False, None, None, {{}}, True), stores, None).record(7,
    "file:///p") is None
dist.destroy_process_group()
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_a_record_too_large_for_the_rows_is_broadcast_once_for_the_job(tmp_path):
    # Over 249 ranks the rows carry the record's header alone and the lister broadcasts its
    # bytes: every rank gets the record it read, and no rank reads the record from storage
    # (before, every rank read it: W COMMIT reads). Two ranks here, the slot's limit lowered
    # so that their record does not fit it. A hot reload needs no record: no broadcast.
    import subprocess
    import sys

    script = f"""
import sys
import torch.distributed as dist
from safepoint import _agreement as a
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=rank, world_size=2)
g = dist.new_group(backend="gloo")
a.RECORD_LIMIT = 0
assert a.record_words(2) == 2
broadcasts = []
real = dist.broadcast
def counted(*args, **kw):
    broadcasts.append(1)
    return real(*args, **kw)
dist.broadcast = counted
stores = ["file:///p", "file:///t"]
data = bytes(range(1, 122)) * 3  # 363 bytes: not a multiple of 8
lister = a.Statement(False, None, None, {{}}, True, {{6: [0], 7: [1]}}, 7, None, (7, 1, data))
other = a.Statement(False, None, None, {{}}, True)
agreed = a.agree(g, 2, lister if rank == 0 else other, stores, None)
assert agreed.record(7, "file:///t") == data, agreed.record(7, "file:///t")
assert agreed.record(7, "file:///p") is None and agreed.record(6, "file:///t") is None
assert len(broadcasts) == 1
# Another step asked for: no record, no broadcast.
assert a.agree(g, 2, lister if rank == 0 else other, stores, 6).record(7, "file:///t") is None
assert len(broadcasts) == 1
# A hot reload (both ranks loaded step 7 of attempt 9, the newest): no broadcast.
hot = a.Statement(True, 7, 9, {{7: 9}}, True, {{7: [0]}} if rank == 0 else None, 7, None,
                  (7, 0, data) if rank == 0 else None)
assert a.agree(g, 2, hot, stores, None).hot
assert len(broadcasts) == 1
dist.destroy_process_group()
print("ok")
"""
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0 and out.strip() == "ok", err[-3000:]
