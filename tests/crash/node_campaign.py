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
from nodes import Cluster, unavailable  # noqa: E402
from processes import dead, kill_and_wait, proc_argv, wait_until  # noqa: E402

HANG = ct.HANG
Violation = ct.Violation

LOSSES = ("node", "nodes", "agent+node")
MODES = ["workload"] * 2 + ["agent"] * 2 + ["node"] * 4 + ["agent+node"] + ["nodes"]


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

    def note(self, msg: str) -> None:
        self.log.write(f"[round {self.round}] {msg}\n")

    def plan(self, job: NodeJob) -> dict:
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
                    "redundancy": job.redundancy, "peer_timeout": 10.0,
                    "bandwidth": p.get("bandwidth")}
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
        fired = p["mode"] == "none"
        ended = False
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
            for rk in ranks:
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
            everyone_idle = all(rk.idle or rk.status is not None or not rk.alive()
                                for rk in ranks)
            if everyone_idle and not ended:
                if not fired:
                    fired = True
                    fire("at the end")
                self.full_seconds.append(time.monotonic() - t0)
                ended = True
                for rk in ranks:
                    if rk.alive() and rk.idle:
                        rk.send(p["end"])
                p["end_sent"] = p["end"]
            if ended and all(rk.status is not None or (rk.eof and not rk.alive())
                             for rk in ranks):
                break
        ct.reap_ranks(ranks, events)
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
        def idle() -> bool:
            for i, node in enumerate(job.cluster):
                zpid = job.zygotes[i].host_pid()
                for pid in node.processes():
                    argv = proc_argv(pid)
                    if pid != zpid and any("--zygote" in a for a in argv):
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
                if not (j["queued"] == 0 and j["in_flight"] is None and
                        all(not r["connected"] and r["pending_persists"] == 0
                            for r in j["ranks"])):
                    return False
            return True
        if not wait_until(idle, interval=0.05):
            raise Violation(f"the agents of {job.name} never became idle:\n" + "\n".join(
                job.agent_log(i)[-2000:] for i in range(job.world)))

    def check_storage(self, job: NodeJob) -> None:
        import safepoint
        from workload import first_difference, make_state

        listed = safepoint.steps(job.path)
        job.expected.check_listed(listed)
        for s in listed:
            for r in range(job.world):
                try:
                    got, state = safepoint.load(job.path, s, rank=r)
                except safepoint.Error as e:
                    raise Violation(f"listed step {s} cannot be loaded for rank {r}: {e}")
                diff = first_difference(state, make_state(self.seed, s, r))
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
            while sum(self.modes[m] for m in LOSSES) < self.args.rounds:
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
                  f"--rounds {self.args.rounds} --seed {self.seed}", flush=True)
            self.cleanup(keep=True)
            return 1
        self.report(time.monotonic() - t0)
        self.cleanup(keep=self.args.keep)
        return 0

    def report(self, wall: float) -> None:
        rs = sorted(self.round_seconds)
        print(f"node-loss campaign, seed {self.seed}: {self.round} rounds "
              f"({sum(self.modes[m] for m in LOSSES)} losing nodes), {wall:.1f} s wall; "
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
    campaign = NodeCampaign(args, env)
    try:
        return campaign.run()
    finally:
        for job in campaign.jobs:
            job.close()
