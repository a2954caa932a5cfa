"""The crash campaign's model of what is committed (tests/crash/crashtest.py, ExpectedState), on
the case it once flagged wrongly (crash campaign seed 3695189617, round 334, docs/reliability.md):
a step that no check had seen committed, committed by an agent that adopted a killed agent's
leftover snapshot as the next round started, and then loaded from storage."""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import pytest

import safepoint

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "crash"))
import crashtest as ct  # noqa: E402
from processes import wait_until  # noqa: E402
from test_flash import SEED, env, first_difference, make_state  # noqa: E402,F401 (env: fixture)

NUMEL = 1000


def rank(r: int, loaded=None, uri: str = "-", began=(), saved=()) -> SimpleNamespace:
    """What crashtest.Rank records of a training process, as the model reads it."""
    return SimpleNamespace(rank=r, loaded=loaded, loaded_uri=uri, fresh=False, began=list(began),
                           saved=list(saved), committed=[], newest=[], closed=None)


def model(listed: list[int]) -> ct.ExpectedState:
    """Two ranks, keep 3, that both began and returned from saves of steps 2 and 3, with
    `listed` committed at the last check."""
    exp = ct.ExpectedState(world=2, keep=3)
    exp.record_round([rank(r, began=(2, 3), saved=(2, 3)) for r in (0, 1)], None)
    exp.check_listed(listed)
    return exp


def test_a_step_committed_by_an_adopting_agent_loads_from_storage(env, cli):  # noqa: F811
    """Rank 0's image of step 3 is persisted (its every-step schedule), rank 1's is not (step 3
    is not due on its schedule) and step 3 is not committed; rank 0 closes cleanly (its
    snapshots go) and the agent is killed with rank 1. The next agent adopts rank 1's leftover
    snapshot, persists it and commits step 3 (src/agent/adoption.cc), so the next rank 0 loads
    step 3 from storage although the last check saw only step 2 committed. The campaign's model
    takes that (storage holds step 3 committed now); before, it flagged "step 3 is not committed
    but was loaded from storage"."""
    c0 = env.checkpointer(rank=0, world_size=2, persist_every=1)
    c1 = env.checkpointer(rank=1, world_size=2, persist_every=2)
    for step in (2, 3):
        for ck in (c0, c1):
            assert ck.save(step, make_state(SEED, step, NUMEL))

    def idle() -> bool:
        jobs = json.loads(cli("status", "--shm-dir", env.shm, "--json", check=0).stdout)
        j = next((j for j in jobs if j["job"] == env.job), None)
        return j is not None and "queued" in j and j["queued"] == 0 and \
            j["in_flight"] is None and all(r["pending_persists"] == 0 for r in j["ranks"])
    assert wait_until(lambda: idle() and 2 in safepoint.steps(env.path)), env.agent_log()[-3000:]
    listed_at_check = safepoint.steps(env.path)
    assert listed_at_check == [2], listed_at_check
    c0.close()
    env.kill_agent(env.wait_agent())
    c1.abandon()

    d0 = env.checkpointer(rank=0, world_size=2)  # starts an agent, which adopts rank 1's snapshot
    assert wait_until(lambda: idle() and 3 in safepoint.steps(env.path)), env.agent_log()[-3000:]
    step, state = d0.load()
    assert (step, d0.last_load_source) == (3, "storage")
    assert first_difference(state, make_state(SEED, 3, NUMEL)) is None
    uri = d0.last_restore.uri

    exp = model(listed_at_check)
    exp.listing = lambda u: (safepoint.steps(u), 3)
    exp.check_resume([rank(0, loaded=(3, "storage", "EXACT"), uri=uri)])
    assert exp.committed_late == {3}


@pytest.mark.parametrize("now", [[2], [], [4], [2, 4, 5]])
def test_a_step_that_storage_does_not_hold_committed_is_a_violation(now):
    """Loaded from storage, newer than anything committed at the last check, and not listed
    now (nor pruned by retention, which leaves `keep` newer steps)."""
    exp = model([2])
    exp.listing = lambda u: (now, 3)
    with pytest.raises(ct.Violation, match="step 3 is not committed"):
        exp.check_resume([rank(r, loaded=(3, "storage", "EXACT"), uri="/p") for r in (0, 1)])


@pytest.mark.parametrize("now", [[2, 3], [3], [4, 5, 6]])
def test_a_step_committed_since_the_last_check_may_load_from_storage(now):
    """Listed now, or pruned since with `keep` newer steps listed."""
    exp = model([2])
    exp.listing = lambda u: (now, 3)
    exp.check_resume([rank(r, loaded=(3, "storage", "EXACT"), uri="/p") for r in (0, 1)])


def test_a_step_loaded_from_storage_with_nothing_committed_at_the_last_check():
    """Also when no step was committed at the last check (the model did not look then)."""
    exp = model([])
    exp.listing = lambda u: ([], 3)
    with pytest.raises(ct.Violation, match="step 3 is not committed"):
        exp.check_resume([rank(r, loaded=(3, "storage", "EXACT"), uri="/p") for r in (0, 1)])


def test_a_load_from_a_path_that_the_node_loss_then_took_is_checked_against_its_last_listing(
        tmp_path):
    """A node round that loses the path removes it before the round is checked, so the loads
    are checked against what the path listed when it was lost (crash campaign seed 3977695246,
    round 892, flagged "step 1121 is not committed (listed: [])"), and still against storage."""
    path = str(tmp_path / "gone")
    exp = ct.ExpectedState(world=2, keep=3)
    job = SimpleNamespace(path=path, stores=[path, "file:///tier1"], expected=exp)
    exp.keeps = [3, 2]
    listing = ct.Campaign.listing
    assert listing(None, job, "-", [1120, 1121]) == ([1120, 1121], 3)
    assert listing(None, job, "file://" + path, [1121]) == ([1121], 3)
    assert listing(None, job, path, None) == ([], 3)  # without it: the path's listing now
    with pytest.raises(ct.Violation):
        listing(None, job, "/elsewhere", [1121])
