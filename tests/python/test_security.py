"""A second local user against a job's agent, snapshots and job directory (issue 5, part 6).

Runs where this machine allows it: as root, with a user "safepoint-other" (created with useradd if
absent). The other user's side runs in /usr/bin/python3 with only the standard library, as that
user. The shm_dir is a world-writable sticky directory, like /dev/shm, so that the other user can
reach the job directory's name.

Shown: the other uid cannot list the job directory or open the slot files (0700 directory, 0600
files); even with the directory and socket opened up by hand, the agent refuses its connection
(SO_PEERCRED) and keeps serving; a symlink or a directory the other user planted at the job
directory's path is refused, and nothing is written through it.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import tempfile
import textwrap

import pytest
import torch

import safepoint

OTHER = "safepoint-other"
PY = "/usr/bin/python3"


def other_user():
    if os.geteuid() != 0:
        pytest.skip("needs root to act as a second local user")
    if not os.access(PY, os.X_OK):
        pytest.skip(f"{PY} is missing (the other user's side needs a system Python)")
    try:
        return pwd.getpwnam(OTHER)
    except KeyError:
        pass
    useradd = shutil.which("useradd")
    if useradd is None:
        pytest.skip("no useradd to create a second local user")
    proc = subprocess.run([useradd, "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                           OTHER], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot create a second local user: {proc.stderr.strip()}")
    return pwd.getpwnam(OTHER)


def as_other(user, code: str, *args) -> dict:
    """Runs `code` as the other user; it prints one JSON object, returned here."""
    proc = subprocess.run([PY, "-c", textwrap.dedent(code), *map(str, args)], user=user.pw_uid,
                          group=user.pw_gid, extra_groups=[], cwd="/", capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture
def shared_shm():
    # Like /dev/shm: world-writable and sticky (a short path: the socket path has a limit).
    d = tempfile.mkdtemp(prefix="spsec-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.chmod(d, 0o1777)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


PROBE = """
import errno, json, os, socket, struct, sys
job_dir, sock_path, slot = sys.argv[1:4]
out = {"uid": os.getuid()}
def attempt(name, f):
    try:
        f()
        out[name] = "ok"
    except OSError as e:
        out[name] = errno.errorcode.get(e.errno, str(e.errno))
attempt("listdir", lambda: os.listdir(job_dir))
attempt("open_slot", lambda: os.close(os.open(slot, os.O_RDONLY)))
def connect():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(20)
    s.connect(sock_path)
    payload = json.dumps({"rank": 0, "world_size": 1, "storage": "/tmp/x", "keep": 1,
                          "pid": os.getpid()}).encode()
    s.sendall(struct.pack("<IHH", len(payload) + 4, 1, 1) + payload)  # a well-formed hello
    out["reply"] = s.recv(65536).decode(errors="replace")  # "" = closed by the agent
    s.close()
attempt("connect", connect)
print(json.dumps(out))
"""


def test_other_user_cannot_reach_snapshots_or_the_agent(tmp_path, shared_shm):
    user = other_user()
    ck = safepoint.Checkpointer(tmp_path / "ckpt", job="secjob", shm_dir=shared_shm)
    try:
        ck.save(1, {"w": torch.arange(1000)}, persist=True)
        ck.wait()
        job_dir = ck.status()["agent"]["job_dir"]
        sock_path = os.path.join(job_dir, "agent.sock")
        slot = os.path.join(job_dir, "rank-00000.slot-0")
        assert os.stat(job_dir).st_mode & 0o777 == 0o700
        assert os.stat(slot).st_mode & 0o777 == 0o600

        # As they are: the directory keeps the other user out of everything.
        got = as_other(user, PROBE, job_dir, sock_path, slot)
        assert got["uid"] == user.pw_uid
        assert got["listdir"] == "EACCES"
        assert got["open_slot"] == "EACCES"
        assert got["connect"] == "EACCES"

        # Opened up by hand (a mistake an operator could make): the files stay private and the
        # agent itself refuses the other uid (SO_PEERCRED), answering nothing.
        os.chmod(job_dir, 0o711)
        os.chmod(sock_path, 0o666)
        try:
            got = as_other(user, PROBE, job_dir, sock_path, slot)
        finally:
            os.chmod(job_dir, 0o700)
            os.chmod(sock_path, 0o600)
        assert got["open_slot"] == "EACCES"
        # Closed without a reply (a reset when the hello was still unread).
        assert (got["connect"] == "ok" and got["reply"] == "") or \
            got["connect"] in ("ECONNRESET", "EPIPE"), got
        with open(os.path.join(job_dir, "agent.log")) as f:
            assert f"refused a connection from uid {user.pw_uid}" in f.read()
        # ... and keeps serving its own user.
        ck.save(2, {"w": torch.arange(1000) + 2}, persist=True)
        ck.wait()
        assert ck.status()["newest_committed"] == 2
        assert ck.load()[0] == 2
    finally:
        ck.close()


PLANT = """
import json, os, sys
path, target, kind = sys.argv[1:4]
os.mkdir(target, 0o777)
if kind == "symlink":
    os.symlink(target, path)
else:
    os.mkdir(path, 0o700)
print(json.dumps({"planted": kind}))
"""


@pytest.mark.parametrize("kind", ["symlink", "directory"])
def test_job_directory_planted_by_another_user_is_refused(tmp_path, shared_shm, kind):
    user = other_user()
    path = os.path.join(shared_shm, f"safepoint-{os.geteuid()}-plantedjob")
    target = os.path.join(shared_shm, "other-owned")
    as_other(user, PLANT, path, target, kind)
    assert os.lstat(path).st_uid == user.pw_uid
    with pytest.raises(safepoint.Error) as e:
        safepoint.Checkpointer(tmp_path / "ckpt", job="plantedjob", shm_dir=shared_shm)
    msg = str(e.value)
    assert path in msg
    assert ("symlink" in msg) if kind == "symlink" else (f"uid {user.pw_uid}" in msg)
    assert os.listdir(target) == []  # nothing was created through it
    if kind == "directory":
        assert os.listdir(path) == []
