"""Nodes for multi-node tests: network namespaces with their own /dev/shm, hostname and address.

A `Cluster(n)` is n "nodes" on one machine (as root): per node a network namespace with a veth
pair into a bridge that the cluster creates, an address in a private /24 that no other cluster
uses at the same time (a lock file per /24), and a node init process, started as

    ip netns exec NS unshare --mount --pid --fork --mount-proc --uts --ipc sh -c '...'

that mounts its own tmpfs on /dev/shm, bind-mounts the cluster's hosts file on /etc/hosts (the
node names resolve to their addresses), sets the hostname and then reaps orphans as the pid
namespace's init. `node.popen`/`node.run` start processes inside a node (nsenter into the
init's mount, pid, uts, ipc and network namespaces): they see the node's /dev/shm, hostname and
address, and the host's file system everywhere else (a directory under /tmp is "shared
storage"). `node.kill()` is the loss of a node: SIGKILL to its init kills every process of the
node, and with the last of them the mount namespace and its /dev/shm go; kill() checks both.
`cluster.replace(i)` starts a fresh node with the same name, address and MAC (so the other
nodes' ARP caches stay right) and an empty /dev/shm.

`node.partition(direction)` cuts the node off the network while everything on it runs on:
"both" sets its eth0 down inside its namespace (`ip link set eth0 down`: sends fail at once,
what is in flight is lost, connections survive); "out" drops what the node sends (a blackhole
qdisc on its eth0, inside the namespace) and "in" what it receives (a blackhole qdisc on the
bridge's side of its veth: the namespace has no ingress filter to use, nor iptables), one
direction each, as an asymmetric link failure does (TCP then stalls both ways: its
acknowledgements cross the dead direction). `node.heal()` undoes it: the link, its address and
routes are as they were, and so are the node's processes and /dev/shm. `partitions_unavailable()`
says why a machine cannot do it (the blackhole qdisc is probed).

`Job` launches one process per rank inside the nodes with torchrun's environment (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT), collects exit
codes and outputs, and `restart()`s the job (new processes, new port) as an elastic agent does
after a node loss.

Teardown removes every namespace, link and process the cluster made, also when a test fails,
and an atexit hook and SIGTERM/SIGHUP handlers do the same for a dying test process; leftovers
of a SIGKILLed one are swept when the next cluster starts (their /24's lock is free).

Waits here only guard against hangs (processes.HANG); no test may depend on how long
something takes.
"""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from processes import HANG, LineReader, dead, kill, wait_until  # noqa: E402

PREFIX = "spt"  # every netns and link of a cluster is named spt<k>...: <k> is its /24
LOCK_DIR = Path("/run/lock/safepoint-test-nodes")
SUBNETS = range(1, 250)  # 10.213.<k>.0/24


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


# --- can this machine do it? -------------------------------------------------------------------

_unavailable: Optional[str] = None
_probed = False


def unavailable() -> Optional[str]:
    """Why nodes cannot be made here (not root, tools missing, namespaces not permitted), or
    None. Probed once per process."""
    global _probed, _unavailable
    if _probed:
        return _unavailable
    _probed = True
    if os.geteuid() != 0:
        _unavailable = "nodes need root (network namespaces, bridges, tmpfs mounts)"
        return _unavailable
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            _unavailable = f"nodes need the tool {tool!r}, which is not on PATH"
            return _unavailable
    probe = f"{PREFIX}probe{os.getpid()}"
    try:
        add = _sh("ip", "netns", "add", probe, check=False)
        if add.returncode != 0:
            _unavailable = f"cannot create a network namespace: {add.stderr.strip()}"
            return _unavailable
        link = _sh("ip", "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1",
                   check=False)
        if link.returncode != 0:
            _unavailable = f"cannot create a veth pair: {link.stderr.strip()}"
            return _unavailable
        run = _sh("ip", "netns", "exec", probe, "unshare", "--mount", "--pid", "--fork",
                  "--mount-proc", "--uts", "--ipc", "sh", "-c",
                  "mount -t tmpfs -o size=1m tmpfs /dev/shm && hostname probe", check=False)
        if run.returncode != 0:
            _unavailable = f"cannot unshare mount/pid/uts/ipc namespaces: {run.stderr.strip()}"
    finally:
        _sh("ip", "netns", "del", probe, check=False)
    return _unavailable


_partitions_unavailable: Optional[str] = None
_partitions_probed = False


def partitions_unavailable() -> Optional[str]:
    """Why nodes cannot be partitioned here (nodes unavailable, or no blackhole qdisc), or None.
    Probed once per process."""
    global _partitions_probed, _partitions_unavailable
    if _partitions_probed:
        return _partitions_unavailable
    _partitions_probed = True
    _partitions_unavailable = unavailable()
    if _partitions_unavailable or shutil.which("tc") is None:
        _partitions_unavailable = _partitions_unavailable or "partitions need the tool 'tc'"
        return _partitions_unavailable
    probe = f"{PREFIX}pprobe{os.getpid()}"
    try:
        _sh("ip", "netns", "add", probe)
        _sh("ip", "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1")
        q = _sh("ip", "netns", "exec", probe, "tc", "qdisc", "replace", "dev", "p0", "root",
                "blackhole", check=False)
        if q.returncode != 0:
            _partitions_unavailable = f"no blackhole qdisc (tc): {q.stderr.strip()}"
    except RuntimeError as e:
        _partitions_unavailable = str(e)
    finally:
        _sh("ip", "netns", "del", probe, check=False)
    return _partitions_unavailable


# --- namespaces seen from /proc ----------------------------------------------------------------

def _ns(pid: int, kind: str) -> Optional[str]:
    try:
        return os.readlink(f"/proc/{pid}/ns/{kind}")
    except OSError:
        return None


def _pids() -> list[int]:
    return [int(e) for e in os.listdir("/proc") if e.isdigit()]


def pids_in_ns(kind: str, ns: str) -> list[int]:
    """Live (not zombie) processes in the namespace `ns` ("mnt:[4026...]") of kind `kind`."""
    return [p for p in _pids() if _ns(p, kind) == ns and not dead(p)]


def mounted_anywhere(dev: int) -> bool:
    """Whether a file system with device number `dev` is mounted in any mount namespace that a
    process lives in (one /proc/<pid>/mountinfo per namespace)."""
    want = f"{os.major(dev)}:{os.minor(dev)}"
    seen = set()
    for p in _pids():
        ns = _ns(p, "mnt")
        if ns is None or ns in seen:
            continue
        seen.add(ns)
        try:
            with open(f"/proc/{p}/mountinfo") as f:
                if any(line.split()[2] == want for line in f):
                    return True
        except (OSError, IndexError):
            continue
    return False


# --- the safety net ----------------------------------------------------------------------------

_live: set[Cluster] = set()
_net_installed = False


def _cleanup_all() -> None:
    for c in list(_live):
        c.close()


def _on_signal(signum, frame):  # noqa: ARG001
    _cleanup_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _install_net() -> None:
    global _net_installed
    if _net_installed:
        return
    _net_installed = True
    atexit.register(_cleanup_all)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) in (signal.SIG_DFL, None):
                signal.signal(sig, _on_signal)


def _names_of(k: int) -> tuple[list[str], list[str]]:
    """The netns and links that exist now and belong to subnet k's cluster."""
    pat = re.compile(rf"^{PREFIX}{k}[nvb]")
    netns = [line.split()[0] for line in _sh("ip", "netns", "list").stdout.splitlines()
             if line.strip()]
    links = [line.split()[0].split("@")[0] for line in
             _sh("ip", "-br", "link").stdout.splitlines() if line.strip()]
    return [n for n in netns if pat.match(n)], [n for n in links if pat.match(n)]


def _remove(netns: Sequence[str], links: Sequence[str]) -> None:
    for ns in netns:
        for pid in _sh("ip", "netns", "pids", ns, check=False).stdout.split():
            kill(int(pid))
    for ns in netns:
        _sh("ip", "netns", "del", ns, check=False)
    for link in links:
        _sh("ip", "link", "del", link, check=False)


def _sweep_stale() -> None:
    """Removes what clusters of dead test processes left (their /24's lock is free)."""
    ks = set()
    for line in (_sh("ip", "netns", "list").stdout + _sh("ip", "-br", "link").stdout).splitlines():
        m = re.match(rf"^{PREFIX}(\d+)[nvb]", line)
        if m:
            ks.add(int(m.group(1)))
    for d in Path(tempfile.gettempdir()).glob(f"{PREFIX}*-*"):
        m = re.match(rf"^{PREFIX}(\d+)-", d.name)
        if m:
            ks.add(int(m.group(1)))
    for k in ks:
        fd = os.open(LOCK_DIR / f"net-{k}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live cluster
            _remove(*_names_of(k))
            for d in Path(tempfile.gettempdir()).glob(f"{PREFIX}{k}-*"):
                shutil.rmtree(d, ignore_errors=True)
        finally:
            os.close(fd)


# --- nodes -------------------------------------------------------------------------------------

_INIT = r"""
import os, signal, sys
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
sys.stdout.write("ready\n")
sys.stdout.flush()
os.close(1)
while True:
    signal.sigwait({signal.SIGCHLD})
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
"""


class Node:
    """One node of a Cluster. `name` is its hostname, `addr` its address, `index` its place."""

    def __init__(self, cluster: Cluster, index: int):
        self.cluster, self.index = cluster, index
        k = cluster.k
        self.name = f"{cluster.prefix}{index}"
        self.addr = f"10.213.{k}.{index + 1}"
        self.netns = f"{PREFIX}{k}n{index}"
        self.veth = f"{PREFIX}{k}v{index}"
        self.mac = f"02:53:50:{k:02x}:{index:02x}:01"
        self.init_pid: Optional[int] = None
        self.mnt_ns = self.pid_ns = None
        self.shm_dev: Optional[int] = None
        self._unshare: Optional[subprocess.Popen] = None
        self._procs: list[subprocess.Popen] = []
        self.partitioned: set[str] = set()  # the directions cut now (partition())

    # -- life --------------------------------------------------------------------------------
    def _start(self) -> None:
        c = self.cluster
        _sh("ip", "netns", "add", self.netns)
        _sh("ip", "link", "add", self.veth, "type", "veth", "peer", "name", "eth0", "address",
            self.mac, "netns", self.netns)
        _sh("ip", "link", "set", self.veth, "master", c.bridge, "up")
        _sh("ip", "-n", self.netns, "addr", "add", f"{self.addr}/24", "dev", "eth0")
        _sh("ip", "-n", self.netns, "link", "set", "eth0", "up")
        _sh("ip", "-n", self.netns, "link", "set", "lo", "up")
        script = (f"mount -t tmpfs -o size={c.shm_size},mode=1777 tmpfs /dev/shm && "
                  f"mount --bind {c.hosts} /etc/hosts && hostname {self.name} && "
                  f"exec {sys.executable} -I -S -c '{_INIT}'")
        log = open(c.dir / f"{self.name}.init.log", "ab")
        self._unshare = subprocess.Popen(
            ["ip", "netns", "exec", self.netns, "unshare", "--mount", "--pid", "--fork",
             "--mount-proc", "--uts", "--ipc", "sh", "-c", script],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, start_new_session=True)
        log.close()
        line = self._unshare.stdout.readline()
        self._unshare.stdout.close()
        if line != b"ready\n":
            self._unshare.wait()
            raise RuntimeError(f"node {self.name} did not start: "
                               f"{(c.dir / f'{self.name}.init.log').read_text()}")
        found: list[int] = []
        wait_until(lambda: found.extend(_children(self._unshare.pid)) or bool(found))
        if not found:
            raise RuntimeError(f"node {self.name}: no init below unshare {self._unshare.pid}")
        self.init_pid = found[0]
        self.mnt_ns, self.pid_ns = _ns(self.init_pid, "mnt"), _ns(self.init_pid, "pid")
        self.shm_dev = os.stat(self.shm).st_dev

    @property
    def alive(self) -> bool:
        return self.init_pid is not None and not dead(self.init_pid)

    @property
    def shm(self) -> Path:
        """The node's /dev/shm as the host sees it (through its init's root)."""
        return Path(f"/proc/{self.init_pid}/root/dev/shm")

    def processes(self) -> list[int]:
        """Host pids of the live processes in the node's pid namespace."""
        return pids_in_ns("pid", self.pid_ns) if self.pid_ns else []

    def gone(self) -> Optional[str]:
        """None when nothing of the node is left (no process in its pid or mount namespace,
        its /dev/shm mounted nowhere), else what is left."""
        left = []
        if self.init_pid is not None and not dead(self.init_pid):
            left.append(f"init {self.init_pid}")
        if self.pid_ns and pids_in_ns("pid", self.pid_ns):
            left.append(f"processes {pids_in_ns('pid', self.pid_ns)}")
        if self.mnt_ns and pids_in_ns("mnt", self.mnt_ns):
            left.append(f"mount namespace held by {pids_in_ns('mnt', self.mnt_ns)}")
        if self.shm_dev is not None and mounted_anywhere(self.shm_dev):
            left.append("/dev/shm still mounted")
        return "; ".join(left) or None

    def kill(self) -> list[int]:
        """Node loss: SIGKILL to the node's init. Waits until every process of the node is dead
        and its /dev/shm is unmounted everywhere (AssertionError if not); returns the host pids
        of the processes it had."""
        had = self.processes()
        self._kill_init()
        self._unshare.wait(timeout=HANG)
        for p in self._procs:  # nsenter parents exit after their child in the node died
            p.wait(timeout=HANG)
        if not wait_until(lambda: self.gone() is None):
            raise AssertionError(f"node {self.name} survived SIGKILL: {self.gone()}")
        return had

    # -- partitions ---------------------------------------------------------------------------
    DIRECTIONS = ("both", "out", "in")

    def partition(self, direction: str = "both") -> None:
        """Cuts the node off in `direction` ("both", "out", "in"; see the module's docstring).
        Idempotent per direction; heal() undoes every one."""
        if direction not in self.DIRECTIONS:
            raise ValueError(f"no partition direction {direction!r}")
        if direction == "both":
            _sh("ip", "-n", self.netns, "link", "set", "eth0", "down")
        elif direction == "out":
            _sh("ip", "netns", "exec", self.netns, "tc", "qdisc", "replace", "dev", "eth0",
                "root", "blackhole")
        else:
            _sh("tc", "qdisc", "replace", "dev", self.veth, "root", "blackhole")
        self.partitioned.add(direction)

    def heal(self) -> None:
        """The node's link as before any partition(): up, no blackhole either way."""
        if "out" in self.partitioned:
            _sh("ip", "netns", "exec", self.netns, "tc", "qdisc", "del", "dev", "eth0", "root",
                check=False)
        if "in" in self.partitioned:
            _sh("tc", "qdisc", "del", "dev", self.veth, "root", check=False)
        if "both" in self.partitioned:
            _sh("ip", "-n", self.netns, "link", "set", "eth0", "up")
        self.partitioned.clear()

    def _kill_init(self) -> None:
        # Only while the pid is still this node's init (never a reused pid).
        if self.init_pid is not None and _ns(self.init_pid, "pid") == self.pid_ns:
            kill(self.init_pid)

    # -- processes in the node ---------------------------------------------------------------
    def popen(self, argv: Sequence[str], *, cwd: Optional[str] = None, **kw) -> subprocess.Popen:
        """Starts argv inside the node (its mount, pid, uts, ipc and network namespaces), in a new
        session (killpg of its pid kills it and what it started in that session). `kw` go to
        subprocess.Popen (env, stdout, ...)."""
        if not self.alive:
            raise RuntimeError(f"node {self.name} is not running")
        kw.setdefault("start_new_session", True)
        proc = subprocess.Popen(
            ["nsenter", f"--target={self.init_pid}", "--mount", "--uts", "--ipc", "--net", "--pid",
             f"--wd={cwd or os.getcwd()}", "--", *map(str, argv)], **kw)
        self._procs.append(proc)
        return proc

    def run(self, argv: Sequence[str], *, timeout: float = HANG, check: bool = False,
            **kw) -> subprocess.CompletedProcess:
        """Runs argv inside the node to its end; stdout and stderr as text."""
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
        proc = self.popen(argv, text=True, **kw)
        try:
            out, err = proc.communicate(timeout=timeout)
        finally:
            if proc.poll() is None:
                _killpg(proc)
                proc.wait()
        done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        if check and done.returncode != 0:
            raise AssertionError(f"{argv} on {self.name} failed ({done.returncode}): {err}")
        return done

    def _stop(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                _killpg(p)
        self._kill_init()
        if self._unshare is not None:
            if self._unshare.poll() is None:
                try:
                    self._unshare.wait(timeout=HANG)
                except subprocess.TimeoutExpired:
                    pass
        for p in self._procs:
            try:
                p.wait(timeout=HANG)
            except subprocess.TimeoutExpired:
                pass
        _remove([self.netns], [self.veth])


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _killpg(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class Cluster:
    """n nodes on a bridge of their own (see the module's docstring). Use as a context manager;
    `close()` is idempotent. `shm_size` is each node's /dev/shm size (tmpfs size=)."""

    def __init__(self, n: int, *, shm_size: str = "256m", prefix: str = "node"):
        if not 1 <= n <= 250:
            raise ValueError(f"a cluster has 1..250 nodes, not {n}")
        self.n, self.shm_size, self.prefix = n, shm_size, prefix
        self.k: Optional[int] = None
        self.nodes: list[Node] = []
        self._lock_fd: Optional[int] = None
        self.dir: Optional[Path] = None

    # -- setup / teardown --------------------------------------------------------------------
    def __enter__(self) -> Cluster:
        reason = unavailable()
        if reason:
            raise RuntimeError(reason)
        _install_net()
        LOCK_DIR.mkdir(parents=True, exist_ok=True)
        _sweep_stale()
        self._take_subnet()
        _live.add(self)
        try:
            self.dir = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{self.k}-"))
            self.bridge = f"{PREFIX}{self.k}br"
            self.hosts = self.dir / "hosts"
            names = [f"{self.prefix}{i}" for i in range(self.n)]
            self.hosts.write_text("127.0.0.1 localhost\n" + "".join(
                f"10.213.{self.k}.{i + 1} {name}\n" for i, name in enumerate(names)))
            _remove(*_names_of(self.k))  # what a dead holder of this /24 may have left
            _sh("ip", "link", "add", self.bridge, "type", "bridge")
            _sh("ip", "link", "set", self.bridge, "up")
            for i in range(self.n):
                node = Node(self, i)
                self.nodes.append(node)
                node._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _take_subnet(self) -> None:
        start = os.getpid() % len(SUBNETS)
        for j in range(len(SUBNETS)):
            k = SUBNETS[(start + j) % len(SUBNETS)]
            fd = os.open(LOCK_DIR / f"net-{k}.lock", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.k, self._lock_fd = k, fd
            return
        raise RuntimeError("no free test subnet 10.213.<k>.0/24 (all locks held)")

    def close(self) -> None:
        if self._lock_fd is None:
            return
        for node in self.nodes:
            node._stop()
        _remove(*_names_of(self.k))
        _sh("ip", "link", "del", self.bridge, check=False)
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
        os.close(self._lock_fd)
        self._lock_fd = None
        _live.discard(self)

    def leftovers(self) -> list[str]:
        """Namespaces and links of this cluster that still exist (empty after close)."""
        netns, links = _names_of(self.k)
        return netns + links

    # -- nodes -------------------------------------------------------------------------------
    def __getitem__(self, i: int) -> Node:
        return self.nodes[i]

    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self):
        return iter(self.nodes)

    def replace(self, i: int) -> Node:
        """A fresh node in place of node i (killed first if it still runs): same name, address
        and MAC, a new network namespace and an empty /dev/shm."""
        old = self.nodes[i]
        if old.alive:
            old.kill()
        old._stop()
        node = Node(self, i)
        self.nodes[i] = node
        node._start()
        return node


# --- jobs --------------------------------------------------------------------------------------

# Variables a launcher sets or that would tell a rank something other than its node does.
_SCRUB = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
          "MASTER_PORT", "SAFEPOINT_NODE", "SAFEPOINT_SHM_DIR", "SAFEPOINT_JOB",
          "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")


class Rank:
    """One rank's process: `proc` (the nsenter in front of it), `out` (a LineReader over its
    stdout), `stderr_path`."""

    def __init__(self, rank: int, node: Node, proc: subprocess.Popen, stderr_path: Path):
        self.rank, self.node, self.proc, self.stderr_path = rank, node, proc, stderr_path
        self.out = LineReader(proc.stdout, f"rank {rank} on {node.name}", self.stderr)

    def stderr(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")[-4000:]
        except FileNotFoundError:
            return ""

    def expect(self, kind: str) -> dict:
        """The JSON object of the next stdout line "KIND {json}"."""
        fields = self.out.expect(kind)
        return json.loads(" ".join(fields[1:])) if len(fields) > 1 else {}


class Job:
    """One run of a script as a multi-node job: `ranks_per_node` processes on every node of
    `cluster`, each with torchrun's environment (GROUP_RANK is the node's index; MASTER_ADDR
    node 0's address). `attempt` counts restarts; each attempt uses a new MASTER_PORT. The
    script's stdout is read line by line (`expect`), its stderr goes to a file."""

    def __init__(self, cluster: Cluster, script: str, args: Sequence = (), *,
                 ranks_per_node: int = 1, env: Optional[dict] = None, attempt: int = 0,
                 base_port: int = 29500):
        self.cluster, self.script, self.args = cluster, os.path.abspath(script), list(args)
        self.ranks_per_node, self.extra_env, self.attempt = ranks_per_node, env or {}, attempt
        self.base_port = base_port
        self.port = base_port + attempt
        self.ranks: list[Rank] = []
        self._start()

    def _start(self) -> None:
        world = len(self.cluster) * self.ranks_per_node
        base = {k: v for k, v in os.environ.items() if k not in _SCRUB}
        base.update(PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        base.update(self.extra_env)
        for node in self.cluster:
            for local in range(self.ranks_per_node):
                rank = node.index * self.ranks_per_node + local
                env = dict(base, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local),
                           LOCAL_WORLD_SIZE=str(self.ranks_per_node),
                           GROUP_RANK=str(node.index), MASTER_ADDR=self.cluster[0].addr,
                           MASTER_PORT=str(self.port))
                err = self.cluster.dir / f"rank-{rank}.attempt-{self.attempt}.err"
                with open(err, "w") as f:
                    proc = node.popen([sys.executable, self.script, *map(str, self.args)],
                                      env=env, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, stderr=f, text=True)
                self.ranks.append(Rank(rank, node, proc, err))

    def __getitem__(self, rank: int) -> Rank:
        return self.ranks[rank]

    def expect_all(self, kind: str) -> list[dict]:
        """The next "KIND {json}" line of every rank, in rank order."""
        return [r.expect(kind) for r in self.ranks]

    def wait(self, timeout: float = HANG) -> list[int]:
        """Waits for every rank to exit (killing the job on a hang guard); returns the exit
        codes in rank order (negative: killed by that signal)."""
        codes = []
        for r in self.ranks:
            try:
                codes.append(r.proc.wait(timeout=timeout))
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(f"rank {r.rank} hung; stderr:\n{r.stderr()}") from None
            r.out.drain()
        return codes

    def check(self, timeout: float = HANG) -> None:
        """Waits and asserts every rank exited 0."""
        codes = self.wait(timeout)
        bad = [r for r, c in zip(self.ranks, codes) if c != 0]
        assert not bad, "\n".join(f"rank {r.rank} on {r.node.name} exited {r.proc.returncode}:"
                                  f"\n{r.stderr()}" for r in bad)

    def kill(self) -> None:
        """SIGKILL every rank that still runs (its session: not the node agents, which run in
        sessions of their own) and reap them."""
        for r in self.ranks:
            _killpg(r.proc)
        for r in self.ranks:
            r.proc.wait(timeout=HANG)

    def restart(self, args: Optional[Sequence] = None) -> Job:
        """Kills what is left of this attempt and starts the next one (new processes, new port)
        on the cluster's current nodes, with the same arguments unless `args` are given."""
        self.kill()
        return Job(self.cluster, self.script, self.args if args is None else args,
                   ranks_per_node=self.ranks_per_node,
                   env=self.extra_env, attempt=self.attempt + 1, base_port=self.base_port)


__all__ = ["Cluster", "Job", "Node", "Rank", "unavailable", "partitions_unavailable",
           "mounted_anywhere", "pids_in_ns"]
