"""A checkpoint directory that cannot be written is said so at once (issue 36, item 2).

Before, a Checkpointer on a read-only or permission-denied directory accepted every save()
without a word (the node agent's persists failed in the background; only wait() raised), and a
path that could not be created raised InvalidArgumentError ("the agent refused this process").
Now the constructor checks the directory (a write, not access(): these tests run as root, whom
permission bits do not stop, so the unwritable directories here are real: a read-only bind
mount, an immutable directory, a path under a file, and, for other users, a directory without
write permission), and save() warns while the agent's persists fail.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import warnings

import pytest
import torch

import safepoint
from safepoint.errors import (
    InvalidArgumentError,
    PermissionDeniedError,
    StorageError,
)


def _chattr(flag: str, path) -> bool:
    if shutil.which("chattr") is None:
        return False
    return subprocess.run(["chattr", flag, str(path)], capture_output=True).returncode == 0


@pytest.fixture
def immutable(tmp_path):
    """An existing directory nothing may be created in, not even by root (chattr +i)."""
    d = tmp_path / "immutable"
    d.mkdir()
    if not _chattr("+i", d):
        pytest.skip("chattr +i is not possible here (not root, or a filesystem without it)")
    yield d
    _chattr("-i", d)


@pytest.fixture
def read_only(tmp_path):
    """A read-only bind mount of an empty directory (root and mount privileges needed)."""
    src, mnt = tmp_path / "ro-src", tmp_path / "ro"
    src.mkdir()
    mnt.mkdir()
    if subprocess.run(["mount", "--bind", str(src), str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot bind-mount here (not root, or no mount privilege)")
    try:
        if subprocess.run(["mount", "-o", "remount,bind,ro", str(mnt)],
                          capture_output=True).returncode:
            pytest.skip("cannot remount read-only here")
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def refused(path, shm, cls=StorageError) -> StorageError:
    with pytest.raises(cls) as got:
        safepoint.Checkpointer(path, job="unwritable", shm_dir=shm)
    assert not isinstance(got.value, InvalidArgumentError)
    assert str(got.value).startswith(f"{path}: "), got.value  # names the path first
    assert "could not persist any step" in str(got.value)
    assert not os.listdir(shm), "no agent or job directory for a refused path"
    return got.value


@pytest.mark.parametrize("below", [False, True], ids=["the-directory", "a-path-below"])
def test_a_read_only_mount_is_refused_when_the_checkpointer_is_built(read_only, shm, below):
    path = read_only / "run1" / "ckpt" if below else read_only
    e = refused(path, shm, PermissionDeniedError)
    assert isinstance(e, PermissionError) and "Read-only file system" in str(e), e


@pytest.mark.parametrize("below", [False, True], ids=["the-directory", "a-path-below"])
def test_an_immutable_directory_is_refused(immutable, shm, below):
    path = immutable / "ckpt" if below else immutable
    e = refused(path, shm, PermissionDeniedError)
    assert isinstance(e, PermissionError) and "Operation not permitted" in str(e), e


def test_a_directory_without_write_permission_is_refused(tmp_path, shm):
    if os.geteuid() == 0:
        pytest.skip("root writes whatever the permission bits say (the other tests cover it)")
    d = tmp_path / "no-write"
    d.mkdir(mode=0o500)
    try:
        e = refused(d / "ckpt", shm, PermissionDeniedError)
        assert "Permission denied" in str(e), e
    finally:
        d.chmod(0o700)


def test_a_path_that_cannot_be_created_is_a_storage_error(tmp_path, shm):
    """Not InvalidArgumentError ("the safepoint agent refused this process"), as before."""
    (tmp_path / "a-file").write_text("x")
    e = refused(tmp_path / "a-file" / "ckpt", shm)
    assert f"{tmp_path / 'a-file'} is not a directory" in str(e), e
    refused(tmp_path / "a-file", shm)  # the path itself a file


def test_the_agents_refusal_of_a_path_is_a_storage_error(tmp_path, shm, monkeypatch):
    """Where the agent still refuses (the check above passed, the agent could not create the
    path after all), its status code's error is raised, not InvalidArgumentError: the client
    keeps the code of the agent's refusal (src/client/snapshot_client.cc, HelloRefusal; the
    other codes: AgentTest.APathTheAgentCannotCreateIsAStorageErrorNamingIt)."""
    import safepoint._checkpointer as ck
    monkeypatch.setattr(ck, "_check_writable", lambda path: None)  # reach the agent
    (tmp_path / "a-file").write_text("x")
    path = tmp_path / "a-file" / "ckpt"
    with pytest.raises(StorageError) as e:
        safepoint.Checkpointer(path, job="refused", shm_dir=shm)
    assert type(e.value) is StorageError and str(e.value).startswith(str(tmp_path / "a-file")), e
    assert "cannot use the checkpoint path" in str(e.value)
    # Another refusal stays InvalidArgumentError (another path under the job's name).
    (tmp_path / "good").mkdir()
    with safepoint.Checkpointer(tmp_path / "good", job="refused", shm_dir=shm) as first:
        with pytest.raises(InvalidArgumentError, match="already persists"):
            safepoint.Checkpointer(tmp_path / "other", job="refused", shm_dir=shm)
        first.save(1, {"w": torch.ones(1)})


def test_a_writable_path_passes_and_leaves_no_probe_behind(tmp_path, shm):
    (tmp_path / "existing").mkdir()
    for path in (tmp_path / "existing", tmp_path / "new" / "ckpt"):
        with safepoint.Checkpointer(path, job="writable", shm_dir=shm) as ckpt:
            ckpt.save(1, {"w": torch.ones(3)})
            ckpt.wait()
        assert safepoint.steps(path) == [1]
        for d in (path, path.parent):
            assert not [n for n in os.listdir(d) if n.startswith(".safepoint-write-check")]


def test_save_warns_while_persists_fail(tmp_path, shm):
    """The directory becomes unwritable after the Checkpointer is built: the agent's persists
    fail, and save() says so (one warning, then at most one a minute), naming the error."""
    path = tmp_path / "ckpt"
    ckpt = safepoint.Checkpointer(path, job="failing", shm_dir=shm, keep=100)
    try:
        ckpt.save(1, {"w": torch.ones(3)})
        ckpt.wait()
        if not _chattr("+i", path):
            pytest.skip("chattr +i is not possible here")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                deadline = time.monotonic() + 60
                step = 1
                while not caught and time.monotonic() < deadline:
                    step += 1
                    ckpt.save(step, {"w": torch.full((3,), float(step))})
                    time.sleep(0.05)
                for _ in range(20):  # more failing saves within the minute: no more warnings
                    step += 1
                    ckpt.save(step, {"w": torch.full((3,), float(step))})
                    time.sleep(0.1)
            assert len(caught) == 1, [str(w.message) for w in caught]
            msg = str(caught[0].message)
            assert caught[0].category is RuntimeWarning
            assert msg.startswith(f"safepoint: {path}: the node agent failed to persist"), msg
            assert "Operation not permitted" in msg, msg
            status = ckpt.status()
            assert status["persists_failed"] >= 1 and status["last_persist_error"], status
            with pytest.raises(StorageError):
                ckpt.wait(30)
        finally:
            _chattr("-i", path)
    finally:
        ckpt.abandon()
