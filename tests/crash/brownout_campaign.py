#!/usr/bin/env python3
"""Storage brownout rounds (issue 35, item 2): a job persists to, copies to, collects chunks on
or loads from the throwaway Ceph cluster (scripts/ceph-cluster.sh) while that cluster browns out,
and every call the training makes must end, with its result or a named error, within its
documented bound; nothing reported committed is ever lost.

    scripts/with-ceph.sh .venv/bin/python tests/crash/brownout_campaign.py [--rounds N] [--seed S]
        [--build-dir build/py] [--verbose]

It needs the cluster that scripts/with-ceph.sh starts (SAFEPOINT_TEST_CEPH_DIR and the URIs it
exports); without one it says so and exits 0 (skipped). It stops and kills the cluster's OSD and
radosgw and fills the OSD, so nothing else may use the cluster meanwhile. It runs the installed
safepoint by default, or with --build-dir the package, `safepointd` and `safepoint` of that build
(tests/crash/crashtest.py's setup_build).

A round (all of it drawn from the seeded generator):
  1. a job of 1-4 ranks (one long-lived worker process per rank, which imported torch once:
     `--worker`), each saving steps whose state is a pure function of (seed, step, rank)
     (workload.make_state, plus a "bulk" tensor of 0.25-4 MiB), in one phase:
       persist  path is s3:// or rados:// on the cluster: save, wait per step;
       tier     path is a local directory with an s3:// or rados:// tier (keep 2): the agent's
                tier copies run under the fault;
       gc       path is s3:// or rados:// with incremental=True and keep=2: every persist prunes
                and the agent runs the chunk GC; `safepoint chunk-gc` runs by hand during the
                fault too;
       load     steps are committed first; during the fault every rank reloads from memory and
                loads the newest committed step from the store (safepoint.load), and saves once
                more;
     every storage URI carries `?timeout=T&retries=R` (T 1-3 s, R 0-2);
  2. a fault, at a random moment of the phase: the OSD SIGSTOPped for 0.2-6 s then resumed
     (`resume-osd`), the OSD killed and restarted (`restart-osd`), radosgw killed and restarted
     (`restart-rgw`; its rounds use s3://), or the cluster full (`full`: the OSD's full ratio
     under what it holds) for 0.5-4 s then `unfull`; each script returns once the cluster is
     healthy again;
  3. with the cluster back, every rank saves and waits once more (it must commit), tiers catch up,
     every rank reports its status and closes.

Checks (any failure is a violation; the run exits 1):
  - bounds: every call (open, save, wait, load, status, close, the store load, the chunk GC) ends
    within `overlap + B + slack`, where B = (R+1) x T + the retries' backoff, 2T an attempt on
    rados:// (docs/operations.md: a stalled OSD or gateway fails a request with Unavailable
    after timeout x (retries + 1) at worst, on rados:// each attempt may first wait up to
    `timeout` for a newer OSD map), overlap is how long the call and the fault (until the
    cluster was healthy again)
    overlapped, and slack (SLACK) the call's healthy work on this 2-core machine; a wait on a
    local `path` gets no overlap (the tier below never holds it up). The longest of each kind is
    printed against its bound;
  - named failures: a call fails only with a safepoint error, and a failed wait names the store
    (its bucket/prefix or pool/prefix); a tier with failures names it in status()'s last_error;
    a call with no fault in effect since the round began never fails;
  - the newest committed step stays loadable during the fault: each rank's reload (memory, or
    `path` above a faulty tier) returns a step at least as new as the newest one reported
    committed, bit-exact;
  - after the fault (the healing script returned and the store answers again, as before a
    round): the last save of every rank commits; a tier holds the newest committed step
    within its catch-up bound; every step reported committed (a wait that returned) is listed or
    was pruned with `keep` newer ones listed; every listed step loads bit-exact for every rank;
  - processes: the job's agent is the one of the round's start and is alive until the close; no
    worker dies; nothing hangs (each answer is awaited at most its bound + HANG_MARGIN).

Before each round and before the save after the fault the store must answer again (a listing
through radosgw and one of the pool, each within 2 s): radosgw can stay stuck on the previous fault's requests for a while after every
PG is active+clean. A reload that fails because `path` alone cannot be listed is a violation (it
was the open defect OPEN-1 until load() served memory then: docs/reliability.md).

Each round's plan is a function of (seed, round); where a fault lands depends on timing, so a
replay repeats the plan, not every interleaving. `--only N` replays round N alone; `--phase`,
`--fault` and `--backend` force one kind of round (for reproducing).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "tests", "common"))
sys.path.insert(0, HERE)
from processes import LineReader, agent_log, dead, kill_agents, wait_until  # noqa: E402

CLUSTER = os.path.join(REPO, "scripts", "ceph-cluster.sh")
SLACK = 20.0        # s: a call's healthy work on this machine, added to every bound
HANG_MARGIN = 60.0  # s: past its bound, an unanswered call is a hang
SETTLE = 300.0      # s: the cluster answers again this long after a round, at most
MAX_STEPS = 60      # steps a round's training saves at most while it waits for the cluster
GC_BACK = 60        # seconds the chunk GC after the fault is retried (a fresh process each time)
PHASES = ("persist", "tier", "gc", "load")
# Faults and their weights: the OSD restarts (about 8 s each) are a minority.
FAULTS = (("osd-stop", 4), ("osd-kill", 2), ("rgw-kill", 2), ("full", 2))


def request_bound(timeout: float, retries: int, backend: str = "s3") -> float:
    """docs/operations.md: each attempt is bounded by `timeout`; between attempts a backoff of
    at most a window that doubles from 0.2 s, up to 10 s; on rados:// an attempt may first wait
    up to `timeout` for a newer OSD map (after a transient failure)."""
    attempt = 2 * timeout if backend == "rados" else timeout
    return (retries + 1) * attempt + sum(min(10.0, 0.2 * 2 ** i) for i in range(retries))


def bulk_of(seed: int, step: int, rank: int, n: int):
    import torch

    g = torch.Generator().manual_seed((seed * 7_368_787 + step * 131 + rank) & (2 ** 62 - 1))
    return torch.randn(n, generator=g)


def state_of(seed: int, step: int, rank: int, n: int) -> dict:
    from workload import make_state

    s = make_state(seed, step, rank)
    s["bulk"] = bulk_of(seed, step, rank, n)
    return s


# --- the worker: one rank's training process, commanded one JSON line at a time -----------------

def worker_main() -> int:
    import faulthandler
    import warnings
    faulthandler.register(signal.SIGUSR1)  # the driver asks for the stacks of a hung call
    warnings.simplefilter("ignore")
    import safepoint
    sys.path.insert(0, os.path.join(REPO, "tests", "python", "workloads"))
    from bitexact import first_difference

    ck: Optional[Any] = None
    a: dict = {}

    def exact(got, step: int) -> Optional[str]:
        return first_difference(got, state_of(a["seed"], step, a["rank"], a["bulk"]))

    def do(op: str, c: dict) -> dict:
        nonlocal ck, a
        if op == "open":
            a = c
            tiers = [safepoint.Tier(u, keep=k) for u, k in c["tiers"]]
            ck = safepoint.Checkpointer(c["path"], job=c["job"], shm_dir=c["shm"],
                                        rank=c["rank"], world_size=c["world"], keep=c["keep"],
                                        tiers=tiers, incremental=c["incremental"])
            return {"agent": ck.status()["agent"]["pid"]}
        if op == "save":
            ck.save(c["step"], state_of(a["seed"], c["step"], a["rank"], a["bulk"]))
            return {}
        if op == "wait":
            ck.wait()
            return {}
        if op == "load":  # what a restarted rank of this node would resume from
            out = ck.load()
            if out is None:
                return {"step": None}
            return {"step": out[0], "source": ck.last_load_source, "diff": exact(out[1], out[0])}
        if op == "storeload":
            step, got = safepoint.load(c["uri"], c["step"], rank=a["rank"])
            return {"step": step, "diff": exact(got, step)}
        if op == "status":
            st = ck.status()
            return {"agent": st["agent"]["pid"], "newest": st.get("newest_committed"),
                    "failed": st.get("persists_failed"),
                    "error": st.get("last_persist_error") or "",
                    "tiers": [{k: t.get(k) for k in ("newest_step", "failures", "last_error",
                                                     "pending_step", "in_flight_step")}
                              for t in st.get("tiers", [])]}
        if op == "close":
            c_ = ck
            ck = None
            c_.close()
            return {}
        raise ValueError(op)

    for line in sys.stdin:
        c = json.loads(line)
        t0 = time.monotonic()
        try:
            out = {"ok": True, **do(c["op"], c)}
        except safepoint.Error as e:
            out = {"ok": False, "error": type(e).__name__, "named": True,
                   "msg": str(e).replace("\n", " ")[:2000]}
        except Exception as e:  # noqa: BLE001 (reported: the driver judges)
            out = {"ok": False, "error": type(e).__name__, "named": False,
                   "msg": (str(e) + " " + traceback.format_exc()).replace("\n", " ")[:3000]}
        out["s"] = time.monotonic() - t0
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()
    return 0


class Worker:
    def __init__(self, env: dict, rank: int):
        self.rank = rank
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env)
        self.out = LineReader(self.proc.stdout, f"rank {rank}'s worker ({self.proc.pid})")

    def send(self, c: dict) -> None:
        self.proc.stdin.write(json.dumps(c) + "\n")
        self.proc.stdin.flush()

    def answer(self, guard: float) -> Optional[dict]:
        """The next answer, None when the worker said nothing for `guard` s or died."""
        try:
            fields = self.out.queue.get(timeout=guard)
        except Exception:  # noqa: BLE001 (queue.Empty)
            return None
        return None if fields is None else json.loads(fields)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


# --- faults -------------------------------------------------------------------------------------

class Cluster:
    def __init__(self, ceph_dir: str):
        self.dir = ceph_dir

    def pid(self, name: str) -> int:
        with open(os.path.join(self.dir, "run", f"{name}.pid")) as f:
            return int(f.read())

    def script(self, cmd: str) -> None:
        p = subprocess.run([CLUSTER, cmd, self.dir], capture_output=True, text=True, timeout=300)
        if p.returncode != 0:
            raise RuntimeError(f"ceph-cluster.sh {cmd} failed: {p.stderr[-3000:]}")

    def alive(self) -> list[str]:
        """The daemons that run (not killed, not zombies)."""
        out = []
        for name in ("mon.a", "mgr.x", "osd.0", "client.rgw"):
            try:
                pid = self.pid(name)
            except (FileNotFoundError, ValueError):
                continue
            if not dead(pid):
                out.append(name)
        return out


class Fault(threading.Thread):
    """Injects one fault after `delay` s, holds it, heals it; `start_t`/`healed_t` are the
    monotonic times the fault began and the cluster was healthy again."""

    def __init__(self, cluster: Cluster, kind: str, delay: float, hold: float):
        super().__init__(daemon=True)
        self.cluster, self.kind, self.delay, self.hold = cluster, kind, delay, hold
        self.start_t: Optional[float] = None
        self.healed_t: Optional[float] = None
        self.error: Optional[str] = None
        self.go = threading.Event()

    def run(self) -> None:
        try:
            self.go.wait()
            time.sleep(self.delay)
            c = self.cluster
            self.start_t = time.monotonic()
            if self.kind == "osd-stop":
                os.kill(c.pid("osd.0"), signal.SIGSTOP)
                time.sleep(self.hold)
                c.script("resume-osd")
            elif self.kind == "osd-kill":
                os.kill(c.pid("osd.0"), signal.SIGKILL)
                time.sleep(self.hold)
                c.script("restart-osd")
            elif self.kind == "rgw-kill":
                os.kill(c.pid("client.rgw"), signal.SIGKILL)
                time.sleep(self.hold)
                c.script("restart-rgw")
            elif self.kind == "full":
                c.script("full")
                time.sleep(self.hold)
                c.script("unfull")
            self.healed_t = time.monotonic()
        except Exception as e:  # noqa: BLE001 (the round reports it)
            self.error = f"{type(e).__name__}: {e}"
            self.healed_t = time.monotonic()

    def overlap(self, t0: float, t1: float) -> float:
        if self.start_t is None:
            return 0.0
        end = self.healed_t if self.healed_t is not None else time.monotonic()
        return max(0.0, min(t1, end) - max(t0, self.start_t))


# --- the campaign -------------------------------------------------------------------------------

class Broken(Exception):
    """A worker hung or died: the round ends there (its violation is recorded)."""


class Round:
    def __init__(self, n: int, phase: str, kind: str, fault: Fault, base_bound: float,
                 base: str, bulk: int):
        self.n, self.phase, self.kind, self.fault = n, phase, kind, fault
        self.base_bound, self.base, self.bulk = base_bound, base, bulk
        self.committed: set[int] = set()   # steps a wait() returned for, on some rank
        self.agent: Optional[int] = None

    def guard(self, extra: float) -> float:
        """How long an answer is awaited before the call counts as hung: its bound with the
        whole fault as overlap (and a healing script's own time), plus HANG_MARGIN."""
        return self.base_bound + extra + self.fault.delay + self.fault.hold + 120.0 + HANG_MARGIN


class Campaign:
    def __init__(self, args, env: dict):
        self.args, self.env = args, env
        self.rng = random.Random(args.seed)
        self.cluster = Cluster(os.environ["SAFEPOINT_TEST_CEPH_DIR"])
        self.s3 = os.environ["SAFEPOINT_TEST_S3_URI"].rstrip("/") + f"/bo{args.seed}"
        self.rados = os.environ["SAFEPOINT_TEST_RADOS_URI"].rstrip("/") + f"/bo{args.seed}"
        self.root = tempfile.mkdtemp(prefix=f"sp-brownout-{args.seed}-", dir=args.dir)
        self.shm = tempfile.mkdtemp(prefix="sp-bo-", dir=args.shm_parent)
        self.cli = shutil.which("safepoint", path=env.get("PATH")) or "safepoint"
        self.workers: list[Worker] = []
        self.violations: list[str] = []
        self.faults: Counter = Counter()
        self.phases: Counter = Counter()
        self.failed: Counter = Counter()     # "call:ErrorClass" -> count
        self.longest: dict[str, tuple] = {}  # call -> (seconds, bound, overlap, round)
        self.rounds_done = 0
        self.settled = (0.0, 0)  # the longest wait for the cluster to answer before a round

    # -- plumbing --

    def worker(self, rank: int) -> Worker:
        while len(self.workers) <= rank:
            self.workers.append(Worker(self.env, len(self.workers)))
        if self.workers[rank].proc.poll() is not None:
            self.workers[rank] = Worker(self.env, rank)
        return self.workers[rank]

    def violation(self, r: Round, what: str) -> None:
        self.violations.append(f"round {r.n} ({r.phase}, {r.kind}): {what}")
        print(f"VIOLATION round {r.n} ({r.phase}, {r.kind}): {what}", flush=True)

    def timed(self, r: Round, call: str, seconds: float, t1: float, local: bool = False,
              extra: float = 0.0) -> None:
        """Checks one call's duration against its bound and keeps the longest of each kind."""
        overlap = 0.0 if local else r.fault.overlap(t1 - seconds, t1)
        bound = r.base_bound + extra + overlap
        if seconds > self.longest.get(call, (-1.0,))[0]:
            self.longest[call] = (seconds, bound, overlap, r.n)
        if seconds > bound:
            self.violation(r, f"{call} took {seconds:.2f} s, past its bound {bound:.1f} s "
                              f"(overlap with the fault {overlap:.1f} s)")

    def calls(self, r: Round, op: str, ranks: list[int], local: bool = False,
              **c) -> dict[int, dict]:
        """Sends `op` to every rank (together, as a job's ranks act), awaits each answer and
        checks it: within its bound; ok, or a safepoint error, and never before the fault."""
        for rank in ranks:
            self.worker(rank).send({"op": op, "rank": rank, **c})
        out = {}
        deadline = time.monotonic() + r.guard(0.0)
        for rank in ranks:
            w = self.workers[rank]
            ans = w.answer(max(1.0, deadline - time.monotonic()))
            t1 = time.monotonic()
            if ans is None:
                died = w.proc.poll()
                if died is None:
                    w.proc.send_signal(signal.SIGUSR1)
                    time.sleep(1.0)
                w.kill()
                self.violation(r, f"rank {rank}'s {op} did not return (worker "
                                  f"{'exited ' + str(died) if died is not None else 'hung'}); "
                                  f"stderr: {w.proc.stderr.read()[-2000:]}; the agent's log: "
                                  f"{agent_log(self.shm, r.job)[-3000:]}")
                for other in ranks:
                    self.workers[other].kill()
                raise Broken()
            ans["t0"], ans["t1"] = t1 - ans["s"], t1
            self.timed(r, op, ans["s"], t1, local=local)
            if not ans["ok"]:
                self.failed[f"{op}:{ans['error']}"] += 1
                if not ans["named"]:
                    self.violation(r, f"rank {rank}'s {op} raised a non-safepoint error: "
                                      f"{ans['error']}: {ans['msg']}")
                elif r.fault.start_t is None or t1 < r.fault.start_t:
                    self.violation(r, f"rank {rank}'s {op} failed before any fault: "
                                      f"{ans['error']}: {ans['msg']}")
            out[rank] = ans
        return out

    def ok(self, r: Round, answers: dict[int, dict], what: str) -> bool:
        bad = {k: f"{a['error']}: {a['msg'][:600]}" for k, a in answers.items() if not a["ok"]}
        if bad:
            self.violation(r, f"{what}: {bad}")
        return not bad

    # -- a round --

    def run_round(self, n: int) -> None:
        # Each round's plan is a function of (seed, round) alone: --only replays one round.
        rng = self.rng = random.Random(f"{self.args.seed}-{n}")
        phase = rng.choice(PHASES)
        kind = rng.choices([f for f, _ in FAULTS], [w for _, w in FAULTS])[0]
        backend = "s3" if kind == "rgw-kill" else rng.choice(("s3", "rados"))
        # Reproducing a kind of round: force its phase, fault or backend (the rest as drawn).
        phase, kind = self.args.phase or phase, self.args.fault or kind
        backend = "s3" if kind == "rgw-kill" else self.args.backend or backend
        world = rng.choice((1, 1, 2, 2, 3, 4))
        timeout, retries = rng.choice((1, 2, 3)), rng.choice((0, 1, 2))
        bulk = rng.choice((1 << 16, 1 << 18, 1 << 20))  # float32 elements: 0.25-4 MiB
        delay = rng.uniform(0.0, 1.5)
        hold = {"osd-stop": rng.choice((rng.uniform(0.2, 2.0), rng.uniform(2.0, 6.0))),
                "osd-kill": rng.uniform(0.0, 2.0), "rgw-kill": rng.uniform(0.0, 2.0),
                "full": rng.uniform(0.5, 4.0)}[kind]
        steps = rng.randint(3, 5)
        load_at = rng.uniform(0.0, 1.0)
        base = (self.s3 if backend == "s3" else self.rados) + f"/r{n}"
        store = f"{base}?timeout={timeout}&retries={retries}"
        r = Round(n, phase, kind, Fault(self.cluster, kind, delay, hold),
                  request_bound(timeout, retries, backend) + SLACK, base, bulk)
        self.faults[kind] += 1
        self.phases[phase] += 1
        job = r.job = f"bo{self.args.seed % 100000}-{n}"
        local = os.path.join(self.root, f"r{n}")
        if phase == "tier":
            path, tiers, keep = local, [(store, 2)], 3
        else:
            path, tiers, keep = store, [], (2 if phase == "gc" else 3)
        ranks = list(range(world))
        if self.args.verbose:
            print(f"round {n}: {phase}, {kind} {delay:.2f} s in for {hold:.2f} s, {backend}, "
                  f"{world} rank(s), timeout={timeout} retries={retries}, bulk "
                  f"{bulk * 4 >> 10} KiB, {steps} steps", flush=True)
        self.settle(r)
        r.fault.start()
        t0 = time.monotonic()
        try:
            opened = self.calls(r, "open", ranks, job=job, path=path, shm=self.shm, world=world,
                                keep=keep, tiers=tiers, incremental=(phase == "gc"),
                                seed=self.args.seed, bulk=bulk)
            if self.ok(r, opened, "open"):
                r.agent = opened[0]["agent"]
                self.body(r, ranks, store, base, tiers, steps, keep, load_at, local)
            else:
                self.calls(r, "close", ranks)
        except Broken:
            pass
        finally:
            r.fault.go.set()
            r.fault.join(600)
            if r.fault.is_alive() or r.fault.error:
                self.violation(r, f"the fault did not heal: {r.fault.error or 'hung'}")
                raise SystemExit(1)
            kill_agents(self.shm, job)
            shutil.rmtree(local, ignore_errors=True)
        self.rounds_done += 1
        if self.args.verbose:
            print(f"round {n}: done in {time.monotonic() - t0:.1f} s, committed "
                  f"{sorted(r.committed)}", flush=True)

    def settle(self, r: Round) -> None:
        """Before the round: the store answers again, a listing through radosgw and one of the
        pool each within 2 s. The healing scripts return once every PG is active+clean, but
        radosgw may still be stuck on the previous fault's requests for a while (a round's
        first persist then failed before its fault, seed 3512 round 8)."""
        import safepoint

        def answers() -> bool:
            try:
                for base in (self.s3, self.rados):
                    safepoint.steps(f"{base}/settle?timeout=2&retries=0")
                return True
            except safepoint.Error:
                return False

        t0 = time.monotonic()
        if not wait_until(answers, SETTLE, 0.5):
            self.violation(r, f"the cluster did not answer within {SETTLE:.0f} s of the "
                              "previous round's end (its daemons all run)")
        waited = time.monotonic() - t0
        if waited > self.settled[0]:
            self.settled = (waited, r.n)

    def step(self, r: Round, ranks: list[int], step: int, local: bool,
             must: bool = False) -> None:
        """Every rank saves `step`, then waits for it; a wait that returned commits it. With
        `must` (the cluster is back), every wait must return."""
        saved = self.calls(r, "save", ranks, step=step)
        self.ok(r, saved, f"save of step {step}")  # into memory: never fails
        waited = self.calls(r, "wait", ranks, local=local)
        for rank, a in waited.items():
            if a["ok"]:
                r.committed.add(step)
            elif must:
                self.violation(r, f"rank {rank}'s wait for step {step}, saved once the cluster "
                                  f"was back, failed: {a['error']}: {a['msg'][:600]}")
            elif local:
                self.violation(r, f"rank {rank}'s wait for step {step} on its local path failed "
                                  f"under a fault of its tier: {a['error']}: {a['msg'][:600]}")
            elif r.base.split("?")[0].split("://", 1)[1] not in a["msg"]:
                self.violation(r, f"rank {rank}'s failed wait does not name the store "
                                  f"{r.base}: {a['error']}: {a['msg'][:600]}")

    def reload(self, r: Round, ranks: list[int]) -> None:
        """Each rank's reload (memory first) returns the newest committed step or a newer one,
        bit-exact, during the fault."""
        newest = max(r.committed, default=None)
        for rank, a in self.calls(r, "load", ranks).items():
            if not a["ok"]:
                self.violation(r, f"rank {rank} could not reload during the fault (newest "
                                  f"committed {newest}): {a['error']}: {a['msg'][:600]}")
            elif a["step"] is None or (newest is not None and a["step"] < newest) \
                    or a["diff"] is not None:
                self.violation(r, f"rank {rank} reloaded step {a['step']} from "
                                  f"{a.get('source')} (newest committed {newest}; difference "
                                  f"{a['diff']})")

    def status(self, r: Round, ranks: list[int]) -> None:
        """status() answers during the fault, and a failed persist it reports names the store."""
        for rank, a in self.calls(r, "status", ranks).items():
            if not a["ok"]:
                self.violation(r, f"rank {rank}'s status failed: {a['error']}: {a['msg'][:600]}")
            elif a["failed"] and r.phase != "tier" \
                    and r.base.split("://", 1)[1] not in a["error"]:
                self.violation(r, f"rank {rank}'s status reports {a['failed']} failed persists "
                                  f"and a last error that does not name the store: {a['error']}")
            t = (a.get("tiers") or [{}])[0] if a["ok"] else {}
            if t.get("failures") and t.get("last_error") \
                    and r.base.split("://", 1)[1] not in t["last_error"]:
                self.violation(r, f"rank {rank}'s tier error does not name the tier: {t}")

    def chunk_gcs(self, r: Round, store: str, result: list) -> None:
        """`safepoint chunk-gc` by hand, again and again until the cluster is healthy again."""
        while True:
            t0 = time.monotonic()
            try:
                p = subprocess.run([self.cli, "chunk-gc", store], capture_output=True, text=True,
                                   env=self.env, timeout=r.guard(0.0))
                result.append((time.monotonic() - t0, time.monotonic(), p.returncode,
                               (p.stdout + p.stderr)[-1500:]))
            except subprocess.TimeoutExpired:
                result.append((time.monotonic() - t0, time.monotonic(), None, "hung"))
            if r.fault.healed_t is not None or len(result) >= MAX_STEPS:
                return
            time.sleep(0.2)

    def body(self, r: Round, ranks, store, base, tiers, steps, keep, load_at, local) -> None:
        tiered = bool(tiers)
        last = steps
        if r.phase == "load":
            for s in range(1, steps + 1):
                self.step(r, ranks, s, local=False)
            newest = max(r.committed, default=None)
            r.fault.go.set()
            time.sleep(r.fault.delay + (load_at * min(r.fault.hold, 1.0)))
            self.reload(r, ranks)
            if newest is not None:
                for rank, a in self.calls(r, "storeload", ranks, uri=store, step=newest).items():
                    if a["ok"] and (a["step"] != newest or a["diff"] is not None):
                        self.violation(r, f"rank {rank} loaded step {a['step']} from the store "
                                          f"for {newest}: difference {a['diff']}")
                    elif not a["ok"] and base.split("://", 1)[1] not in a["msg"]:
                        self.violation(r, f"rank {rank}'s failed load does not name the store: "
                                          f"{a['msg'][:600]}")
            last = steps + 1
            self.step(r, ranks, last, local=False)
        else:
            gc: list = []
            gc_thread = None
            s = 0
            # Training goes on (a save and a wait per step) at least `steps` steps and until the
            # cluster is healthy again, so that the fault lands within the phase.
            while s < steps or (r.fault.healed_t is None and s < MAX_STEPS):
                s += 1
                if s == 2:
                    r.fault.go.set()
                    if r.phase == "gc":
                        gc_thread = threading.Thread(target=self.chunk_gcs, args=(r, store, gc))
                        gc_thread.start()
                self.step(r, ranks, s, local=tiered)
                if s >= 2 and r.committed:
                    self.reload(r, ranks)
                    self.status(r, ranks)
                time.sleep(self.rng.uniform(0.0, 0.3))  # the training's work between saves
            last = s
            if gc_thread is not None:
                gc_thread.join()
                for seconds, t1, rc, out in gc:
                    self.timed(r, "chunk-gc", seconds, t1)
                    if rc is None:
                        self.violation(r, "safepoint chunk-gc hung")
                    elif rc != 0:
                        self.failed[f"chunk-gc:exit {rc}"] += 1
                        if base.split("://", 1)[1] not in out:
                            self.violation(r, f"safepoint chunk-gc failed without naming the "
                                              f"store: {out}")
        # The cluster is back: the next step commits, tiers catch up, nothing is lost. "Back" is
        # what a round starts from (settle): the healing script returned and the store answers a
        # listing through radosgw and one of the pool within 2 s. Right after `resume-osd` the
        # gateway's first requests can still take longer than a round's 1-3 s timeout (seed
        # 90210 round 14: the persist's first HEAD, with retries=0, timed out at 3 s twice in
        # two runs), which fails that step by its configuration, not by a defect.
        r.fault.join(600)
        self.settle(r)
        last += 1
        self.step(r, ranks, last, local=tiered, must=True)
        if tiered:
            self.catch_up(r, ranks, base, last)
        for rank, a in self.calls(r, "status", ranks).items():
            if not a["ok"]:
                self.violation(r, f"rank {rank}'s status failed once the cluster was back: "
                                  f"{a['msg'][:600]}")
            elif a["agent"] != r.agent or dead(a["agent"]):
                self.violation(r, f"the job's agent changed or died: {r.agent} -> {a['agent']}")
        self.ok(r, self.calls(r, "close", ranks), "close once the cluster was back")
        if r.phase == "gc":
            # A fresh process each try, for up to GC_BACK seconds: an OSD resumed under load may
            # answer a new client's first requests only after their short timeout although every
            # PG is active+clean (seed 20261273 round 5, beside a sanitizer build).
            deadline = time.monotonic() + GC_BACK
            while True:
                p = subprocess.run([self.cli, "chunk-gc", store], capture_output=True, text=True,
                                   env=self.env, timeout=300)
                if p.returncode == 0 or time.monotonic() > deadline:
                    break
                time.sleep(2)
            if p.returncode != 0:
                self.violation(r, f"chunk-gc once the cluster was back (tried for {GC_BACK} s): "
                                  f"{p.stdout}{p.stderr}")
        self.check_store(r, ranks, store, keep if not tiered else None)
        if tiered:
            self.check_store(r, ranks, os.path.join(self.root, f"r{r.n}"), keep)

    def catch_up(self, r: Round, ranks, base: str, last: int) -> None:
        """The tier holds the newest committed step within its bound: a copy that failed under
        the fault is retried (SAFEPOINT_TIER_RETRY_SECONDS) and takes at most a request bound
        per attempt."""
        t0 = time.monotonic()
        bound = 2 * r.base_bound + 10.0
        seen: dict = {}

        def there() -> bool:
            a = self.calls(r, "status", ranks[:1])[0]
            seen.update(a)
            t = (a.get("tiers") or [{}])[0]
            return a["ok"] and t.get("newest_step") == last and t.get("pending_step") is None \
                and t.get("in_flight_step") is None

        if not wait_until(there, bound + HANG_MARGIN, 0.2):
            self.violation(r, f"the tier did not catch up with step {last}: {seen}")
        self.timed(r, "tier catch-up", time.monotonic() - t0, time.monotonic(), local=True,
                   extra=bound - r.base_bound)
        t = (seen.get("tiers") or [{}])[0]
        if t.get("failures") and base.split("://", 1)[1] not in (t.get("last_error") or "") \
                and t.get("last_error"):
            self.violation(r, f"the tier's error does not name it: {t}")

    def check_store(self, r: Round, ranks, uri: str, keep: Optional[int]) -> None:
        """Every step reported committed is listed (or pruned, `keep` newer ones listed); every
        listed step loads bit-exact for every rank. With keep None (a tier) only the listing's
        steps are checked."""
        from bitexact import first_difference

        import safepoint

        check = uri.split("?")[0] + ("?timeout=20&retries=4" if "://" in uri else "")
        try:
            listed = safepoint.steps(check)
        except safepoint.Error as e:
            self.violation(r, f"{uri} cannot be listed once the cluster is back: {e}")
            return
        if keep is not None:
            for s in sorted(r.committed):
                if s not in listed and len([x for x in listed if x > s]) < keep:
                    self.violation(r, f"step {s} was reported committed, and {uri} lists "
                                      f"{listed}")
        for s in listed:
            for rank in ranks:
                try:
                    got_step, got = safepoint.load(check, s, rank=rank)
                    diff = first_difference(got, state_of(self.args.seed, s, rank,
                                                          r.bulk)) if got_step == s else "step"
                except safepoint.Error as e:
                    diff = f"{type(e).__name__}: {e}"
                if diff is not None:
                    self.violation(r, f"{uri} step {s} rank {rank} does not load bit-exact: "
                                      f"{diff}")

    # -- the run --

    def run(self) -> int:
        t0 = time.monotonic()
        try:
            for n in range(1, self.args.rounds + 1):
                if self.args.only and n != self.args.only:
                    continue
                self.run_round(n)
                if self.cluster.alive() != ["mon.a", "mgr.x", "osd.0", "client.rgw"]:
                    self.violations.append(f"round {n}: the cluster's daemons after the round: "
                                           f"{self.cluster.alive()}")
                    break
        finally:
            for w in self.workers:
                w.kill()
            kill_agents(self.shm)
            shutil.rmtree(self.shm, ignore_errors=True)
            shutil.rmtree(self.root, ignore_errors=True)
        wall = time.monotonic() - t0
        a = self.args
        print(f"brownout campaign: seed {a.seed}: {self.rounds_done} rounds in {wall:.0f} s; "
              f"faults {dict(sorted(self.faults.items()))}; phases "
              f"{dict(sorted(self.phases.items()))}; calls failed with a named error "
              f"{dict(sorted(self.failed.items()))}; {len(self.violations)} violations")
        print(f"the cluster answered again at most {self.settled[0]:.1f} s after a round's "
              f"end (before round {self.settled[1]})")
        print("longest call of each kind (seconds / its bound in that round: overlap with the "
              "fault + request bound (R+1) x T (2T on rados://) + backoff + slack):")
        for call, (s, bound, overlap, n) in sorted(self.longest.items()):
            print(f"  {call:14s} {s:7.2f} s / {bound:6.1f} s (overlap {overlap:.1f} s, round {n})")
        for v in self.violations:
            print("VIOLATION", v)
        if self.violations:
            print(f"replay: {replay(a)}")
        return 1 if self.violations else 0


def replay(a) -> str:
    build = f" --build-dir {a.build_dir}" if a.build_dir else ""
    return (f"scripts/with-ceph.sh .venv/bin/python tests/crash/brownout_campaign.py "
            f"--seed {a.seed} --rounds {a.rounds}{build}")


def main() -> int:
    if sys.argv[1:] == ["--worker"]:
        return worker_main()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--seed", type=int, default=None, help="replay a run (default: random)")
    ap.add_argument("--build-dir", default=None,
                    help="run this build's package, safepointd and CLI (default: the installed "
                         "safepoint)")
    ap.add_argument("--dir", default=None, help="where local checkpoint directories go")
    ap.add_argument("--shm-parent", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    ap.add_argument("--verbose", action="store_true", help="a line per round")
    ap.add_argument("--only", type=int, default=0, help="run round N of the seed alone")
    ap.add_argument("--phase", choices=PHASES, help="every round in this phase (reproducing)")
    ap.add_argument("--fault", choices=[f for f, _ in FAULTS], help="every round this fault")
    ap.add_argument("--backend", choices=("s3", "rados"), help="every round on this store")
    args = ap.parse_args()
    if args.seed is None:
        args.seed = int.from_bytes(os.urandom(4), "little")
    missing = [k for k in ("SAFEPOINT_TEST_CEPH_DIR", "SAFEPOINT_TEST_S3_URI",
                           "SAFEPOINT_TEST_RADOS_URI") if not os.environ.get(k)]
    if missing:
        print(f"brownout campaign: skipped: {', '.join(missing)} unset (it needs the throwaway "
              "Ceph cluster: run it under scripts/with-ceph.sh, as `make test` does)", flush=True)
        return 0
    print(f"brownout campaign: seed {args.seed}, {args.rounds} rounds (replay: {replay(args)})",
          flush=True)
    env = dict(os.environ)
    if args.build_dir:
        from crashtest import setup_build
        env = setup_build(args.build_dir)
        sys.path[:0] = env["PYTHONPATH"].split(os.pathsep)
        os.environ["PATH"] = env["PATH"]
    env["SAFEPOINT_TIER_RETRY_SECONDS"] = "0.2"  # a failed tier copy is retried soon
    env["PYTHONPATH"] = os.pathsep.join(
        [HERE, os.path.join(REPO, "tests", "python", "workloads")]
        + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    sys.path.insert(0, os.path.join(REPO, "tests", "python", "workloads"))
    import warnings
    warnings.simplefilter("ignore")
    return Campaign(args, env).run()


if __name__ == "__main__":
    sys.exit(main())
