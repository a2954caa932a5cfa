"""Runs the examples of docs/guide.md (examples/*.py) as their users would.

Every example is one command that trains, is interrupted (a real SIGKILL of a training process)
and resumes, all on the CPU in a few seconds. The contract each example keeps:

- ``python examples/<file> [args]`` exits 0;
- it prints ``resumed from step N (SOURCE)`` (SOURCE: memory or storage), once per rank that
  resumes, possibly after a prefix such as ``[rank 1] ``. An example that shows something else
  (a load, not a resume) names its own line in ``Example.pattern`` (a regex with a ``step``
  group).

To add an example, add an ``Example`` to EXAMPLES (a missing file is skipped, with the reason).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Optional

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
EXAMPLES_DIR = os.path.join(REPO, "examples")
RESUMED = r"resumed from step (?P<step>\d+) \((?P<source>memory|storage)\)"


@dataclass(frozen=True)
class Example:
    file: str                      # under examples/
    args: tuple[str, ...] = ()
    pattern: str = RESUMED         # the line that says what it resumed (or loaded) from
    step: Optional[int] = None     # the step it must resume from, when the example fixes it
    source: Optional[str] = None   # "memory" or "storage", when the example fixes it
    resumes: int = 1               # how many resume lines (one per rank that resumes)
    timeout: float = 600.0         # a guard against a hang, not a performance limit


EXAMPLES = [
    Example("plain_pytorch.py", step=12, source="memory"),
    # Either source is correct for ddp.py; since leaving `with` by an exception keeps the
    # snapshots, both ranks normally resume from memory.
    Example("ddp.py", step=12, resumes=2),
    # DCP's example saves and then loads the newest step in one process (no crash to resume).
    Example("dcp_example.py", pattern=r"loaded step (?P<step>\d+) from \S+: weights "
                                      r"bit-identical: True"),
    # Saved by 2 FSDP2 ranks, resumed by one process: resharding reads from storage.
    Example("fsdp2.py", step=6, source="storage"),
    Example("lightning_example.py", step=16, source="memory"),
    Example("hf_example.py", step=6, source="memory"),
    # SIGTERM after step 12: both ranks persist step 13 at once and resume from it.
    Example("preemptible.py", step=13, source="storage", resumes=2),
]


def _agents_of(shm: str) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:
            continue
        if argv and argv[0].endswith("safepointd") and \
                dict(zip(argv[1::2], argv[2::2])).get("--shm-dir") == shm:
            out.append(int(entry))
    return out


@pytest.mark.parametrize("ex", EXAMPLES, ids=[e.file for e in EXAMPLES])
def test_example_runs_and_resumes(ex: Example):
    path = os.path.join(EXAMPLES_DIR, ex.file)
    if not os.path.exists(path):
        pytest.skip(f"examples/{ex.file} does not exist yet")
    # The examples' snapshots go to a private directory instead of /dev/shm.
    own = tempfile.mkdtemp(prefix="spx-")
    env = dict(os.environ, SAFEPOINT_SHM_DIR=own)
    try:
        proc = subprocess.run([sys.executable, path, *ex.args], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=ex.timeout)
        out = f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
        assert proc.returncode == 0, out
        # Searched in the whole output: the lines of ranks that print at once may interleave.
        found = [(int(m.group("step")), m.groupdict().get("source"))
                 for m in re.finditer(ex.pattern, proc.stdout)]
        assert len(found) == ex.resumes, out
        if ex.step is not None:
            assert {s for s, _ in found} == {ex.step}, out
        if ex.source is not None:
            assert {src for _, src in found} == {ex.source}, out
    finally:
        for pid in _agents_of(own):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(own, ignore_errors=True)
