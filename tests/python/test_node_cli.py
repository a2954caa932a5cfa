"""safepoint status / gc: a job whose agent and processes died keeps its snapshots until gc; a job
with a live agent, or with a live training process whose agent died, is kept."""

import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

import safepoint
from conftest import cli_path
from processes import wait_until

# A training process of one job, driven over stdin: it saves step 1 (persisted when asked), prints
# its job directory, then saves one step per line ("saved N") until it reads "exit", when it
# leaves without closing (as a crashed process would: its snapshots stay in shared memory).
SAVER = r"""
import os, sys, torch, safepoint
path, job, shm, persist = sys.argv[1:5]
ck = safepoint.Checkpointer(path, job=job, shm_dir=shm)
ck.save(1, {"w": torch.ones(1000)}, persist=persist == "1")
if persist == "1":
    ck.wait()
print(ck.status()["agent"]["job_dir"], flush=True)
for line in sys.stdin:
    if line.strip() == "exit":
        os._exit(0)
    step = int(line)
    ck.save(step, {"w": torch.full((1000,), float(step))})
    print("saved", step, flush=True)
"""


class Saver:
    def __init__(self, path, job, shm, persist=False):
        self.proc = subprocess.Popen([sys.executable, "-c", SAVER, str(path), job, str(shm),
                                      "1" if persist else "0"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.job_dir = self.proc.stdout.readline().strip()
        assert self.job_dir, "the saver did not start"

    def save(self, step):
        self.proc.stdin.write(f"{step}\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def exit(self):
        self.proc.stdin.write("exit\n")
        self.proc.stdin.flush()
        assert self.proc.wait() == 0

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def agent_pid(job_dir):
    with open(os.path.join(job_dir, "agent.lock")) as f:
        return int(f.read().strip())


def lock_free(job_dir):
    """True when no process holds the agent's lock (as the CLI asks it)."""
    fd = os.open(os.path.join(job_dir, "agent.lock"), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def kill_agent(job_dir, deadline=30):
    """SIGKILLs the job's agent and waits until its lock is released: only once every thread of
    the agent has exited (its main thread is a zombie earlier, while the lock is still held)."""
    os.kill(agent_pid(job_dir), signal.SIGKILL)
    end = time.monotonic() + deadline
    while not lock_free(job_dir):
        assert time.monotonic() < end, "the killed agent's lock was not released"
        time.sleep(0.01)


def test_status_and_gc(tmp_path, cli):
    shm = tmp_path / "shm"
    shm.mkdir()
    live = safepoint.Checkpointer(tmp_path / "a", job="live-job", shm_dir=str(shm))
    dead = Saver(tmp_path / "b", "dead-job", shm, persist=True)
    try:
        live.save(1, {"w": torch.ones(1000)})
        status = json.loads(cli("status", "--shm-dir", shm, "--json", check=0).stdout)
        jobs = {j["job"]: j for j in status}
        assert set(jobs) == {"live-job", "dead-job"}
        assert all(j["agent_alive"] for j in jobs.values())
        assert jobs["dead-job"]["newest_committed"] == 1
        assert jobs["live-job"]["arenas"][0]["slots"][0]["state"] == "COMPLETE"
        # The dead job: its process and its agent are gone; the snapshots stay for hot reload.
        dead.exit()
        kill_agent(dead.job_dir)
        out = cli("status", "--shm-dir", shm, check=0).stdout
        assert "no live agent (snapshots kept" in out and "dead-job" in out
        # Its checkpoint path still shows (from the job.json its agent left).
        assert f"job dead-job: checkpoints in {tmp_path / 'b'}\n" in out, out
        jobs = {j["job"]: j for j in json.loads(cli("status", "--shm-dir", shm, "--json",
                                                    check=0).stdout)}
        assert jobs["dead-job"]["storage"] == str(tmp_path / "b")
        assert cli("gc", "--shm-dir", shm, "--dry-run", check=0).stdout.count("would remove") == 1
        report = json.loads(cli("gc", "--shm-dir", shm, "--dry-run", "--json", check=0).stdout)
        assert [(r["job"], r["action"], r["reason"] if r["action"] == "keep" else None)
                for r in report["jobs"]] == [("dead-job", "would_remove", None),
                                          ("live-job", "keep", "agent alive")]
        assert report["staging"]["would_remove_files"] == 0
        assert os.path.isdir(dead.job_dir)
        out = cli("gc", "--shm-dir", shm, check=0).stdout
        assert "removed" in out and "dead-job" in out and "keep" in out
        assert not os.path.exists(dead.job_dir)
        # The live job is untouched and still reloads from memory.
        assert live.load()[0] == 1 and live.last_load_source == "memory"
        # A job directory holding a file safepoint did not create is not removed.
        stray = shm / f"safepoint-{os.geteuid()}-stray"
        stray.mkdir(mode=0o700)
        (stray / "notes.txt").write_text("mine")
        proc = cli("gc", "--shm-dir", shm, check=1)
        assert "notes.txt" in proc.stderr and stray.exists()
    finally:
        dead.kill()
        live.close()


def test_gc_keeps_a_job_whose_training_process_lives(tmp_path, cli, shm):
    # The agent died; the training process lives on and will start a new agent at its next
    # call. gc must not take its snapshots away (it did: its next save then failed).
    saver = Saver(tmp_path / "ckpt", "orphan", shm)
    try:
        # Stopped (alive, yet running nothing): its client's watch would start a new agent within
        # a second (src/client/snapshot_client.cc, AgentWatch), before the calls below end on a
        # loaded machine (make test once saw gc --json find that new agent).
        os.kill(saver.proc.pid, signal.SIGSTOP)
        kill_agent(saver.job_dir)
        status = json.loads(cli("status", "--shm-dir", shm, "--json", check=0).stdout)
        assert [(j["job"], j["agent_alive"], j["live_writers"]) for j in status] == [
            ("orphan", False, [saver.proc.pid])]
        out = cli("status", "--shm-dir", shm, check=0).stdout
        assert f"no live agent; training process {saver.proc.pid} alive" in out
        out = cli("gc", "--shm-dir", shm, "--dry-run", check=0).stdout
        assert "would remove" not in out and "keep" in out and f"process {saver.proc.pid}" in out
        out = cli("gc", "--shm-dir", shm, check=0).stdout
        assert "removed" not in out and "keep" in out and f"process {saver.proc.pid}" in out
        assert os.path.isdir(saver.job_dir)
        report = json.loads(cli("gc", "--shm-dir", shm, "--json", check=0).stdout)
        assert report["jobs"] == [{"job": "orphan", "job_dir": saver.job_dir, "action": "keep",
                           "reason": "training process alive", "writers": [saver.proc.pid]}]
        assert os.path.isdir(saver.job_dir)
        # Its next save works (and starts a new agent).
        os.kill(saver.proc.pid, signal.SIGCONT)
        assert saver.save(2) == "saved 2"
    finally:
        saver.kill()
    # Once the process is gone too (and its new agent), gc removes the job.
    kill_agent(saver.job_dir)
    report = json.loads(cli("gc", "--shm-dir", shm, "--json", check=0).stdout)
    assert len(report["jobs"]) == 1 and report["jobs"][0]["action"] == "removed"
    assert report["jobs"][0]["bytes"] > 0
    assert not os.path.exists(saver.job_dir)


def test_gc_and_status_need_an_existing_shm_dir(tmp_path, cli):
    missing = tmp_path / "no-such-shm"
    for args in (["status"], ["status", "--json"], ["gc"], ["gc", "--json"], ["gc", "--dry-run"]):
        proc = cli(*args, "--shm-dir", missing, check=1)
        assert str(missing) in proc.stderr and proc.stdout == ""
    proc = cli("agent", "--job", "j", "--shm-dir", missing, check=1)
    assert str(missing) in proc.stderr


@pytest.mark.filterwarnings("ignore:safepoint.*failed to persist:RuntimeWarning")
def test_status_text_names_jobs_by_path_shows_persist_failures_and_reads_the_env(tmp_path, cli,
                                                                                  shm):
    """Issue 36: `status` showed persist failures only in --json, printed raw nulls, ignored
    $SAFEPOINT_SHM_DIR and named every framework job safepoint-<hash> and nothing else."""
    ckpt = tmp_path / "run"
    ckpt.mkdir()
    (ckpt / "step-00000000000000000001").write_text("in the way")  # step 1 cannot be persisted
    checkpoints = tmp_path / "lightning" / "checkpoints"
    framework = checkpoints / "safepoint"  # a Lightning job's default: <its directory>/safepoint
    failing = safepoint.Checkpointer(ckpt, job="failing", shm_dir=shm)
    lightning = safepoint.Checkpointer(framework, shm_dir=shm)
    try:
        (checkpoints / "epoch=0-step=1.ckpt").write_text("a pointer")
        failing.save(1, {"w": torch.ones(10)})
        lightning.save(1, {"w": torch.ones(10)}, persist=False)

        def failed():
            jobs = json.loads(cli("status", "--shm-dir", shm, "--json", check=0).stdout)
            job = next(j for j in jobs if j["job"] == "failing")
            return job["persists_failed"] > 0 and job["last_persist_error"]

        assert wait_until(failed)
        env = dict(os.environ, SAFEPOINT_SHM_DIR=str(shm))
        out = subprocess.run([cli_path(), "status"], env=env, capture_output=True, text=True,
                             timeout=60).stdout
        assert f"job failing: checkpoints in {ckpt}\n" in out, out
        failures = r"\n  persists 0 ok, [1-9][0-9]* failed; last error: rank 0: .+\n"
        assert re.search(failures, out), out
        assert f"checkpoints in {framework} (Lightning's, beside its checkpoints in " \
               f"{checkpoints})" in out, out
        assert re.search(r"job safepoint-[0-9a-f]{12}: ", out), out
        assert "newest committed step none yet" in out and "null" not in out, out
        assert f"shared memory {shm}/" in out
    finally:
        failing.abandon()
        lightning.close()
