"""Kill points (src/base/kill_point.h) are in every build, the installed package's included, and
do nothing unless SAFEPOINT_KILL_AT arms one: the crash campaign (tests/crash) runs this build."""

import os
import signal
import subprocess
import sys

import safepoint

# Saves steps 1, 2, 3 to argv[1] with the plain API (the commit protocol's kill points).
SAVE = """
import sys, torch, safepoint
for step in (1, 2, 3):
    safepoint.save(sys.argv[1], step, {"w": torch.full((4,), float(step))})
    print("saved", step, flush=True)
"""


def save(ckpt, **env) -> subprocess.CompletedProcess:
    full = dict(os.environ)
    for k in ("SAFEPOINT_KILL_AT", "SAFEPOINT_KILL_STAMP"):
        full.pop(k, None)
    full.update(env)
    return subprocess.run([sys.executable, "-c", SAVE, str(ckpt)], env=full, capture_output=True,
                          text=True, timeout=120)


def test_disarmed_without_the_variable(ckpt):
    proc = save(ckpt)
    assert proc.returncode == 0, proc.stderr
    assert safepoint.steps(str(ckpt)) == [1, 2, 3]


def test_nth_hit_kills(ckpt):
    # The second COMMIT is durable when the process dies; the third save never starts.
    proc = save(ckpt, SAFEPOINT_KILL_AT="store.commit.after_write:2")
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stderr)
    assert proc.stdout.split() == ["saved", "1"]
    assert safepoint.steps(str(ckpt)) == [1, 2]


def test_first_hit_by_default(ckpt):
    proc = save(ckpt, SAFEPOINT_KILL_AT="store.commit.before_write")
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stderr)
    assert proc.stdout == ""
    assert safepoint.steps(str(ckpt)) == []


def test_stamp_kills_once_across_processes(ckpt, tmp_path):
    stamp = tmp_path / "stamp"
    env = {"SAFEPOINT_KILL_AT": "store.commit.before_write", "SAFEPOINT_KILL_STAMP": str(stamp)}
    first = save(ckpt, **env)
    assert first.returncode == -signal.SIGKILL, (first.returncode, first.stderr)
    name, nth, pid = stamp.read_text().split()
    assert (name, nth) == ("store.commit.before_write", "1") and int(pid) > 0
    second = save(ckpt, **env)
    assert second.returncode == 0, second.stderr
    assert safepoint.steps(str(ckpt)) == [1, 2, 3]


def test_unknown_name_aborts(ckpt):
    proc = save(ckpt, SAFEPOINT_KILL_AT="store.commit.no_such_point")
    assert proc.returncode == -signal.SIGABRT, (proc.returncode, proc.stderr)
    assert "SAFEPOINT_KILL_AT names no kill point: store.commit.no_such_point" in proc.stderr
