import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def cli_path() -> str:
    """The safepoint CLI installed beside this Python (the venv's bin) or on PATH."""
    cand = os.path.join(os.path.dirname(sys.executable), "safepoint")
    if os.path.exists(cand):
        return cand
    found = shutil.which("safepoint")
    if not found:
        pytest.skip("the safepoint CLI is not installed")
    return found


@pytest.fixture
def cli():
    path = cli_path()

    def run(*args, check=None):
        proc = subprocess.run([path, *map(str, args)], capture_output=True, text=True, timeout=120)
        if check is not None:
            assert proc.returncode == check, (proc.returncode, proc.stdout, proc.stderr)
        return proc

    return run


@pytest.fixture
def ckpt(tmp_path):
    return tmp_path / "ckpt"


def run_python(code: str, *args, timeout=300, **kwargs):
    """Runs `code` in a fresh interpreter (a separate process, as a rank would be)."""
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], **kwargs)
