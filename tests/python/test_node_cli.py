"""safepoint status / gc: a job whose agent died keeps its snapshots until gc; a live one is kept."""

import json
import os
import signal
import time

import torch

import safepoint


def agent_pid(job_dir):
    with open(os.path.join(job_dir, "agent.lock")) as f:
        return int(f.read().strip())


def wait_gone(pid, deadline=30):
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return
        except FileNotFoundError:
            return
        time.sleep(0.02)
    raise AssertionError(f"agent {pid} did not exit")


def test_status_and_gc(tmp_path, cli):
    shm = tmp_path / "shm"
    shm.mkdir()
    live = safepoint.Checkpointer(tmp_path / "a", job="live-job", shm_dir=str(shm))
    dead = safepoint.Checkpointer(tmp_path / "b", job="dead-job", shm_dir=str(shm))
    try:
        live.save(1, {"w": torch.ones(1000)})
        dead.save(7, {"w": torch.zeros(1000)}, persist=True)
        dead.wait()
        dead_dir = dead.status()["agent"]["job_dir"]
        status = json.loads(cli("status", "--shm-dir", shm, "--json", check=0).stdout)
        jobs = {j["job"]: j for j in status}
        assert set(jobs) == {"live-job", "dead-job"}
        assert all(j["agent_alive"] for j in jobs.values())
        assert jobs["dead-job"]["newest_committed"] == 7
        assert jobs["live-job"]["arenas"][0]["slots"][0]["state"] == "COMPLETE"
        # The dead job: its process and its agent are gone; the snapshots stay for hot reload.
        dead._client.abandon()
        dead._client = None
        pid = agent_pid(dead_dir)
        os.kill(pid, signal.SIGKILL)
        wait_gone(pid)
        out = cli("status", "--shm-dir", shm, check=0).stdout
        assert "no live agent" in out and "dead-job" in out
        assert cli("gc", "--shm-dir", shm, "--dry-run", check=0).stdout.count("would remove") == 1
        assert os.path.isdir(dead_dir)
        out = cli("gc", "--shm-dir", shm, check=0).stdout
        assert "removed" in out and "dead-job" in out and "keep" in out
        assert not os.path.exists(dead_dir)
        # The live job is untouched and still reloads from memory.
        assert live.load()[0] == 1 and live.last_load_source == "memory"
        # A job directory holding a file safepoint did not create is not removed.
        stray = shm / f"safepoint-{os.geteuid()}-stray"
        stray.mkdir(mode=0o700)
        (stray / "notes.txt").write_text("mine")
        proc = cli("gc", "--shm-dir", shm, check=1)
        assert "notes.txt" in proc.stderr and stray.exists()
    finally:
        live.close()
