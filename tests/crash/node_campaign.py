"""The crash campaign's node-loss rounds (`crashtest.py --nodes`): multi-node jobs with peer
replication (docs/replication.md) on clusters of tests/common/nodes.py (network namespaces with
their own /dev/shm; needs root), killed the way nodes die.

Two jobs run side by side, each on a cluster of its own, one rank per node: 3 nodes with
redundancy "mirror" and 4 nodes with "ec:2+1" (both tolerate the loss of one node). Every node runs
a zygote of its own (crashtest.Zygote, started inside the node, with the crash build on
PYTHONPATH/PATH as the campaign's), which forks that node's training processes (workload.py); their
agents run inside the node. A round (the plan is a function of the seed):

  1. plan: what to kill: the training processes ("workload"), one node's agent ("agent"), one
     whole node ("node": Node.kill(), every process of the node and its /dev/shm), one node's
     agent and then the node whose replicas that agent holds ("agent+node": its restarted agent
     must serve them from the files its predecessor left), or two nodes at once ("nodes": more
     than the redundancy tolerates), and when (a random delay, or at the end, after every rank
     waited for its snapshots to be committed and replicated);
  2. start the ranks; each restores (memory, peer memory, storage), checks what it loaded bit for
     bit, saves a few steps, sometimes waits (wait()) and reports where its newest snapshot's
     replication stands (status(): PROTECTED <step> / UNPROTECTED <step>);
  3. kill; when a rank dies the others are killed too (as torchrun does); a lost node is replaced
     (same name and address, empty /dev/shm) and gets a new zygote;
  4. wait until every node's agent is idle, then check.

Half the rounds also arm one of the replication kill points (src/base/kill_point.h, "replica.*":
a chunk mid-push on the sender, a received replica before it is made visible, a lost rank's
snapshot rebuilt into its slot but not finished, a lost node's step persisted from its replica
by a surviving agent at teardown), drawn from a generator of its own (seeded from the seed, so
that a seed's rounds stay what they were before the points): the round first kills every agent
of the job (SIGKILL, as "agent" rounds do) so that the agents its ranks start inherit
SAFEPOINT_KILL_AT, with a SAFEPOINT_KILL_STAMP of the round (one-shot: the first agent of any node
that reaches the point dies). A rebuild is armed in rounds after a node loss (the replaced node's
rank rebuilds then), the teardown persist in rounds that lose a node (it runs 3 s after every
rank died, often after the round's checks: an armed agent may die in a later round). An agent
death counts as that point's kill when the stamp in the agent's environment (read from /proc
while it lived) names its pid in its node. Before the final clean rounds every agent is killed,
so that none still armed dies in them.

Checks (NodeExpected), besides crashtest's (every rank resumes the same step, bit-exact; never
older than the newest committed step or a step the agent reported committed; never older than the
newest step whose save() returned on every rank while every node's memory lived; listed steps
load bit-exact, `safepoint verify --all` clean):
  - never older than P, the newest step that every rank reported protected after its save()
    returned, while at most `tolerated` nodes were lost since the reports and no rank began a step
    past P+1 since (with two slots, the snapshot P may be overwritten after that);
  - a rank whose node was lost never loads from "memory" (unless its node's agent rebuilt that
    step from peers into its slot in a round killed before the rank said so); a step newer than
    the newest committed one at the last check comes from "memory" or "peer" (so "peer" for the
    lost node's ranks), or from storage only when it is listed at the restore (a restarted
    agent may complete a commit as the round starts); the round log lists every rank's source
    and the peers it came from;
  - no round hangs, no process dies unless killed.

Partition rounds (--partitions N, drawn from a generator of their own, so that a seed's
node-loss rounds stay what they were without them; docs/reliability.md, "Partition rounds"): one
node is cut off the network (tests/common/nodes.py, Node.partition: its link down, or one
direction blackholed) while everything on it runs on, when a push from it, a receive on it, a
rebuild from peers, a persist and commit, a restore or a random moment comes (`trigger`), for a
random time (a fifth of them longer than peer_timeout), then healed; "flap" cuts and heals it
several times within a save; "stale" stops the node's rank (SIGSTOP: hung in a collective, as a
cut-off trainer is) and kills the others as the job restarts, and the job's next round (a
"wake" round) starts a new process for that rank while the stale one still runs: once it said
READY (its hello superseded the stale process) the stale one is resumed and told to save (a
poisoned state), wait and say hello again (a stale process stuck in a collective whose peers
died during the cut may learn so only at its process group's timeout, PG_TIMEOUT, as a real one
does: it acts after that). After a cut is healed every rank saves once more,
waits and reports its replication ("rejoin"). Checks, beside the others:
  - the stale process's save, wait and hello each fail with SupersededError, and no rank of the
    job's current run is ever superseded;
  - the ranks resume from snapshots of one run (every saved state carries its round's tag, which
    LOADED reports), never a stale process's (its poisoned state would not load bit-exact
    either; a listed step holding one is a violation too);
  - no two writers publish one rank's image of one attempt: a step directory holds at most one
    image per rank and attempt;
  - every timed call (open, load, save, wait, status, close: TIME lines) returns or fails with
    a safepoint error (a torch.distributed error only in a round that killed a rank) within
    CALL_BOUNDS plus the time the round's link was cut; the longest of each is reported;
  - after the cut every rank's newest snapshot is protected again (its rejoin save reached every
    peer placement names), and nothing committed is lost (the storage checks above).
"""

from __future__ import annotations

import json
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "tests", "common"))
import crashtest as ct  # noqa: E402
from nodes import Cluster, partitions_unavailable, unavailable  # noqa: E402
from processes import dead, kill_and_wait, proc_argv, proc_state, wait_until  # noqa: E402

HANG = ct.HANG
Violation = ct.Violation

LOSSES = ("node", "nodes", "agent+node")
MODES = ["workload"] * 2 + ["agent"] * 2 + ["node"] * 4 + ["agent+node"] + ["nodes"]
# Partition rounds (--partitions): a node cut off the network while everything on it runs on.
PARTITIONS = ("partition", "flap", "stale")
PARTITION_MODES = ["partition"] * 6 + ["flap"] * 2 + ["stale"] * 2
TRIGGERS = ("push", "receive", "rebuild", "commit", "restore", "random")
PEER_TIMEOUT = 10.0  # the jobs' peer_timeout (seconds)
# The documented bound of each call the ranks time (docs/reliability.md, "Partition rounds"),
# in seconds beyond the time the round's link was down (a collective waits for the link): a
# call that takes longer, or fails with an error that is not a safepoint error, is a violation.
# load: the agreement's collectives, then for each step tried a peer listing and a rebuild, each
# bounded by peer_timeout on the agents' side; wait: its timeout (600 s; the campaign never
# comes near it); status and close: the client's 30 s request timeout (one retry: 60 s); save:
# the copy and the save's one collective; open: hello (30 s per reply) and the membership
# exchange (peer setup 60 s, membership 60 s).
# The ranks' wait() timeout: below the hang guard, so that a wait that cannot end (below)
# ends with its error and the round goes on.
WAIT_TIMEOUT = 120.0
# The ranks' process group timeout. A stale rank (a "stale" round) stopped in a collective whose
# peers were killed while its link was cut may never learn they are gone (a killed peer's RST is
# not sent again once the cut dropped it) and waits for the timeout, as a real one does (30
# minutes by default): shorter here, so that the wake round ends; longer than any wait of a
# healthy round's collectives (a cut lasts at most PEER_TIMEOUT + 4 s).
PG_TIMEOUT = 120.0
CALL_BOUNDS = {"open": 150.0, "load": 4 * PEER_TIMEOUT + 60.0, "save": 60.0,
               "wait": WAIT_TIMEOUT + 5.0, "status": 60.0, "close": 60.0}


def ns_to_host(node, nspid: int) -> Optional[int]:
    """The host pid of the process that is `nspid` in `node`'s pid namespace."""
    for p in node.processes():
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("NSpid:"):
                        if int(line.split()[-1]) == nspid:
                            return p
                        break
        except (OSError, ValueError):
            continue
    return None


def armed_stamp(pid: int) -> Optional[str]:
    """The SAFEPOINT_KILL_STAMP in `pid`'s environment (an agent inherits its rank's)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            for var in f.read().split(b"\0"):
                if var.startswith(b"SAFEPOINT_KILL_STAMP="):
                    return var.split(b"=", 1)[1].decode()
    except OSError:
        pass
    return None


def ns_pid(pid: int) -> Optional[int]:
    """`pid`'s pid in its innermost pid namespace (the one a kill point's stamp names)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError):
        pass
    return None


class NodeZygote(ct.Zygote):
    """A zygote inside a node: forks that node's ranks. Rank pids are translated to host pids
    (the driver kills and watches them from the host)."""

    def __init__(self, node, env: dict, log: str):
        self.node = node
        self.ns_of: dict[int, int] = {}
        super().__init__(env, log, launch=node.popen)

    def spawn(self, args: dict, stderr_path: str) -> tuple[int, int, int]:
        nspid, in_w, out_r = super().spawn(args, stderr_path)
        found: list[int] = []
        wait_until(lambda: found.append(ns_to_host(self.node, nspid)) or found[-1] is not None)
        if not found or found[-1] is None:
            raise Violation(f"rank process {nspid} of {self.node.name} not found from the host")
        self.ns_of[found[-1]] = nspid
        return found[-1], in_w, out_r

    def wait_exit(self, pid: int, timeout: float = HANG) -> Optional[int]:
        return super().wait_exit(self.ns_of.get(pid, pid), timeout)

    def host_pid(self) -> Optional[int]:
        """The zygote's own host pid (below the nsenter that started it)."""
        kids = ct.children(self.proc.pid)
        return kids[0] if kids else None


class NodeExpected(ct.ExpectedState):
    """ExpectedState with memory per node and the replication promise."""

    def __init__(self, world: int, keep: int, tolerated: int):
        super().__init__(world, keep)
        self.tolerated = tolerated
        self.prot: list[Optional[int]] = [None] * world    # newest step reported protected
        self.losses: list[int] = [0] * world               # nodes lost since that report
        self.after: list[int] = [0] * world                # newest step begun since that report
        self.lost_ranks: set[int] = set()   # their node was lost; they have not loaded since
        self.promises_checked = 0
        self.rebuilt = lambda rank, step: False  # check_resume's arguments, for its checks

    def promise(self) -> Optional[int]:
        if any(p is None for p in self.prot) or any(n > self.tolerated for n in self.losses):
            return None
        p = min(self.prot)
        if any(a > p + 1 for a in self.after):
            return None
        return p

    # Memory is per node, and a restore may rebuild a snapshot from peers' replicas.
    MEMORY_KEPT = "every node's memory lived"
    PEERS_HOLD_SNAPSHOTS = True

    def check_resume(self, ranks: list, rebuilt=lambda rank, step: False) -> None:
        """ExpectedState.check_resume, with the replication promise. `rebuilt(rank, step)`:
        whether the agent of the rank's node says it rebuilt that snapshot from peers into the
        rank's slot (then it is in memory, also when the rank was killed before it said
        LOADED)."""
        self.rebuilt = rebuilt
        super().check_resume(ranks)

    def check_fresh(self) -> None:
        promise = self.promise()
        if promise is not None:
            raise Violation(f"the ranks started fresh although step {promise} was protected "
                            f"on every rank ({self.prot}, nodes lost since {self.losses})")

    def check_resumed_step(self, s: int) -> None:
        promise = self.promise()
        if promise is not None:
            self.promises_checked += 1
            if s < promise:
                raise Violation(
                    f"resumed at step {s}, but step {promise} was reported protected on every "
                    f"rank (newest protected per rank {self.prot}, nodes lost since "
                    f"{self.losses}, tolerated {self.tolerated}; newest step begun since "
                    f"{self.after})")

    def begun_elsewhere(self) -> list[int]:
        return [max(self.after)]  # peers may hold up to the newest step begun since a report

    def check_sources(self, ranks: list, s: int, newest: Optional[int]) -> None:
        """A lost node's rank loads from memory only what its agent rebuilt from peers; a step
        not committed at the last check loads from memory or peers, or committed since."""
        for rk in ranks:
            if rk.loaded is None:
                continue
            _, source, _ = rk.loaded
            if rk.rank in self.lost_ranks and source == "memory" and not self.rebuilt(rk.rank, s):
                raise Violation(f"rank {rk.rank}'s node was lost, yet it loaded step {s} from "
                                f"memory, and its agent never rebuilt that step from peers")
            if (newest is None or s > newest) and source not in ("memory", "peer"):
                self.check_committed_since(rk, s)

    def record_round(self, ranks: list, end_sent: Optional[str]) -> None:
        super().record_round(ranks, end_sent)
        for rk in ranks:
            r = rk.rank
            if rk.saved == [] and rk.loaded is not None and rk.loaded[1] == "peer":
                if rk.loaded[0] != self.mem_lb[r]:
                    self.mem_run[r] = None  # which run saved the rebuilt snapshot: not known
                self.mem_lb[r] = rk.loaded[0]  # rebuilt into the rank's slot
            for line in rk.lines:
                f = line.split()
                if f and f[0] == "PROTECTED":
                    self.prot[r], self.losses[r], self.after[r] = int(f[1]), 0, int(f[1])
                elif f and f[0] == "BEGIN":
                    self.after[r] = max(self.after[r], int(f[1]))
        if end_sent == "close" and all(rk.closed is True for rk in ranks):
            # A clean close removes the snapshots and the replicas.
            self.prot = [None] * self.world
        # A lost node's rank has memory again once it loaded (from a peer) or began a save (it
        # may complete although the rank was killed before it said SAVED).
        self.lost_ranks -= {rk.rank for rk in ranks if rk.loaded is not None or rk.began}

    def nodes_lost(self, ranks_lost: set[int], n: int) -> None:
        for r in ranks_lost:
            self.mem_lb[r] = None
            self.mem_ub[r] = None
            self.mem_run[r] = None
        self.losses = [x + n for x in self.losses]
        self.lost_ranks |= ranks_lost


class NodeJob:
    def __init__(self, name: str, nodes: int, redundancy: str, tolerated: int,
                 persist_every: int, keep: int, root: str, env: dict):
        self.name, self.world, self.redundancy = name, nodes, redundancy
        self.persist_every, self.keep = persist_every, keep
        self.root, self.env = root, env
        self.path = os.path.join(root, name)
        self.cluster = Cluster(nodes, shm_size="256m")
        self.cluster.__enter__()
        self.zygotes: list[Optional[NodeZygote]] = [None] * nodes
        for i in range(nodes):
            self.start_zygote(i)
        self.expected = NodeExpected(nodes, keep, tolerated)
        self.rounds = 0
        self.steps_saved = 0
        self.logs_of_lost: dict[int, str] = {}  # node -> its agent's log when lost this round
        # node -> its agent's log as the round started: a rebuild logged in an earlier round is
        # still known after a clean close of every rank removed the log with the job directory
        self.logs_at_start: dict[int, str] = {}
        self.lost_last = False  # the job's previous round lost nodes (its ranks rebuild now)
        # A stale process left by a "stale" round (its run superseded while it hung): (the rank's
        # ct.Rank, the step it is told to save), woken by the job's next round.
        self.stale: Optional[tuple] = None
        self.port = 29400 + (os.getpid() % 1000)

    def start_zygote(self, i: int) -> None:
        node = self.cluster[i]
        log = os.path.join(self.root, f"{self.name}-{node.name}-zygote.err")
        self.zygotes[i] = NodeZygote(node, self.env, log)

    def agent_pids(self, i: int) -> list[int]:
        """Host pids of the safepointd processes running in node i."""
        return [p for p in self.cluster[i].processes()
                if (proc_argv(p) or [""])[0].endswith("safepointd")]

    def agent_log(self, i: int) -> str:
        try:
            return (self.cluster[i].shm / f"safepoint-{os.geteuid()}-{self.name}"
                    / "agent.log").read_text(errors="replace")
        except OSError:
            return ""

    def close(self) -> None:
        for z in self.zygotes:
            if z is not None:
                try:
                    z.sock.close()
                except OSError:
                    pass
        self.cluster.close()
        for z in self.zygotes:
            if z is not None:
                try:
                    z.proc.wait(timeout=30)
                except Exception:
                    pass


class Cut:
    """A partition round's cut (plan_partition): when to set it off, the node's link cut and
    healed (or flapping), the stale rank stopped ("stale"), and the rejoin save once healed."""

    def __init__(self, campaign, job: NodeJob, p: dict, ranks: list):
        self.c, self.job, self.p, self.ranks = campaign, job, p, ranks
        self.t = p["targets"][0]
        self.node = job.cluster[self.t]
        self.fired = False
        self.cut_since: Optional[float] = None  # the link is cut since (None: not now)
        self.until = 0.0                         # when the current cut (or flap phase) ends
        self.flaps = list(p.get("flaps") or [])
        self.down_total = 0.0
        self.seen_at: Optional[float] = None     # when the trigger's event was seen
        self.rebuilders = sorted(job.expected.lost_ranks)
        self.stale = None                        # the rank stopped as a hung process
        self.rejoin_sent = False

    def _said(self, rk, kind: str, pred=lambda f: True) -> int:
        return sum(1 for line in list(rk.lines)
                   if line.split()[:1] == [kind] and pred(line.split()))

    def _event_seen(self, kill_at: float) -> bool:
        trig, rk, now = self.p["trigger"], self.ranks[self.t], time.monotonic()
        if trig == "random":
            # Once every rank's Checkpointer is up: a link down while the job's own process
            # group connects fails torch.distributed's rendezvous (gloo's connect: "Network is
            # unreachable"), which is the job's start, not safepoint's to survive.
            return now >= kill_at and all(self._said(x, "READY") >= 1 for x in self.ranks)
        if trig == "saved":
            return self._said(rk, "SAVED") >= min(self.p["nth_saved"], self.p["steps"])
        if trig == "push":
            return self._said(rk, "SAVED") >= 1
        if trig == "commit":
            pe = self.job.persist_every
            return self._said(rk, "BEGIN", lambda f: int(f[1]) % pe == 0) >= 1
        if trig == "restore":
            return self._said(rk, "READY") >= 1
        if trig == "rebuild":
            who = [self.ranks[r] for r in self.rebuilders] or [rk]
            return any(self._said(x, "READY") >= 1 for x in who)
        if trig == "receive":
            # Once the node's rank is up (as for "random": seed 2026120561's round 102 met a
            # temporary left by an earlier round at its start and cut the node while its rank's
            # Checkpointer made its gloo group: "connect: Network is unreachable").
            if self._said(rk, "READY") < 1:
                return False
            d = self.node.shm / f"safepoint-{os.geteuid()}-{self.job.name}" / "replicas"
            try:
                return any(n.startswith(".tmp") for n in os.listdir(d))
            except OSError:
                return False
        raise AssertionError(f"unknown trigger {trig}")

    def step(self, kill_at: float) -> None:
        now = time.monotonic()
        if not self.fired:
            if self.seen_at is None and self._event_seen(kill_at):
                self.seen_at = now
            # restore, rebuild and commit: cut a random moment (< 0.3 s) into what follows
            lag = self.p["delay"] * 0.3 if self.p["trigger"] in ("restore", "rebuild",
                                                                  "commit") else 0.0
            if self.seen_at is not None and now >= self.seen_at + lag:
                self.fire(self.p["trigger"])
            return
        if self.cut_since is not None and now >= self.until:
            self._heal()
            if self.flaps:  # up for a while, then down again
                self.until = now + self.flaps.pop(0)[1]
        elif self.cut_since is None and self.flaps and now >= self.until:
            self._cut(self.flaps[0][0])

    def fire(self, why: str) -> None:
        self.fired = True
        self.c.triggered[why] += 1
        self.c.note(f"partition of {self.node.name} ({self.p['mode']}, {self.p['direction']}) "
                    f"set off by {why}")
        if self.p["mode"] == "stale":
            rk = self.ranks[self.t]
            if rk.alive():
                os.kill(rk.pid, signal.SIGSTOP)  # hung in a collective, as a cut-off rank is
                self.stale = rk
                self.job.stale = (rk, max(rk.began, default=0) + 1)
            self._cut(self.p["down"])
            for other in self.ranks:  # the job restarts without it (torchrun kills the rest)
                if other is not rk and other.kill():
                    self.c.kills["rank (the job restarts)"] += 1
            return
        self._cut(self.flaps[0][0] if self.flaps else self.p["down"])

    def _cut(self, seconds: float) -> None:
        self.node.partition(self.p["direction"])
        self.cut_since = time.monotonic()
        self.until = self.cut_since + seconds

    def _heal(self) -> None:
        self.node.heal()
        self.down_total += time.monotonic() - self.cut_since
        self.cut_since = None
        self.c.note(f"healed {self.node.name} ({self.down_total:.2f} s cut in all)")

    def done(self, kill_at: float) -> bool:
        """Whether the round may end (every rank idle): cut and healed, and the rejoin save (every
        rank saves once more, waits and reports its replication) answered."""
        if not self.fired:
            self.fire("end")
            return False
        if self.cut_since is not None or self.flaps:
            return False
        if self.p.get("rejoin") and not self.rejoin_sent:
            self.rejoin_sent = True
            if all(rk.alive() and rk.idle and not rk.killed for rk in self.ranks):
                for rk in self.ranks:
                    rk.idle = False
                    rk.rejoin_from = len(rk.lines)
                    rk.send("more")
                return False
        return True

    def finish(self) -> None:
        if self.cut_since is not None:
            self._heal()
        self.flaps = []
        self.p["down_total"] = self.down_total
        self.c.down_seconds.append(self.down_total)


class Wake:
    """The round after a "stale" one: once its own process of the stale rank said READY (its
    hello superseded the stale process), the stale process is resumed and told to save, wait and
    say hello again; each must fail with SupersededError."""

    ACTS = ("save", "wait", "hello")
    # Seconds after the wake without an answer (a collective it is stuck in times out after
    # PG_TIMEOUT at most): its stacks are logged.
    DIAGNOSE_AFTER = PG_TIMEOUT + 30.0

    def __init__(self, campaign, job: NodeJob, ranks: list):
        self.c, self.job, self.ranks = campaign, job, ranks
        self.stale, self.step_no = job.stale
        self.woken = False
        self.woken_at = 0.0
        self.diagnosed = False
        self.answered: Optional[dict] = None

    def step(self) -> None:
        new = self.ranks[self.stale.rank]
        if not self.woken:
            if any(line.startswith("READY") for line in list(new.lines)):
                self.woken = True
                self.woken_at = time.monotonic()
                os.kill(self.stale.pid, signal.SIGCONT)
                self.stale.send(f"stale {self.step_no}")
                self.c.note(f"woke the stale rank {self.stale.rank} (pid {self.stale.pid})")
            return
        if self.answered is None and not self.diagnosed and \
                time.monotonic() - self.woken_at > self.DIAGNOSE_AFTER:
            self.diagnose()
        if self.answered is None:
            acts = {}
            for line in list(self.stale.lines):
                f = line.split()
                if f[:1] == ["STALE"] and len(f) >= 4:
                    acts[f[1]] = (f[2], float(f[3]))
            if len(acts) == len(self.ACTS):
                self.answered = acts
                for act, (outcome, _) in acts.items():
                    self.c.stale_outcomes[(act, outcome)] += 1
                    if outcome != "SupersededError":
                        raise Violation(
                            f"the stale process of rank {self.stale.rank} (pid {self.stale.pid}, "
                            f"superseded by the job's next run) got {outcome} from {act}, not "
                            f"SupersededError: {self.stale.lines[-6:]}")

    def diagnose(self) -> None:
        """The stale process has not answered long after it was woken: its Python stacks
        (faulthandler, into its stderr) and native ones (gdb) go to the campaign's log."""
        self.diagnosed = True
        pid = self.stale.pid
        self.c.note(f"the stale rank {self.stale.rank} (pid {pid}, state {proc_state(pid)}) "
                    f"has not answered {self.DIAGNOSE_AFTER:.0f} s after it was woken; its "
                    f"lines: {self.stale.lines[-8:]}")
        try:
            os.kill(pid, signal.SIGUSR2)  # faulthandler's (SIGUSR1 is a preemption notice)
        except ProcessLookupError:
            return
        time.sleep(1.0)
        self.c.note(f"its Python stacks:\n{self.stale.stderr()}")
        try:
            gdb = subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex",
                                  "thread apply all bt 25"], capture_output=True, text=True,
                                 timeout=60)
            self.c.note(f"its native stacks:\n{gdb.stdout[-12000:]}")
        except (OSError, subprocess.TimeoutExpired) as e:
            self.c.note(f"gdb could not read its stacks: {e}")

    def done(self) -> bool:
        return self.answered is not None

    def finish(self) -> None:
        if self.answered is None:
            raise Violation(f"the stale process of rank {self.stale.rank} (pid {self.stale.pid}) "
                            f"never answered: {self.stale.lines[-6:]}\n{self.stale.stderr()}")
        status = self.stale.reap()
        if not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0):
            raise Violation(f"the stale process of rank {self.stale.rank} exited with status "
                            f"{status}:\n{self.stale.stderr()}")
        self.job.stale = None


class NodeCampaign:
    def __init__(self, args, env: dict):
        ct.start_campaign(self, args, env, "safepoint-nodecrash-")
        os.chmod(self.root, 0o755)
        tag = f"{self.seed % 100000}"
        self.jobs: list[NodeJob] = []
        specs = [("mirror", 3, "mirror", 1, 2, 2), ("ec", 4, "ec:2+1", 1, 3, 3)]
        if args.node_jobs:
            specs = [s for s in specs if s[0] in args.node_jobs.split(",")]
        for kind, n, red, tol, pe, keep in specs:
            self.jobs.append(NodeJob(f"n{kind}-{tag}", n, red, tol, pe, keep, self.root, env))
        self.round = 0
        self.kills = Counter()
        self.modes = Counter()
        self.sources = Counter()         # (lost node's rank?, source) of every resume
        self.resumes = Counter()
        self.round_seconds: list[float] = []
        self.full_seconds: list[float] = []  # until every rank was idle, of rounds that got there
        self.node_loss_seconds: list[float] = []   # Node.kill() until nothing of it is left
        self.replace_seconds: list[float] = []     # replace() and a new zygote (imports torch)
        self.peer_restore_seconds: list[float] = []
        self.loads_checked = 0
        self.verifies = 0
        self.current = None
        # The replication kill points, armed from a generator of their own.
        self.points = [n for n in ct.read_kill_points() if n.startswith("replica.")]
        self.point_rng = random.Random(f"{self.seed}-replica-points")
        self.planned: Counter = Counter()   # rounds armed at each point
        self.stamps: dict[str, str] = {}    # stamp file -> the point it arms
        # Partition rounds, drawn from a generator of their own (without --partitions the
        # node-loss rounds of a seed are what they were).
        self.partition_rng = random.Random(f"{self.seed}-partitions")
        self.partitions = Counter()         # (mode, trigger, direction) of partition rounds
        self.triggered = Counter()          # how each partition was set off: trigger or "end"
        self.down_seconds: list[float] = []  # per partition round, the time the link was cut
        self.longest: dict[str, tuple] = {}  # call -> (seconds, round, outcome) of the longest
        self.calls = Counter()               # call -> how many were timed
        self.failed_calls = Counter()        # (call, error class) of calls that raised
        self.stale_outcomes = Counter()      # (call, outcome) of the stale processes' acts
        self.rejoined = 0                    # rounds whose every rank was protected again
        # (round, rank) whose rejoin save was not protected, its replication not through the cut
        self.unprotected_elsewhere: list[tuple[int, int]] = []
        self.waits_timed_out: list[tuple[int, int]] = []  # (round, rank): waits that timed out

    def note(self, msg: str) -> None:
        self.log.write(f"[round {self.round}] {msg}\n")

    def plan(self, job: NodeJob) -> dict:
        if job.stale is not None:  # the round that wakes the stale process: nothing else fails
            return self.plan_wake(job)
        need_p = self.args.partitions - sum(self.modes[m] for m in PARTITIONS)
        need_l = self.args.rounds - sum(self.modes[m] for m in LOSSES)
        if need_p > 0 and (need_l <= 0 or
                           self.partition_rng.random() < need_p / (need_p + need_l)):
            return self.plan_partition(job)
        r = self.rng
        mode = r.choice(MODES)
        return {
            "mode": mode,
            "targets": r.sample(range(job.world), 2 if mode == "nodes" else 1),
            "at_end": r.random() < 0.4,
            "delay": r.random(),
            "steps": r.randint(2, 7),
            "end": "close" if r.random() < 0.1 else "exit",
            "p_wait": r.choice([0.0, 0.3, 0.8]),
            "p_status": r.choice([0.0, 0.2]),
            "p_final_wait": r.choice([0.0, 1.0, 1.0]),
            # bytes/s an agent sends: slow pushes are superseded by newer saves, and kills land
            # in the middle of them (None: no cap, the veth's speed is unknown)
            "bandwidth": r.choice([None, None, 20e6, 4e6]),
            "rng": r.getrandbits(64),
            **self.plan_point(job, mode),
        }

    def plan_partition(self, job: NodeJob) -> dict:
        """A partition round: one node cut off ("both" directions: its link down; "out" or
        "in": one direction) while something is under way (`trigger`: a push from it, a receive
        on it, a rebuild from peers, a persist and commit, a restore, or a random moment), for
        `down` seconds (a fifth of them longer than peer_timeout), then healed; "flap": down and
        up `flaps` times within a save; "stale": its rank stopped as a hung process and the
        other ranks killed (the job restarts), the rank's next process then supersedes it."""
        r = self.partition_rng
        mode = r.choice(PARTITION_MODES)
        trigger = r.choice(TRIGGERS)
        if trigger == "rebuild" and not job.lost_last:
            trigger = "restore"  # a rebuild from peers follows a node loss only
        elif trigger == "restore" and job.lost_last:
            trigger = "rebuild"  # after a node loss the restore is the lost rank's rebuild
        direction = "both" if mode in ("stale", "flap") else r.choice(["both", "both", "out",
                                                                       "in"])
        down = (r.uniform(PEER_TIMEOUT + 1, PEER_TIMEOUT + 4) if r.random() < 0.2
                else r.uniform(0.2, 3.0))
        flaps = [(r.uniform(0.05, 0.5), r.uniform(0.05, 0.4)) for _ in range(r.randint(2, 5))]
        stale = mode == "stale"
        return {
            "mode": mode,
            "targets": [r.randrange(job.world)],
            "trigger": "saved" if stale else trigger,
            "direction": direction,
            "down": down if mode != "flap" else sum(d for d, _ in flaps),
            "flaps": flaps if mode == "flap" else [],
            "at_end": False,
            "delay": r.random(),
            "steps": r.randint(3, 7),
            "end": "close" if r.random() < 0.1 and not stale else "exit",
            "p_wait": 0.0 if stale else r.choice([0.0, 0.3, 0.8]),
            "p_status": 0.0 if stale else r.choice([0.0, 0.2]),
            "p_final_wait": 0.0 if stale else 1.0,
            "nth_saved": r.randint(1, 3),
            # slow pushes make a push and a receive last long enough to cut them
            "bandwidth": r.choice([20e6, 4e6]) if trigger in ("push", "receive")
            else r.choice([None, None, 20e6]),
            "rejoin": not stale,
            "rng": r.getrandbits(64),
            "point": None, "nth": None,
        }

    def plan_wake(self, job: NodeJob) -> dict:
        """The round after a "stale" one: the job's next run, whose process of the stale rank
        supersedes the stale process; that one is then woken and told to save (it must fail).
        Half the time the stale node's agent is killed first: the new agent knows the stale
        process only from the rank's claim in shared memory."""
        r = self.partition_rng
        return {"mode": "wake", "targets": [], "at_end": True, "delay": 0.0,
                "restart_agent": r.random() < 0.5,
                "steps": r.randint(2, 5), "end": "exit", "p_wait": 0.3, "p_status": 0.2,
                "p_final_wait": 1.0, "bandwidth": None, "rng": r.getrandbits(64),
                "point": None, "nth": None}

    def plan_point(self, job: NodeJob, mode: str) -> dict:
        """Which replication kill point the round arms (None: none), and its nth hit."""
        r = self.point_rng
        if r.random() >= 0.5:
            return {"point": None, "nth": None}
        if job.lost_last and r.random() < 0.6:
            point = "replica.rebuild.before_finish"
        elif mode in LOSSES and r.random() < 0.5:
            point = r.choice([n for n in self.points if n.startswith("replica.flush.")])
        else:
            point = r.choice(["replica.push.after_chunk", "replica.receive.before_visible"])
        return {"point": point, "nth": r.randint(1, 4) if point.endswith("after_chunk") else 1}

    def kill_agents(self, job: NodeJob, why: str) -> None:
        """SIGKILL every agent of the job, on every node."""
        for i in range(job.world):
            for pid in job.agent_pids(i):
                kill_and_wait(pid)
                self.kills[f"agent ({why})"] += 1
                self.note(f"killed the agent {pid} of {job.cluster[i].name} ({why})")

    def died_at_point(self, nspid: Optional[int], stamp: Optional[str]) -> Optional[str]:
        """The kill point that a dead process (`nspid` in its node, armed with `stamp`) died
        at: the point its stamp arms, if the stamp names it."""
        if nspid is None or stamp is None or ct.stamp_pid(stamp) != nspid:
            return None
        return self.stamps.get(stamp)

    def fired(self) -> Counter:
        """Armed rounds whose point fired (its stamp written), by point."""
        return Counter(point for stamp, point in self.stamps.items() if os.path.exists(stamp))

    # -- a round --------------------------------------------------------------------------------
    def run_round(self, job: NodeJob, p: Optional[dict] = None) -> None:
        final = p is not None
        if p is None:
            p = self.plan(job)
        self.round += 1
        job.rounds += 1
        self.modes[p["mode"]] += 1
        if p["mode"] in PARTITIONS:
            self.partitions[(p["mode"], p["trigger"], p["direction"])] += 1
        self.note(f"job {job.name}: {json.dumps(p)}")
        stamp = os.path.join(self.root, f"stamp-{self.round}")
        kill_env = {}
        if final:
            # An agent armed in an earlier round must not die in the clean final rounds.
            self.kill_agents(job, "before the final round")
        elif p.get("point") is not None:
            # The point must be in the environment of the agents: the ranks start them.
            self.kill_agents(job, f"arming {p['point']}")
            self.planned[p["point"]] += 1
            self.stamps[stamp] = p["point"]
            kill_env = {"SAFEPOINT_KILL_AT": f"{p['point']}:{p['nth']}",
                        "SAFEPOINT_KILL_STAMP": stamp}
        if p.get("restart_agent") and job.stale is not None:
            i = job.stale[0].rank  # one rank per node: its node
            for pid in job.agent_pids(i):
                kill_and_wait(pid)
                self.kills["agent (before a wake)"] += 1
                self.note(f"killed the agent {pid} of {job.cluster[i].name} (before a wake)")
        t0 = time.monotonic()
        rdzv = os.path.join(self.root, f"rdzv-{self.round}")
        events: "queue.Queue" = queue.Queue()
        ranks = []
        job.port += 1
        master = job.cluster[0].addr
        for rank in range(job.world):
            env = {"GROUP_RANK": str(rank), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                   "MASTER_ADDR": master, "MASTER_PORT": str(job.port),
                   "GLOO_SOCKET_IFNAME": "eth0", **kill_env}
            args = {"path": job.path, "job": job.name, "shm_dir": "/dev/shm", "seed": self.seed,
                    "rank": rank, "world_size": job.world, "persist_every": job.persist_every,
                    "keep": job.keep, "steps": p["steps"], "p_wait": p["p_wait"],
                    "p_status": p["p_status"], "p_final_wait": p["p_final_wait"],
                    "rng": f"{p['rng']}-{rank}", "rdzv": rdzv, "env": env,
                    "redundancy": job.redundancy, "peer_timeout": PEER_TIMEOUT,
                    "bandwidth": p.get("bandwidth"), "run_tag": f"{job.name}-r{self.round}",
                    "timing": True, "wait_timeout": WAIT_TIMEOUT, "pg_timeout": PG_TIMEOUT}
            ranks.append(ct.Rank(job.zygotes[rank], args,
                                 os.path.join(self.root, f"r{self.round}-{rank}.err"), events))
        self.current = (job, ranks)
        job.logs_of_lost = {}
        job.logs_at_start = {i: job.agent_log(i) for i in range(job.world)}
        # A typical round: one that ran to its end (rounds killed early would make it shorter
        # and shorter, and the kills ever earlier).
        typical = (sorted(self.full_seconds)[len(self.full_seconds) // 2]
                   if self.full_seconds else 3.0)
        kill_at = t0 + p["delay"] * typical
        deadline = time.monotonic() + HANG
        fired = p["mode"] in ("none", "wake") or p["mode"] in PARTITIONS
        ended = False
        cut = Cut(self, job, p, ranks) if p["mode"] in PARTITIONS else None
        wake = Wake(self, job, ranks) if job.stale is not None else None
        rank_down = False
        lost: list[int] = []
        killed_agents: set[int] = set()
        agents_seen: dict[int, int] = {}  # host pid -> node index
        # host pid -> (its pid in its node, the stamp in its environment)
        armed: dict[int, tuple[Optional[int], Optional[str]]] = {}
        next_look = 0.0

        def look_at_agents() -> None:
            """Every agent seen alive must die only when killed, with its node, or saying so."""
            for i in range(job.world):
                if i in lost:
                    continue
                for pid in job.agent_pids(i):
                    agents_seen[pid] = i
                    if pid not in armed or None in armed[pid]:
                        armed[pid] = (ns_pid(pid), armed_stamp(pid))
            for pid, i in list(agents_seen.items()):
                if dead(pid):
                    del agents_seen[pid]
                    if pid in killed_agents or i in lost:
                        continue
                    # An agent that died at once (a rebuild is asked for as the rank starts) may
                    # have been read as a zombie, whose environment is gone: it was started in
                    # this round, with the round's stamp.
                    nspid, armed_with = armed.get(pid, (None, None))
                    point = self.died_at_point(
                        nspid, armed_with or kill_env.get("SAFEPOINT_KILL_STAMP"))
                    if point is not None:
                        self.note(f"the agent {pid} of {job.cluster[i].name} died at kill "
                                  f"point {point}")
                        continue
                    text = job.agent_log(i)
                    lock = (job.cluster[i].shm / f"safepoint-{os.geteuid()}-{job.name}" /
                            "agent.lock")
                    # A clean close of every rank removes the job directory, log included.
                    if lock.exists() and not (": exited" in text or
                                              "another agent serves" in text):
                        raise Violation(f"the agent {pid} of {job.cluster[i].name} died without "
                                        f"being killed:\n{text[-3000:]}")

        def kill_workloads(why: str) -> None:
            nonlocal rank_down
            rank_down = True
            for rk in ranks:
                if rk.kill():
                    self.kills[f"rank ({why})"] += 1
                    self.note(f"killed rank {rk.rank} pid {rk.pid} ({why})")

        def fire(why: str) -> None:
            mode = p["mode"]
            if mode == "workload":
                kill_workloads(why)
            if mode in ("agent", "agent+node"):
                i = p["targets"][0]
                for pid in job.agent_pids(i):
                    killed_agents.add(pid)
                    kill_and_wait(pid)
                    self.kills[f"agent ({why})"] += 1
                    self.note(f"killed the agent {pid} of {job.cluster[i].name} ({why})")
            if mode in ("node", "nodes", "agent+node"):
                t = time.monotonic()
                # agent+node: the node whose replicas the killed agent held (the ring's previous)
                targets = ([(p["targets"][0] - 1) % job.world] if mode == "agent+node"
                           else p["targets"])
                for i in targets:
                    # Its agent's log dies with it; the checks still need it (rebuilds).
                    job.logs_of_lost[i] = job.agent_log(i)
                    had = job.cluster[i].kill()  # every process of the node and its /dev/shm
                    lost.append(i)
                    self.kills[f"node ({why})"] += 1
                    self.note(f"lost {job.cluster[i].name} ({why}): {len(had)} processes")
                    for rk in ranks:
                        if rk.rank == i:  # one rank per node
                            rk.killed = True
                            rk.status = -signal.SIGKILL
                self.node_loss_seconds.append(time.monotonic() - t)
                kill_workloads("a peer's node died")

        while True:
            ct.take_event(events, 0.01, deadline, ranks, self.round)
            if time.monotonic() >= next_look:
                next_look = time.monotonic() + 0.5
                look_at_agents()
            if not fired and not p["at_end"] and time.monotonic() >= kill_at:
                fired = True
                fire("random moment")
            if cut is not None:
                cut.step(kill_at)
            if wake is not None:
                wake.step()
            for rk in ranks:
                if rk is getattr(cut, "stale", None):
                    continue  # stopped on purpose: the job's next round supersedes it
                if rk.eof and rk.status is None and not rk.alive():
                    status = rk.reap()
                    told = ended and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
                    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL and \
                            self.died_at_point(rk.zygote.ns_of.get(rk.pid),
                                               kill_env.get("SAFEPOINT_KILL_STAMP")):
                        kill_workloads("a peer died at a kill point")
                    elif not (rk.killed or told or rank_down):
                        raise Violation(f"rank {rk.rank} (pid {rk.pid}) exited with status "
                                        f"{status} without being killed:\n{rk.stderr()}")
            stale = getattr(cut, "stale", None)
            everyone_idle = all(rk.idle or rk.status is not None or not rk.alive()
                                or rk is stale for rk in ranks)
            if everyone_idle and not ended and cut is not None and not cut.done(kill_at):
                continue  # the link is still cut (or a rejoin save is under way)
            if everyone_idle and not ended and wake is not None and not wake.done():
                continue  # the stale process has not answered yet
            if everyone_idle and not ended:
                if not fired:
                    fired = True
                    fire("at the end")
                self.full_seconds.append(time.monotonic() - t0)
                ended = True
                for rk in ranks:
                    if rk.alive() and rk.idle and rk is not stale:
                        rk.send(p["end"])
                p["end_sent"] = p["end"]
            if ended and all(rk.status is not None or (rk.eof and not rk.alive())
                             or rk is stale for rk in ranks):
                break
        if cut is not None:
            cut.finish()
        if wake is not None:
            wake.finish()
        ct.reap_ranks([rk for rk in ranks if rk is not getattr(cut, "stale", None)], events)
        look_at_agents()
        job.lost_last = bool(lost)
        self.round_seconds.append(time.monotonic() - t0)
        # Lost nodes: replace them (same name and address, empty /dev/shm), new zygotes.
        t = time.monotonic()
        for i in lost:
            z = job.zygotes[i]
            try:
                z.sock.close()
            except OSError:
                pass
            z.proc.wait(timeout=HANG)
            job.cluster.replace(i)
            job.start_zygote(i)
        if lost:
            self.replace_seconds.append(time.monotonic() - t)
        self.check_round(job, p, ranks, lost)
        if final:
            bad = [rk for rk in ranks if rk.closed is not True]
            if bad:
                raise Violation(f"the final clean round of {job.name} did not close: "
                                + " | ".join(f"rank {rk.rank}: {rk.lines} {rk.stderr()}"
                                             for rk in bad))

    # -- checks ---------------------------------------------------------------------------------
    def quiesce(self, job: NodeJob) -> None:
        """Every node's agent idle (or none), and no agent on its way (a process forked below a
        zygote that is neither the zygote nor safepointd: a killed rank's helper)."""
        stale_pid = job.stale[0].pid if job.stale is not None else None

        def idle() -> bool:
            for i, node in enumerate(job.cluster):
                zpid = job.zygotes[i].host_pid()
                for pid in node.processes():
                    argv = proc_argv(pid)
                    if pid not in (zpid, stale_pid) and any("--zygote" in a for a in argv):
                        return False
                out = node.run([self.cli, "status", "--shm-dir", "/dev/shm", "--json"])
                try:
                    jobs = {j["job"]: j for j in json.loads(out.stdout)}
                except (ValueError, KeyError, TypeError):
                    return False
                j = jobs.get(job.name)
                if j is None or not j.get("agent_alive"):
                    continue
                if "queued" not in j:
                    return False
                stale = job.stale[0].rank if job.stale is not None else None
                if not (j["queued"] == 0 and j["in_flight"] is None and
                        all((not r["connected"] or r["rank"] == stale) and
                            r["pending_persists"] == 0 for r in j["ranks"])):
                    return False
            return True
        if not wait_until(idle, interval=0.05):
            raise Violation(f"the agents of {job.name} never became idle:\n" + "\n".join(
                job.agent_log(i)[-2000:] for i in range(job.world)))

    def check_storage(self, job: NodeJob) -> None:
        import safepoint
        from workload import first_difference, make_state, strip_run

        listed = safepoint.steps(job.path)
        job.expected.check_listed(listed)
        self.check_one_image_per_attempt(job, listed)
        for s in listed:
            for r in range(job.world):
                try:
                    got, state = safepoint.load(job.path, s, rank=r)
                except safepoint.Error as e:
                    raise Violation(f"listed step {s} cannot be loaded for rank {r}: {e}")
                if isinstance(state.get("run"), dict) and state["run"].get("stale"):
                    raise Violation(f"listed step {s} of rank {r} is a stale process's save "
                                    f"({state['run']}): it was made after its run was superseded")
                diff = first_difference(strip_run(state), make_state(self.seed, s, r))
                if got != s or diff is not None:
                    raise Violation(f"step {s} rank {r} loads with a difference: {diff}")
                self.loads_checked += 1
        if listed:
            out = subprocess.run([self.cli, "verify", job.path, "--all"], capture_output=True,
                                    text=True, timeout=HANG)
            if out.returncode != 0:
                raise Violation(f"safepoint verify --all {job.path} failed:\n{out.stdout[-2000:]}"
                                f"{out.stderr[-2000:]}")
            self.verifies += 1

    def check_one_image_per_attempt(self, job: NodeJob, listed: list[int]) -> None:
        """No two writers publish one rank's image of one attempt: in every step directory a
        rank has at most one image (plain or packed) of each save attempt (temporaries aside)."""
        import re

        name = re.compile(r"^rank-(\d+)(?:\.g([0-9a-f]+))?\.(img|pack)$")
        for s in listed:
            d = os.path.join(job.path, f"step-{s:020d}")
            seen: dict = {}
            for n in os.listdir(d):
                m = name.match(n)
                if m is None:
                    continue
                key = (int(m.group(1)), m.group(2))
                if key in seen:
                    raise Violation(f"step {s} holds two images of rank {key[0]} of save attempt "
                                    f"{key[1]}: {seen[key]} and {n}")
                seen[key] = n

    def check_calls(self, job: NodeJob, p: dict, ranks: list) -> None:
        """Every timed call (TIME lines) returned or failed with a safepoint error, within its
        bound (CALL_BOUNDS) plus the time the round's link was cut; the longest of each kind is
        kept for the report. In a round that killed a rank (or lost its node) the others' calls
        may fail in the job's own collectives (torch.distributed's errors): those are not
        safepoint's to name."""
        down = p.get("down_total", 0.0)
        someone_killed = any(rk.killed for rk in ranks)
        for rk in ranks:
            for line in list(rk.lines):
                f = line.split()
                if f[:1] != ["TIME"] or len(f) < 4:
                    continue
                kind, seconds, outcome = f[1], float(f[2]), f[3]
                self.calls[kind] += 1
                if outcome != "ok":
                    self.failed_calls[(kind, outcome)] += 1
                if outcome.startswith("raised:") and not someone_killed:
                    raise Violation(f"rank {rk.rank}'s {kind} failed with {outcome[7:]}, which "
                                    f"is not a safepoint error: {rk.stderr()}")
                bound = CALL_BOUNDS.get(kind, 60.0) + down
                if seconds > bound:
                    raise Violation(f"rank {rk.rank}'s {kind} took {seconds:.1f} s, beyond its "
                                    f"bound of {bound:.1f} s ({CALL_BOUNDS.get(kind, 60.0):.0f} s "
                                    f"+ {down:.1f} s cut)")
                if kind == "wait" and outcome != "ok" and seconds >= WAIT_TIMEOUT:
                    # Open (docs/reliability.md, "Found and not yet fixed"): a wait for a step
                    # that a rank on another node will never persist ends only by its timeout.
                    self.waits_timed_out.append((self.round, rk.rank))
                    self.note(f"rank {rk.rank}'s wait ran into its timeout ({seconds:.1f} s)")
                if seconds > self.longest.get(kind, (0.0,))[0]:
                    self.longest[kind] = (seconds, self.round, outcome, down)

    def check_partition_round(self, job: NodeJob, p: dict, ranks: list) -> None:
        """What a partition round adds: no rank of the job's current run was superseded; the
        ranks resumed from snapshots of one run, never a stale process's; after the link came
        back every rank saved again, waited and is protected again (its newest snapshot reached
        every peer placement names)."""
        stale = job.stale[0] if job.stale is not None else None
        for rk in ranks:
            if rk.superseded and rk is not stale:
                raise Violation(f"rank {rk.rank} (pid {rk.pid}) of the job's current run was "
                                f"superseded: {rk.superseded}")
        tags = {rk.loaded_tag for rk in ranks if rk.loaded is not None}
        if any(t.startswith("stale:") for t in tags):
            raise Violation(f"a rank resumed from a stale process's snapshot: "
                            f"{[(rk.rank, rk.loaded, rk.loaded_tag) for rk in ranks]}")
        if len(tags) > 1:
            raise Violation(f"the ranks resumed step {[rk.loaded for rk in ranks]} from "
                            f"snapshots of different runs: {[rk.loaded_tag for rk in ranks]}")
        if p.get("rejoin") and all(rk.rejoin_from is not None for rk in ranks) and \
                job.redundancy:
            t = p["targets"][0]
            # The ranks whose replication goes through the cut node: its own, and those placing
            # copies on it (mirror: the ring's previous node; ec:2+1 over 4 nodes: every node).
            involved = {t, (t - 1) % job.world} if job.redundancy == "mirror" else set(
                range(job.world))
            # A node whose agent a kill point ended during the round is no excuse: its rank's
            # watch starts a new one on the same port, whose peer service starts once the node's
            # link is up if it was cut then (OPEN-4, fixed: docs/reliability.md).
            for rk in ranks:
                after = [ln.split() for ln in rk.lines[rk.rejoin_from:]]
                reports = [f for f in after if f[:1] in (["PROTECTED"], ["UNPROTECTED"])]
                fails = [f for f in after if f[:1] in (["WAITFAIL"], ["STATUSFAIL"])]
                if fails or not reports or reports[-1][0] != "PROTECTED":
                    if rk.rank in involved:
                        raise Violation(
                            f"{job.cluster[t].name} came back, yet rank {rk.rank}'s save after "
                            f"it is not protected again: {rk.lines[rk.rejoin_from:]}")
                    # Between two nodes the cut never touched: not the rejoin's; counted.
                    self.unprotected_elsewhere.append((self.round, rk.rank))
                    self.note(f"rank {rk.rank} (its replication does not go through the cut "
                              f"node) is not protected after the rejoin save: "
                              f"{rk.lines[rk.rejoin_from:]}")
            self.rejoined += 1

    def check_round(self, job: NodeJob, p: dict, ranks: list, lost: list[int]) -> None:
        import safepoint

        exp = job.expected
        promise = exp.promise()
        lost_before = sorted(exp.lost_ranks)
        # One rank per node: rank r runs on node r.
        exp.listing = lambda uri: (safepoint.steps(job.path), job.keep)  # one store: path
        exp.check_resume(ranks, rebuilt=lambda r, s: f"rank {r} step {s}: rebuilt" in
                         job.logs_at_start.get(r, "") + job.logs_of_lost.get(r, "") +
                         job.agent_log(r))
        loaded = [(rk.rank, rk.loaded) for rk in ranks if rk.loaded is not None]
        desc = []
        for r, (s, source, _) in loaded:
            peers = ""
            for line in ranks[r].lines:
                f = line.split()
                if f and f[0] == "LOADED" and len(f) > 5:
                    if f[4] != "-":
                        peers = f"<{f[4]}"
                    if source == "peer":
                        self.peer_restore_seconds.append(float(f[5]))
                        peers += f"({float(f[5]):.2f} s)"
            lost_mark = "*" if r in lost_before else ""
            desc.append(f"r{r}{lost_mark}:{s}:{source}{peers}")
            self.sources[("lost node" if lost_mark else "other", source)] += 1
        if loaded:
            self.resumes["peer" if any(x[1][1] == "peer" for x in loaded) else
                         "memory" if all(x[1][1] == "memory" for x in loaded) else
                         "storage" if all(x[1][1] == "storage" for x in loaded) else "mixed"] += 1
        elif any(rk.fresh for rk in ranks):
            self.resumes["fresh"] += 1
        self.check_calls(job, p, ranks)
        self.check_partition_round(job, p, ranks)
        exp.record_round(ranks, p.get("end_sent"))
        job.steps_saved += sum(len(rk.saved) for rk in ranks)
        if lost:
            exp.nodes_lost(set(lost), len(lost))
        self.quiesce(job)
        self.check_storage(job)
        prot = [max([int(ln.split()[1]) for ln in rk.lines if ln.startswith("PROTECTED ")],
                    default=None) for rk in ranks]
        line = (f"round {self.round:3d} {job.name:>12} {p['mode']:8} "
                f"{'lost ' + ','.join(job.cluster[i].name for i in lost) if lost else '':12} "
                f"resume[{' '.join(desc) or ('fresh' if any(rk.fresh for rk in ranks) else 'killed before loading')}] promise {promise} "
                f"saved to {max([max(rk.saved) for rk in ranks if rk.saved], default=None)} "
                f"protected {prot} committed {exp.listed[-1] if exp.listed else None} "
                f"({self.round_seconds[-1]:.1f} s)")
        self.note(line)
        if self.args.verbose:
            print(line, flush=True)

    # -- the whole campaign ---------------------------------------------------------------------
    def run(self) -> int:
        t0 = time.monotonic()
        try:
            while (sum(self.modes[m] for m in LOSSES) < self.args.rounds or
                   sum(self.modes[m] for m in PARTITIONS) < self.args.partitions):
                job = self.jobs[self.round % len(self.jobs)]
                self.run_round(job)
            for job in self.jobs:
                self.run_round(job, {"mode": "none", "targets": [], "at_end": True, "delay": 0,
                                     "steps": job.persist_every * 2, "end": "close",
                                     "p_wait": 1.0, "p_status": 0.0, "p_final_wait": 1.0,
                                     "rng": "final"})
        except Violation as v:
            ct.note_violation(self, v, lambda rk: "\n" + rk.stderr(), lambda job: [
                f"agent log of {job.cluster[i].name}:\n"
                f"{(job.logs_of_lost.get(i, '') or job.agent_log(i))[-5000:]}"
                for i in range(job.world)])
            print(f"kept for inspection: {self.root} (log.txt); replay: {sys.argv[0]} --nodes "
                  f"--rounds {self.args.rounds} --partitions {self.args.partitions} "
                  f"--seed {self.seed}", flush=True)
            self.cleanup(keep=True)
            return 1
        self.report(time.monotonic() - t0)
        self.cleanup(keep=self.args.keep)
        return 0

    def report(self, wall: float) -> None:
        rs = sorted(self.round_seconds)
        print(f"node-loss campaign, seed {self.seed}: {self.round} rounds "
              f"({sum(self.modes[m] for m in LOSSES)} losing nodes, "
              f"{sum(self.modes[m] for m in PARTITIONS)} partitions), {wall:.1f} s wall; "
              f"0 violations")
        print("  rounds by mode: " + ", ".join(f"{m} {n}" for m, n in sorted(self.modes.items())))
        print("  kills: " + ", ".join(f"{k} {n}" for k, n in sorted(self.kills.items())))
        fired = self.fired()
        print("  replication kill points (fired/armed): " + ", ".join(
            f"{n} {fired[n]}/{self.planned[n]}" for n in self.points))
        print("  resumes: " + ", ".join(f"{k} {n}" for k, n in sorted(self.resumes.items())))
        print("  sources: " + ", ".join(f"{a} ranks from {b} {n}"
                                        for (a, b), n in sorted(self.sources.items())))
        for job in self.jobs:
            e = job.expected
            print(f"  job {job.name}: {job.world} nodes, {job.redundancy}, persist every "
                  f"{job.persist_every}, keep {job.keep}: {job.rounds} rounds, {job.steps_saved} "
                  f"saves returned, replication promise checked in {e.promises_checked} rounds, "
                  f"{len(e.committed_late)} steps loaded from storage that were committed "
                  f"after the previous round's check, "
                  f"newest committed step {e.listed[-1] if e.listed else None}")
        print(f"  checked: {self.loads_checked} bit-exact loads from storage, {self.verifies} "
              f"clean `safepoint verify --all`")
        if self.partitions:
            print("  partitions (mode, trigger, direction): " + ", ".join(
                f"{m}/{t}/{d} {n}" for (m, t, d), n in sorted(self.partitions.items())))
            print("  set off by: " + ", ".join(f"{k} {n}" for k, n in
                                               sorted(self.triggered.items())))
            ds = sorted(self.down_seconds)
            print(f"  link cut per round: median {ds[len(ds) // 2]:.2f} s, max {ds[-1]:.2f} s; "
                  f"{self.rejoined} rounds rejoined (the cut node's rank and those placing copies "
                  f"on it protected again after the cut); rejoin saves of other ranks not "
                  f"protected: {self.unprotected_elsewhere or 'none'}")
            print("  stale processes' acts: " + (", ".join(
                f"{a} {o} {n}" for (a, o), n in sorted(self.stale_outcomes.items())) or "none"))
        if self.calls:
            print("  calls (longest seen / bound beyond the cut): " + "; ".join(
                f"{k} {self.calls[k]}: {self.longest[k][0]:.2f} s (round {self.longest[k][1]}, "
                f"{self.longest[k][2]}, {self.longest[k][3]:.1f} s cut) / "
                f"{CALL_BOUNDS.get(k, 60.0):.0f} s" for k in sorted(self.calls)))
            print(f"  waits that ran into their {WAIT_TIMEOUT:.0f} s timeout (a step another "
                  f"node's rank will never persist): {self.waits_timed_out or 'none'}")
            if self.failed_calls:
                print("  calls that failed (raised:X only where the round killed a rank: the job's "
                      "own collectives): " + ", ".join(
                    f"{k} {e} {n}" for (k, e), n in sorted(self.failed_calls.items())))

        def dist(xs: list[float]) -> str:
            xs = sorted(xs)
            return f"median {xs[len(xs) // 2]:.2f}, max {xs[-1]:.2f}" if xs else "none"
        print(f"  seconds: rounds {dist(rs)}; node loss (Node.kill) {dist(self.node_loss_seconds)}"
              f"; replacement and its zygote {dist(self.replace_seconds)}; restores from peers "
              f"{dist(self.peer_restore_seconds)}")

    def cleanup(self, keep: bool) -> None:
        if self.current is not None:
            for rk in self.current[1]:
                rk.kill()
        for job in self.jobs:
            job.close()
        if not keep:
            shutil.rmtree(self.root, ignore_errors=True)


def run(args, env: dict) -> int:
    reason = unavailable()
    if reason:
        print(f"node-loss rounds skipped: {reason}", flush=True)
        return 0
    if args.partitions and partitions_unavailable():
        print(f"partition rounds skipped: {partitions_unavailable()}", flush=True)
        args.partitions = 0
    campaign = NodeCampaign(args, env)
    try:
        return campaign.run()
    finally:
        for job in campaign.jobs:
            job.close()
