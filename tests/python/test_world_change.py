"""A job killed and restarted with another world size (issue 36, item 3): the node agent
persists what the previous world left in memory and drops it, the restore reads the newest
committed step from storage, resharded, bit-exact, and the job goes on with its new world size;
a refused process leaves no agent behind. Real processes: DDP on gloo, a Checkpointer per rank
(tests/python/workloads/world_change_worker.py), the same job name and shm directory throughout.
"""

import json
import os
import subprocess
import sys
import tempfile

import pytest
from conftest import agents_of, free_port
from processes import wait_until

import safepoint
from safepoint import _core

WORKER = os.path.join(os.path.dirname(__file__), "workloads", "world_change_worker.py")
# The worker's persist schedule: with 5 steps, step 3 is persisted and steps 4 and 5 are only in
# memory when the ranks are killed.
STEPS, PERSIST_EVERY = 5, 3


def run_world(ckpt, shm, job, world, steps, end, *extra, timeout=240):
    """Runs `world` ranks of the worker at once; (returncode, the JSON line it printed, stderr)
    per rank."""
    port = free_port()
    files = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in range(world)]
    # Output to files, not pipes: the agent a rank starts outlives it.
    procs = [subprocess.Popen([sys.executable, WORKER, str(ckpt), str(shm), job, str(port),
                               str(r), str(world), str(steps), str(PERSIST_EVERY), end, *extra],
                              stdout=o, stderr=e, text=True, env=dict(os.environ,
                                                                      PYTHONWARNINGS="ignore"))
             for r, (o, e) in enumerate(files)]
    outs = []
    for p, (o, e) in zip(procs, files):
        try:
            p.wait(timeout=timeout)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        o.seek(0)
        e.seek(0)
        lines = o.read().strip().splitlines()
        outs.append((p.returncode, json.loads(lines[-1]) if lines else None, e.read()[-3000:]))
    return outs


def killed(outs):
    """The ranks' reports of a run that ended in SIGKILL (after every rank saved)."""
    for rc, out, err in outs:
        assert rc == -9 and out is not None, (rc, err)
    return [out for _, out, _ in outs]


def finished(outs):
    for rc, out, err in outs:
        assert rc == 0 and out is not None, (rc, err)
    return [out for _, out, _ in outs]


def committed_worlds(ckpt):
    """step -> the world size that committed it."""
    return {s: _core.read_metadata(str(ckpt), s, 0).world_size for s in safepoint.steps(ckpt)}


@pytest.fixture
def job():
    return f"world-{os.getpid()}"


def test_two_ranks_killed_restart_as_one_rank_restores_the_newest_step(tmp_path, shm, job):
    ckpt = tmp_path / "ckpt"
    first = killed(run_world(ckpt, shm, job, 2, STEPS, "kill"))
    assert [o["restored"] for o in first] == [None, None]
    assert first[0]["saved"] == first[1]["saved"]  # replicated model, the table digested whole
    assert len(agents_of(shm, job)) == 1  # the killed run's agent keeps its snapshots

    # The same job name and shm directory, one rank: accepted (not "already persists ... with
    # world size 2"). Steps 4 and 5 were only in memory: 5 is persisted, committed with world
    # size 2 and restored from storage (memory holds no snapshot a rank of one can use), its
    # replicated state from the image that wrote it, the table's rows from both ranks' images.
    (again,) = killed(run_world(ckpt, shm, job, 1, 2, "kill"))
    assert again["restored"] == STEPS and again["source"] == "storage", again
    assert again["restored_digest"] == first[0]["saved"][str(STEPS)]
    # The job goes on with world size 1, and the previous world's snapshots are gone.
    assert again["agent_world_size"] == 1
    assert again["slot_files"] == ["rank-00000.slot-0", "rank-00000.slot-1"], again
    worlds = committed_worlds(ckpt)
    assert worlds[STEPS] == 2, worlds

    # Killed again with world size 1: the next restart reloads from memory, bit-exact.
    (third,) = finished(run_world(ckpt, shm, job, 1, 1, "close"))
    assert third["restored"] == STEPS + 2 and third["source"] == "memory", third
    assert third["restored_digest"] == again["saved"][str(STEPS + 2)]
    worlds = committed_worlds(ckpt)
    assert worlds[STEPS + 3] == 1, worlds
    assert safepoint.steps(ckpt)[-1] == STEPS + 3
    # Every rank closed: the agent exits; nothing lingers.
    assert wait_until(lambda: not agents_of(shm), 60), agents_of(shm)


def test_refused_process_leaves_no_agent_then_one_rank_resumes(tmp_path, shm, job):
    ckpt = tmp_path / "ckpt"
    first = killed(run_world(ckpt, shm, job, 2, STEPS, "kill"))
    (agent,) = agents_of(shm, job)
    # A process that names another checkpoint path under the job's name is refused...
    with pytest.raises(safepoint.InvalidArgumentError, match="already persists to"):
        safepoint.Checkpointer(tmp_path / "elsewhere", job=job, shm_dir=shm)
    # ... and the job's agent, serving no rank, exits once its persists are done, well before
    # its idle time (60 s), so that `safepoint gc` can clean the job up.
    assert wait_until(lambda: not agents_of(shm), 30), agents_of(shm)
    # The snapshots stayed: a new agent adopts them and changes the world size.
    (again,) = finished(run_world(ckpt, shm, job, 1, 1, "close"))
    assert again["restored"] == STEPS and again["source"] == "storage", again
    assert again["restored_digest"] == first[0]["saved"][str(STEPS)]
    assert again["agent_world_size"] == 1
    assert committed_worlds(ckpt)[STEPS + 1] == 1
    assert wait_until(lambda: not agents_of(shm), 60), agents_of(shm)


def test_one_rank_killed_restart_as_two_ranks(tmp_path, shm, job):
    ckpt = tmp_path / "ckpt"
    (first,) = killed(run_world(ckpt, shm, job, 1, STEPS, "kill"))
    # Each rank first loads the step whole (what the HF and Lightning integrations do): rank 1,
    # which the saving world lacked, gets rank 0's image (the replicated model is whole), not
    # "nothing to load"; then each restores in place, the table's rows resharded.
    outs = finished(run_world(ckpt, shm, job, 2, 1, "close", "load"))
    for o in outs:
        assert o["loaded"] == [STEPS, first["model_digest"]], o
        assert o["restored"] == STEPS and o["source"] == "storage", o
        assert o["restored_digest"] == first["saved"][str(STEPS)]
        assert o["agent_world_size"] == 2
    assert outs[0]["saved"] == outs[1]["saved"]
    worlds = committed_worlds(ckpt)
    assert worlds[STEPS] == 1 and worlds[STEPS + 1] == 2, worlds
    assert wait_until(lambda: not agents_of(shm), 60), agents_of(shm)
