"""Flash checkpoints: ``Checkpointer`` snapshots into host shared memory; the node agent persists.

``save()`` blocks only while the state is copied into a shared-memory slot. The node agent (a
separate, detached process) persists snapshots to the checkpoint directory in the background,
commits them, prunes old steps, and, when the training process dies, persists its newest
snapshot (emergency flush) and keeps it for hot reload: ``load()`` in a restarted process reads
it from memory instead of from storage.

Across ranks, a Checkpointer agrees on the step to resume from (``_agreement``), tags its images
with the run's save attempt (``_attempt``) and writes replicated tensors once (``_dedupe``).

This module holds the constructor and the lifetime (close, abandon); the class is made of parts by
job, each in its own module (``_ckpt_base`` says what they share): the preemption watch
(``_ckpt_preemption``), the save path (``_ckpt_save``), the restore path (``_ckpt_restore``) and
status (``_ckpt_status``).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import shutil
import tempfile
import weakref
from collections.abc import Iterator
from typing import Any, Optional, Union

from safepoint import _core
from safepoint._advisor import Advisor, parse_mtbf
from safepoint._attempt import new_attempt, run_attempt
from safepoint._ckpt_base import RestoreInfo
from safepoint._ckpt_preemption import ON_PREEMPTION
from safepoint._ckpt_restore import RestoreMixin
from safepoint._ckpt_save import SaveMixin
from safepoint._ckpt_status import StatusMixin
from safepoint._dedupe import ReplicaPlan
from safepoint._pickle import AllowPickle, pickler, unpickler
from safepoint._preemption import DEFAULT_SIGNALS
from safepoint._replication import exchange_membership, join_commit_relay
from safepoint._stateful import RNG_KEY
from safepoint._tiers import TierLike, check_layout, core_tiers, normalize_tiers
from safepoint._versions import encode_metadata
from safepoint.errors import (
    InvalidArgumentError,
    PermissionDeniedError,
    StorageError,
)

__all__ = ["Checkpointer", "RestoreInfo"]

_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")


def _check_writable(path: str) -> None:
    """Checks, as the Checkpointer is built, that the checkpoint directory can be written: a
    file can be made in it, or, when it does not exist yet, in the nearest directory above it
    that does (where the agent will create it). A local path or file:// URI only (other storages
    are checked by their own requests). The probe is a hidden empty file, removed at once. Root
    passes permission bits but not a read-only filesystem, an immutable directory or a file in
    the way, which is why this writes instead of asking access(). Raises PermissionDeniedError
    (read-only, no permission, immutable) or StorageError naming the path: without it, every
    persist of the run would fail in the background (issue 36, item 2)."""
    if path.startswith("file://"):
        local = path[len("file://"):]
    elif _SCHEME.match(path):
        return
    else:
        local = path
    where = local
    while not os.path.lexists(where):
        parent = os.path.dirname(where)
        if parent == where:
            break
        where = parent
    if not os.path.isdir(where):
        what = ("is not a directory" if where == local
                else f"cannot be created: {where} is not a directory")
        raise StorageError(f"{path}: {what}; the node agent could not persist any step there")
    try:
        fd, probe = tempfile.mkstemp(prefix=".safepoint-write-check-", dir=where)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        cls = (PermissionDeniedError if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS)
               else StorageError)
        what = "is not writable" if where == local else f"cannot be created in {where}"
        raise cls(f"{path}: {what} ({e.strerror}); the node agent could not persist any step "
                  "there: choose a writable checkpoint path") from None


def _distributed() -> tuple[Optional[int], Optional[int]]:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:  # pragma: no cover - torch without distributed
        pass
    return None, None


def _node_name(shm_dir: str) -> str:
    """Names this rank's node for the copy plan: ranks whose names are equal see the same
    shared memory (the running kernel's boot id, and the device and inode of the shm
    directory: two containers or namespaces with their own /dev/shm on one host are two nodes,
    two hosts never one). Unique to this process when either cannot be read (no sharing)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        st = os.stat(shm_dir)
    except OSError:
        import socket

        return f"{socket.gethostname()}:{os.getpid()}:{id(shm_dir)}"
    return f"{boot}:{st.st_dev}:{st.st_ino}"


def _job_timeout(dist: Any) -> Any:
    """The timeout the job gave ``init_process_group`` (its default group's), or None when it
    cannot be read. ``new_group`` gives a gloo group gloo's own default (30 minutes) whatever
    the job chose, so without it a rank of the Checkpointer's group would wait on a peer that
    is gone (killed, or its node cut off) for 30 minutes instead of the job's timeout."""
    import torch

    world = dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            timeout = world._get_backend(torch.device(device)).options._timeout
        except Exception:  # noqa: BLE001 (no such backend, or a torch without these names)
            continue
        if timeout is not None:
            return timeout
    return None


def _default_job(storage: str) -> str:
    env = os.environ.get("SAFEPOINT_JOB")
    if env:
        return env
    base = re.sub(r"[^A-Za-z0-9._-]", "_", os.path.basename(storage.rstrip("/")) or "ckpt")[:40]
    digest = hashlib.sha1(storage.encode()).hexdigest()[:12]
    return f"{base}-{digest}"



def _agent_binary() -> str:
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "safepointd")
    if os.access(here, os.X_OK):
        return here
    found = shutil.which("safepointd")
    return found or ""


class Checkpointer(StatusMixin, RestoreMixin, SaveMixin):
    """Flash checkpoints of one rank's state.

    ``path`` is the checkpoint directory (the same one ``safepoint.load`` and ``safepoint ls``
    read). ``job`` names the job's snapshots and agent on this node (default: derived from the
    path, or ``$SAFEPOINT_JOB``). ``rank``/``world_size`` default to torch.distributed's, then to
    ``$RANK``/``$WORLD_SIZE``, then 0/1. Every ``persist_every``-th step is persisted;
    ``persist_every="auto"`` persists on the interval advisor's schedule instead, from the save,
    persist, restore and restart times measured for the job and its MTBF (``mtbf``: seconds or
    ``"3h"``; default: learned from the job's restarts), bounded and with hysteresis;
    ``status()["persist_interval"]`` says what it does and why (docs/guide.md, "Choosing the
    checkpoint interval"). The agent that serves rank 0 records the job's measurements in its
    history beside the checkpoints (each save's report goes with its snapshot note). The newest
    ``keep`` committed steps are kept. ``on_busy`` says what ``save`` does when no slot is free
    because the agent still persists it: ``"wait"`` or ``"skip"`` (counted in ``status()``).

    With several ranks under torch.distributed, ``dedupe`` (default) writes each replicated
    tensor to storage once in total instead of once per rank: tensors with the same name,
    dtype, shape and box on several ranks are taken as replicas (DDP's parameters and optimizer
    state; DCP's convention), and the ranks split the writing between them by bytes. The ranks
    of one node also split the copy into shared memory (without ``redundancy``): from the
    second save of a structure on, each copies only its share of the replicated tensors, and a
    hot reload fills the others from the other ranks' snapshots on the node (verified; when one
    is missing or damaged, every rank loads storage instead). Loading from storage reads a
    replica from the rank that wrote it. Keep tensors that differ
    between ranks under different names (the generator states of ``include_rng`` are never
    taken as replicas), or pass ``dedupe=False``. With dedupe, ``save`` is a collective (like
    DCP's save): every rank calls it for the same steps; if the ranks cannot agree (a peer died),
    the snapshot is still taken and this rank writes all of its tensors.

    ``redundancy`` keeps copies of every node's snapshots in other nodes' memory, so that a
    lost node's state is restored from its peers instead of storage (docs/replication.md):
    ``"mirror"`` (one full copy on another node), ``"mirror:N"`` (N copies on N other nodes) or
    ``"ec:K+P"`` (K data and P parity fragments on K+P other nodes, any K of which rebuild it).
    It needs torch.distributed and enough nodes (a node is ``$SAFEPOINT_NODE``, torchrun's
    ``$GROUP_RANK`` or the hostname); the constructor says so when the job has too few.
    ``replication_bandwidth`` caps the bytes/s an agent sends (default: half the link's speed
    when the kernel knows it, else no cap); ``peer_timeout`` is how long a silent peer is
    waited for.

    With several ranks under torch.distributed, ``share_reads`` (default) makes ``restore`` from
    storage read bytes that several ranks need (replicas) once: one rank reads each such range
    and sends it to the others over the checkpointer's gloo group (docs/architecture.md,
    "Restore at scale"); ranges only one rank needs (shards) it reads itself. ``status()``'s
    ``last_load`` counts the bytes read from storage and sent/received between ranks.

    ``tiers`` adds storage levels below ``path`` (``[Tier("file:///shared/run1", every=100,
    keep=5), Tier("s3://bucket/run1", every=500, keep=20)]``; a plain URI is a tier that takes
    every step and keeps 3). The node agent fills each tier by copying committed, verified steps
    from the tier above on the tier's own schedule, never from the training process; a failing
    or stalled tier never holds up the ones above it (``status()["tiers"]``). ``load`` and
    ``restore`` read the fastest copy of the step all ranks agree on: memory, peer memory, then
    ``path``, then the tiers in order, falling back to the next tier when a copy is damaged.

    ``metrics="HOST:PORT"`` (default ``$SAFEPOINT_METRICS_ADDR``) has the node agent serve
    Prometheus metrics at ``http://HOST:PORT/metrics`` (port 0 picks a free port;
    ``status()["metrics_url"]`` names it). The agent is one per job and node, so each node's
    agent serves its own endpoint, every series labelled ``safepoint_job``
    (docs/operations.md, "Metrics"). The agent also appends one JSON line per save, persist,
    commit, flush, restore and failure to its event log: ``event_log`` (default
    ``$SAFEPOINT_EVENT_LOG``, else ``events.jsonl`` in the job's shared-memory directory, removed
    when the job finishes), bounded by rotation.
    ``compression`` (``"none"`` or another of the codec's modes, ``_core.COMPRESSIONS``) and
    ``incremental`` say how the agent stores steps in ``path`` (each ``Tier`` has its own): the
    defaults keep the plain layout; otherwise packed steps, whose chunks the agent encodes while
    it persists (never in shared memory, never in ``save()``) and which steps share
    (docs/guide.md, "Compression and incremental checkpoints"). ``status()["storage_layout"]``
    shows the mode in use and its ratio.

    ``snapshot_every`` lets a loop call ``save`` every step while only every
    ``snapshot_every``-th step (``step % snapshot_every == 0``) is copied into shared memory;
    the other calls return False at once (``status()["saves_not_due"]`` counts them). A
    snapshot is persisted when a step due under ``persist_every`` fell since the previous
    scheduled snapshot (``persist_every=10, snapshot_every=5``: steps 10, 20, ...).

    ``preemption`` (docs/guide.md, "Preemption"): once SIGTERM or SIGUSR1 (``preemption_signals``)
    has reached the process, or ``notify_preemption()`` was called, the next ``save`` copies and
    persists its step whatever the schedule and waits until the step is committed
    (``preemption_pending()`` says whether that save is still to come). Then, by default
    (``on_preemption="exit"``), the process ends as the signal would have ended it (the signal
    raised again with its default action: the exit status is a death by SIGTERM, as a
    scheduler expects), with one line on stderr saying so; a loop need not check anything.
    ``on_preemption="return"`` leaves it to the program: ``save`` returns, ``preempted`` is
    True from then on, and the loop stops on its own. A notice from ``notify_preemption()``
    (no signal) always returns. A restart resumes from that step. With several ranks every
    rank preempts at the same step: each ``save`` is then a collective (one all-reduce of one
    int on the Checkpointer's gloo group) until the notice. Default (None): on for one
    process, and for several ranks when ``save`` is a collective anyway (``dedupe``); True
    turns it on for ``dedupe=False`` too (every rank must then call ``save`` for the same
    steps), False off. The handlers are installed only when the Checkpointer is made in the
    main thread, chain to the handlers installed before, and are put back by ``close``. A
    second signal, or ``preemption_grace_s`` seconds after the first (default: no limit), ends
    the process as the signal's default action would (the agent persists the newest snapshot,
    as for any dying process); with ``on_preemption="exit"`` and no ``preemption_grace_s``, so
    does a loop that begins no ``save`` within 20 s of the signal.
    """

    def __init__(self, path: str | os.PathLike[str], *, job: Optional[str] = None,
                 rank: Optional[int] = None, world_size: Optional[int] = None,
                 persist_every: Union[int, str] = 1, keep: int = 3, on_busy: str = "wait",
                 shm_dir: Optional[str] = None, allow_pickle: AllowPickle = False,
                 dedupe: bool = True, share_reads: bool = True,
                 redundancy: Optional[str] = None,
                 replication_bandwidth: Optional[float] = None,
                 peer_timeout: float = 30.0,
                 tiers: Optional[list[TierLike]] = None,
                 metadata: Optional[dict[str, Any]] = None,
                 mtbf: Union[None, float, str] = None,
                 max_shm_bytes: Optional[int] = None,
                 metrics: Optional[str] = None,
                 event_log: Optional[str | os.PathLike[str]] = None,
                 compression: str = "none", incremental: bool = False,
                 snapshot_every: int = 1, preemption: Optional[bool] = None,
                 preemption_grace_s: Optional[float] = None,
                 preemption_signals: tuple[int, ...] = DEFAULT_SIGNALS,
                 on_preemption: str = "exit") -> None:
        p = os.fspath(path)
        if not isinstance(p, str) or not p:
            raise InvalidArgumentError(f"checkpoint path must be a non-empty str, got {path!r}")
        # The agent runs in another directory: give it an absolute path.
        self.path = p if _SCHEME.match(p) else os.path.abspath(p)
        _check_writable(self.path)
        drank, dworld = _distributed()
        if rank is None:
            rank = drank if drank is not None else int(os.environ.get("RANK", 0))
        if world_size is None:
            world_size = dworld if dworld is not None else int(os.environ.get("WORLD_SIZE", 1))
        if persist_every != "auto" and (type(persist_every) is not int or persist_every < 1):
            raise InvalidArgumentError(
                f"{self.path}: persist_every must be a positive int or 'auto'")
        mtbf_seconds = parse_mtbf(self.path, mtbf)
        if type(keep) is not int or keep < 1:
            raise InvalidArgumentError(f"{self.path}: keep must be a positive int")
        if type(snapshot_every) is not int or snapshot_every < 1:
            raise InvalidArgumentError(f"{self.path}: snapshot_every must be a positive int")
        if preemption_grace_s is not None and not preemption_grace_s > 0:
            raise InvalidArgumentError(f"{self.path}: preemption_grace_s must be > 0 or None")
        if on_busy not in ("wait", "skip"):
            raise InvalidArgumentError(
                f"{self.path}: on_busy must be 'wait' or 'skip', got {on_busy!r}")
        if on_preemption not in ON_PREEMPTION:
            raise InvalidArgumentError(
                f"{self.path}: on_preemption must be 'exit' or 'return', got {on_preemption!r}")
        self.on_preemption = on_preemption
        if not 0 <= rank < world_size:
            raise InvalidArgumentError(f"{self.path}: rank {rank} is not in [0, {world_size})")
        # Lineage (docs/guide.md, "Versions"): every step records the step this run was
        # restored from (none for a fresh run) and this metadata.
        self._metadata = encode_metadata(self.path, metadata)
        self.tiers = normalize_tiers(self.path, tiers)
        check_layout(self.path, compression, incremental)
        self.compression, self.incremental = compression, incremental
        # Where committed steps may be, fastest first: path, then the tiers in order.
        self._stores = [self.path] + [t.uri for t in self.tiers]
        self.job = job or _default_job(self.path)
        self.rank, self.world_size = rank, world_size
        self.persist_every, self.keep, self.on_busy = persist_every, keep, on_busy
        self.shm_dir = shm_dir or os.environ.get("SAFEPOINT_SHM_DIR", "/dev/shm")
        self.allow_pickle = allow_pickle
        self._pickler, self._unpickler = pickler(allow_pickle), unpickler(allow_pickle)
        # Restore agreement runs over its own gloo group (CPU), whatever the training backend,
        # with the job's timeout.
        self._group = None
        if world_size > 1 and drank is not None:
            import torch.distributed as dist

            self._group = dist.new_group(backend="gloo", timeout=_job_timeout(dist))
        self.attempt = run_attempt(self._group)
        if self.attempt == 0 and world_size == 1:
            self.attempt = new_attempt()  # tells this run's steps apart in the lineage (log)
        self.dedupe = bool(dedupe) and self._group is not None
        self.share_reads = bool(share_reads) and self._group is not None
        self._io = {}  # bytes moved by the current load (see load())
        self._replicas = ReplicaPlan(self._group, rank, world_size, RNG_KEY + ".",
                                     lambda: _node_name(self.shm_dir))
        if max_shm_bytes is not None and (type(max_shm_bytes) is not int or max_shm_bytes < 1):
            raise InvalidArgumentError(
                f"{self.path}: max_shm_bytes must be a positive int, got {max_shm_bytes!r}")
        self.max_shm_bytes = max_shm_bytes
        # an overlapped save copying: (step, t0, seconds of the save call, copy_again)
        self._pending = None
        # optimizer -> the handle of its step pre-hook (before_update)
        self._hooks = weakref.WeakKeyDictionary()
        self.metrics = metrics if metrics is not None else os.environ.get(
            "SAFEPOINT_METRICS_ADDR", "")
        if not isinstance(self.metrics, str):
            raise InvalidArgumentError(f"{self.path}: metrics must be 'HOST:PORT', got {metrics!r}")
        log = event_log if event_log is not None else os.environ.get("SAFEPOINT_EVENT_LOG", "")
        self.event_log = os.path.abspath(os.fspath(log)) if log else ""
        self._client = _core.Client(
            self.path, self.job, self.shm_dir, rank, world_size, keep, on_busy == "wait",
            _agent_binary(), self.attempt, core_tiers(self.tiers), max_shm_bytes or 0,
            self.metrics, self.event_log, compression, incremental)
        self._advisor = Advisor(self.path, self.job, rank, self.attempt, persist_every,
                                mtbf_seconds, self.tiers)
        if rank == 0:  # a run of the job begins (the agent's history: src/advisor/history.h)
            self._client.report("start", self.attempt, True, 0.0, 0)
        self._stats = {
            "saves": 0, "skipped_saves": 0, "saves_not_due": 0, "last_save": None,
            "last_load": None, "agent_errors": 0, "blocking_seconds_sum": 0.0, "restores": {},
        }
        self.last_restore = None
        if self._metadata:
            self._client.set_lineage(None, "", self._metadata)
        self.snapshot_every = snapshot_every
        self.preempted = False
        self._watch = self._watch_preemption(preemption, preemption_grace_s, preemption_signals)
        self.replication = None
        self.commit_relay = None
        replicated = redundancy not in (None, "", "none")
        if replicated and self._group is None:
            raise InvalidArgumentError(
                f"{self.path}: redundancy={redundancy!r} keeps copies on other nodes and "
                "needs torch.distributed initialized with ranks on several nodes")
        try:
            if replicated:
                self.replication = exchange_membership(
                    self._client, self._group, rank, world_size, str(redundancy),
                    replication_bandwidth, peer_timeout)
            elif self._group is not None:  # several nodes: the agents' commit relay
                self.commit_relay = join_commit_relay(self._client, self._group, rank,
                                                      world_size, peer_timeout)
        except BaseException:
            self._client.abandon()
            self._client = None
            self._stop_watching()
            raise


    @contextlib.contextmanager
    def replication_paused(self) -> Iterator[None]:
        """Pauses this node's replication sends while the block runs (e.g. around the
        optimizer step or the gradient all-reduce, so that replication traffic does not compete
        with the training's own collectives)."""
        self._live.pause_replication(True)
        try:
            yield
        finally:
            if self._client is not None:
                self._client.pause_replication(False)

    # -- lifetime -----------------------------------------------------------------------------
    def close(self, timeout: Optional[float] = None) -> None:
        """Persists the newest snapshot if it is not yet, then removes this rank's snapshots from
        memory (the job is done). Idempotent."""
        self._stop_watching()
        if self._client is not None:
            self._unhook()
            try:
                self.before_update()  # an overlapped save still copying completes first
            finally:
                client, self._client = self._client, None
                client.close(-1.0 if timeout is None else float(timeout))

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:
            # Leaving by an exception is a crash, not the end of the job: keep the snapshots for
            # hot reload (the agent persists what is not yet committed, as when a process dies).
            self.abandon()

    def abandon(self) -> None:
        """Drops the connection like a dying process would: the agent persists the newest
        snapshot and keeps the snapshots in memory for a restarted process. Idempotent."""
        self._stop_watching()
        if self._client is not None:
            self._unhook()
            self._pending = None  # the client lets its copy finish, then drops the connection
            client, self._client = self._client, None
            client.abandon()

    def __del__(self) -> None:  # no clean close: the agent treats it like a death and flushes
        watch = getattr(self, "_watch", None)
        if watch is not None:
            watch.close()
        client = getattr(self, "_client", None)
        if client is not None:
            client.abandon()
