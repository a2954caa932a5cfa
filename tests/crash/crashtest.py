#!/usr/bin/env python3
"""The crash campaign (RocksDB's db_crashtest idea): kill -9 the training processes, the agent or
both, at random moments and at the named kill points (src/base/kill_point.h), restart, and check an
expected-state record after every round.

    tests/crash/crashtest.py [--kills N] [--seed S] [--build-dir build/py]
    tests/crash/crashtest.py --nodes [--rounds N] [--seed S] [--verbose]

It runs the Python package, `safepointd` and `safepoint` of the build in --build-dir (`make build`'s,
by default; every build has the kill points, armed by SAFEPOINT_KILL_AT). Two jobs run side by side: one rank, and two ranks (torch.distributed over gloo, lockstep),
each with persists every k-th step and retention, and two storage tiers below its path (file://
directories the agent copies committed steps into on their own schedules). Every state a rank
saves is a pure function of (seed, step, rank) (workload.make_state). A round:

  1. plan (from the seeded generator): whom to kill (the training processes, the agent, both, or
     both plus the node's shared memory, and half the time the job's path: the node's own
     storage, so that the job resumes from a tier), and when: at a named kill point
     (SAFEPOINT_KILL_AT, one-shot through SAFEPOINT_KILL_STAMP) or after a random delay;
  2. start the ranks (forked from a zygote that imported torch once); each resumes, checks what it
     loaded bit for bit, saves a few steps, sometimes waits for a commit or asks status();
  3. kill; when one rank dies, the others are killed too (as torchrun does); the survivors of a
     round that killed only the agent finish, then exit without closing or close cleanly;
  4. wait until the agent is idle (or gone), then check.

Checks (any failure is a violation; the run exits 1 and prints how to replay it):
  - resume: every rank loads the same step, bit-exact; never older than the newest committed
    step; never older than the newest step whose save() returned on every rank while the
    snapshots stayed in memory; from storage exactly the newest committed step when memory was
    lost (and exactly the step the ranks closed at, after a clean close);
  - storage: every listed step (safepoint.steps) was begun by every rank and loads bit-exact for
    every rank; every step the agent reported committed (wait() returned, status()) is listed
    or was pruned by retention (then `keep` newer steps are listed); `safepoint verify --all`
    is clean; temporaries (left by kills, and decoys planted by the driver) are never listed;
  - tiers: the same on every tier (each listed step begun by every rank, bit-exact for every
    rank, `verify --all` clean); on path and every tier, a step listed at one check is listed
    at the next or was pruned by that store's retention (`keep` newer listed); a tier is never
    ahead of the tier above; the resume is never older than the newest step listed on any
    store; with the agent idle (and after the final clean run) each tier is caught up: it holds
    a step once the tier above does, less than its `every` behind the tier above's newest;
  - processes: a training process exits only when killed or told to; an agent dies only when
    killed (or exits, logging so); no round hangs.

`--nodes` runs the node-loss rounds instead (tests/crash/node_campaign.py: multi-node jobs with
peer replication on network-namespace nodes, rounds that lose whole nodes; root).

The plan is a function of the seed; where a random-delay kill lands depends on timing, so a replay
repeats the plan, not every interleaving. Kill-point kills repeat exactly.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import queue
import random
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from typing import Any, Callable, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "tests", "common"))
from processes import (agent_log, agents_of, become_subreaper, children, dead,  # noqa: E402
                       job_dir, kill_and_wait, lock_agent_pid, proc_argv, proc_state,
                       wait_until)

HANG = 300.0  # seconds: a guard against hangs, never a performance limit


# --- the kill points ----------------------------------------------------------------------------

def read_kill_points() -> dict[str, bool]:
    """name -> hit once per piece/object ("(each)"), from src/base/kill_point.h, the one list."""
    text = open(os.path.join(REPO, "src", "base", "kill_point.h")).read()
    body = text[text.index("kKillPoints[] = {"):]
    body = body[:body.index("};")]
    points = {}
    for m in re.finditer(r'^\s*"([a-z_.]+)",\s*//(.*)$', body, re.M):
        points[m.group(1)] = "(each)" in m.group(2)
    if not points:
        raise SystemExit("no kill points found in src/base/kill_point.h")
    return points


# --- the zygote: imports torch once, forks a training process per request -----------------------

def zygote_main(fd: int) -> int:
    sock = socket.socket(fileno=fd)
    # The agents that training processes start (double-forked to be reparented) stay below the
    # zygote, where the driver finds them before they even run safepointd (Campaign.lose_node).
    become_subreaper()
    sys.path.insert(0, HERE)
    import torch  # noqa: F401  (imported once here; children are forked)
    import torch.distributed  # noqa: F401

    import safepoint
    import workload

    sock.send(json.dumps({"ready": os.getpid(), "core": safepoint._core.__file__}).encode())
    while True:
        # Reap by polling (no SIGCHLD handler: nothing to inherit, nothing to miss).
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            sock.send(json.dumps({"exited": pid, "status": status}).encode())
        ready, _, _ = select.select([sock], [], [], 0.01)
        if not ready:
            continue
        msg, fds, _, _ = socket.recv_fds(sock, 1 << 16, 3)
        if not msg:
            return 0
        args = json.loads(msg)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                sock.close()
                for i, f in enumerate(fds):
                    os.dup2(f, i)
                    os.close(f)
                code = workload.child_main(args)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except BaseException:
                traceback.print_exc()
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code)
        for f in fds:
            os.close(f)
        sock.send(json.dumps({"spawned": pid}).encode())


class Zygote:
    def __init__(self, env: dict, log: str, launch=subprocess.Popen):
        """`launch`: how the zygote is started (subprocess.Popen, or a node's popen: inside the
        node's namespaces, tests/common/nodes.py)."""
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with open(log, "ab") as err:
            self.proc = launch(
                [sys.executable, os.path.abspath(__file__), "--zygote", str(child.fileno())],
                pass_fds=[child.fileno()], env=env, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=err)
        child.close()
        self.sock = parent
        self.sock.settimeout(HANG)
        hello = json.loads(self.sock.recv(1 << 16) or b"{}")
        if "ready" not in hello:
            raise SystemExit(f"the zygote did not start; see {log}")
        self.info = hello
        self.sock.settimeout(None)
        self.exits: dict[int, int] = {}
        self.cv = threading.Condition()
        self.spawned: "queue.Queue[int]" = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                msg = self.sock.recv(1 << 16)
            except OSError:
                return
            if not msg:
                return
            m = json.loads(msg)
            if "spawned" in m:
                # The pid may be one an earlier process had (pid_max 32768 wraps within a long
                # campaign): its exit status is not this one's (seed 3149345724, round 561).
                with self.cv:
                    self.exits.pop(m["spawned"], None)
                self.spawned.put(m["spawned"])
            elif "exited" in m:
                with self.cv:
                    self.exits[m["exited"]] = m["status"]
                    self.cv.notify_all()

    def spawn(self, args: dict, stderr_path: str) -> tuple[int, int, int]:
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        socket.send_fds(self.sock, [json.dumps(args).encode()], [in_r, out_w, err])
        for f in (in_r, out_w, err):
            os.close(f)
        pid = self.spawned.get(timeout=HANG)
        return pid, in_w, out_r

    def wait_exit(self, pid: int, timeout: float = HANG) -> Optional[int]:
        with self.cv:
            self.cv.wait_for(lambda: pid in self.exits, timeout=timeout)
            return self.exits.get(pid)

    def close(self) -> None:
        try:
            self.sock.close()
        finally:
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class Violation(Exception):
    pass


def stamp_pid(stamp: str) -> Optional[int]:
    """The pid that a kill point's stamp names ("<name> <nth> <pid>"), if it was written."""
    try:
        with open(stamp) as f:
            fields = f.read().split()
        return int(fields[2]) if len(fields) == 3 else None
    except (FileNotFoundError, ValueError):
        return None


class Rank:
    """One training process of a round: its lines, parsed."""

    def __init__(self, zygote: Zygote, args: dict, err: str, events: "queue.Queue"):
        self.rank = args["rank"]
        self.err = err
        self.pid, in_w, out_r = zygote.spawn(args, err)
        self.stdin = os.fdopen(in_w, "w", buffering=1)
        self.stdout = os.fdopen(out_r, "r")
        self.zygote = zygote
        self.loaded: Optional[tuple] = None
        self.loaded_uri = "-"
        self.fresh = False
        self.began: list[int] = []
        self.saved: list[int] = []
        self.committed: list[int] = []
        self.newest: list[int] = []
        self.idle = False
        self.closed: Optional[bool] = None
        self.eof = False
        self.lines: list[str] = []
        self.killed = False  # by the driver
        self.status: Optional[int] = None
        self.loaded_tag = "-"
        self.superseded: Optional[str] = None  # a SUPERSEDED line (node campaign)
        self.rejoin_from: Optional[int] = None  # index of its first line after "more"
        threading.Thread(target=self._read, args=(events,), daemon=True).start()

    def _read(self, events: "queue.Queue") -> None:
        for line in self.stdout:
            self.lines.append(line.rstrip("\n"))
            events.put((self, line.split()))
        events.put((self, None))

    def handle(self, f: list[str]) -> None:
        kind = f[0] if f else ""
        if kind == "LOADED":
            self.loaded = (int(f[1]), f[2], f[3])
            self.loaded_uri = f[6] if len(f) > 6 else "-"
            self.loaded_tag = f[7] if len(f) > 7 else "-"  # the run that saved it (node rounds)
        elif kind == "FRESH":
            self.fresh = True
        elif kind == "BEGIN":
            self.began.append(int(f[1]))
        elif kind == "SAVED":
            self.saved.append(int(f[1]))
        elif kind == "COMMITTED":
            self.committed.append(int(f[1]))
        elif kind == "NEWEST":
            self.newest.append(int(f[1]))
        elif kind == "IDLE":
            self.idle = True
        elif kind == "CLOSED":
            self.closed = True
        elif kind == "CLOSEFAIL":
            self.closed = False
        elif kind == "SUPERSEDED":
            self.superseded = " ".join(f)

    def alive(self) -> bool:
        return not dead(self.pid)

    def kill(self) -> bool:
        """SIGKILL if alive; True when this call killed it."""
        if not self.killed and self.alive():
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                return False
            self.killed = True
            return True
        return False

    def send(self, cmd: str) -> None:
        try:
            self.stdin.write(cmd + "\n")
            self.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def reap(self) -> Optional[int]:
        self.status = self.zygote.wait_exit(self.pid, timeout=60)
        if self.status is None:
            raise Violation(f"rank {self.rank} (pid {self.pid}, state {proc_state(self.pid)}) "
                            f"was not reaped; zygote alive: {self.zygote.proc.poll() is None}")
        try:
            self.stdin.close()
        except OSError:
            pass
        return self.status

    def stderr(self) -> str:
        try:
            with open(self.err, errors="replace") as f:
                return f.read()[-3000:]
        except FileNotFoundError:
            return ""


def take_event(events: queue.Queue, timeout: float, deadline: float, ranks: list,
               round_no: int) -> None:
    """Hands the next line a rank said within `timeout` (if any) to that rank. A rank that
    loaded bytes other than those saved, or a round past its `deadline`, is a violation."""
    if time.monotonic() > deadline:
        raise Violation(f"round {round_no} hung; ranks said: "
                        + " | ".join(" ".join(rk.lines[-5:]) for rk in ranks))
    try:
        rk, fields = events.get(timeout=timeout)
    except queue.Empty:
        return
    if fields is None:
        rk.eof = True
        return
    rk.handle(fields)
    if fields and fields[0] == "LOADED" and fields[3] != "EXACT":
        raise Violation(f"rank {rk.rank} loaded step {fields[1]} from {fields[2]} "
                        f"and it differs from what was saved: {rk.lines}")


def reap_ranks(ranks: list, events: queue.Queue) -> None:
    """After a round: reaps the ranks not reaped yet and hands each the lines still queued."""
    for rk in ranks:
        if rk.status is None:
            rk.reap()
    while not events.empty():
        rk, fields = events.get()
        if fields is not None:
            rk.handle(fields)


# --- the expected state: what must have survived ----------------------------------------------

class ExpectedState:
    """What must have survived the kills so far, for one job (RocksDB's ExpectedState): updated
    from what the ranks said after every round (`record_round`), checked against how the next
    round resumed (`check_resume`) and against what storage lists (`check_listed`). Kills
    never update it: a kill can only lose what this record does not promise."""

    def __init__(self, world: int, keep: int, tier_keeps: tuple = ()):
        self.world, self.keep = world, keep
        self.keeps = [keep, *tier_keeps]  # per store: the job's path, then its tiers
        self.began_ever: list[set] = [set() for _ in range(world)]
        # Per rank, bounds on the newest COMPLETE snapshot in memory: at least `mem_lb` (the last
        # save() that returned), at most `mem_ub` (the last save begun). None: nothing known.
        self.mem_lb: list[Optional[int]] = [None] * world
        self.mem_ub: list[Optional[int]] = [None] * world
        # Per rank, the run (a count of record_round calls) whose save made the snapshot behind
        # `mem_lb`: with several ranks each run draws a new save attempt, and the ranks never
        # resume from snapshots of different attempts (a step commits, and a hot reload is
        # agreed, only from one attempt's). None: unknown.
        self.mem_run: list[Optional[int]] = [None] * world
        self.runs = 0
        self.closed_at: Optional[int] = None  # every rank closed cleanly after saving this step
        self.reported: set[int] = set()       # the agent said these are committed
        self.listed: list[int] = []           # committed steps at the last check
        self.store_listed: list[list[int]] = [[] for _ in self.keeps]  # the same, per store
        self.path_behind = False  # path was lost and has no step newer than tier 1's yet
        # Steps loaded from storage that were committed after the last check, and how storage
        # is read for that check (set by the driver: the committed steps the store `uri` lists
        # now, and that store's keep).
        self.committed_late: set[int] = set()
        self.listing: Callable[[str], tuple[list[int], int]] = lambda uri: ([], 0)

    def newest_anywhere(self) -> Optional[int]:
        """The newest step committed on any store (path or a tier) at the last check."""
        return max((ls[-1] for ls in [self.listed, *self.store_listed] if ls), default=None)

    def path_lost(self) -> None:
        """The job's path (tier 0: the node's own storage) is gone with the node: what it held
        is no longer promised; the tiers below keep theirs. Until path has a step newer than
        tier 1's newest, tier 1 is ahead of it."""
        self.reported = set()
        self.closed_at = None
        self.listed = []
        self.store_listed[0] = []
        self.path_behind = True

    def memory_lost(self) -> None:
        """The node's shared memory is gone (node loss)."""
        self.mem_lb = [None] * self.world
        self.mem_ub = [None] * self.world
        self.mem_run = [None] * self.world

    def one_attempt(self) -> bool:
        """Whether every rank's `mem_lb` snapshot is of one run's save attempt (so that they
        can be resumed from together): rank 0 of one run saved step N and died, rank 1 saved N
        in the next run, and rank 0 was killed before its save of N completed: both hold N,
        of two attempts, and the ranks rightly resume from an older step (seed 3213208876,
        round 170)."""
        return self.world == 1 or (None not in self.mem_run and len(set(self.mem_run)) == 1)

    # What a subclass (the node campaign's) changes of check_resume: how it words memory that
    # survived, and whether a restore may find a snapshot elsewhere than this node's memory.
    MEMORY_KEPT = "the snapshots stayed in memory"
    PEERS_HOLD_SNAPSHOTS = False  # with memory lost, a resume is at the newest committed step

    def check_fresh(self) -> None:
        """More reasons a fresh start (no rank loaded anything) is wrong (none here)."""

    def check_resumed_step(self, s: int) -> None:
        """More bounds on the step `s` all ranks resumed from (none here)."""

    def begun_elsewhere(self) -> list[int]:
        """Steps begun that memory bounds do not cover, which a resume may reach (none here)."""
        return []

    def check_sources(self, ranks: list, s: int, newest: Optional[int]) -> None:
        """Where each rank loaded step `s` from: a step newer than the newest committed one at
        the last check from memory, or from a store that holds it committed now."""
        for rk in ranks:
            if rk.loaded is None:
                continue
            if (newest is None or s > newest) and rk.loaded[1] != "memory":
                self.check_committed_since(rk, s)

    def check_committed_since(self, rk: Any, s: int) -> None:
        """Rank `rk` loaded step `s` from storage although `s` was not committed at the last
        check. That is right only if it was committed since: an agent that adopts the snapshots
        a killed one left persists them as the next round starts (src/agent/adoption.cc), and
        when the other ranks' images of that step were already written, its TryCommit commits
        the step before the ranks' restore reads storage (seed 3695189617, round 334). Then the
        store it was read from lists it now, or retention pruned it since (then at least that
        store's `keep` newer steps are listed: retention deletes only steps with `keep` newer
        ones). A step that storage does not hold committed is a violation."""
        now, keep = self.listing(rk.loaded_uri)
        newer = [t for t in now if t > s]
        if s not in now and len(newer) < keep:
            raise Violation(f"step {s} is not committed (listed on {rk.loaded_uri}: {now}, "
                            f"keep {keep}) but rank {rk.rank} loaded it from {rk.loaded[1]}")
        self.committed_late.add(s)

    def check_resume(self, ranks: list) -> None:
        """How the ranks of a round resumed (`loaded` (step, source, verdict) or `fresh`)."""
        loaded = [rk.loaded for rk in ranks if rk.loaded is not None]
        fresh = [rk for rk in ranks if rk.fresh]
        if not loaded and not fresh:
            return  # killed before loading
        newest = self.newest_anywhere()
        if fresh:
            if loaded:
                raise Violation(f"some ranks loaded {loaded}, others nothing")
            if newest is not None:
                raise Violation(f"a rank started fresh although step {newest} is committed")
            if all(lb is not None for lb in self.mem_lb) and self.one_attempt():
                raise Violation(f"the ranks started fresh although every rank's save returned "
                                f"(steps {self.mem_lb}) and memory was kept")
            self.check_fresh()
            return
        steps = {s for s, _, _ in loaded}
        if len(steps) != 1:
            raise Violation(f"ranks resumed from different steps: {loaded}")
        s = steps.pop()
        if newest is not None and s < newest:
            raise Violation(f"resumed at step {s}, older than the newest committed step {newest}")
        if self.reported and s < max(self.reported):
            raise Violation(f"resumed at step {s}; the agent had reported step "
                            f"{max(self.reported)} committed")
        lbs = [lb for lb in self.mem_lb if lb is not None]
        if len(lbs) == self.world and s < min(lbs) and self.one_attempt():
            raise Violation(f"resumed at step {s}, but every rank's save() of step {min(lbs)} "
                            f"returned and {self.MEMORY_KEPT} (ranks: {self.mem_lb})")
        self.check_resumed_step(s)
        ubs = [ub for ub in self.mem_ub if ub is not None]
        top = max(ubs + ([newest] if newest is not None else []) + self.begun_elsewhere())
        if s > top:
            raise Violation(f"resumed at step {s}, newer than any step begun ({top})")
        if not ubs and s != newest and not self.PEERS_HOLD_SNAPSHOTS:
            raise Violation(f"memory was lost; resumed at step {s}, not at the newest committed "
                            f"step {newest}")
        if self.closed_at is not None and not ubs and s != self.closed_at:
            raise Violation(f"every rank closed after step {self.closed_at}, resumed at {s}")
        self.check_sources(ranks, s, newest)

    def record_round(self, ranks: list, end_sent: Optional[str]) -> None:
        """What the ranks of a round said: begun, returned and reported steps, and a clean close
        (`end_sent` "close"), which removes the snapshots."""
        self.runs += 1
        for rk in ranks:
            r = rk.rank
            self.began_ever[r].update(rk.began)
            self.reported.update(rk.committed)
            self.reported.update(rk.newest)
            if rk.began:
                self.mem_ub[r] = max(rk.began)
            if rk.saved:
                self.mem_lb[r] = max(rk.saved)
                self.mem_run[r] = self.runs
            elif rk.loaded is not None and rk.loaded[1] == "memory":
                if rk.loaded[0] != self.mem_lb[r]:
                    self.mem_run[r] = None  # an older snapshot: which run saved it is not known
                self.mem_lb[r] = rk.loaded[0]
        closed = [rk.closed for rk in ranks]
        if end_sent == "close" and any(c is not None for c in closed):
            # A clean close removes the snapshots (a failed one may have).
            if all(c is True for c in closed) and all(rk.saved for rk in ranks):
                self.closed_at = max(ranks[0].saved)
            else:
                self.closed_at = None
            self.mem_lb = [None] * self.world
            self.mem_run = [None] * self.world
            if all(c is True for c in closed):
                self.mem_ub = [None] * self.world
        elif any(rk.began for rk in ranks):
            self.closed_at = None

    def check_stores(self, listed: list[list[int]], tiers: list[dict]) -> None:
        """The committed steps each store lists now (the job's path, then its tiers). On every
        store: each step was begun by every rank; a step listed at the last check is still
        listed, or retention removed it (then at least that store's `keep` newer steps are
        listed: retention deletes only steps with `keep` newer ones, and never the newest). A
        lower tier receives only steps committed on the tier above, which never loses its
        newest step, so it is never ahead of the tier above (but tier 1 is ahead of a lost path
        until path commits a newer step)."""
        for k, steps in enumerate(listed):
            where = "path" if k == 0 else f"tier {k} ({tiers[k - 1]['uri']})"
            for s in steps:
                for r in range(self.world):
                    if s not in self.began_ever[r]:
                        raise Violation(f"step {s} is listed on {where} but rank {r} never "
                                        "began saving it")
            for s in self.store_listed[k]:
                newer = [t for t in steps if t > s]
                if s not in steps and len(newer) < self.keeps[k]:
                    raise Violation(f"step {s} was committed on {where} and is gone, with only "
                                    f"{newer} newer (keep={self.keeps[k]}); listed: {steps}")
            if k == 1 and self.path_behind:
                if not listed[0] or (steps and listed[0][-1] <= steps[-1]):
                    continue  # path was lost; it has no step newer than tier 1's yet
                self.path_behind = False
            if k > 0 and steps and (not listed[k - 1] or steps[-1] > listed[k - 1][-1]):
                raise Violation(f"{where} holds step {steps[-1]}, newer than the newest step of "
                                f"the tier above ({listed[k - 1][-1:] or None})")
        self.store_listed = [list(steps) for steps in listed]

    def check_caught_up(self, tiers: list[dict], why: str) -> None:
        """With the agent idle (nothing queued, no copy pending or in flight): every tier holds
        a step once the tier above has one, and is less than its `every` behind the tier above
        (a step `every` or more past the tier's newest is due, and the agent offers each tier
        the newest step of the tier above: when it commits there, and when it starts)."""
        for k, t in enumerate(tiers, 1):
            above, here = self.store_listed[k - 1], self.store_listed[k]
            if not above:
                continue
            if not here or above[-1] - here[-1] >= t["every"]:
                raise Violation(f"{why}, tier {k} ({t['uri']}, every {t['every']}) holds "
                                f"{here} while the tier above holds {above}")

    def check_listed(self, listed: list[int]) -> None:
        """The committed steps storage lists now: each begun by every rank; every step the
        agent reported committed listed, or pruned with `keep` newer ones listed; after a clean
        close, the close step is the newest."""
        for s in listed:
            for r in range(self.world):
                if s not in self.began_ever[r]:
                    raise Violation(f"step {s} is listed but rank {r} never began saving it")
        for s in self.reported:
            newer = [t for t in listed if t > s]
            if s not in listed and len(newer) < self.keep:
                raise Violation(f"the agent reported step {s} committed; it is not listed and "
                                f"only {newer} are newer (keep={self.keep}); listed: {listed}")
        if self.closed_at is not None and (not listed or listed[-1] != self.closed_at):
            raise Violation(f"every rank closed after step {self.closed_at}; the newest "
                            f"committed step is {listed[-1:] or None}")
        self.listed = listed


# --- one job: a checkpoint directory, its ranks and the expected state ---------------------------

class Job:
    def __init__(self, name: str, world: int, persist_every: int, keep: int, root: str,
                 shm: str, tiers: tuple = (), layout: Optional[dict] = None):
        """`tiers`: (every, keep[, layout]) of each storage tier below `path` (file://
        directories); `layout`: how path stores steps (compression, incremental: packed steps
        whose chunks steps share, and the chunk GC after every prune)."""
        self.name, self.world = name, world
        self.persist_every, self.keep = persist_every, keep
        self.path = os.path.join(root, name)
        self.layout = dict(layout or {})
        self.tiers = [{"uri": "file://" + os.path.join(root, f"{name}-tier{i}"), "every": t[0],
                       "keep": t[1], **(t[2] if len(t) > 2 else {})}
                      for i, t in enumerate(tiers, 1)]
        self.stores = [self.path] + [t["uri"] for t in self.tiers]
        self.verified: dict[str, list[int]] = {}  # store -> its listing when last verified
        self.shm = os.path.join(shm, name)  # its own: `safepoint gc` of a lost node is per job
        os.makedirs(self.shm, mode=0o700)
        self.job_dir = str(job_dir(self.shm, name))
        self.expected = ExpectedState(world, keep, tuple(t["keep"] for t in self.tiers))
        self.rounds = 0
        self.steps_saved = 0

    def agent_pid(self) -> Optional[int]:
        """The job's live agent, as its lock names it."""
        return lock_agent_pid(self.shm, self.name)

    def agent_log(self) -> str:
        return agent_log(self.shm, self.name)


# --- the campaign --------------------------------------------------------------------------------

def start_campaign(campaign, args, env: dict, prefix: str) -> None:
    """What every campaign (this one and node_campaign's) sets first: its arguments, the rng
    seeded from them, the environment, a fresh root folder (named by prefix) with its log, and
    the CLI of the build."""
    campaign.args = args
    campaign.seed = args.seed
    campaign.rng = random.Random(campaign.seed)
    campaign.env = env
    campaign.root = tempfile.mkdtemp(prefix=prefix, dir=args.dir)
    campaign.cli = os.path.join(args.build_dir, "safepoint")
    campaign.log = open(os.path.join(campaign.root, "log.txt"), "w", buffering=1)


MODES = ["workload"] * 4 + ["agent"] * 3 + ["both"] * 2 + ["node"]


def note_violation(campaign: Any, v: Violation, rank_detail: Callable[[Rank], str],
                   job_notes: Callable[[Any], list[str]]) -> None:
    """Prints a violation and writes what the round's ranks said and `job_notes(job)` (agent
    logs, status) to the campaign's log, for the single-node and the node-loss campaigns."""
    print(f"VIOLATION in round {campaign.round}: {v}", flush=True)
    campaign.note(f"VIOLATION: {v}")
    if campaign.current is None:
        return
    job, ranks = campaign.current
    for rk in ranks:
        campaign.note(f"rank {rk.rank} pid {rk.pid} said: {' | '.join(rk.lines)}" + rank_detail(rk))
    for text in job_notes(job):
        campaign.note(text)


class Campaign:
    def __init__(self, args, env: dict):
        self.points = read_kill_points()
        self.client_points = [p for p in self.points if p.startswith("client.")]
        # The replication points (replica.*) are reached only with peers: the node campaign's.
        self.agent_points = [p for p in self.points if not p.startswith(("client.", "replica."))]
        self.copy_points = [p for p in self.points if p.startswith("tier_copy.")]
        start_campaign(self, args, env, "safepoint-crash-")
        self.shm = tempfile.mkdtemp(prefix="spc-", dir=args.shm_parent)
        self.zygote = Zygote(env, os.path.join(self.root, "zygote.err"))
        tag = f"{self.seed % 100000}"
        # Each job fills two storage tiers below its path (the agent copies committed steps
        # down): every 2nd/3rd step keeping 2, then every 4th/5th keeping 2. Job 1 persists
        # packed, incremental steps to its path and its first tier (the pack.* kill points: its
        # saves, tier copies and the chunk GC after each prune); job 2's second tier compresses.
        packed = {"compression": "zstd", "incremental": True}
        self.jobs = [Job(f"c1-{tag}", 1, persist_every=2, keep=2, root=self.root, shm=self.shm,
                         tiers=((2, 2, {"incremental": True}), (4, 2)), layout=packed),
                     Job(f"c2-{tag}", 2, persist_every=3, keep=3, root=self.root, shm=self.shm,
                         tiers=((3, 2), (5, 2, {"compression": "auto", "incremental": True})))]
        self.kills = 0
        self.by_point: Counter = Counter()
        self.planned: Counter = Counter()  # rounds armed at each named point
        self.by_random: Counter = Counter()
        self.modes: Counter = Counter()
        self.fallbacks = 0
        self.decoys = 0
        self.temporaries_seen = 0
        self.verifies = 0
        self.loads_checked = 0
        self.tier_loads: Counter = Counter()  # bit-exact loads checked, by store (0: path)
        self.caught_up_checks = 0
        self.paths_lost = 0
        self.cp_runs = 0
        self.chunk_gcs = 0  # chunk stores collected and checked after the final run
        self.cp_kills: Counter = Counter()
        self.restores_from: Counter = Counter()
        self.round_seconds: list[float] = []
        self.round = 0
        self.killed_agents: set[int] = set()
        self.current = None

    # -- helpers --------------------------------------------------------------------------------
    def note(self, msg: str) -> None:
        self.log.write(f"[round {self.round}] {msg}\n")

    def cli_run(self, *args, check: Optional[int] = None) -> subprocess.CompletedProcess:
        proc = subprocess.run([self.cli, *map(str, args)], capture_output=True, text=True,
                              timeout=HANG)
        if check is not None and proc.returncode != check:
            raise Violation(f"`safepoint {' '.join(map(str, args))}` exited {proc.returncode} "
                            f"(expected {check}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        return proc

    def kill_agent(self, job: Job, why: str) -> bool:
        pid = job.agent_pid()
        if pid is None:
            return False
        self.killed_agents.add(pid)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return False
        if not wait_until(lambda: dead(pid)):
            raise Violation(f"agent {pid} survived SIGKILL")
        self.kills += 1
        self.by_random[f"agent ({why})"] += 1
        self.note(f"killed agent {pid} ({why})")
        return True

    def stop_agent(self, job: Job) -> None:
        """SIGTERM (the agent flushes and exits): not a kill."""
        pid = job.agent_pid()
        if pid is None:
            return
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        if not wait_until(lambda: dead(pid)):
            raise Violation(f"agent {pid} did not exit after SIGTERM:\n{job.agent_log()[-3000:]}")

    def starting_agents(self) -> list[int]:
        """Agents that training processes started and that do not run safepointd yet: forked
        helpers below the zygote (their subreaper) that are not training processes. Call only
        when no training process is alive."""
        out = []
        for pid in children(self.zygote.proc.pid):
            argv = proc_argv(pid)
            if argv and not argv[0].endswith("safepointd"):
                out.append(pid)
        return out

    def lose_node_agents(self, job: Job, ranks: list) -> None:
        """Every agent of the job dies with the node: the one its lock names, and any that a
        training process of the round started before it was killed, which may not have taken
        the lock yet, or not even run safepointd yet (a forked helper below the zygote, the
        subreaper of every rank's descendants). The ranks are dead, so none can start another:
        kill until none is left, then check that the job's lock is free."""
        if not all(dead(rk.pid) for rk in ranks):
            raise Violation("a rank outlived the node loss")

        def found() -> list[int]:
            return sorted(set(self.starting_agents()) | set(agents_of(job.shm, job.name)))

        def none_left() -> bool:
            for pid in found():
                self.killed_agents.add(pid)
                kill_and_wait(pid)
                self.kills += 1
                self.by_random["agent (node lost)"] += 1
                self.note(f"killed agent {pid} (node lost)")
            if found():
                return False
            out = self.cli_run("status", "--shm-dir", job.shm, "--json")
            return not any(j.get("agent_alive") for j in json.loads(out.stdout or "[]"))
        if not wait_until(none_left, interval=0.01):
            raise Violation(f"an agent of {job.name} survived the node loss")

    # -- a round --------------------------------------------------------------------------------
    def plan(self, job: Job) -> dict:
        r = self.rng
        mode = r.choice(MODES)
        use_point = r.random() < 0.6
        point = nth = None
        if use_point:
            point = r.choice(self.client_points if mode == "workload" else self.agent_points)
            nth = r.randint(1, 4) if self.points[point] else r.randint(1, 3)
        return {
            "mode": mode,
            "point": point,
            "nth": nth,
            "target_rank": r.randrange(job.world),
            "delay": r.random(),          # fraction of a typical round
            "steps": r.randint(2, 9),
            "end": "close" if r.random() < 0.15 else "exit",
            "p_wait": r.choice([0.0, 0.3, 0.8]),
            "p_status": r.choice([0.0, 0.2]),
            "decoy": r.random() < 0.3,
            "rng": r.getrandbits(64),
            "lose_path": r.random() < 0.5,  # a node loss takes the node's path (its storage)
            # After the checks: `safepoint cp` of path's newest step, killed at a copy point.
            "cp": r.random() < 0.25,
            "cp_point": r.choice(self.copy_points),
            "cp_nth": r.randint(1, 3),
        }

    def run_round(self, job: Job) -> None:
        p = self.plan(job)
        self.round += 1
        job.rounds += 1
        self.modes[p["mode"]] += 1
        if p["point"] is not None:
            self.planned[p["point"]] += 1
        self.note(f"job {job.name}: {json.dumps(p)}")
        t0 = time.monotonic()
        stamp = os.path.join(self.root, f"stamp-{self.round}")
        agent_point = p["point"] is not None and p["mode"] != "workload"
        # An agent-side kill point must be in the agent's environment: the agent is started by a
        # rank of this round, so an agent still running from an earlier round goes first.
        if agent_point:
            self.stop_agent(job)
        rdzv = os.path.join(self.root, f"rdzv-{self.round}")
        events: "queue.Queue" = queue.Queue()
        ranks = []
        for rank in range(job.world):
            env = {}
            if p["point"] is not None and (agent_point or rank == p["target_rank"]):
                env = {"SAFEPOINT_KILL_AT": f"{p['point']}:{p['nth']}",
                       "SAFEPOINT_KILL_STAMP": stamp}
            args = {"path": job.path, "job": job.name, "shm_dir": job.shm, "seed": self.seed,
                    "rank": rank, "world_size": job.world, "persist_every": job.persist_every,
                    "keep": job.keep, "steps": p["steps"], "p_wait": p["p_wait"],
                    "p_status": p["p_status"], "rng": f"{p['rng']}-{rank}", "rdzv": rdzv,
                    "env": env, "tiers": job.tiers, "layout": job.layout}
            ranks.append(Rank(self.zygote, args, os.path.join(self.root, f"r{self.round}-{rank}.err"),
                              events))
        self.current = (job, ranks)
        typical = (sorted(self.round_seconds)[len(self.round_seconds) // 2]
                   if self.round_seconds else 1.0)
        kill_at = t0 + p["delay"] * typical
        agents_seen: set[int] = set()
        rank_down = False    # a rank of this round died by a kill (point or driver)
        point_fired = False
        ended = False        # the workloads were told to exit or close
        deadline = time.monotonic() + HANG

        def kill_workloads(why: str) -> None:
            nonlocal rank_down
            rank_down = True
            for rk in ranks:
                if rk.kill():
                    self.kills += 1
                    self.by_random[f"rank ({why})"] += 1
                    self.note(f"killed rank {rk.rank} pid {rk.pid} ({why})")

        def fire(why: str) -> None:
            """The random-moment kill (or the fallback when a kill point never fired)."""
            if p["mode"] in ("agent", "both", "node"):
                self.kill_agent(job, why)
            if p["mode"] in ("workload", "both", "node"):
                targets = ([ranks[p["target_rank"]]] if p["mode"] == "workload" else ranks)
                for rk in targets:
                    if rk.kill():
                        self.kills += 1
                        self.by_random[f"rank ({why})"] += 1
                        self.note(f"killed rank {rk.rank} pid {rk.pid} ({why})")
                kill_workloads("a peer died")

        random_done = p["point"] is not None
        armed = p["point"]
        while True:
            take_event(events, 0.005, deadline, ranks, self.round)
            pid = job.agent_pid()
            if pid is not None:
                agents_seen.add(pid)
            # A kill point fired?
            if not point_fired and p["point"] is not None and os.path.exists(stamp):
                with open(stamp) as f:
                    text = f.read()
                if text.strip():
                    point_fired = True
                    self.kills += 1
                    self.by_point[p["point"]] += 1
                    dead_pid = int(text.split()[2])
                    if not wait_until(lambda: dead(dead_pid)):
                        raise Violation(f"pid {dead_pid} survived its kill point")
                    self.note(f"kill point {text.strip()} fired")
                    if any(rk.pid == dead_pid for rk in ranks):
                        kill_workloads("a peer died")
                    else:
                        self.killed_agents.add(dead_pid)
                        if p["mode"] in ("both", "node"):
                            kill_workloads("with the agent")
            # Random moment.
            if not random_done and time.monotonic() >= kill_at:
                random_done = True
                fire("random moment")
            # A rank that died on its own, without a kill: a violation unless a peer died first
            # (gloo then fails) or it was told to end.
            for rk in ranks:
                if rk.eof and rk.status is None and not rk.alive():
                    status = rk.reap()
                    by_point = point_fired and os.WIFSIGNALED(status) and \
                        os.WTERMSIG(status) == signal.SIGKILL
                    told = ended and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
                    # A rank may fail on its own only after a peer was killed (gloo fails).
                    if not (rk.killed or by_point or told or rank_down):
                        raise Violation(f"rank {rk.rank} (pid {rk.pid}) exited with status "
                                        f"{status} without being killed:\n{rk.stderr()}")
                    if by_point:
                        kill_workloads("a peer died")
            # An agent that died without being killed must have exited on its own, saying so
            # (or, when every rank closed, removing its lock and log with the job directory).
            for pid in list(agents_seen):
                if dead(pid):
                    agents_seen.discard(pid)
                    stamped = stamp_pid(stamp)
                    if stamped == pid and pid not in self.killed_agents:
                        # The armed point fired late, in an agent started after the fallback
                        # kill (it inherited the ranks' environment): a kill all the same.
                        self.killed_agents.add(pid)
                        self.kills += 1
                        self.by_point[armed] += 1
                        self.note(f"kill point fired late in agent {pid}")
                    # Every agent logs "serving job" first. A log without a line of this agent
                    # is a new one: this agent exited after every rank closed and removed its
                    # log with the job directory, and an agent that a rank had started while
                    # the previous one was being killed took the lock late (seed 2072461297,
                    # round 372). A crash leaves the agent's lines without "exited".
                    lock = os.path.join(job.job_dir, "agent.lock")
                    log = job.agent_log()
                    if pid not in self.killed_agents and os.path.exists(lock) and \
                            f"safepointd[{pid}]" in log and \
                            f"safepointd[{pid}]: exited" not in log:
                        raise Violation(f"agent {pid} died without being killed:\n"
                                        + log[-3000:])
            everyone_idle = all(rk.idle or rk.status is not None or not rk.alive() for rk in ranks)
            if everyone_idle and not ended:
                if p["point"] is not None and not point_fired:
                    # The point was not reached this often: kill now instead.
                    self.fallbacks += 1
                    p["point"] = None
                    random_done = True
                    fire("kill point not reached")
                elif not random_done:
                    random_done = True
                    fire("random moment (at the end)")
                ended = True
                end = p["end"]
                for rk in ranks:
                    if rk.alive() and rk.idle:
                        rk.send(end)
                p["end_sent"] = end
            if ended and all(rk.status is not None or (rk.eof and not rk.alive()) for rk in ranks):
                break
        reap_ranks(ranks, events)
        # Whatever was killed, make sure an armed agent does not outlive the round.
        if agent_point and not point_fired:
            self.kill_agent(job, "armed, kill point not reached")
        if p["mode"] == "node":
            self.lose_node_agents(job, ranks)
            # Node lost: the shared memory is gone.
            self.cli_run("gc", "--shm-dir", job.shm, check=0)
            if os.path.exists(job.job_dir):
                raise Violation(f"safepoint gc left {job.job_dir}")
            if p["lose_path"]:
                # The node's local storage (path) is lost with it: the job resumes from a tier.
                # What it listed when it was lost is what this round's loads are checked against.
                import safepoint

                p["path_listing"] = safepoint.steps(job.path)
                shutil.rmtree(job.path)
                self.paths_lost += 1
        self.round_seconds.append(time.monotonic() - t0)
        self.check_round(job, p, ranks)

    # -- checks ---------------------------------------------------------------------------------
    def quiesce(self, job: Job) -> Optional[dict]:
        """Waits until the job's agent is gone or idle with no rank connected and no tier copy
        pending or in flight, and no other agent is on its way: one that a killed rank started
        may not have taken the lock yet (or not even run safepointd yet), and would adopt and
        persist while storage is checked. Returns the idle agent's status (None: no agent)."""
        seen: list[Optional[dict]] = [None]

        def idle() -> bool:
            seen[0] = None
            if self.starting_agents() or any(a != job.agent_pid()
                                             for a in agents_of(job.shm, job.name)):
                return False  # a starting agent takes the lock or exits ("another agent serves")
            # `safepoint status` asks the job's lock (flock), which a starting agent holds before
            # it writes its pid: no window in which a live agent looks absent.
            out = self.cli_run("status", "--shm-dir", job.shm, "--json")
            try:
                jobs = {j["job"]: j for j in json.loads(out.stdout)}
            except (ValueError, KeyError):
                return False
            j = jobs.get(job.name)
            if j is None or not j.get("agent_alive"):
                return job.agent_pid() is None
            if "queued" not in j:
                return False  # the agent did not answer (busy starting): ask again
            seen[0] = j
            return (j["queued"] == 0 and j["in_flight"] is None and
                    all(not r["connected"] and r["pending_persists"] == 0 for r in j["ranks"]) and
                    # A tier this agent fills is open (its catch-up offered) and idle.
                    all((t.get("open") or not t.get("filled_here")) and
                        t.get("pending_step") is None and t.get("in_flight_step") is None
                        for t in j.get("tiers", [])))
        if not wait_until(idle, interval=0.02):
            raise Violation(f"the agent of {job.name} never became idle: {json.dumps(seen[0])}"
                            f"\n{job.agent_log()[-3000:]}")
        return seen[0]

    def check_storage(self, job: Job) -> None:
        import safepoint
        from workload import first_difference, make_state

        by_store = [safepoint.steps(uri) for uri in job.stores]
        job.expected.check_listed(by_store[0])
        job.expected.check_stores(by_store, job.tiers)
        for k, (uri, listed) in enumerate(zip(job.stores, by_store)):
            for s in listed:
                for r in range(job.world):
                    try:
                        got, state = safepoint.load(uri, s, rank=r)
                    except safepoint.Error as e:
                        raise Violation(f"step {s} listed on {uri} cannot be loaded for rank "
                                        f"{r}: {e}")
                    diff = first_difference(state, make_state(self.seed, s, r))
                    if got != s or diff is not None:
                        raise Violation(f"step {s} rank {r} loads from {uri} with a "
                                        f"difference: {diff}")
                    self.loads_checked += 1
                    self.tier_loads[k] += 1
            # verify --all wherever the listing changed since the store was last verified (an
            # unchanged listing is the same committed objects: nothing rewrites them).
            if listed and job.verified.get(uri) != listed:
                self.cli_run("verify", uri, "--all", check=0)
                self.verifies += 1
                job.verified[uri] = list(listed)
            d = uri[len("file://"):] if uri.startswith("file://") else uri
            tmps = glob.glob(os.path.join(d, "step-*", "*.tmp.*"))
            self.temporaries_seen += len(tmps)

    def plant_decoy(self, job: Job) -> None:
        """A torn temporary where a killed writer (a save or a tier copy) would leave one, on
        path or a tier: it must never be read."""
        roots = [job.path] + [t["uri"][len("file://"):] for t in job.tiers]
        dirs = sorted(d for root in roots for d in glob.glob(os.path.join(root, "step-*")))
        if not dirs:
            return
        d = self.rng.choice(dirs)
        r = self.rng.randrange(job.world)
        name = f"rank-{r:05d}.img.tmp.{self.rng.getrandbits(64):016x}"
        if self.rng.random() < 0.5:
            name = f"COMMIT.tmp.{self.rng.getrandbits(64):016x}"
        real = sorted(glob.glob(os.path.join(d, "rank-*.img")))
        with open(os.path.join(d, name), "wb") as f:
            if real and self.rng.random() < 0.5:
                with open(real[0], "rb") as src:  # a torn copy of a real image
                    data = src.read()
                f.write(data[: self.rng.randrange(1, max(2, len(data)))])
            else:
                f.write(os.urandom(self.rng.randrange(1, 20000)))
        self.decoys += 1

    def listing(self, job: Job, uri: str,
                lost: Optional[list[int]] = None) -> tuple[list[int], int]:
        """The committed steps the store `uri` of `job` lists now, and its keep. `lost`: what the
        job's path listed when this round's node loss took it (the path is gone now)."""
        import safepoint

        stores = [u[len("file://"):] if u.startswith("file://") else u for u in job.stores]
        plain = uri[len("file://"):] if uri.startswith("file://") else uri
        if plain == "-":
            plain = job.path  # a load that did not name its store read the job's path
        if plain not in stores:
            raise Violation(f"a rank loaded from {uri}, not one of the job's stores {job.stores}")
        k = stores.index(plain)
        if k == 0 and lost is not None:
            return lost, job.expected.keeps[k]
        return safepoint.steps(job.stores[k]), job.expected.keeps[k]

    def check_round(self, job: Job, p: dict, ranks: list) -> None:
        job.expected.listing = lambda uri: self.listing(job, uri, p.get("path_listing"))
        job.expected.check_resume(ranks)
        job.expected.record_round(ranks, p.get("end_sent"))
        job.steps_saved += sum(len(rk.saved) for rk in ranks)
        if p["mode"] == "node":
            job.expected.memory_lost()
            if p["lose_path"]:
                job.expected.path_lost()
        agent = self.quiesce(job)
        self.check_storage(job)
        if p["mode"] == "final" or (agent is not None and
                                    any(t.get("filled_here") for t in agent.get("tiers", []))):
            # The agent that fills the tiers is idle (or, after the clean final run, exited
            # when its copies were done): the tiers have caught up.
            job.expected.check_caught_up(job.tiers, f"with the agent idle after round {self.round}"
                                         if p["mode"] != "final" else "after the final run")
            self.caught_up_checks += 1
        for rk in ranks:
            if rk.loaded is not None:
                self.restores_from[rk.loaded[1] if rk.loaded_uri == "-" else
                                   "path" if rk.loaded_uri in (job.path, "file://" + job.path)
                                   else f"tier {job.stores.index(rk.loaded_uri)}"
                                   if rk.loaded_uri in job.stores else rk.loaded_uri] += 1
        if p.get("cp"):
            self.check_cp(job, p)
        if p["decoy"]:
            self.plant_decoy(job)

    def check_cp(self, job: Job, p: dict) -> None:
        """`safepoint cp` of path's newest step into a new directory, SIGKILLed at a copy kill
        point: the step is committed there only if the kill came after its COMMIT; a second
        `safepoint cp` (over what the first left) commits it, bit-exact for every rank, and
        `verify --all` is clean. Not counted in --kills (the short run keeps its length)."""
        import safepoint
        from workload import first_difference, make_state

        listed = job.expected.store_listed[0]
        if not listed:
            return
        step = listed[-1]
        dst = os.path.join(self.root, f"{job.name}-cp-{self.round}")
        point = p["cp_point"]
        env = dict(self.env, SAFEPOINT_KILL_AT=f"{point}:{p['cp_nth']}",
                   SAFEPOINT_KILL_STAMP=os.path.join(self.root, f"stamp-cp-{self.round}"))
        argv = [self.cli, "cp", job.path, dst, "--step", str(step)]
        first = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=HANG)
        self.cp_runs += 1
        killed = first.returncode == -signal.SIGKILL
        if not killed and first.returncode != 0:
            raise Violation(f"`safepoint cp` of step {step} failed ({first.returncode}): "
                            f"{first.stdout[-2000:]}{first.stderr[-2000:]}")
        there = safepoint.steps(dst) if os.path.isdir(dst) else []
        if killed:
            self.cp_kills[point] += 1
            self.note(f"safepoint cp of step {step} killed at {point}:{p['cp_nth']}; "
                      f"{dst} lists {there}")
            if point != "tier_copy.after_commit" and there:
                raise Violation(f"`safepoint cp` killed at {point} left {there} committed")
        elif there != [step]:
            raise Violation(f"`safepoint cp` of step {step} succeeded; {dst} lists {there}")
        second = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=HANG)
        if second.returncode != 0 or safepoint.steps(dst) != [step]:
            raise Violation(f"`safepoint cp` of step {step} after a killed one failed "
                            f"({second.returncode}): {second.stdout[-2000:]}"
                            f"{second.stderr[-2000:]}; {dst} lists {safepoint.steps(dst)}")
        for r in range(job.world):
            got, state = safepoint.load(dst, step, rank=r)
            diff = first_difference(state, make_state(self.seed, step, r))
            if got != step or diff is not None:
                raise Violation(f"step {step} rank {r} copied by `safepoint cp` loads with a "
                                f"difference: {diff}")
            self.loads_checked += 1
        self.cli_run("verify", dst, "--all", check=0)
        self.verifies += 1
        shutil.rmtree(dst)

    def final_round(self, job: Job) -> None:
        """A clean run to the end: resume, save, commit, close; then no temporary may remain
        below the newest committed step (the commit's clean-up removed what the kills left)."""
        self.round += 1
        events: "queue.Queue" = queue.Queue()
        ranks = []
        for rank in range(job.world):
            args = {"path": job.path, "job": job.name, "shm_dir": job.shm, "seed": self.seed,
                    "rank": rank, "world_size": job.world, "persist_every": job.persist_every,
                    "keep": job.keep, "steps": job.persist_every * 2, "p_wait": 1.0,
                    "p_status": 0.0, "rng": f"final-{rank}",
                    "rdzv": os.path.join(self.root, "rdzv-final"), "env": {},
                    "tiers": job.tiers, "layout": job.layout}
            ranks.append(Rank(self.zygote, args, os.path.join(self.root, f"final-{rank}.err"),
                              events))
        sent = False
        while not all(rk.eof for rk in ranks):
            rk, fields = events.get(timeout=HANG)
            if fields is None:
                rk.eof = True
                continue
            rk.handle(fields)
            if not sent and all(r.idle for r in ranks):
                for r in ranks:
                    r.send("close")
                sent = True
        for rk in ranks:
            status = rk.reap()
            if status != 0 or rk.closed is not True or "WAITFAIL" in " ".join(rk.lines):
                raise Violation(f"the final clean run of {job.name} failed: {rk.lines}\n"
                                f"{rk.stderr()}")
        p = {"mode": "final", "decoy": False, "end_sent": "close"}
        self.check_round(job, p, ranks)
        newest = job.expected.listed[-1]
        left = [t for t in glob.glob(os.path.join(job.path, "step-*", "*.tmp.*"))
                if int(os.path.basename(os.path.dirname(t))[5:]) < newest]
        if left:
            raise Violation(f"temporaries below the newest committed step {newest} survived a "
                            f"commit's clean-up: {left}")
        self.check_chunk_stores(job)

    def check_chunk_stores(self, job: Job) -> None:
        """Kills left at most garbage: on every store with packed steps, once stale intents and
        locks of killed processes are gone (a later GC removes them once old; here by hand),
        `safepoint chunk-gc` leaves exactly the chunks that manifests reference, and every
        listed step still loads bit-exact (check_storage)."""
        roots = [job.path] + [t["uri"][len("file://"):] for t in job.tiers]
        for root in roots:
            if not os.path.isdir(os.path.join(root, "chunks")):
                continue
            for f in glob.glob(os.path.join(root, "chunks", "inflight", "*")):
                os.unlink(f)
            if os.path.exists(os.path.join(root, "chunks", "gc-lock")):
                os.unlink(os.path.join(root, "chunks", "gc-lock"))
            subprocess.run([self.cli, "chunk-gc", root], check=True, capture_output=True,
                           timeout=HANG)
            referenced = set()
            for m in glob.glob(os.path.join(root, "step-*", "*.pack")):
                data = open(m, "rb").read()
                count = int.from_bytes(data[32:40], "little")
                table = data[len(data) - 4 - 48 * count:len(data) - 4]
                referenced |= {table[i * 48:i * 48 + 32].hex() for i in range(count)}
            there = {os.path.basename(c) for c in glob.glob(os.path.join(root, "chunks", "??", "*"))
                     if ".tmp." not in c}
            if there != referenced:
                raise Violation(f"{root}: after chunk-gc, {len(there - referenced)} chunks no "
                                f"manifest references remain and {len(referenced - there)} "
                                "referenced chunks are missing")
            self.chunk_gcs += 1
        self.check_storage(job)

    # -- the whole campaign ---------------------------------------------------------------------
    def run(self) -> int:
        t0 = time.monotonic()
        last_report = t0
        try:
            while self.kills < self.args.kills:
                job = self.jobs[self.round % len(self.jobs)]
                self.run_round(job)
                if time.monotonic() - last_report > 30:
                    last_report = time.monotonic()
                    print(f"  {self.kills} kills in {self.round} rounds, "
                          f"{time.monotonic() - t0:.0f} s", flush=True)
            for job in self.jobs:
                self.final_round(job)
        except Violation as v:
            note_violation(self, v, lambda rk: "", lambda job: [
                "status: " + self.cli_run("status", "--shm-dir", job.shm, "--json").stdout,
                "agent log:\n" + job.agent_log()[-5000:]])
            print(f"kept for inspection: {self.root} (log.txt); replay: "
                  f"{sys.argv[0]} --seed {self.seed} --kills {self.args.kills}", flush=True)
            self.cleanup(keep=True)
            return 1
        wall = time.monotonic() - t0
        self.report(wall)
        self.cleanup(keep=self.args.keep)
        return 0

    def report(self, wall: float) -> None:
        named = sum(self.by_point.values())
        print(f"crash campaign, seed {self.seed}: {self.kills} kill points executed "
              f"({named} at named kill points, {self.kills - named} at random moments) in "
              f"{self.round} rounds, {wall:.1f} s wall; 0 violations")
        print("  rounds by mode: " + ", ".join(f"{m} {n}" for m, n in sorted(self.modes.items())))
        print("  named kill points (fired/armed): " + ", ".join(
            f"{p} {self.by_point.get(p, 0)}/{self.planned.get(p, 0)}"
            for p in self.client_points + self.agent_points))
        print("  random kills: " + ", ".join(f"{k} {n}" for k, n in sorted(self.by_random.items())))
        print(f"  kill points not reached (killed at the end instead): {self.fallbacks}")
        for job in self.jobs:
            print(f"  job {job.name}: world {job.world}, persist every {job.persist_every}, "
                  f"keep {job.keep}: {job.rounds} rounds, {job.steps_saved} saves returned, "
                  f"newest committed step {job.expected.listed[-1] if job.expected.listed else None}, "
                  f"{len(job.expected.reported)} steps reported committed; tiers " +
                  ", ".join(f"every {t['every']} keep {t['keep']} (newest "
                            f"{(job.expected.store_listed[k][-1:] or [None])[0]})"
                            for k, t in enumerate(job.tiers, 1)))
        print(f"  checked: {self.loads_checked} bit-exact loads from storage, {self.verifies} "
              f"clean `safepoint verify --all`, {self.temporaries_seen} temporaries seen left "
              f"over (never listed or read), {self.decoys} decoy temporaries planted")
        print("  bit-exact loads by store: " + ", ".join(
            f"{'path' if k == 0 else f'tier {k}'} {n}" for k, n in sorted(self.tier_loads.items()))
            + f"; tiers caught up with the agent idle: {self.caught_up_checks} checks"
            + f"; chunk stores collected and checked after the final run: {self.chunk_gcs}")
        print(f"  safepoint cp: {self.cp_runs} runs, killed at " + ", ".join(
            f"{k} {n}" for k, n in sorted(self.cp_kills.items())) +
            "; each then copied again, bit-exact")
        print("  resumes from: " + ", ".join(f"{k} {n}" for k, n in
                                             sorted(self.restores_from.items()))
              + f" ({self.paths_lost} node losses took the job's path too)")
        missing = [p for p in self.client_points + self.agent_points if not self.by_point.get(p)]
        if missing and self.args.kills >= 1000:
            print(f"  WARNING: never fired: {missing}")

    def cleanup(self, keep: bool) -> None:
        if self.current is not None:
            for rk in self.current[1]:
                rk.kill()
        for job in self.jobs:
            pid = job.agent_pid()
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.zygote.close()
        if keep:
            print(f"shared memory kept in {self.shm}", flush=True)
        else:
            shutil.rmtree(self.shm, ignore_errors=True)
        if not keep:
            shutil.rmtree(self.root, ignore_errors=True)


def setup_build(build_dir: str) -> dict:
    """A package directory over the build: python/safepoint/*.py, the build's _core and
    safepointd. Returns the environment that runs it."""
    build_dir = os.path.abspath(build_dir)
    pkg = os.path.join(build_dir, "crashpkg", "safepoint")
    os.makedirs(pkg, exist_ok=True)
    wanted = {}
    for f in glob.glob(os.path.join(REPO, "python", "safepoint", "*.py")):
        wanted[os.path.basename(f)] = f
    cores = glob.glob(os.path.join(build_dir, "_core*.so"))
    agent = os.path.join(build_dir, "safepointd")
    cli = os.path.join(build_dir, "safepoint")
    if not cores or not os.path.exists(agent) or not os.path.exists(cli):
        raise SystemExit(f"{build_dir} has no _core module, safepointd or safepoint: "
                         "run `make build` first")
    wanted[os.path.basename(cores[0])] = cores[0]
    wanted["safepointd"] = agent
    for name in os.listdir(pkg):
        if name not in wanted:
            os.unlink(os.path.join(pkg, name))
    for name, target in wanted.items():
        link = os.path.join(pkg, name)
        if os.path.islink(link) and os.readlink(link) == target:
            continue
        if os.path.lexists(link):
            os.unlink(link)
        os.symlink(target, link)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.dirname(pkg) + os.pathsep + HERE
    env["PATH"] = build_dir + os.pathsep + env.get("PATH", "")
    env.pop("SAFEPOINT_KILL_AT", None)
    env.pop("SAFEPOINT_KILL_STAMP", None)
    env.pop("SAFEPOINT_JOB", None)
    env["SAFEPOINT_TIER_RETRY_SECONDS"] = "0.2"  # a failed tier copy is retried soon
    env["PYTHONWARNINGS"] = "default,ignore::FutureWarning"  # safepoint's warnings go to .err
    return env


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--zygote":
        return zygote_main(int(sys.argv[2]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=1000, help="kill points to execute")
    ap.add_argument("--seed", type=int, default=None, help="replay a run (default: random)")
    ap.add_argument("--build-dir", default=os.path.join(REPO, "build", "py"))
    ap.add_argument("--dir", default=None, help="where checkpoint directories go (default: $TMPDIR)")
    ap.add_argument("--shm-parent", default="/dev/shm" if os.path.isdir("/dev/shm") else None,
                    help="where the private shm_dir is made")
    ap.add_argument("--keep", action="store_true", help="keep the run directory")
    ap.add_argument("--nodes", action="store_true",
                    help="node-loss rounds instead: multi-node jobs with peer replication on "
                         "clusters of network namespaces (tests/crash/node_campaign.py; root)")
    ap.add_argument("--rounds", type=int, default=30, help="with --nodes: rounds that lose nodes")
    ap.add_argument("--partitions", type=int, default=0,
                    help="with --nodes: partition rounds besides the node-loss rounds (a node cut "
                         "off the network while it runs on: tests/crash/node_campaign.py)")
    ap.add_argument("--node-jobs", default=None,
                    help="with --nodes: which jobs (mirror,ec; default both)")
    ap.add_argument("--verbose", action="store_true", help="with --nodes: a line per round")
    args = ap.parse_args()
    if args.seed is None:
        args.seed = int.from_bytes(os.urandom(4), "little")
    if args.nodes:
        print(f"node-loss campaign: seed {args.seed}, {args.rounds} rounds losing nodes, "
              f"{args.partitions} partition rounds (replay: {sys.argv[0]} --nodes --seed "
              f"{args.seed} --rounds {args.rounds} --partitions {args.partitions})", flush=True)
        env = setup_build(args.build_dir)
        sys.path[:0] = env["PYTHONPATH"].split(os.pathsep)
        os.environ["PATH"] = env["PATH"]
        import warnings
        warnings.simplefilter("ignore")
        import node_campaign
        return node_campaign.run(args, env)
    print(f"crash campaign: seed {args.seed}, {args.kills} kill points "
          f"(replay: {sys.argv[0]} --seed {args.seed} --kills {args.kills})", flush=True)
    env = setup_build(args.build_dir)
    # This process checks storage with the same build.
    sys.path[:0] = env["PYTHONPATH"].split(os.pathsep)
    os.environ["PATH"] = env["PATH"]
    import warnings
    warnings.simplefilter("ignore")
    campaign = Campaign(args, env)
    return campaign.run()


if __name__ == "__main__":
    sys.exit(main())
