"""A preemption notice loses nothing (issue 22, "Build"): SIGTERM or SIGUSR1 to a training
process makes its next save() copy and persist that step whatever the schedule, and a restart
resumes from exactly that step, bit for bit. Then (issue 36, item 1) the process ends as the
signal would have ended it (exit status: death by that signal), with one line on stderr, even
when the loop never looks at ``ckpt.preempted``; ``on_preemption="return"`` leaves the end to
the program (the loop stops on its own and exits normally).

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
    proc = run("train", "--on-preemption", "return")
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


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_a_signal_ends_a_plain_loop_after_its_step_is_committed(run, sig):
    """The loop never looks at ckpt.preempted: the save after the signal persists its step,
    and the process ends as the signal would have ended it, saying so on stderr."""
    proc = run("plain")
    lines = LineReader(proc.stdout, "worker")
    lines.expect("step")
    seen = int(lines.expect("step")[1])
    proc.send_signal(sig)
    code, objs, out = finish(proc, lines)
    assert code == -sig, out  # a death by the signal, as a scheduler expects
    assert "finished" not in out, out
    name = signal.Signals(sig).name
    said = [line for line in out.splitlines() if line.startswith(f"safepoint: {name}:")]
    assert len(said) == 1, out
    at = int(said[0].split()[3])  # "safepoint: SIGTERM: step N is committed ..."
    # the save that followed the signal, which never returned (no "step N" line after it)
    assert at > seen and f"step {at}" not in lines.lines, out
    assert said == [f"safepoint: {name}: step {at} is committed to {run.ckpt}; ending the "
                    f"process as {name} does (Checkpointer(on_preemption='return') lets the "
                    "program stop on its own)"], out
    assert safepoint.steps(run.ckpt) == [at]  # committed before the process ended
    r = resumed(run)
    assert (r["step"], r["exact"]) == (at, True), r


def test_on_preemption_return_leaves_the_end_to_the_program(run):
    """The opt-out keeps the behaviour before issue 36: the preemption save persists its step
    and returns, and a loop that does not stop trains on to its end and exits normally."""
    proc = run("plain", "--steps", "40", "--on-preemption", "return", "--self-signal", "5")
    code, objs, out = finish(proc)
    assert code == 0, out
    assert "finished" in out, out
    assert ("safepoint: SIGTERM: step 6 is committed to "
            f"{run.ckpt}; ckpt.preempted is True: the program stops on its own") in out, out
    assert safepoint.steps(run.ckpt) == [6]


def test_a_loop_that_makes_no_further_save_still_ends(run):
    """on_preemption="exit" and no save after the signal: the process ends as SIGTERM would
    after 20 s (_preemption.DEFAULT_SAVE_WAIT_S), and the agent persists the newest snapshot."""
    proc = run("hang", "--snapshot-every", "1")
    lines = LineReader(proc.stdout, "worker")
    lines.expect("hanging")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=HANG) == -signal.SIGTERM
    code, objs, out = finish(proc, lines)
    assert ("safepoint: SIGTERM: no save() began within 20 s of the notice; ending the process "
            "as SIGTERM does") in out, out
    assert wait_until(lambda: safepoint.steps(run.ckpt)[-1:] == [3], deadline=HANG)


def test_a_handler_installed_before_still_runs_and_is_put_back(run):
    proc = run("train", "--user-handler", "--self-signal", "4", "--on-preemption", "return")
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
        outs = ranks("train", "a", lambda r: ["--self-signal", signal_at[r],
                                              "--on-preemption", "return"])
        assert [o["preempted_at"] for o in outs] == [4, 4], outs
        assert all(o["committed"] == [4] for o in outs), outs
        assert safepoint.steps(tmp_path / "ckpt") == [4]
        outs = ranks("resume", "b", lambda r: [])
        assert [(o["step"], o["exact"]) for o in outs] == [(4, True), (4, True)], outs
    finally:
        kill_agents(shm, job)


def test_every_rank_ends_by_the_signal_after_the_same_preemption_save(tmp_path, shm):
    """As under torchrun: the signal reaches the ranks at different steps; both persist the
    same step, and both end as SIGTERM would (the rank whose own signal had not come yet, by
    the signal the ranks agreed on)."""
    job = f"preempt2x-{os.getpid()}"
    try:
        files = [(tmp_path / f"out{r}", tmp_path / f"err{r}") for r in range(2)]
        procs = [subprocess.Popen(
            [sys.executable, WORKER, tmp_path / "ckpt", shm, job, "plain", "--ranks", "2",
             "--rank", str(r), "--store", tmp_path / "store", "--self-signal", str(3 + 2 * r)],
            stdout=open(o, "w"), stderr=open(e, "w")) for r, (o, e) in enumerate(files)]
        codes = [p.wait(timeout=HANG) for p in procs]
        outs = [o.read_text() + e.read_text() for o, e in files]
        assert codes == [-signal.SIGTERM] * 2, outs
        for r, out in enumerate(outs):
            assert (f"safepoint [rank {r}]: SIGTERM: step 4 is committed to {tmp_path / 'ckpt'}"
                    "; ending the process as SIGTERM does") in out, out
            assert "finished" not in out
        assert safepoint.steps(tmp_path / "ckpt") == [4]
    finally:
        kill_agents(shm, job)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
