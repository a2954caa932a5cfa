"""Storage tiers (issue 11, part 1): Checkpointer(path, tiers=[...]).

The node agent fills each tier below `path` by copying committed, verified steps from the tier
above, on the tier's own schedule, keeping its newest `keep`; restore reads the fastest tier that
holds the agreed step. Real agents and real training processes; the object-store tier runs
against the real Ceph that `make test` starts (SAFEPOINT_TEST_S3_URI), else that case skips."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import uuid
import warnings

import pytest
import torch

import safepoint
from safepoint import Checkpointer, Tier

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "common"))
from processes import HANG, agent_log, dead, kill_agents, wait_until  # noqa: E402


def state(step: int, n: int = 300_000) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(n, generator=g), "b": torch.arange(step, step + 17), "step": step}


def same(a: dict, b: dict) -> bool:
    return (torch.equal(a["w"], b["w"]) and torch.equal(a["b"], b["b"])
            and a["step"] == b["step"])


def tiers_idle(ck: Checkpointer, count: int | None = None) -> bool:
    """No step waits for or is in flight to the first `count` tiers (all by default). A tier
    that is still copying when newer steps commit takes only the newest (it coalesces), so a
    test that wants every step on a tier waits for this between saves."""
    tiers = ck.status()["tiers"][:count]
    return all(t.get("pending_step") is None and t.get("in_flight_step") is None for t in tiers)


def test_tiers_receive_steps_on_their_schedules_and_keep_their_newest(dirs):
    tmp, shm = dirs
    p0, p1, p2 = tmp / "nvme", tmp / "shared", tmp / "archive"
    ck = Checkpointer(p0, job="tiers-a", shm_dir=shm, keep=3,
                      tiers=[Tier(str(p1), every=2, keep=2), Tier(str(p2), every=4, keep=1)])
    for step in range(1, 9):
        ck.save(step, state(step))
        ck.wait()
        assert wait_until(lambda: tiers_idle(ck)), ck.status()["tiers"]
    # Tier 1 takes its first step, then the multiples of 2, keeping 2; tier 2 takes from tier 1
    # its first step, then 4 and 8, keeping 1.
    assert safepoint.steps(p0) == [6, 7, 8]
    assert safepoint.steps(p1) == [6, 8]
    assert safepoint.steps(p2) == [8]
    t1, t2 = ck.status()["tiers"]
    assert (t1["tier"], t1["uri"], t1["every"], t1["keep"]) == (1, str(p1), 2, 2)
    assert (t1["copies"], t2["copies"]) == (5, 3)
    assert t1["failures"] == 0 and t1["last_error"] == ""
    assert t2["newest_step"] == 8 and t2["last_copy_time"] is not None
    ck.close()
    # Every copy is bit-exact (the agent verified each chunk on the way, and so does load).
    for path, steps in ((p1, [6, 8]), (p2, [8])):
        for s in steps:
            got_step, got = safepoint.load(path, s)
            assert got_step == s and same(got, state(s))


def test_restore_reads_the_fastest_tier_that_holds_the_step(dirs):
    tmp, shm = dirs
    p0, p1 = tmp / "nvme", tmp / "shared"
    tiers = [Tier(str(p1), keep=5)]
    ck = Checkpointer(p0, job="tiers-b", shm_dir=shm, tiers=tiers)
    for step in (1, 2):
        ck.save(step, state(step))
        ck.wait()
        assert wait_until(lambda: tiers_idle(ck)), ck.status()["tiers"]
    assert safepoint.steps(p1) == [1, 2]
    ck.close()
    # Memory is gone (closed); `path` holds step 2: it is read from there, not the tier.
    ck = Checkpointer(p0, job="tiers-b", shm_dir=shm, tiers=tiers)
    target = state(0)
    assert ck.restore(target) == 2 and same(target, state(2))
    assert ck.last_restore.source == "storage" and ck.last_restore.uri == str(p0)
    ck.close()
    # The copy on `path` is damaged: restore says so and reads the next tier's.
    image = next((p0 / "step-00000000000000000002").glob("rank-*.img"))
    data = bytearray(image.read_bytes())
    data[len(data) // 2] ^= 0x10
    image.write_bytes(bytes(data))
    ck = Checkpointer(p0, job="tiers-b", shm_dir=shm, tiers=tiers)
    target = state(0)
    with pytest.warns(RuntimeWarning, match="cannot be read from"):
        assert ck.restore(target) == 2
    assert same(target, state(2)) and ck.last_restore.uri == str(p1)
    ck.close()
    # `path` lost everything: the tier alone serves load() too.
    shutil.rmtree(p0)
    ck = Checkpointer(p0, job="tiers-b", shm_dir=shm, tiers=tiers)
    got_step, got = ck.load()
    assert got_step == 2 and same(got, state(2)) and ck.last_restore.uri == str(p1)
    ck.close()


def test_a_failing_tier_is_reported_and_never_blocks_the_tiers_above(dirs, tmp_path):
    tmp, shm = dirs
    p0, p1 = tmp / "nvme", tmp / "shared"
    blocked = tmp / "not-a-directory"
    blocked.write_text("a file where the tier's directory should be")
    ck = Checkpointer(p0, job="tiers-c", shm_dir=shm,
                      tiers=[Tier(str(p1)), Tier(str(blocked / "run"))])
    for step in (1, 2, 3):
        ck.save(step, state(step))
        ck.wait()  # never held up by the failing tier
        # Tier 1 is not held up either: it takes every step while tier 2 keeps failing.
        assert wait_until(lambda: tiers_idle(ck, count=1)), ck.status()["tiers"]
    assert safepoint.steps(p0) == [1, 2, 3]
    assert safepoint.steps(p1) == [1, 2, 3]
    assert wait_until(lambda: ck.status()["tiers"][1]["failures"] > 0)
    bad = ck.status()["tiers"][1]
    assert str(blocked) in bad["last_error"] and bad["newest_step"] is None
    assert ck.status()["tiers"][0]["failures"] == 0
    agent = ck.status()["agent"]["pid"]
    ck.close()
    # The failing tier does not keep the agent alive forever once its retries are spent.
    assert wait_until(lambda: dead(agent)), agent_log(shm, "tiers-c")[-3000:]


def test_safepoint_status_shows_the_tiers(dirs, cli):
    tmp, shm = dirs
    p0, p1 = tmp / "nvme", tmp / "shared"
    ck = Checkpointer(p0, job="tiers-d", shm_dir=shm, tiers=[Tier(str(p1), every=5, keep=4)])
    ck.save(5, state(5))
    ck.wait()
    assert wait_until(lambda: safepoint.steps(p1) == [5])
    out = cli("status", "--shm-dir", shm, "--json", check=0)
    doc = json.loads(out.stdout)
    job = next(j for j in (doc if isinstance(doc, list) else doc["jobs"])
               if j.get("job") == "tiers-d")
    tier = job["tiers"][0]
    assert tier["uri"] == str(p1) and tier["newest_step"] == 5 and tier["every"] == 5
    text = cli("status", "--shm-dir", shm, check=0).stdout
    assert str(p1) in text
    ck.close()


@pytest.mark.parametrize("bad, match", [
    ([Tier("")], "non-empty URI"),
    ([Tier("/x", keep=0)], "keep"),
    ([Tier("/x", every=0)], "every"),
    ([Tier("/x", every_seconds=-1.0)], "every_seconds"),
    (["/x", "/x"], "repeats"),
    ("/x", "list"),
])
def test_bad_tiers_are_refused_naming_the_tier(dirs, bad, match):
    tmp, shm = dirs
    with pytest.raises(safepoint.InvalidArgumentError, match=match):
        Checkpointer(tmp / "p", job="tiers-e", shm_dir=shm, tiers=bad)


def test_the_path_itself_cannot_be_a_tier(dirs):
    tmp, shm = dirs
    with pytest.raises(safepoint.InvalidArgumentError, match="repeats"):
        Checkpointer(tmp / "p", job="tiers-f", shm_dir=shm, tiers=[str(tmp / "p")])


# --- a training run killed on a node whose memory and local disk are lost ----------------------

WORKER = textwrap.dedent("""
    import sys, torch, safepoint
    from safepoint import Checkpointer, Tier
    path, lowest, shm, job = sys.argv[1:5]
    sys.path.insert(0, sys.argv[5])
    from test_tiers import state
    ck = Checkpointer(path, job=job, shm_dir=shm,
                      tiers=[Tier(path + "-shared", every=2, keep=2), Tier(lowest, every=4, keep=2)])
    step = 0
    while True:
        step += 1
        ck.save(step, state(step))
        ck.wait()
        print("SAVED", step, flush=True)
""")


def lowest_tier_uris():
    s3 = os.environ.get("SAFEPOINT_TEST_S3_URI")
    return [pytest.param("file", id="file"),
            pytest.param(s3, id="s3", marks=pytest.mark.skipif(
                not s3, reason="no object store (make test starts Ceph's radosgw)"))]


@pytest.mark.parametrize("lowest", lowest_tier_uris())
def test_a_run_killed_with_its_node_resumes_bit_exact_from_the_lowest_tier(dirs, lowest):
    tmp, shm = dirs
    path = str(tmp / "nvme")
    lowest = str(tmp / "archive") if lowest == "file" else f"{lowest}/tiers-{uuid.uuid4().hex}"
    job = "tiers-crash"
    proc = subprocess.Popen([sys.executable, "-c", WORKER, path, lowest, shm, job,
                             os.path.dirname(__file__)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONWARNINGS="ignore"))
    try:
        def reached() -> bool:
            try:
                return any(s >= 8 for s in safepoint.steps(lowest))
            except safepoint.Error:
                return False
        assert wait_until(reached, HANG, 0.05), proc.stderr.read() if proc.poll() else ""
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    # The node is lost: its agent, its shared memory and its local directories are gone.
    kill_agents(shm)
    shutil.rmtree(shm)
    os.mkdir(shm)
    shutil.rmtree(path, ignore_errors=True)
    shutil.rmtree(path + "-shared", ignore_errors=True)
    committed = safepoint.steps(lowest)
    ck = Checkpointer(path, job=job, shm_dir=shm,
                      tiers=[Tier(path + "-shared", every=2, keep=2), Tier(lowest, every=4, keep=2)])
    target = state(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = ck.restore(target)
    # (Not necessarily a multiple of 4: a slow tier skips the steps offered while it copies, and
    # takes the next one that is 4 steps after its last.)
    assert got == committed[-1]
    assert same(target, state(got))
    assert ck.last_restore.source == "storage" and ck.last_restore.uri == lowest
    ck.close()


def test_a_second_process_asking_for_other_tiers_under_the_same_job_is_refused(dirs):
    tmp, shm = dirs
    p0 = tmp / "nvme"
    ck = Checkpointer(p0, job="tiers-g", shm_dir=shm, rank=0, world_size=2,
                      tiers=[Tier(str(tmp / "a"))])
    # The job's other rank (same path and world size) with other tiers: the agent keeps the
    # job's configuration and the error names both.
    with pytest.raises(safepoint.Error, match="already fills the storage tiers") as e:
        Checkpointer(p0, job="tiers-g", shm_dir=shm, rank=1, world_size=2,
                     tiers=[Tier(str(tmp / "b"))])
    assert str(tmp / "a") in str(e.value) and str(tmp / "b") in str(e.value)
    # With the job's own tiers the rank is accepted.
    ck1 = Checkpointer(p0, job="tiers-g", shm_dir=shm, rank=1, world_size=2,
                       tiers=[Tier(str(tmp / "a"))])
    assert ck1.status()["tiers"][0]["uri"] == str(tmp / "a")
    ck1.close()
    ck.close()
