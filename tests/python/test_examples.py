"""Runs the examples of docs/guide.md (examples/*.py) as their users would.

Every example is one command that trains, is interrupted (a real SIGKILL of a training process)
and resumes, all on the CPU in a few seconds. The contract each example keeps:

- ``python examples/<file> [args]`` exits 0;
- it prints ``resumed from step N (SOURCE)`` (SOURCE: memory or storage), once per rank that
  resumes, possibly after a prefix such as ``[rank 1] ``. An example that shows something else
  (a load, not a resume) names its own line in ``Example.pattern`` (a regex with a ``step``
  group);
- it removes the temporary directory it made (named ``safepoint-*`` or ``sp-*`` in the
  temporary directory, ``$TMPDIR``).

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
from conftest import free_port

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
    needs: tuple[str, ...] = ()    # optional modules it imports (skipped without them, e.g.
    #                                under scripts/other-torch.sh; `make test` installs them)


EXAMPLES = [
    # Longest first (as measured with `--durations`): the workers take them in this order
    # (tests/python/conftest.py, SPREAD_MODULES), and a long one taken last would be the tail.
    # Lightning's DDP saves on rank 0: rank 0 resumes from memory, rank 1 from storage.
    Example("lightning_example.py", ("--devices", "2"), step=8, resumes=2,
            needs=("pytorch_lightning",)),
    # Lightning's ModelParallelStrategy (FSDP2): each rank saves its shard; both resume from memory.
    Example("lightning_example.py", ("--strategy", "fsdp2"), step=8, source="memory", resumes=2,
            needs=("pytorch_lightning",)),
    Example("hf_example.py", step=6, source="memory", needs=("transformers", "accelerate")),
    # 2 DDP ranks (CPU, gloo), both killed after the save of step 6: both resume from memory.
    Example("hf_example.py", ("--ranks", "2"), step=6, source="memory", resumes=2,
            needs=("transformers", "accelerate")),
    Example("lightning_example.py", step=16, source="memory", needs=("pytorch_lightning",)),
    # Saved by 2 FSDP2 ranks, resumed by one process: resharding reads from storage.
    Example("fsdp2.py", step=6, source="storage"),
    # DCP's example saves and then loads the newest step in one process (no crash to resume).
    Example("dcp_example.py", pattern=r"loaded step (?P<step>\d+) from \S+: weights "
                                      r"bit-identical: True"),
    Example("plain_pytorch.py", step=12, source="memory"),
    # Either source is correct for ddp.py; since leaving `with` by an exception keeps the
    # snapshots, both ranks normally resume from memory.
    Example("ddp.py", step=12, resumes=2),
    Example("deepspeed_example.py", step=3, source="memory", needs=("deepspeed",)),
    Example("torchtitan_example.py", step=4, source="memory", needs=("torchtitan",)),
    # Saved by 2 TP-2 ranks (flash), both killed; 2 ranks resume with TP 1: storage.
    Example("megatron_example.py", step=3, source="storage", resumes=2,
            needs=("megatron.core",)),
    Example("torchft_example.py", pattern=r"healed to step (?P<step>\d+) from a live peer: "
                                          r"bit-identical: True", step=5, needs=("torchft",)),
    # SIGTERM after step 12: both ranks persist step 13 at once, end by SIGTERM (the agent
    # keeps their snapshots, as after any death) and resume from it in memory.
    Example("preemptible.py", step=13, source="memory", resumes=2),
    # 2 ranks killed after step 7, 3 ranks resume: another world size reads storage; the
    # example exits 1 unless every global step trained on an uninterrupted run's samples.
    Example("exact_resume.py", step=7, source="storage", resumes=3),
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


def _remove_with_agents(shm: str) -> None:
    """SIGKILLs the agents of `shm` and of its subdirectories (one per "node"), removes it."""
    for d in [shm, *(os.path.join(shm, n) for n in os.listdir(shm))]:
        for pid in _agents_of(d):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    shutil.rmtree(shm, ignore_errors=True)


@pytest.mark.parametrize("ex", EXAMPLES, ids=[" ".join((e.file, *e.args)) for e in EXAMPLES])
def test_example_runs_and_resumes(ex: Example):
    path = os.path.join(EXAMPLES_DIR, ex.file)
    if not os.path.exists(path):
        pytest.skip(f"examples/{ex.file} does not exist yet")
    for module in ex.needs:
        pytest.importorskip(module)
    # The examples' snapshots go to a private directory instead of /dev/shm, their temporary
    # directories to a private $TMPDIR.
    own = tempfile.mkdtemp(prefix="spx-")
    tmp = tempfile.mkdtemp(prefix="spt-")
    env = dict(os.environ, SAFEPOINT_SHM_DIR=own, TMPDIR=tmp)
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
        left = sorted(n for n in os.listdir(tmp) if n.startswith(("safepoint-", "sp-")))
        assert left == [], f"temporary directories left behind: {left}\n{out}"
    finally:
        _remove_with_agents(own)
        shutil.rmtree(tmp, ignore_errors=True)


# --- docs/guide.md, "Getting started": its shell blocks, run as they stand ------------------------
# Each block follows a `<!-- getting-started: NAME -->` line. They run in bash with the paths a
# newcomer would use moved to this test's own: /tmp/gs-* under tmp_path, /dev/shm/gs-* under a
# private directory, `.venv/bin/` to this Python's bin directory and `make demo` to the demo the
# target runs once it has built (this test runs on a built tree). A `--watch` line runs for a few
# seconds and is stopped with Ctrl-C (SIGINT), as its reader would.
GUIDE = os.path.join(REPO, "docs", "guide.md")


def guide_block(name: str) -> str:
    text = open(GUIDE).read()
    m = re.search(rf"<!-- getting-started: {name} -->\n```sh\n(.*?)```", text, re.S)
    assert m, f"docs/guide.md has no getting-started block {name!r}"
    return m.group(1)


def localize(block: str, tmp: str, shm: str) -> str:
    bindir = os.path.dirname(sys.executable)
    return (block.replace("$PWD/.venv/bin", bindir).replace(".venv/bin/", bindir + "/")
            .replace("make demo", f"{sys.executable} examples/demo.py")
            .replace("/dev/shm/gs-", shm + "/gs-").replace("/tmp/gs-", tmp + "/gs-"))


def run_guide_line(line: str, env: dict) -> subprocess.CompletedProcess:
    if "--watch" not in line:
        return subprocess.run(["bash", "-c", line], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=600)
    proc = subprocess.Popen(["bash", "-c", f"exec {line}"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=3)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture
def guide_env(tmp_path):
    shm = tempfile.mkdtemp(prefix="spg-")
    env = dict(os.environ, SAFEPOINT_SHM_DIR=shm,
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    yield str(tmp_path), shm, env
    _remove_with_agents(shm)


def test_getting_started_one_node_then_what_to_watch(guide_env):
    tmp, shm, env = guide_env
    for line in localize(guide_block("one-node"), tmp, shm).strip().splitlines():
        proc = run_guide_line(line, env)
        out = f"{line}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
        assert proc.returncode == 0, out
        if "demo.py" in line:
            assert "bit-identical to an uninterrupted run" in proc.stdout, out
        if "plain_pytorch.py" in line:
            assert re.search(RESUMED, proc.stdout), out
    assert os.path.isdir(os.path.join(tmp, "gs-run0"))
    for line in localize(guide_block("watch"), tmp, shm).strip().splitlines():
        line = line.split("#")[0].strip()
        proc = run_guide_line(line, env)
        out = f"{line}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
        assert proc.returncode == 0, out
        if " advise " in line:
            assert "save every" in proc.stdout and "persist every" in proc.stdout, out


def test_getting_started_several_nodes(guide_env):
    """Two torchrun "nodes" on this machine, redundancy="mirror", and the S3 tier when the test
    Ceph runs (`make test` starts it; without it the block runs without the tier)."""
    tmp, shm, env = guide_env
    block = localize(guide_block("nodes"), tmp, shm)
    # A free rendezvous port instead of the guide's fixed one (tests run side by side), and the
    # Ceph `make test` already runs under (scripts/with-ceph.sh) instead of a second one.
    block = block.replace("--master-port 29531", f"--master-port {free_port()}")
    assert block.startswith("scripts/with-ceph.sh bash -c"), block
    block = block.replace("scripts/with-ceph.sh bash -c", "bash -c", 1)
    proc = subprocess.run(["bash", "-c", block], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    out = f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, out
    assert len(re.findall(r"\[rank \d\] fresh start", proc.stdout)) == 2, out
    assert {int(s) for s in re.findall(r"resumed from step (\d+)", proc.stdout)} == {20}, out
    assert len(re.findall(r"in a peer's memory: True", proc.stdout)) == 4, out
    if os.environ.get("SAFEPOINT_TEST_S3_URI"):
        assert re.search(r"on s3://\S+: steps \[.*30\]", proc.stdout), out
