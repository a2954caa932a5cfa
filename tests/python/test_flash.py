"""Flash checkpoints with real processes and real kills (issue 3, "Done when").

Training processes are tests/python/workloads/flash_worker.py, run as subprocesses and killed with
SIGKILL; the node agent (safepointd) is killed through the pid in its agent.lock. Every state is a
pure function of (seed, step) (flash_worker.make_state), so every load is checked bit for bit.
Every test uses its own job name and a private shm_dir, and kills its agents when it ends.

No test depends on how long something takes: the waits below only guard against hangs, and the
random kill moments (seeded by $SAFEPOINT_TEST_SEED) change where a kill lands, never whether
the assertions must hold.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Optional

import pytest

import safepoint
from safepoint import _core

WORKLOADS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workloads")
WORKER = os.path.join(WORKLOADS, "flash_worker.py")
sys.path.insert(0, WORKLOADS)
from flash_worker import first_difference, make_state  # noqa: E402
from processes import (LineReader, agent_log, agents_of, is_agent_of,  # noqa: E402
                       kill_agents, kill_and_wait, lock_agent_pid, sigkill, small_tmpfs,
                       start_script, wait_until)
from processes import job_dir as job_directory  # noqa: E402

SEED = int(os.environ.get("SAFEPOINT_TEST_SEED", "1234"))
HANG = 180.0  # seconds: only a guard against a hung process, never a performance limit

WRITING = "WRITING"  # a slot state (docs/format.md, "Snapshot slot files")


# --- helpers -------------------------------------------------------------------------------------

def slot_states(job_dir: Path) -> list[str]:
    """The state of each of the job's slot files ("FREE", "WRITING", "COMPLETE"), read from their
    control blocks by the core."""
    return _core.slot_states(str(job_dir))


def storage_temporaries(path: Path) -> set:
    """Images being written (or left by a killed writer): temporaries in step directories."""
    while True:
        try:
            return {str(p) for p in path.glob("step-*/*.tmp.*")}
        except FileNotFoundError:
            continue  # a step directory was pruned while it was listed: list again


def persist_in_progress(path: Path) -> bool:
    """The agent is writing an image (no agent was killed: no temporaries are left over)."""
    return bool(storage_temporaries(path))


def verify_committed(path: Path, seed: int, numel: int) -> list[int]:
    """Every committed step loads and is bit-exact; returns the steps verified."""
    done = []
    for s in safepoint.steps(path):
        try:
            step, state = safepoint.load(path, s)
        except safepoint.NotFoundError:
            # Retention may prune a step between listing and loading it; then it must be gone.
            assert s not in safepoint.steps(path), f"committed step {s} cannot be loaded"
            continue
        assert step == s
        diff = first_difference(state, make_state(seed, s, numel))
        assert diff is None, f"committed step {s} differs from what was saved: {diff}"
        done.append(s)
    return done


class Worker:
    """A flash_worker.py process; its stdout lines are read by a thread."""

    def __init__(self, env: "FlashEnv", args: list, job: str, path: Path):
        self.n = len(env.workers)
        self.err = env.tmp / f"worker-{job}-{self.n}.err"
        with open(self.err, "wb") as err:
            self.proc = start_script(WORKER, "--path", path, "--job", job, "--shm-dir", env.shm,
                                     *args, stdin=subprocess.PIPE, stderr=err, bufsize=1,
                                     env=os.environ)
        self.saved: list[int] = []
        self.began: list[int] = []
        self.out = LineReader(self.proc.stdout, f"worker {self.proc.pid}", self.stderr,
                              self._observe)
        self.next, self.expect = self.out.next, self.out.expect

    def stderr(self) -> str:
        try:
            return self.err.read_text(errors="replace")[-4000:]
        except FileNotFoundError:
            return ""

    def _observe(self, fields: list[str]) -> None:
        if fields and fields[0] == "SAVED":
            self.saved.append(int(fields[1]))
        elif fields and fields[0] == "BEGIN":
            self.began.append(int(fields[1]))
        assert not fields or fields[0] != "DIFF", f"worker: {' '.join(fields)}"

    def send(self, cmd: str) -> None:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        """SIGKILL, reap, and collect what it printed before it died."""
        sigkill(self.proc)
        self.out.drain()

    def finish(self) -> int:
        """Waits for the process to exit on its own; returns its exit status."""
        self.out.drain()
        return self.proc.wait(timeout=HANG)

    @property
    def last_saved(self) -> Optional[int]:
        return max(self.saved) if self.saved else None

    @property
    def last_began(self) -> Optional[int]:
        return max(self.began) if self.began else None


class FlashEnv:
    def __init__(self, tmp: Path, shm: Path, job: str):
        self.tmp, self.shm, self.job = tmp, shm, job
        self.path = tmp / "ckpt"
        self.workers: list[Worker] = []
        self.checkpointers: list[safepoint.Checkpointer] = []
        self.stopped: list[int] = []

    def job_dir(self, job: Optional[str] = None) -> Path:
        return job_directory(self.shm, job or self.job)

    def worker(self, *args, job: Optional[str] = None, path: Optional[Path] = None) -> Worker:
        w = Worker(self, list(args), job or self.job, path or self.path)
        self.workers.append(w)
        return w

    def checkpointer(self, job: Optional[str] = None, path: Optional[Path] = None,
                     **kw) -> safepoint.Checkpointer:
        ck = safepoint.Checkpointer(path or self.path, job=job or self.job, shm_dir=str(self.shm),
                                    **kw)
        self.checkpointers.append(ck)
        return ck

    def agent_pid(self, job: Optional[str] = None) -> Optional[int]:
        """The pid in the job's agent.lock when that process is the job's live agent."""
        return lock_agent_pid(self.shm, job or self.job)

    def wait_agent(self, job: Optional[str] = None, not_in=()) -> int:
        pid = None

        def found() -> bool:
            nonlocal pid
            pid = self.agent_pid(job)
            return pid is not None and pid not in not_in

        assert wait_until(found), f"no new agent serves job {job or self.job}"
        return pid

    def agent_log(self, job: Optional[str] = None) -> str:
        return agent_log(self.shm, job or self.job)

    def _connections(self, job: Optional[str] = None) -> list[tuple[int, int]]:
        """(agent pid, client pid) of every "rank 0 connected" line of the job's agent log."""
        return [(int(a), int(c)) for a, c in re.findall(
            r"safepointd\[(\d+)\]: rank 0 connected \(pid (\d+)\)", self.agent_log(job))]

    def wait_connected_agent(self, not_in=()) -> int:
        """A live agent, not one of `not_in`, that a training process is connected to."""
        pid = None

        def found() -> bool:
            nonlocal pid
            live = [a for a, _ in self._connections()
                    if a not in not_in and is_agent_of(a, self.shm, self.job)]
            pid = live[-1] if live else None
            return pid is not None

        assert wait_until(found), f"no new agent serves job {self.job}:\n{self.agent_log()[-3000:]}"
        return pid

    def agent_of_worker(self, worker_pid: int) -> int:
        """The live agent the worker is connected to."""
        live = [a for a, c in self._connections()
                if c == worker_pid and is_agent_of(a, self.shm, self.job)]
        assert live, f"worker {worker_pid} is not connected:\n{self.agent_log()[-3000:]}"
        return live[-1]

    def kill_agent(self, pid: int) -> None:
        """SIGKILL an agent and wait until it is dead."""
        assert is_agent_of(pid, self.shm), f"pid {pid} is not an agent of this test"
        kill_and_wait(pid)

    def cleanup(self) -> None:
        for w in self.workers:
            sigkill(w.proc)
        for ck in self.checkpointers:  # drop without a clean close (agents are killed next)
            client, ck._client = ck._client, None
            if client is not None:
                client.abandon()
        kill_agents(self.shm, deadline=30)


_counter = iter(range(1 << 30))


@pytest.fixture
def env(tmp_path):
    shm = tmp_path / "shm"
    own = None
    # The agent's socket is <shm>/safepoint-<uid>-<job>/agent.sock: at most 107 bytes.
    if len(str(shm)) > 60:
        own = tempfile.mkdtemp(prefix="spf-")
        shm = Path(own) / "shm"
    shm.mkdir()
    e = FlashEnv(tmp_path, shm, f"f{os.getpid() % 10000}-{next(_counter)}")
    try:
        yield e
    finally:
        e.cleanup()
        if own:
            shutil.rmtree(own, ignore_errors=True)


def check_resumed(fields: list[str], killed: Worker) -> int:
    """A restarted worker's LOADED line: the newest step whose save() returned in the killed
    worker (or the step it was saving, if that save completed before the kill reached it), from
    memory, bit-exact."""
    assert fields[0] == "LOADED", fields
    step, source, verdict = int(fields[1]), fields[2], fields[3]
    assert verdict == "EXACT", fields
    assert source == "memory", fields
    r = killed.last_saved
    assert r is not None
    assert step == r or (step == r + 1 and killed.last_began == r + 1), \
        (f"resumed at step {step}; the killed process's last save() that returned was of step "
         f"{r} (last begun: {killed.last_began})")
    return step


# --- training process killed ---------------------------------------------------------------------

def test_killed_between_saves_resumes_from_memory_then_from_storage(env):
    numel = 1 << 18  # 1 MiB
    common = ("--seed", SEED, "--numel", numel, "--persist-every", 1000)
    w = env.worker(*common, "--steps", 5)
    w.expect("IDLE")
    w.kill()
    assert w.saved == [1, 2, 3, 4, 5]

    # The agent notices the death and persists the newest snapshot (emergency flush).
    assert wait_until(lambda: 5 in safepoint.steps(env.path)), \
        f"step 5 was never flushed; committed: {safepoint.steps(env.path)}"
    assert safepoint.steps(env.path)[-1] == 5
    verify_committed(env.path, SEED, numel)

    # A restarted process resumes from memory, at step 5, bit-exact.
    w2 = env.worker(*common, "--resume", "--steps", 0)
    assert w2.expect("LOADED", "FRESH") == ["LOADED", "5", "memory", "EXACT"]
    w2.expect("IDLE")
    w2.send("exit")  # dies again, without closing
    assert w2.finish() == 0

    # Wipe the agent's memory: kill the agent (unless it already exited, idle), remove the job
    # directory.
    pid = env.agent_pid()
    if pid is not None:
        env.kill_agent(pid)
    shutil.rmtree(env.job_dir())

    # Now the same step comes from storage, bit-exact, and training goes on.
    w3 = env.worker(*common, "--resume", "--steps", 2)
    assert w3.expect("LOADED", "FRESH") == ["LOADED", "5", "storage", "EXACT"]
    w3.expect("IDLE")
    assert w3.saved == [6, 7]
    w3.send("close")
    w3.expect("CLOSED")
    assert w3.finish() == 0
    assert safepoint.steps(env.path)[-1] == 7  # close persisted the newest snapshot
    assert verify_committed(env.path, SEED, numel)[-1] == 7


def start_resumed(env, common, killed: Optional["Worker"]) -> "Worker":
    """Starts a worker with --resume: the first one starts fresh, each later one must resume
    where the killed one's last returned save left off."""
    w = env.worker(*common, "--resume")
    first = w.expect("LOADED", "FRESH")
    if killed is None:
        assert first == ["FRESH"]
    else:
        check_resumed(first, killed)
    return w


def test_killed_during_copy_resumes_from_memory(env):
    """A 256 MiB state saved in a loop; each process is killed while a slot is being written."""
    rng = random.Random(SEED)
    numel = 64 << 20  # 256 MiB of int32
    common = ("--seed", SEED, "--numel", numel, "--persist-every", 1000)
    jd = env.job_dir()
    killed: Optional[Worker] = None
    torn = 0
    for attempt in range(3):
        w = start_resumed(env, common, killed)
        for _ in range(rng.randint(1, 2)):
            w.expect("SAVED")
        w.expect("BEGIN")
        # Catch it in the middle of the copy: a slot is WRITING.
        if wait_until(lambda: WRITING in slot_states(jd), deadline=60, interval=0.0005):
            time.sleep(rng.uniform(0.0, 0.02))
        w.kill()
        torn += WRITING in slot_states(jd)
        killed = w
    if torn == 0:
        warnings.warn("no kill landed in the middle of a copy (the state stayed intact anyway)")

    # The restarted process resumes from memory, saves once more and closes cleanly.
    w = env.worker(*common, "--resume", "--steps", 1)
    resumed = check_resumed(w.expect("LOADED", "FRESH"), killed)
    w.expect("IDLE")
    assert w.saved == [resumed + 1]
    w.send("close")
    w.expect("CLOSED")
    assert w.finish() == 0
    assert safepoint.steps(env.path)[-1] == resumed + 1
    step, state = safepoint.load(env.path)
    assert step == resumed + 1
    assert first_difference(state, make_state(SEED, step, numel)) is None


def test_a_save_after_a_resume_keeps_the_snapshot_resumed_from(env):
    """Regression (issue 9, defect 10; crash campaign, seed 866710947): a rank held step 5 and
    a later step 6 of a run that was abandoned (its peer never completed 6), so the ranks
    resumed from 5 in memory. The arena kept the snapshot completed last while writing the
    next save, the stale 6, and overwrote 5: a kill during that save left the rank without
    step 5 (its peer without 6), the ranks could no longer agree on a step in memory and
    resumed from an older one on storage. The snapshot a run resumes from is the one kept."""
    numel = 1000
    abandoned = env.checkpointer(persist_every=1000)
    for step in (5, 6):
        assert abandoned.save(step, make_state(SEED, step, numel))
    abandoned.abandon()

    resumed = env.checkpointer(persist_every=1000)
    step, state = resumed.load(5)
    assert (step, resumed.last_load_source) == (5, "memory")
    assert first_difference(state, make_state(SEED, 5, numel)) is None
    slot_of_5 = next(s["slot"] for s in resumed.status()["snapshots"]
                     if s["state"] == "COMPLETE" and s["step"] == 5)
    assert resumed.save(6, make_state(SEED, 6, numel))
    assert resumed.status()["last_save"]["slot"] != slot_of_5, \
        "the save after the resume overwrote the snapshot the run resumed from"
    held = sorted(s["step"] for s in resumed.status()["snapshots"] if s["state"] == "COMPLETE")
    assert held == [5, 6], held
    step, state = resumed.load(5)
    assert first_difference(state, make_state(SEED, 5, numel)) is None


def test_adopting_agent_persists_only_the_current_snapshot_of_a_step(env, cli, monkeypatch):
    """Found by the crash campaign (seed 866710947, round 364): rank 0 held two snapshots of
    step 3, one of an abandoned run (attempt Z) and the current run's (attempt C), rank 1 only
    the current one. An agent that adopted them persisted both of rank 0's, the stale one last:
    rank 0's image was of attempt Z and rank 1's of C, so step 3 never committed and every
    wait() for it hung. Of two snapshots of one step, the agent persists the one that became
    current last, as loads and the restore agreement read it."""
    numel = 1000

    def crash(*checkpointers) -> None:
        """Agent and ranks die together: nothing is flushed."""
        env.kill_agent(env.wait_agent())
        for ck in checkpointers:
            ck.abandon()

    monkeypatch.setenv("SAFEPOINT_ATTEMPT", "run-Z")
    z0 = env.checkpointer(rank=0, world_size=2, persist_every=1000)
    for step in (2, 3):  # rank 1 of this run died before it saved step 3
        assert z0.save(step, make_state(SEED, step, numel))
    crash(z0)

    monkeypatch.setenv("SAFEPOINT_ATTEMPT", "run-C")
    c0 = env.checkpointer(rank=0, world_size=2, persist_every=1000)
    c1 = env.checkpointer(rank=1, world_size=2, persist_every=1000)
    assert c0.save(3, make_state(SEED, 3, numel))  # beside the stale one, completed earlier
    assert c1.save(3, make_state(SEED, 3, numel))
    held = sorted(s["step"] for s in c0.status()["snapshots"] if s["state"] == "COMPLETE")
    assert held == [3, 3], held
    crash(c0, c1)

    monkeypatch.setenv("SAFEPOINT_ATTEMPT", "run-D")
    env.checkpointer(rank=0, world_size=2)  # starts an agent, which adopts the snapshots

    def idle() -> bool:
        jobs = json.loads(cli("status", "--shm-dir", env.shm, "--json", check=0).stdout)
        j = next(j for j in jobs if j["job"] == env.job)
        return "queued" in j and j["queued"] == 0 and j["in_flight"] is None and \
            all(r["pending_persists"] == 0 for r in j["ranks"])
    assert wait_until(idle), env.agent_log()[-3000:]
    assert 3 in safepoint.steps(env.path), env.agent_log()[-3000:]
    for rank in (0, 1):
        step, state = safepoint.load(env.path, 3, rank=rank)
        assert first_difference(state, make_state(SEED, 3, numel)) is None


def test_killed_during_persist_resumes_from_memory(env):
    """Persist every step (64 MiB); each process is killed while the agent writes an image."""
    rng = random.Random(SEED + 1)
    numel = 16 << 20  # 64 MiB
    common = ("--seed", SEED, "--numel", numel, "--persist-every", 1)
    killed: Optional[Worker] = None
    for attempt in range(2):
        w = start_resumed(env, common, killed)
        for _ in range(rng.randint(1, 3)):
            w.expect("SAVED")
        wait_until(lambda: persist_in_progress(env.path), deadline=60, interval=0.0005)
        w.kill()
        killed = w
        # Whatever was in flight, the newest step whose save() returned reaches storage.
        assert wait_until(lambda: killed.last_saved in safepoint.steps(env.path)), \
            f"step {killed.last_saved} never reached storage: {safepoint.steps(env.path)}"
        verify_committed(env.path, SEED, numel)

    w = env.worker(*common, "--resume", "--steps", 1)
    resumed = check_resumed(w.expect("LOADED", "FRESH"), killed)
    w.expect("IDLE")
    w.send("close")
    w.expect("CLOSED")
    assert w.finish() == 0
    assert verify_committed(env.path, SEED, numel)[-1] == resumed + 1


# --- agent killed --------------------------------------------------------------------------------

def test_agent_killed_during_persist_leaves_only_complete_steps(env):
    """Persist every step (64 MiB); the agent is killed while it writes an image, again and again.

    Regression: this failed intermittently (a committed step's image replaced, "image header
    does not match the COMMIT record") while a restarted agent trusted a client's stale lease;
    see test_restarted_agent_persists_a_step_once."""
    rng = random.Random(SEED + 2)
    numel = 16 << 20  # 64 MiB
    common = ("--seed", SEED, "--numel", numel, "--persist-every", 1, "--keep", 3)
    w = env.worker(*common)
    w.expect("READY")
    dead: list[int] = []
    leftovers: set = set()  # temporaries of killed agents' writes

    def kill_agent_while_it_persists() -> None:
        pid = env.wait_connected_agent(not_in=dead)  # the worker restarted one after each kill
        wait_until(lambda: bool(storage_temporaries(env.path) - leftovers), deadline=60,
                   interval=0.0005)
        time.sleep(rng.uniform(0.0, 0.05))
        env.kill_agent(pid)
        dead.append(pid)
        leftovers.update(storage_temporaries(env.path))

    for _ in range(3):
        for _ in range(rng.randint(1, 3)):
            w.expect("SAVED")
        kill_agent_while_it_persists()
        verify_committed(env.path, SEED, numel)
    # Saving goes on: the worker's next calls start a new agent, which adopts the arena.
    before = len(w.saved)
    while len(w.saved) < before + 2:
        w.expect("SAVED")
    verify_committed(env.path, SEED, numel)

    # Kill the agent during a persist, and the training process as well.
    kill_agent_while_it_persists()
    w.kill()
    verify_committed(env.path, SEED, numel)

    # A new Checkpointer gets an agent that adopts the snapshots; saving continues.
    w2 = env.worker(*common, "--resume", "--steps", 2)
    resumed = check_resumed(w2.expect("LOADED", "FRESH"), w)
    w2.expect("IDLE")
    assert w2.saved == [resumed + 1, resumed + 2]
    agent = env.agent_of_worker(w2.proc.pid)
    assert agent not in dead
    log = env.agent_log()
    assert f"safepointd[{agent}]: adopted the snapshots of rank 0" in log, log[-3000:]
    w2.send("close")
    w2.expect("CLOSED")
    assert w2.finish() == 0
    committed = verify_committed(env.path, SEED, numel)
    assert committed and committed[-1] == resumed + 2
    assert len(committed) <= 3  # keep=3


def test_agent_killed_between_saves_next_save_restarts_it(env):
    numel = 1 << 16
    ck = env.checkpointer(persist_every=1)
    for step in (1, 2, 3):
        assert ck.save(step, make_state(SEED, step, numel))
    ck.wait()
    old = ck.status()["agent"]["pid"]
    assert old == env.agent_pid()
    env.kill_agent(old)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an agent_error would warn
        assert ck.save(4, make_state(SEED, 4, numel))
    assert ck.status()["last_save"]["agent_error"] == ""
    ck.wait()
    assert safepoint.steps(env.path)[-1] == 4
    new = env.wait_agent(not_in=[old])
    assert ck.status()["agent"]["pid"] == new
    log = env.agent_log()
    assert f"safepointd[{new}]: adopted the snapshots of rank 0" in log, log[-3000:]

    # Killed again: status() and wait() reconnect as well.
    env.kill_agent(new)
    st = ck.status()
    assert st["agent"]["pid"] not in (old, new)
    ck.wait()
    step, state = ck.load()
    assert step == 4 and ck.last_load_source == "memory"
    assert first_difference(state, make_state(SEED, 4, numel)) is None
    verify_committed(env.path, SEED, numel)
    ck.close()


def test_restarted_agent_reports_newest_committed(env):
    """Regression test for a fixed bug (src/agent/agent.cc, Agent::Adopt / HandleMessage kHello): an agent that adopts a job
    (job.json present) sets config_ and store_ but never newest_committed_, and kHello only reads
    the newest committed step when config_ is unset. So after an agent restart status() reports
    newest_committed None although steps are committed, and EmergencyFlush (which skips steps
    <= newest_committed_) persists already committed snapshots again."""
    numel = 1 << 16
    ck = env.checkpointer(persist_every=1)
    assert ck.save(1, make_state(SEED, 1, numel))
    ck.wait()
    assert ck.status()["newest_committed"] == 1
    env.kill_agent(env.wait_agent())
    st = ck.status()  # reconnects: a new agent adopts the job
    assert safepoint.steps(env.path) == [1]
    assert st["newest_committed"] == 1, st
    ck.close()


def test_restarted_agent_persists_a_step_once(env):
    """Regression test for a fixed bug (src/client/snapshot_client.cc SnapshotClient::Save, with src/agent/agent.cc
    Agent::Adopt and Agent::Persist): when save(step) finds the agent dead, the slot is already
    COMPLETE and leased by the client; the client starts a new agent, whose Adopt() clears every
    lease and enqueues the step ("adopted"); then the client re-sends its note with
    "leased": true, and the agent enqueues the same step again ("requested"). The second task
    trusts a lease that no longer exists: it writes the step again (renaming over the image of an
    already committed step) while the training process may overwrite the slot, which replaces a
    committed image with a torn one (seen in test_agent_killed_during_persist...: "image header
    does not match the COMMIT record", checksum mismatches); if the slot changed first, the
    superseded outcome replaces the OK one and wait() for that step fails.
    Here: the save after the agent was killed is persisted twice (persists_ok 3 for 2 steps)."""
    numel = 1 << 16
    ck = env.checkpointer(persist_every=1)
    for step in (1, 2, 3):
        assert ck.save(step, make_state(SEED, step, numel))
    ck.wait()
    env.kill_agent(env.wait_agent())
    assert ck.save(4, make_state(SEED, 4, numel))  # starts a new agent
    # The agent persists in order: once step 5 is committed, everything before it is done.
    assert ck.save(5, make_state(SEED, 5, numel))
    ck.wait()
    st = ck.status()
    assert st["persists_ok"] == 2, (st, env.agent_log()[-2000:])  # steps 4 and 5, once each
    verify_committed(env.path, SEED, numel)
    ck.close()


# --- /dev/shm too small --------------------------------------------------------------------------

TINY_SCRIPT = r"""
import json, sys, torch, safepoint
path, job, shm, workloads = sys.argv[1:5]
sys.path.insert(0, workloads)
from flash_worker import first_difference, make_state
ck = safepoint.Checkpointer(path, job=job, shm_dir=shm, persist_every=1000)
out = {"error": None}
try:
    ck.save(1, {"w": torch.zeros(16 << 20, dtype=torch.int32)})  # 64 MiB
except Exception as e:
    out.update(error=type(e).__name__, resource=isinstance(e, safepoint.ResourceExhaustedError),
               message=str(e))
state = make_state(7, 2, 1 << 18)  # 1 MiB: fits
out["saved_small"] = ck.save(2, state)
step, got = ck.load()
out["loaded"] = [step, ck.last_load_source, first_difference(got, state)]
ck.close()
print(json.dumps(out), flush=True)
"""


def test_too_little_shared_memory_gives_a_clear_error(env):
    mnt = env.shm / "tiny"
    mnt.mkdir()
    with small_tmpfs(mnt, "8m"):
        try:
            proc = subprocess.run([sys.executable, "-c", TINY_SCRIPT, str(env.path), env.job,
                                   str(mnt), WORKLOADS], capture_output=True, text=True,
                                  timeout=HANG)
            # Never a SIGBUS: the process survives and reports.
            assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
            out = json.loads(proc.stdout.strip().splitlines()[-1])
            assert out["error"] == "ResourceExhaustedError" and out["resource"], out
            msg = out["message"]
            needed = re.search(r"needs (\d+) bytes", msg)
            free = re.search(r"only (\d+) bytes .*free", msg)
            assert needed and free, msg
            assert int(needed.group(1)) >= 64 << 20, msg
            assert int(free.group(1)) <= 8 << 20 < int(needed.group(1)), msg
            assert "/dev/shm" in msg and "shm-size" in msg, msg  # how to fix it
            assert str(mnt) in msg, msg
            # A state that fits still works after the error.
            assert out["saved_small"] is True
            assert out["loaded"] == [2, "memory", None], out
        finally:
            kill_agents(mnt, deadline=30)


# --- two jobs on one node ------------------------------------------------------------------------

def test_two_jobs_on_one_node_do_not_see_each_other(env):
    pa, pb, pc = env.tmp / "a", env.tmp / "b", env.tmp / "c"
    ja, jb, jc = env.job + "a", env.job + "b", env.job + "c"
    a = env.checkpointer(job=ja, path=pa, persist_every=2)
    b = env.checkpointer(job=jb, path=pb, persist_every=3)
    for step in (1, 2, 3):
        assert a.save(step, make_state(11, step, 1000))
    for step in (1, 2, 3, 4, 5):
        assert b.save(step, make_state(22, step, 3000))
    a.wait()
    b.wait()
    assert safepoint.steps(pa) == [2]
    assert safepoint.steps(pb) == [3]

    step, state = a.load()
    assert step == 3 and a.last_load_source == "memory"
    assert first_difference(state, make_state(11, 3, 1000)) is None
    step, state = b.load()
    assert step == 5 and b.last_load_source == "memory"
    assert first_difference(state, make_state(22, 5, 3000)) is None

    sa, sb = a.status(), b.status()
    assert sorted(s["step"] for s in sa["snapshots"] if s["state"] == "COMPLETE") == [2, 3]
    assert sorted(s["step"] for s in sb["snapshots"] if s["state"] == "COMPLETE") == [4, 5]
    assert (sa["job"], sa["newest_committed"], sa["saves"]) == (ja, 2, 3)
    assert (sb["job"], sb["newest_committed"], sb["saves"]) == (jb, 3, 5)
    assert sa["agent"]["pid"] != sb["agent"]["pid"]
    assert sa["agent"]["job_dir"] == str(env.job_dir(ja))
    assert sb["agent"]["job_dir"] == str(env.job_dir(jb))
    assert sorted(p.name for p in env.job_dir(ja).glob("rank-*")) == \
        ["rank-00000.slot-0", "rank-00000.slot-1"]

    # A third job on the same node sees nothing, though the others have snapshots.
    c = env.checkpointer(job=jc, path=pc)
    assert c.load() is None
    assert all(s["state"] == "FREE" for s in c.status()["snapshots"])
    # And a job name cannot be taken over by a process that persists elsewhere.
    with pytest.raises(safepoint.InvalidArgumentError, match="already persists to"):
        env.checkpointer(job=ja, path=pc)

    for ck in (a, b, c):
        ck.close()
    assert wait_until(lambda: not agents_of(env.shm)), agents_of(env.shm)
    assert not any(env.shm.iterdir()), list(env.shm.iterdir())


# --- status, close, retention, persist overrides, on_busy="skip" ---------------------------------

def test_status_retention_persist_overrides_and_close(env):
    numel = 1 << 16

    def save(ck, step, **kw):
        assert ck.save(step, make_state(SEED, step, numel), **kw)

    ck = env.checkpointer(persist_every=3, keep=2)
    for step in (1, 2):
        save(ck, step)
    save(ck, 3)                  # 3 % 3 == 0: persisted
    save(ck, 4)
    save(ck, 5, persist=True)    # forced
    save(ck, 6, persist=False)   # suppressed although 6 % 3 == 0
    ck.wait()
    assert safepoint.steps(env.path) == [3, 5]
    for step in (7, 8, 9):
        save(ck, step)           # 9 persisted
    ck.wait()
    assert safepoint.steps(env.path) == [5, 9]  # keep=2
    save(ck, 10, persist=True)
    ck.wait()
    assert safepoint.steps(env.path) == [9, 10]
    verify_committed(env.path, SEED, numel)

    st = ck.status()
    assert st["saves"] == 10 and st["skipped_saves"] == 0
    assert sorted((s["state"], s["step"]) for s in st["snapshots"]) == \
        [("COMPLETE", 9), ("COMPLETE", 10)]
    assert not any(s["leased"] for s in st["snapshots"])
    assert st["newest_committed"] == 10
    assert st["last_persisted_step"] == 10
    assert st["pending_persists"] == 0
    assert st["persists_ok"] == 4 and st["persists_failed"] == 0  # 3, 5, 9, 10
    assert st["last_persist_error"] is None
    assert st["last_save"]["step"] == 10 and st["last_save"]["saved"]
    assert st["last_persist_bytes"] == st["last_save"]["image_bytes"] > numel * 4
    assert (st["job"], st["rank"], st["world_size"]) == (env.job, 0, 1)
    assert st["agent"]["pid"] == env.agent_pid()
    assert st["agent"]["job_dir"] == str(env.job_dir())

    step, state = ck.load()
    assert step == 10 and ck.last_load_source == "memory"
    assert ck.status()["last_load"]["source"] == "memory"
    step, state = ck.load(9)  # an older step (in memory and on storage)
    assert step == 9
    assert first_difference(state, make_state(SEED, 9, numel)) is None

    # close() persists the newest snapshot, removes the arena, and the agent exits.
    save(ck, 11, persist=False)
    agent = st["agent"]["pid"]
    ck.close()
    assert safepoint.steps(env.path) == [10, 11]
    assert not list(env.job_dir().glob("rank-*"))
    assert wait_until(lambda: not is_agent_of(agent, env.shm)), f"agent {agent} did not exit"
    assert wait_until(lambda: not env.job_dir().exists()), list(env.job_dir().iterdir())
    ck.close()  # idempotent


def test_wait_returns_when_retention_prunes_the_step_at_once(env):
    """An earlier run left steps 59 and 60 in the path (keep=2); a new run saves step 0 there,
    which retention removes as soon as it is committed. wait() returns (the save did not fail)
    and the agent's log says why the step is not on storage. wait() used to hang."""
    numel = 1 << 12
    ck = env.checkpointer(keep=2)
    for step in (59, 60):
        assert ck.save(step, make_state(SEED, step, numel), persist=True)
    ck.wait()
    agent = ck.status()["agent"]["pid"]
    ck.close()
    assert safepoint.steps(env.path) == [59, 60]
    assert wait_until(lambda: not is_agent_of(agent, env.shm)), f"agent {agent} did not exit"

    ck = env.checkpointer(keep=2)
    assert ck.save(0, make_state(SEED, 0, numel), persist=True)
    ck.wait(timeout=60)  # the timeout only turns a hang into a failure
    assert safepoint.steps(env.path) == [59, 60]
    st = ck.status()
    assert st["persists_ok"] == 1 and st["persists_failed"] == 0
    assert "step 0 was committed and then removed at once by retention" in env.agent_log()
    ck.close()


def test_use_after_close_raises_a_safepoint_error(env):
    """Regression test for a fixed bug (minor; python/safepoint/_checkpointer.py, Checkpointer.close): close() sets _client to
    None, so save()/wait()/load()/status() afterwards raise AttributeError ("'NoneType' object has
    no attribute 'save'") instead of a safepoint error saying the checkpointer is closed (the
    binding's PyClient.Get already has that message: "the checkpointer is closed")."""
    ck = env.checkpointer()
    assert ck.save(1, make_state(SEED, 1, 1000))
    ck.close()
    for call in (lambda: ck.save(2, make_state(SEED, 2, 1000)), ck.wait, ck.load, ck.status):
        with pytest.raises(safepoint.Error, match="closed"):
            call()


def test_on_busy_skip_when_no_slot_is_free(env):
    """Made deterministic by stopping the agent (SIGSTOP): a slot it must persist stays leased."""
    numel = 1 << 16
    ck = env.checkpointer(persist_every=1000, on_busy="skip")
    assert ck.save(1, make_state(SEED, 1, numel))
    assert ck.save(2, make_state(SEED, 2, numel))
    agent = env.wait_agent()
    os.kill(agent, signal.SIGSTOP)
    try:
        assert ck.save(3, make_state(SEED, 3, numel), persist=True)  # leased until persisted
        assert ck.save(4, make_state(SEED, 4, numel))                # the other slot
        # Slot of 3: leased; slot of 4: the newest. No slot may be overwritten: skipped.
        assert ck.save(5, make_state(SEED, 5, numel)) is False
    finally:
        os.kill(agent, signal.SIGCONT)
    st = ck.status()
    assert st["saves"] == 3 + 2 and st["skipped_saves"] == 1
    assert st["last_save"]["saved"] is False and st["last_save"]["step"] == 5
    ck.wait()
    assert safepoint.steps(env.path) == [3]
    assert ck.save(5, make_state(SEED, 5, numel))  # the lease is released: room again
    step, state = ck.load()
    assert step == 5 and ck.last_load_source == "memory"
    assert first_difference(state, make_state(SEED, 5, numel)) is None
    ck.close()


def test_revive_agent_restarts_a_killed_agent_before_a_collective(tmp_path, shm):
    """With replicas, a save's collective comes before the agent hears of the snapshot; the
    Checkpointer calls revive_agent() right before it, so that no rank waits there while its
    node has no agent (the node-loss campaign's hang, seed 1005935286)."""
    import torch

    job = f"revive-{os.getpid()}"
    path = tmp_path / "ckpt"
    ck = safepoint.Checkpointer(path, job=job, shm_dir=shm, persist_every=1)
    try:
        ck.save(1, {"w": torch.arange(8.0)})
        ck.wait()
        first = lock_agent_pid(shm, job)
        assert first is not None
        assert ck._live.revive_agent() == ""  # alive: one poll, nothing restarted
        assert lock_agent_pid(shm, job) == first
        kill_and_wait(first)
        assert ck._live.revive_agent() == ""
        second = lock_agent_pid(shm, job)
        assert second is not None and second != first
        ck.save(2, {"w": torch.arange(8.0) + 1})
        ck.wait()
        assert safepoint.steps(path) == [1, 2]
    finally:
        ck.close()
