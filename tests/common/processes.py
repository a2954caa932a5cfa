"""Processes of the tests: training processes, node agents, their logs and their deaths.

One module for every test that starts real processes and kills them (tests/python/test_flash.py,
test_determinism.py, test_processes.py, and the crash driver tests/crash/crashtest.py). It knows
what the agent leaves on a node (docs/architecture.md): the job directory
"<shm_dir>/safepoint-<uid>-<job>" with the agent's lock (its pid), log and socket, and the
agent's command line "safepointd --job <job> --shm-dir <shm_dir>".

Waits here only guard against hangs (they return False or raise when the guard runs out); no
test may depend on how long something takes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import queue
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

HANG = 180.0  # seconds: a guard against a hung process, never a performance limit


# --- waiting -------------------------------------------------------------------------------------

def wait_until(cond: Callable[[], bool], deadline: float = HANG, interval: float = 0.005) -> bool:
    """Polls `cond` until it holds (True) or `deadline` seconds passed (False)."""
    end = time.monotonic() + deadline
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(interval)
    return True


# --- /proc ---------------------------------------------------------------------------------------

def proc_state(pid: int) -> Optional[str]:
    """The state letter of /proc/<pid>/stat ("R", "S", "Z", ...); None when there is no such
    process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def proc_ppid(pid: int) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
        return None


def proc_argv(pid: int) -> list[str]:
    """The command line of a live process; [] when it is gone or a zombie (agents are reparented
    and nobody may reap them: a zombie is dead)."""
    if proc_state(pid) in (None, "Z"):
        return []
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except (FileNotFoundError, ProcessLookupError):
        return []


def dead(pid: int) -> bool:
    """Gone, or a zombie whose threads have all exited (so its files, sockets and locks are
    closed: a thread-group leader shows "Z" while its other threads are still exiting)."""
    if proc_state(pid) not in (None, "Z"):
        return False
    try:
        return os.listdir(f"/proc/{pid}/task") in ([], [str(pid)])
    except (FileNotFoundError, ProcessLookupError):
        return True


def pids() -> list[int]:
    return [int(e) for e in os.listdir("/proc") if e.isdigit()]


def kill(pid: int, sig: int = signal.SIGKILL) -> bool:
    """Sends `sig`; False when the process is already gone."""
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def kill_and_wait(pid: int, deadline: float = HANG) -> None:
    """SIGKILL (after SIGCONT, for a stopped process) and wait until it is dead."""
    kill(pid, signal.SIGCONT)
    kill(pid, signal.SIGKILL)
    if not wait_until(lambda: dead(pid), deadline):
        raise AssertionError(f"pid {pid} survived SIGKILL (state {proc_state(pid)})")


def become_subreaper() -> None:
    """Makes this process the reaper of its orphaned descendants (prctl PR_SET_CHILD_SUBREAPER):
    an agent that a training process starts (a double fork, so that it is reparented) then
    stays below this process, where `children` finds it even before it runs safepointd."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def children(parent: int) -> list[int]:
    """Live processes whose parent is `parent`."""
    return [p for p in pids() if proc_ppid(p) == parent and proc_state(p) not in (None, "Z")]


# --- the node agent ------------------------------------------------------------------------------

def job_dir(shm_dir: "str | Path", job: str) -> Path:
    """The job's directory in shared memory (src/shm/arena.h, JobDirectory)."""
    return Path(shm_dir) / f"safepoint-{os.geteuid()}-{job}"


def is_agent_of(pid: int, shm_dir: "str | Path", job: Optional[str] = None) -> bool:
    """Whether `pid` is a live safepointd serving `job` (any job when None) in `shm_dir`."""
    argv = proc_argv(pid)
    if not argv or not argv[0].endswith("safepointd"):
        return False
    opts = dict(zip(argv[1::2], argv[2::2]))
    return opts.get("--shm-dir") == str(shm_dir) and (job is None or opts.get("--job") == job)


def agents_of(shm_dir: "str | Path", job: Optional[str] = None) -> list[int]:
    """Live safepointd processes serving `job` (every job when None) in `shm_dir`, found by their
    command lines: also those that have not taken the job's lock yet."""
    return [p for p in pids() if is_agent_of(p, shm_dir, job)]


def lock_agent_pid(shm_dir: "str | Path", job: str) -> Optional[int]:
    """The pid in the job's agent.lock when that process is the job's live agent."""
    try:
        text = (job_dir(shm_dir, job) / "agent.lock").read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    if not text.isdigit():
        return None  # an agent is just writing it
    pid = int(text)
    return pid if is_agent_of(pid, shm_dir, job) else None


def agent_log(shm_dir: "str | Path", job: str) -> str:
    try:
        return (job_dir(shm_dir, job) / "agent.log").read_text(errors="replace")
    except (FileNotFoundError, NotADirectoryError):
        return ""


def kill_agents(shm_dir: "str | Path", job: Optional[str] = None,
                deadline: float = HANG) -> list[int]:
    """SIGKILLs every agent of `job` (every job when None) in `shm_dir` and waits until each is
    dead; returns their pids."""
    killed = []
    for pid in agents_of(shm_dir, job):
        kill_and_wait(pid, deadline)
        killed.append(pid)
    return killed


# --- starting processes --------------------------------------------------------------------------

def start_script(path: str, *args, **popen) -> subprocess.Popen:
    """Runs a Python file (a test file doubling as its own worker, or a worker script) with
    warnings off and text pipes for stdout and stderr (unless `popen` says otherwise)."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    kw = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, "env": env}
    kw.update(popen)
    return subprocess.Popen([sys.executable, os.path.abspath(path), *map(str, args)], **kw)


def run_python(code: str, *args, **popen) -> subprocess.Popen:
    """Runs `code` in a fresh interpreter (a separate process, as a rank would be)."""
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], **popen)


def sigkill(proc: subprocess.Popen) -> int:
    """SIGKILL a child (if it still runs) and reap it; returns its exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    return proc.wait()


class LineReader:
    """Reads a process's stdout lines on a thread into a queue: `next` returns the next line's
    fields (None at the end), `expect` the next line of one of the given kinds. `observe` sees
    the fields of every line read (it may record them, or raise on a line that must not be)."""

    def __init__(self, stdout: Iterable[str], what: str, stderr: Callable[[], str] = lambda: "",
                 observe: Callable[[list[str]], None] = lambda fields: None):
        self.what, self.stderr, self.observe = what, stderr, observe
        self.queue: "queue.Queue[Optional[str]]" = queue.Queue()
        self.lines: list[str] = []
        self.eof = False
        threading.Thread(target=self._read, args=(stdout,), daemon=True).start()

    def _read(self, stdout: Iterable[str]) -> None:
        for line in stdout:
            self.queue.put(line)
        self.queue.put(None)

    def next(self, timeout: float = HANG) -> Optional[list[str]]:
        if self.eof:
            return None
        try:
            line = self.queue.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"{self.what} said nothing for {timeout} s; stderr:\n"
                                 f"{self.stderr()}") from None
        if line is None:
            self.eof = True
            return None
        self.lines.append(line.rstrip("\n"))
        if not line.endswith("\n"):
            # The last words of a process killed mid-line ("BEGIN" without its step): kept in
            # `lines` for the record, never parsed as a whole line.
            self.eof = True
            return None
        fields = line.split()
        self.observe(fields)
        return fields

    def expect(self, *kinds: str) -> list[str]:
        while True:
            fields = self.next()
            if fields is None:
                raise AssertionError(f"{self.what} ended before saying {kinds}; stderr:\n"
                                     f"{self.stderr()}")
            if fields and fields[0] in kinds:
                return fields

    def drain(self) -> None:
        while self.next() is not None:
            pass


# --- a worker driven over stdin ------------------------------------------------------------------

def serve_commands(handle: Callable[[str, list[str]], list], errors: tuple = (Exception,)) -> None:
    """The worker's side of CommandedWorker: for each stdin line "CMD ARG...", prints "OK" and
    what `handle(cmd, args)` returns, or "ERROR <type> <message on one line>" for an exception
    of `errors`; returns at the end of stdin."""
    for line in sys.stdin:
        cmd, *args = line.split()
        try:
            print("OK", *handle(cmd, args), flush=True)
        except errors as e:
            print("ERROR", type(e).__name__, str(e).replace("\n", " "), flush=True)


class CommandedWorker:
    """A test file run as its own worker (`python FILE worker ARGS...`, serve_commands on its
    side): one command a line on stdin, one answer line each. `send` then `answer` lets a test
    send a command to several workers before it reads any answer (a collective)."""

    def __init__(self, path: str, *args, what: str = "worker", timeout: float = HANG):
        self.proc = start_script(path, "worker", *args, stdin=subprocess.PIPE)
        self.out = LineReader(self.proc.stdout, f"{what} ({self.proc.pid})")
        self.timeout = timeout

    def send(self, cmd: str) -> None:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()

    def answer(self, cmd: str) -> list[str]:
        fields = self.out.next(timeout=self.timeout)
        assert fields is not None, f"{self.out.what} died on {cmd!r}: " \
            f"{self.proc.stderr.read() if self.proc.poll() is not None else ''}"
        return fields

    def ask(self, cmd: str) -> list[str]:
        self.send(cmd)
        return self.answer(cmd)

    def ok(self, cmd: str) -> list[str]:
        fields = self.ask(cmd)
        assert fields[0] == "OK", f"{cmd!r}: {' '.join(fields)}"
        return fields[1:]


@contextlib.contextmanager
def small_tmpfs(mnt: "str | Path", size: str) -> Iterator[Path]:
    """A tmpfs of `size` (mount's size=, e.g. "8m") mounted on the existing directory `mnt` for
    the block, unmounted after (lazily if busy). Skips the test where it cannot be mounted (not
    root, no mount permission)."""
    import pytest

    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    m = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if m.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {m.stderr.strip()}")
    try:
        yield Path(mnt)
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def tail(path: "str | Path", n: int = 3000) -> str:
    try:
        return Path(path).read_text(errors="replace")[-n:]
    except FileNotFoundError:
        return ""


class PipedProcess:
    """A multiprocessing process running `target(conn, cfg)`, which sends tuples `(kind, ...)`
    on `conn`, and the events it sent (the deterministic-training and exact-resume tests)."""

    def __init__(self, ctx, target: Callable, cfg: dict, hang: float = HANG):
        self.cfg, self.hang = cfg, hang
        r, w = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=target, args=(w, cfg))
        self.proc.start()
        w.close()
        self.conn = r
        self.events: list[tuple] = []
        self.eof = False

    def next(self) -> Optional[tuple]:
        """The next event, None once the process closed its end."""
        if self.eof:
            return None
        if not self.conn.poll(self.hang):
            raise AssertionError(f"rank {self.cfg.get('rank', 0)} (pid {self.proc.pid}) sent "
                                 f"nothing for {self.hang} s; last events {self.events[-3:]}")
        try:
            ev = self.conn.recv()
        except EOFError:
            self.eof = True
            return None
        self.events.append(ev)
        return ev

    def expect(self, *kinds: str) -> tuple:
        """The next event of one of `kinds` (others are kept in `events`)."""
        while True:
            ev = self.next()
            if ev is None:
                self.proc.join(self.hang)
                raise AssertionError(f"rank {self.cfg.get('rank', 0)} exited "
                                     f"({self.proc.exitcode}) before sending {kinds}; "
                                     f"events {self.events[-5:]}")
            if ev[0] in kinds:
                return ev

    def kill(self) -> Optional[int]:
        """SIGKILLs it (if alive) and returns its exit code."""
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(self.hang)
        return self.proc.exitcode

    def finish(self) -> Optional[int]:
        """Reads its events to the end and returns its exit code."""
        while self.next() is not None:
            pass
        self.proc.join(self.hang)
        return self.proc.exitcode
