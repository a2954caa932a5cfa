"""A preemption notice loses nothing (issue 22, "Build"): SIGTERM or SIGUSR1 to a training
process makes its next save() copy and persist that step whatever the schedule; the process exits
normally and a restart resumes from exactly that step, bit for bit.

The training processes are tests/python/workloads/preempt_worker.py (one process, or 2 ranks with
gloo), whose states are pure functions of (step, rank). Their schedule (snapshot_every and
persist_every of 1000) never snapshots a step on its own: every step on storage is there because
of the notice (or of the agent's flush after a death). Waits only guard against hangs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from conftest import run_ranks
from processes import LineReader, kill_agents, start_script, wait_until

import safepoint

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workloads",
                      "preempt_worker.py")
HANG = 120.0


@pytest.fixture
def run(tmp_path, shm):
    """Starts the worker on this test's checkpoint directory and job; kills the agents after."""
    job = f"preempt-{os.getpid()}-{abs(hash(str(tmp_path))) % 10**6}"
    ckpt = tmp_path / "ckpt"

    def start(mode: str, *args) -> subprocess.Popen:
        return start_script(WORKER, ckpt, shm, job, mode, *args)

    start.ckpt = ckpt  # type: ignore[attr-defined]
    yield start
    kill_agents(shm, job)


def finish(proc: subprocess.Popen, lines: LineReader | None = None
           ) -> tuple[int, list[dict], str]:
    """Waits for the worker; returns (exit status, its JSON lines, its whole output). With
    `lines`, its stdout is read there."""
    if lines is None:
        out, err = proc.communicate(timeout=HANG)
    else:
        lines.drain()
        proc.wait(timeout=HANG)
        out, err = "\n".join(lines.lines), proc.stderr.read()
    objs = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return proc.returncode, objs, f"stdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"


def resumed(run) -> dict:
    code, objs, out = finish(run("resume"))
    assert code == 0, out
    return objs[-1]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_a_signal_persists_the_next_step_and_the_restart_resumes_from_it(run, sig):
    proc = run("train")
    lines = LineReader(proc.stdout, "worker")
    lines.expect("step")
    seen = int(lines.expect("step")[1])
    proc.send_signal(sig)
    code, objs, out = finish(proc, lines)
    assert code == 0, out  # the signal did not end the process: the loop stopped on its own
    assert objs[0] == {"handlers": True, "sigterm_default": False}, out
    at = objs[1]["preempted_at"]
    assert at > seen, out
    assert at % 1000, out  # not a scheduled snapshot
    # Committed when save() returned, before the loop's close(); the calls before it copied
    # nothing (not due).
    assert objs[1]["committed"] == [at], out
    assert objs[1]["saves_not_due"] == at - 1, out
    assert objs[1]["after_close_sigterm"] == "default", out  # close() put SIG_DFL back
    assert safepoint.steps(run.ckpt) == [at]
    r = resumed(run)
    assert (r["step"], r["exact"]) == (at, True), r


def test_a_handler_installed_before_still_runs_and_is_put_back(run):
    proc = run("train", "--user-handler", "--self-signal", "4")
    code, objs, out = finish(proc)
    assert code == 0, out
    assert "user handler ran" in out, out
    assert objs[1]["preempted_at"] == 5, out
    assert objs[1]["committed"] == [5], out
    assert objs[1]["after_close_sigterm"] == "user", out


def test_a_second_signal_ends_the_process_and_the_agent_flushes(run):
    proc = run("hang", "--snapshot-every", "1")  # steps 1..3 in memory, none persisted
    lines = LineReader(proc.stdout, "worker")
    lines.expect("hanging")
    proc.send_signal(signal.SIGTERM)
    # The first signal is a notice: the process lives on (it would preempt at its next save).
    assert not wait_until(lambda: proc.poll() is not None, deadline=1.0)
    assert safepoint.steps(run.ckpt) == []
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=HANG) == -signal.SIGTERM
    # As for any dying training process, the agent persists its snapshots, the newest last.
    assert wait_until(lambda: safepoint.steps(run.ckpt)[-1:] == [3], deadline=HANG)
    r = resumed(run)
    assert (r["step"], r["exact"]) == (3, True), r


def test_an_exhausted_grace_period_ends_the_process(run):
    proc = run("hang", "--snapshot-every", "1", "--grace", "0.5")
    lines = LineReader(proc.stdout, "worker")
    lines.expect("hanging")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=HANG) == -signal.SIGTERM
    assert wait_until(lambda: safepoint.steps(run.ckpt)[-1:] == [3], deadline=HANG)


def test_off_the_main_thread_no_handler_but_notify_preemption_works(run):
    proc = run("train", "--thread")
    code, objs, out = finish(proc)
    assert code == 0, out
    assert objs[0] == {"handlers": False, "sigterm_default": True}, out
    assert objs[1]["preempted_at"] == 4, out  # notified (from a third thread) after step 3
    assert objs[1]["committed"] == [4], out
    r = resumed(run)
    assert (r["step"], r["exact"]) == (4, True), r


@pytest.mark.parametrize("signal_at", [(3, 5), (5, 3)], ids=["rank0-first", "rank1-first"])
def test_ranks_signalled_at_different_steps_preempt_at_the_same_step(tmp_path, shm, signal_at):
    job = f"preempt2-{os.getpid()}-{signal_at[0]}"
    try:
        def ranks(mode, tag, extra):
            return run_ranks([[WORKER, tmp_path / "ckpt", shm, job, mode, "--ranks", "2",
                               "--rank", r, "--store", tmp_path / f"store-{tag}", *extra(r)]
                              for r in range(2)], timeout=HANG)

        # One rank gets SIGTERM after step 3, the other would after step 5 (a launcher's SIGTERM
        # reaches the ranks at different moments): both preempt at step 4.
        outs = ranks("train", "a", lambda r: ["--self-signal", signal_at[r]])
        assert [o["preempted_at"] for o in outs] == [4, 4], outs
        assert all(o["committed"] == [4] for o in outs), outs
        assert safepoint.steps(tmp_path / "ckpt") == [4]
        outs = ranks("resume", "b", lambda r: [])
        assert [(o["step"], o["exact"]) for o in outs] == [(4, True), (4, True)], outs
    finally:
        kill_agents(shm, job)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
