"""Faults of the object-store tiers, end to end (issue 11, part 4): a real training process (this
one), a real node agent and the real Ceph that `make test` starts (the `ceph` fixture; skipped
without it).

Every storage request is bounded in time: a gateway that stalls (SIGSTOP), is killed and
restarted, or a pool that is over its quota makes the tier's copies fail with a clear error in
status() (or retry and succeed), never hangs the agent or the training, never holds up `path` or
the tiers above, and never leaves a partial step listed; once the fault is gone a later step
reaches the tier and loads bit-exact.

The gateway faults use a radosgw of this module's own on the test cluster (as the S3 backend's
own fault tests do, src/storage/s3/s3_storage_test.cc) so that stopping or killing it disturbs
no other test; the training process and its agent reach it through AWS_ENDPOINT_URL. Waits only
guard against hangs (tests/common/processes.py): no assertion depends on how long anything
takes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

import safepoint
from safepoint import Checkpointer, Tier

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "common"))
from processes import HANG, agent_log, dead, wait_until  # noqa: E402
from test_tiers import same, state  # noqa: E402  (one definition of the tests' state)

# Each request to a faulty tier gives up after 2 s and one retry: the tests see the failure
# soon. The storage's own default is 60 s and 4 retries (docs/operations.md).
FAST_FAIL = "timeout=2&retries=1"


def tier_state(ck: Checkpointer, i: int = 0) -> dict:
    return ck.status()["tiers"][i]


def tier_idle(ck: Checkpointer, i: int = 0) -> bool:
    t = tier_state(ck, i)
    return t.get("pending_step") is None and t.get("in_flight_step") is None


def step_1_on_its_tier(path, job: str, shm, tier: str) -> Checkpointer:
    """A Checkpointer on path with one tier (both keep 10) once its step 1 is on the tier."""
    ck = Checkpointer(path, job=job, shm_dir=shm, keep=10, tiers=[Tier(tier, keep=10)])
    ck.save(1, state(1))
    ck.wait()
    assert wait_until(lambda: tier_state(ck)["newest_step"] == 1 and tier_idle(ck)), \
        tier_state(ck)
    return ck


def steps_or_none(uri: str):
    try:
        return safepoint.steps(uri)
    except safepoint.Error:
        return None


def loads_bit_exact(uri: str, step: int, n: int = 300_000) -> bool:
    got_step, got = safepoint.load(uri, step)
    return got_step == step and same(got, state(step, n))


def every_listed_step_is_whole(uri: str, *must: int, n: int = 300_000) -> list[int]:
    """Asserts that the steps in `must` are listed on `uri` and that every listed step loads
    bit-exact (a request that timed out may have landed late: then its step is whole, never
    partial). Returns the listed steps."""
    listed = safepoint.steps(uri)
    assert set(must) <= set(listed), (must, listed)
    for step in listed:
        assert loads_bit_exact(uri, step, n), step
    return listed


# --- a radosgw of this module's own ------------------------------------------------------------

class Gateway:
    """radosgw in the foreground, a child of this process, on the test cluster."""

    def __init__(self, ceph_dir: str):
        self.conf = os.path.join(ceph_dir, "ceph.conf")
        self.files = tempfile.mkdtemp(prefix="sp-rgw-", dir="/var/tmp")
        self.name = f"client.rgw.sptf{os.getpid()}"
        self.port = 0
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def accepts(self) -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", self.port)) == 0

    def start(self, port: int = 0) -> None:
        if not port:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        self.port = port
        log = os.path.join(self.files, "rgw.log")
        self.proc = subprocess.Popen(
            ["radosgw", "-f", "-c", self.conf, "-n", self.name,
             "--rgw-frontends", f"beast endpoint=127.0.0.1:{port}",
             "--admin-socket", os.path.join(self.files, "rgw.asok"), "--log-file", log,
             "--rgw-thread-pool-size", "16"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if not wait_until(lambda: self.accepts() or self.proc.poll() is not None, HANG, 0.05) \
                or self.proc.poll() is not None:
            self.kill()
            pytest.fail(f"the test's radosgw did not start on port {port} (log: {log})")

    def logged(self, text: str) -> bool:
        """`text` is in its log (its access log lines name each request)."""
        try:
            with open(os.path.join(self.files, "rgw.log"), errors="replace") as f:
                return text in f.read()
        except FileNotFoundError:
            return False

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def healthy(self) -> None:
        """Running and not stopped (after a test that stopped or killed it)."""
        if self.proc is None or self.proc.poll() is not None:
            self.start(self.port)
        else:
            self.signal(signal.SIGCONT)


@pytest.fixture(scope="module")
def _gateway(ceph):
    gw = Gateway(ceph["SAFEPOINT_TEST_CEPH_DIR"])
    gw.start()
    yield gw
    gw.kill()
    shutil.rmtree(gw.files, ignore_errors=True)


@pytest.fixture
def gw(_gateway, monkeypatch):
    """The module's gateway, running; this process and the agents it starts use it."""
    _gateway.healthy()
    monkeypatch.setenv("AWS_ENDPOINT_URL", _gateway.endpoint)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    yield _gateway
    _gateway.healthy()


def s3_uri(ceph: dict, name: str) -> str:
    return f"{ceph['SAFEPOINT_TEST_S3_URI'].rstrip('/')}/{name}-{uuid.uuid4().hex[:10]}"


# --- a stalled gateway -------------------------------------------------------------------------

def test_a_stalled_s3_tier_fails_in_status_and_catches_up_once_it_resumes(ceph, gw, dirs, cli):
    tmp, shm = dirs
    path = tmp / "nvme"
    tier = s3_uri(ceph, "stalled-tier")
    ck = step_1_on_its_tier(path, "tf-stall", shm, f"{tier}?{FAST_FAIL}")

    gw.signal(signal.SIGSTOP)
    for step in (2, 3):
        ck.save(step, state(step))
        ck.wait()  # `path` and the training never wait for the tier
    assert safepoint.steps(path) == [1, 2, 3]
    assert wait_until(lambda: tier_state(ck)["failures"] > 0), tier_state(ck)
    bad = tier_state(ck)
    assert tier in bad["last_error"], bad  # names the object on the tier
    assert any(c in bad["last_error"] for c in ("Unavailable", "DeadlineExceeded")), bad
    assert bad["newest_step"] == 1 and bad["copies"] == 1
    # `safepoint status` shows it too.
    doc = json.loads(cli("status", "--shm-dir", shm, "--json", check=0).stdout)
    job = next(j for j in (doc if isinstance(doc, list) else doc["jobs"])
               if j.get("job") == "tf-stall")
    assert job["tiers"][0]["failures"] > 0 and tier in job["tiers"][0]["last_error"], job
    assert tier in cli("status", "--shm-dir", shm, check=0).stdout
    # The agent answers while its tier hangs, and `path` keeps taking steps.
    ck.save(4, state(4))
    ck.wait()
    assert ck.status()["newest_committed"] == 4

    gw.signal(signal.SIGCONT)
    ck.save(5, state(5))
    ck.wait()
    assert wait_until(lambda: 5 in (steps_or_none(tier) or []) and tier_idle(ck)), \
        (tier_state(ck), agent_log(shm, "tf-stall")[-3000:])
    done = tier_state(ck)
    assert done["newest_step"] == 5 and done["last_error"] == ""
    ck.close()
    every_listed_step_is_whole(tier, 1, 5)


def test_a_stalled_gateway_under_path_fails_wait_and_training_goes_on(ceph, gw, dirs):
    tmp, shm = dirs
    base = s3_uri(ceph, "stalled-path")
    path = f"{base}?{FAST_FAIL}"
    ck = Checkpointer(path, job="tf-path", shm_dir=shm, keep=10)
    ck.save(1, state(1))
    ck.wait()

    gw.signal(signal.SIGSTOP)
    ck.save(2, state(2))
    with pytest.raises(safepoint.Error) as failed:
        ck.wait()
    assert base in str(failed.value), failed.value  # names the object that could not be written
    st = ck.status()  # the agent still answers
    assert st["persists_failed"] >= 1 and base in (st["last_persist_error"] or "")

    gw.signal(signal.SIGCONT)
    ck.save(3, state(3))
    ck.wait()
    ck.close()
    every_listed_step_is_whole(path, 1, 3)  # step 2 only if its COMMIT landed late


def _ranks(tmp, ckpt: str, shm: str, job: str, phase: str, tag: str) -> list:
    """The 2-rank gloo job of tests/python/test_agreement.py (workloads/agree_worker.py), with
    `ckpt` on the module's gateway."""
    from conftest import run_ranks

    worker = os.path.join(os.path.dirname(__file__), "workloads", "agree_worker.py")
    return run_ranks([[worker, tmp / f"store-{tag}", ckpt, shm, job, r, phase] for r in (0, 1)])


def test_a_job_restarted_while_its_gateway_stalls_resumes_from_memory(ceph, gw, dirs):
    # Steps 1-3 are committed on s3:// (each rank's agent saw it) and both ranks hold step 4 in
    # memory. The job restarts while the gateway stalls: rank 0, the lister, cannot list `path`,
    # the only storage. Every rank resumes from its node's memory (the newest snapshot, at least
    # as new as the newest step any agent saw committed), with a warning, instead of raising the
    # listing's error (issue 35, OPEN-1 for a job with a process group).
    tmp, shm = dirs
    ckpt = f"{s3_uri(ceph, 'stalled-restart')}?{FAST_FAIL}"
    _ranks(tmp, ckpt, shm, "tf-restart", "save-both", "a")
    gw.signal(signal.SIGSTOP)
    outs = _ranks(tmp, ckpt, shm, "tf-restart", "load", "b")
    assert [o.get("step") for o in outs] == [4, 4], outs
    assert all(o["ok"] for o in outs) and [o["source"] for o in outs] == ["memory"] * 2, outs
    assert all(any("cannot be listed" in w for w in o["warnings"]) for o in outs), outs
    gw.signal(signal.SIGCONT)
    # Nothing committed was lost (the agents persist step 4 too once the gateway answers; the
    # default keep=3 then prunes step 1). The resumed gateway's first answers may be slow.
    assert wait_until(lambda: {2, 3} <= set(steps_or_none(ckpt) or ())), steps_or_none(ckpt)


def test_ranks_whose_memory_differs_raise_the_stalled_listing_error(ceph, gw, dirs):
    # Rank 0 holds step 4 in memory, rank 1 step 3: without the listing no step is known that
    # every rank can load from memory and no older one is committed, so every rank raises the
    # listing's error (rank 0 its own, naming the store; rank 1 one of its class naming rank 0).
    tmp, shm = dirs
    base = s3_uri(ceph, "stalled-differ")
    ckpt = f"{base}?{FAST_FAIL}"
    _ranks(tmp, ckpt, shm, "tf-differ", "save", "a")
    gw.signal(signal.SIGSTOP)
    outs = _ranks(tmp, ckpt, shm, "tf-differ", "load", "b")
    assert [o.get("error") for o in outs] == ["UnavailableError"] * 2, outs
    assert base in outs[0]["message"] and "rank 0" in outs[1]["message"], outs


# --- a pool over its quota ---------------------------------------------------------------------

def ceph_cli(ceph: dict, *args: str, check: bool = True) -> str:
    proc = subprocess.run(["ceph", "-c", ceph["CEPH_CONF"], "--connect-timeout", "15", *args],
                          capture_output=True, text=True, timeout=60)
    if check:
        assert proc.returncode == 0, (args, proc.stdout, proc.stderr)
    return proc.stdout


def pool_flags(ceph: dict, pool: str) -> str:
    line = [ln for ln in ceph_cli(ceph, "osd", "pool", "ls", "detail").splitlines()
            if f"'{pool}'" in ln]
    return line[0] if line else ""


@pytest.fixture
def quota_pool(ceph):
    """A pool of the test's own (size 1), so that filling it disturbs no other test."""
    pool = f"sp-tfq-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    ceph_cli(ceph, "osd", "pool", "create", pool, "8", "8")
    try:
        ceph_cli(ceph, "osd", "pool", "set", pool, "size", "1", "--yes-i-really-mean-it")
        yield pool
    finally:
        ceph_cli(ceph, "osd", "pool", "delete", pool, pool, "--yes-i-really-really-mean-it",
                 check=False)


def test_a_rados_tier_over_its_quota_reports_it_and_resumes_when_it_is_lifted(
        ceph, quota_pool, dirs):
    tmp, shm = dirs
    path = tmp / "nvme"
    tier = f"rados://{quota_pool}/run"
    ck = step_1_on_its_tier(path, "tf-quota", shm, f"{tier}?timeout=20&retries=1")

    # A quota below what the pool holds already: the monitor flags it full at its next
    # statistics, and every write to it is refused.
    ceph_cli(ceph, "osd", "pool", "set-quota", quota_pool, "max_bytes", str(1 << 20))
    assert wait_until(lambda: "full_quota" in pool_flags(ceph, quota_pool), HANG, 0.5), \
        pool_flags(ceph, quota_pool)
    ck.save(2, state(2))
    ck.wait()  # the tier above (`path`) is not held up
    assert wait_until(lambda: tier_state(ck)["failures"] > 0), tier_state(ck)
    bad = tier_state(ck)
    assert "ResourceExhausted" in bad["last_error"] and quota_pool in bad["last_error"], bad
    assert bad["newest_step"] == 1
    assert safepoint.steps(path) == [1, 2]
    assert safepoint.steps(tier) == [1]  # nothing of step 2 is listed

    ceph_cli(ceph, "osd", "pool", "set-quota", quota_pool, "max_bytes", "0")
    assert wait_until(lambda: "full_quota" not in pool_flags(ceph, quota_pool), HANG, 0.5)
    ck.save(3, state(3))
    ck.wait()
    assert wait_until(lambda: tier_state(ck)["newest_step"] == 3 and tier_idle(ck)), \
        (tier_state(ck), agent_log(shm, "tf-quota")[-3000:])
    assert tier_state(ck)["last_error"] == ""
    ck.close()
    every_listed_step_is_whole(tier, 1, 3)


# --- SIGTERM to an agent whose tier hangs ------------------------------------------------------

def test_an_agent_with_a_stalled_tier_exits_on_sigterm_and_the_next_one_resumes(ceph, gw, dirs):
    tmp, shm = dirs
    path = tmp / "nvme"
    tier = s3_uri(ceph, "sigterm")
    tiers = [Tier(f"{tier}?timeout=8&retries=0", keep=10)]
    ck = Checkpointer(path, job="tf-term", shm_dir=shm, keep=10, tiers=tiers)
    ck.save(1, state(1))
    ck.wait()
    assert wait_until(lambda: tier_state(ck)["newest_step"] == 1 and tier_idle(ck))

    gw.signal(signal.SIGSTOP)
    ck.save(2, state(2))
    ck.wait()
    assert wait_until(lambda: tier_state(ck)["in_flight_step"] == 2), tier_state(ck)
    agent = ck.status()["agent"]["pid"]
    os.kill(agent, signal.SIGTERM)
    # It drains for its grace (30 s), then cancels the copy: its attempts (8 s each, on their
    # own about 40 s) are still going then. A guard against a hang, not a time limit.
    assert wait_until(lambda: dead(agent)), agent_log(shm, "tf-term")[-3000:]
    ck.abandon()
    assert safepoint.steps(path) == [1, 2]
    for step in (1, 2):
        assert loads_bit_exact(str(path), step), step

    gw.signal(signal.SIGCONT)
    # The next agent of the job copies what the tier lacks.
    ck = Checkpointer(path, job="tf-term", shm_dir=shm, keep=10, tiers=tiers)
    assert ck.status()["agent"]["pid"] != agent
    assert wait_until(lambda: 2 in (steps_or_none(tier) or []) and tier_idle(ck)), \
        (tier_state(ck), agent_log(shm, "tf-term")[-3000:])
    ck.close()
    every_listed_step_is_whole(tier, 2)


# --- the gateway killed and restarted mid-copy -------------------------------------------------

def test_a_gateway_killed_mid_copy_never_shows_a_partial_step(ceph, gw, dirs, monkeypatch):
    tmp, shm = dirs
    path = tmp / "nvme"
    tier = s3_uri(ceph, "killed")
    n = 32 << 20  # 128 MiB of float32: the copy is many parts
    # The tier retries a failed copy after 0.5, 1, 2, 4 s: longer than a radosgw restart.
    monkeypatch.setenv("SAFEPOINT_TIER_RETRY_SECONDS", "0.5")
    ck = Checkpointer(path, job="tf-kill", shm_dir=shm, keep=10,
                      tiers=[Tier(f"{tier}?timeout=10&retries=4", keep=10)])
    seen: set[int] = set()
    key = tier.split("/", 3)[3]  # the tier's prefix in the bucket

    def uploading() -> bool:
        seen.update(steps_or_none(tier) or [])
        # The gateway logged a part of the step's image: the upload is under way.
        return gw.logged(f"/{key}/step-00000000000000000001/") and gw.logged("partNumber=")

    ck.save(1, state(1, n))
    ck.wait()
    assert wait_until(uploading, HANG, 0.01), tier_state(ck)
    # Freeze it with the copy's requests in flight, then kill it and start a new one on the
    # same port: those requests see their connections reset or refused.
    gw.signal(signal.SIGSTOP)
    time.sleep(0.3)  # let more requests queue up on the frozen gateway (not a threshold)
    port = gw.port
    gw.kill()
    seen.update(steps_or_none(tier) or [])
    gw.start(port)

    def settled() -> bool:
        seen.update(steps_or_none(tier) or [])
        return tier_idle(ck)

    assert wait_until(settled, HANG, 0.05), tier_state(ck)
    if 1 not in safepoint.steps(tier):
        # Every retry of step 1 failed: the next step goes down.
        ck.save(2, state(2, n))
        ck.wait()
        assert wait_until(lambda: settled() and 2 in safepoint.steps(tier), HANG, 0.05), \
            (tier_state(ck), agent_log(shm, "tf-kill")[-3000:])
    ck.close()
    listed = every_listed_step_is_whole(tier, n=n)
    assert listed and seen <= set(listed)
