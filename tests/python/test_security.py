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
import pathlib
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


# --- issue 35: files another user planted, credentials in URIs, a squatted job directory --------

def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["safepoint", *args], capture_output=True, text=True, timeout=120)


def _agent_log(ck) -> str:
    with open(os.path.join(ck.status()["agent"]["job_dir"], "agent.log")) as f:
        return f.read()


PLANT_FILE = """
import json, os, sys
path, kind, target = sys.argv[1:4]
if kind == "symlink":
    os.symlink(target, path)
else:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    os.fchmod(fd, 0o666)  # whatever the umask: the other user can read what is written
    os.close(fd)
print(json.dumps({"planted": kind}))
"""


@pytest.fixture
def other_dir():
    """A directory the other user owns and the agent (root) is told to write in (its home, a
    shared log or checkpoint directory): the kernel's protected_symlinks/protected_regular do
    not apply there, only the agent's own checks."""
    user = other_user()
    top = tempfile.mkdtemp(prefix="spsec-other-")  # reachable by the other user
    os.chmod(top, 0o755)
    d = os.path.join(top, "other")
    os.mkdir(d)
    os.chown(d, user.pw_uid, user.pw_gid)
    os.chmod(d, 0o755)
    try:
        yield user, pathlib.Path(d)
    finally:
        shutil.rmtree(top, ignore_errors=True)


@pytest.mark.parametrize("kind", ["file", "symlink"])
def test_event_log_planted_by_another_user_is_refused_and_the_job_goes_on(tmp_path, shared_shm,
                                                                          other_dir, kind):
    user, d = other_dir
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    log = d / "events.jsonl"
    as_other(user, PLANT_FILE, log, kind, victim)
    ck = safepoint.Checkpointer(tmp_path / "ckpt", job=f"evlog{kind}", shm_dir=shared_shm,
                                event_log=log)
    try:
        ck.save(1, {"w": torch.arange(1000)}, persist=True)
        ck.wait()
        assert ck.status()["newest_committed"] == 1  # the job goes on without its log
        text = _agent_log(ck)
        assert "event log" in text and str(log) in text
        assert ("symlink" in text) if kind == "symlink" else (f"uid {user.pw_uid}" in text), text
        got = json.loads(_cli("status", "--json", "--shm-dir", shared_shm).stdout)
        job = next(j for j in got if j["job"] == f"evlog{kind}")
        assert str(log) in (job.get("event_log_error") or ""), job
    finally:
        ck.close()
    assert victim.read_text() == "precious\n"  # nothing written through the symlink
    if kind == "file":
        assert os.path.getsize(log) == 0  # nothing the other user could read


def test_history_planted_by_another_user_is_refused_and_the_job_goes_on(tmp_path, shared_shm,
                                                                        other_dir):
    user, d = other_dir  # a checkpoint directory another user can write (a shared filesystem)
    history = d / "safepoint-history.jsonl"
    as_other(user, PLANT_FILE, history, "file", "")
    ck = safepoint.Checkpointer(d, job="histjob", shm_dir=shared_shm)
    try:
        ck.save(1, {"w": torch.arange(1000)}, persist=True)
        ck.wait()
        assert ck.status()["newest_committed"] == 1
        text = _agent_log(ck)
        assert "measurement history" in text and str(history) in text, text
    finally:
        ck.close()
    assert os.path.getsize(history) == 0
    assert safepoint.load(d)[0] == 1


SECRET = "TopSecretValue"


def test_credentials_in_a_storage_uri_are_refused_and_never_shown(tmp_path, shared_shm,
                                                                   monkeypatch):
    # Credentials for a gateway nobody listens on: what is refused is the URI itself.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    uri = f"s3://AKIAKEYID:{SECRET}@bucket/run1"
    with pytest.raises(safepoint.Error) as e:
        ck = safepoint.Checkpointer(uri, job="credjob", shm_dir=shared_shm)
        try:
            ck.save(1, {"w": torch.arange(10)}, persist=True)
            ck.wait()
        finally:
            ck.close()
    msg = str(e.value)
    assert SECRET not in msg and "AKIAKEYID" not in msg, msg
    assert "AWS_SECRET_ACCESS_KEY" in msg, msg
    for tier_uri in (f"s3://{SECRET}@bucket/run1", f"file://u:{SECRET}@localhost{tmp_path}/t"):
        with pytest.raises(safepoint.Error) as e:
            ck = safepoint.Checkpointer(tmp_path / "ckpt", job="credtier", shm_dir=shared_shm,
                                        tiers=[safepoint.Tier(tmp_path / "ckpt"),
                                               safepoint.Tier(tier_uri, every=2)])
            try:
                ck.save(2, {"w": torch.arange(10)}, persist=True)
                ck.wait()
            finally:
                ck.close()
        assert SECRET not in str(e.value), str(e.value)
    # The CLI refuses it too, without showing it.
    for args in (["ls", uri], ["verify", uri], ["status", "--json", "--shm-dir", shared_shm],
                 ["status", "--shm-dir", shared_shm]):
        out = _cli(*args)
        assert SECRET not in out.stdout + out.stderr, (args, out.stdout, out.stderr)
    # Nothing any agent wrote (job.json, agent.log, events.jsonl) holds it.
    for root, _, files in os.walk(shared_shm):
        for name in files:
            path = os.path.join(root, name)
            if os.path.isfile(path):  # not the agent's socket
                with open(path, "rb") as f:
                    assert SECRET.encode() not in f.read(), path


def test_gc_reports_a_job_directory_another_user_squats(tmp_path, shared_shm):
    user = other_user()
    path = os.path.join(shared_shm, f"safepoint-{os.geteuid()}-squatted")
    target = os.path.join(shared_shm, "other-owned-2")
    as_other(user, PLANT, path, target, "directory")
    # The job's agent fails closed, and its error says whose it is and how to remove it.
    with pytest.raises(safepoint.Error) as e:
        safepoint.Checkpointer(tmp_path / "ckpt", job="squatted", shm_dir=shared_shm)
    msg = str(e.value)
    assert path in msg and f"uid {user.pw_uid}" in msg and f"rm -rf -- '{path}'" in msg, msg
    # gc reports it (and leaves it alone: it is not this user's to remove).
    got = json.loads(_cli("gc", "--dry-run", "--json", "--shm-dir", shared_shm).stdout)
    blocked = got.get("blocked", [])
    assert [b["path"] for b in blocked] == [path], got
    assert blocked[0]["owner_uid"] == user.pw_uid and blocked[0]["foreign"], blocked
    assert blocked[0]["job"] == "squatted" and blocked[0]["kind"] == "directory", blocked
    out = _cli("gc", "--shm-dir", shared_shm)
    assert out.returncode == 0, out.stderr
    assert path in out.stdout and f"uid {user.pw_uid}" in out.stdout, out.stdout
    assert f"rm -rf -- '{path}'" in out.stdout, out.stdout
    assert os.path.isdir(path)
