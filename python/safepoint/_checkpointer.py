"""Flash checkpoints: ``Checkpointer`` snapshots into host shared memory; the node agent persists.

``save()`` blocks only while the state is copied into a shared-memory slot. The node agent (a
separate, detached process) persists snapshots to the checkpoint directory in the background,
commits them, prunes old steps, and, when the training process dies, persists its newest
snapshot (emergency flush) and keeps it for hot reload: ``load()`` in a restarted process reads
it from memory instead of from storage.

Across ranks, a Checkpointer agrees on the step to resume from (``_agreement``), tags its images
with the run's save attempt (``_attempt``) and writes replicated tensors once (``_dedupe``).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import re
import shutil
import time
import warnings
import weakref
from collections.abc import Iterator, Mapping
from typing import Any, Callable, NamedTuple, Optional, Union

from safepoint import _core
from safepoint._advisor import Advisor, parse_mtbf
from safepoint._agreement import (
    agree_on_step,
    gather_candidates,
    hot_reload_agreed,
    load_newest_agreed,
)
from safepoint._api import load as storage_load
from safepoint._api import steps as storage_steps
from safepoint._attempt import new_attempt, newest_attempts, run_attempt
from safepoint._dedupe import ReplicaPlan
from safepoint._pickle import AllowPickle, pickler, unpickler
from safepoint._preemption import DEFAULT_SIGNALS, PreemptionWatch, agreed
from safepoint._replication import exchange_membership
from safepoint._shards import read_into, read_newest_into, read_shared_into
from safepoint._staging import pin_for_gpu_copies
from safepoint._stateful import RNG_KEY, apply_loaded, to_saveable
from safepoint._tiers import Tier, TierLike, check_layout, core_tiers, normalize_tiers
from safepoint._versions import encode_metadata, resolve, same_location, split_ref
from safepoint.errors import CorruptionError, Error, InvalidArgumentError, NotFoundError

_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")


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


def _default_job(storage: str) -> str:
    env = os.environ.get("SAFEPOINT_JOB")
    if env:
        return env
    base = re.sub(r"[^A-Za-z0-9._-]", "_", os.path.basename(storage.rstrip("/")) or "ckpt")[:40]
    digest = hashlib.sha1(storage.encode()).hexdigest()[:12]
    return f"{base}-{digest}"


def _fields(result: Any) -> dict[str, Any]:
    """A bound result of _core (SnapshotResult, SlotInfo) as the plain dict status() reports."""
    return {k: getattr(result, k) for k in dir(result) if not k.startswith("_")}


class RestoreInfo(NamedTuple):
    """Where the last ``load``/``restore`` of a Checkpointer got its state: ``source`` is
    ``"memory"`` (this node's shared memory), ``"peer"`` (rebuilt from other nodes' memory into
    this node's, then read from there) or ``"storage"``; ``peers`` names the nodes it came from;
    ``uri`` the storage tier it was read from (``path`` or one of ``tiers``)."""
    step: int
    source: str
    seconds: float
    peers: str = ""
    uri: Optional[str] = None


def _proc_memory(pid: str) -> dict[str, int]:
    """The memory lines of /proc/<pid>/status in bytes (VmRSS, VmHWM, RssAnon, RssShmem, ...);
    empty when it cannot be read."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                parts = value.split()
                if len(parts) == 2 and parts[1] == "kB" and (key.startswith(("Vm", "Rss"))):
                    out[key] = int(parts[0]) * 1024
    except OSError:
        pass
    return out


def _agent_binary() -> str:
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "safepointd")
    if os.access(here, os.X_OK):
        return here
    found = shutil.which("safepointd")
    return found or ""


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off for the block (as it was after)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class Checkpointer:
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
    persists its step whatever the schedule and returns once the step is committed;
    ``preempted`` is True from then on, so that the loop can stop, and a restart resumes from
    that step. With several ranks every rank preempts at the same step: each ``save`` is then a
    collective (one all-reduce of one int on the Checkpointer's gloo group) until the notice.
    Default (None): on for one process, and for several ranks when ``save`` is a collective
    anyway (``dedupe``); True turns it on for ``dedupe=False`` too (every rank must then call
    ``save`` for the same steps), False off. The handlers are installed only when the
    Checkpointer is made in the main thread, chain to the handlers installed before, and are
    put back by ``close``. A second signal, or ``preemption_grace_s`` seconds after the first
    (default: no limit), ends the process as the signal's default action would (the agent
    persists the newest snapshot, as for any dying process).
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
                 preemption_signals: tuple[int, ...] = DEFAULT_SIGNALS) -> None:
        p = os.fspath(path)
        if not isinstance(p, str) or not p:
            raise InvalidArgumentError(f"checkpoint path must be a non-empty str, got {path!r}")
        # The agent runs in another directory: give it an absolute path.
        self.path = p if _SCHEME.match(p) else os.path.abspath(p)
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
        if not 0 <= rank < world_size:
            raise InvalidArgumentError(f"{self.path}: rank {rank} is not in [0, {world_size})")
        # Lineage (docs/guide.md, "Versions"): every step records the step this run was
        # restored from (none for a fresh run) and this metadata.
        self._metadata = encode_metadata(self.path, metadata)
        self.tiers: list[Tier] = normalize_tiers(self.path, tiers)
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
        # Restore agreement runs over its own gloo group (CPU), whatever the training backend.
        self._group = None
        if world_size > 1 and drank is not None:
            import torch.distributed as dist

            self._group = dist.new_group(backend="gloo")
        self.attempt = run_attempt(self._group)
        if self.attempt == 0 and world_size == 1:
            self.attempt = new_attempt()  # tells this run's steps apart in the lineage (log)
        self.dedupe = bool(dedupe) and self._group is not None
        self.share_reads = bool(share_reads) and self._group is not None
        self._io: dict[str, Any] = {}  # bytes moved by the current load (see load())
        self._replicas = ReplicaPlan(self._group, rank, world_size, RNG_KEY + ".",
                                     lambda: _node_name(self.shm_dir))
        if max_shm_bytes is not None and (type(max_shm_bytes) is not int or max_shm_bytes < 1):
            raise InvalidArgumentError(
                f"{self.path}: max_shm_bytes must be a positive int, got {max_shm_bytes!r}")
        self.max_shm_bytes = max_shm_bytes
        # an overlapped save copying: (step, t0, seconds of the save call, copy_again)
        self._pending: Optional[tuple[int, float, float, Callable[[], Any]]] = None
        # optimizer -> the handle of its step pre-hook (before_update)
        self._hooks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.metrics = metrics if metrics is not None else os.environ.get(
            "SAFEPOINT_METRICS_ADDR", "")
        if not isinstance(self.metrics, str):
            raise InvalidArgumentError(f"{self.path}: metrics must be 'HOST:PORT', got {metrics!r}")
        log = event_log if event_log is not None else os.environ.get("SAFEPOINT_EVENT_LOG", "")
        self.event_log = os.path.abspath(os.fspath(log)) if log else ""
        self._client: Optional[_core.Client] = _core.Client(
            self.path, self.job, self.shm_dir, rank, world_size, keep, on_busy == "wait",
            _agent_binary(), self.attempt, core_tiers(self.tiers), max_shm_bytes or 0,
            self.metrics, self.event_log, compression, incremental)
        self._advisor = Advisor(self.path, self.job, rank, self.attempt, persist_every,
                                mtbf_seconds, self.tiers)
        if rank == 0:  # a run of the job begins (the agent's history: src/advisor/history.h)
            self._client.report("start", self.attempt, True, 0.0, 0)
        self._stats: dict[str, Any] = {
            "saves": 0, "skipped_saves": 0, "saves_not_due": 0, "last_save": None,
            "last_load": None, "agent_errors": 0, "blocking_seconds_sum": 0.0, "restores": {},
        }
        self.last_restore: Optional[RestoreInfo] = None
        if self._metadata:
            self._client.set_lineage(None, "", self._metadata)
        self.snapshot_every = snapshot_every
        self.preempted = False
        self._watch = self._watch_preemption(preemption, preemption_grace_s, preemption_signals)
        self.replication: Optional[dict[str, Any]] = None
        if redundancy not in (None, "", "none"):
            if self._group is None:
                raise InvalidArgumentError(
                    f"{self.path}: redundancy={redundancy!r} keeps copies on other nodes and "
                    "needs torch.distributed initialized with ranks on several nodes")
            try:
                self.replication = exchange_membership(
                    self._client, self._group, rank, world_size, str(redundancy),
                    replication_bandwidth, peer_timeout)
            except BaseException:
                self._client.abandon()
                self._client = None
                self._stop_watching()
                raise

    def _watch_preemption(self, on: Optional[bool], grace_s: Optional[float],
                          signals: tuple[int, ...]) -> Optional[PreemptionWatch]:
        """The preemption watch (None: off), its handlers installed from the main thread."""
        if on is None:
            on = self.world_size == 1 or self.dedupe
        if not on:
            return None
        if self.world_size > 1 and self._group is None:
            raise InvalidArgumentError(
                f"{self.path}: preemption=True with {self.world_size} ranks needs "
                "torch.distributed initialized (the ranks agree on the step to preempt at)")
        watch = PreemptionWatch(signals, grace_s)
        watch.install()
        return watch

    def _stop_watching(self) -> None:
        if self._watch is not None:
            self._watch.close()

    @property
    def preemption_handlers_installed(self) -> bool:
        """Whether the preemption signal handlers are installed (only from the main thread)."""
        return self._watch is not None and self._watch.installed

    def notify_preemption(self) -> None:
        """Gives the preemption notice without a signal (from any thread, e.g. one that polls a
        cloud provider's spot-interruption notice): the next ``save`` persists its step. Raises
        when preemption handling is off."""
        if self._watch is None:
            raise InvalidArgumentError(f"{self.path}: preemption handling is off "
                                       "(Checkpointer(..., preemption=False))")
        self._watch.notify()

    @property
    def _live(self):
        if self._client is None:
            raise InvalidArgumentError(f"{self.path}: the checkpointer is closed")
        if self._pending is not None:
            self.before_update()  # an overlapped save finishes before anything else
        return self._client

    # -- saving -------------------------------------------------------------------------------
    def save(self, step: int, state: Any, *, persist: Optional[bool] = None,
             include_rng: bool = False, overlap: bool = False) -> bool:
        """Snapshots ``state`` for ``step`` into shared memory and returns.

        Values of a top-level mapping that have ``state_dict()``/``load_state_dict()`` (modules,
        optimizers, schedulers, ...) are saved as their state dicts. ``include_rng`` adds this
        process's torch/CUDA/numpy/``random`` generator states. Returns False when the snapshot
        was skipped (``on_busy="skip"`` and no free slot) or the step is not due under
        ``snapshot_every`` (nothing copied). ``persist`` overrides ``persist_every`` for this
        step (``persist=True`` snapshots a step that is not due, too).

        After a preemption notice (a signal, ``notify_preemption()``; on any rank), the save
        copies and persists its step whatever the schedule (``overlap`` and ``persist`` aside),
        sets ``preempted``, and returns once the step is committed: it raises as ``wait()``
        would when it cannot be.

        ``overlap=True`` returns as soon as the state is walked (its structure, non-tensor
        values and tensor addresses taken) and copies the tensors into shared memory on a
        background thread while training goes on (forward and backward do not change the
        state). The copy must be done before anything changes the state: ``before_update()``
        waits for it, and is called on its own before ``step()`` of every optimizer that is a
        value of ``state``'s top-level mapping (``register_step_pre_hook``); any other call on
        the Checkpointer waits for it too. The snapshot is then, bit for bit, the state at the
        time of ``save``, provided nothing but the optimizer changes it before ``before_update``
        (not so for module buffers that forward updates, such as BatchNorm's running
        statistics in training mode: call ``before_update()`` before such a forward). Returns
        True; whether the snapshot was skipped is what ``before_update()`` returns.
        """
        if type(step) is not int or step < 0:
            raise InvalidArgumentError(
                f"{self.path}: step must be a non-negative int, got {step!r}")
        client = self._live  # waits for an overlapped save still copying
        t0 = time.perf_counter()
        preempt = self._preemption_now()
        if not preempt and not persist and step % self.snapshot_every:
            self._stats["saves_not_due"] += 1
            return False
        saveable = to_saveable(state, include_rng)
        if preempt:
            return self._save_preempted(client, step, saveable, t0)
        do_persist = persist if persist is not None else self._persist_due(step)

        def copy_again() -> Any:
            return client.save(step, saveable, bool(do_persist), self._pickler, notify=False)

        if overlap:
            self._hook_optimizers(state)
            client.save_begin(step, saveable, bool(do_persist), self._pickler, notify=False)
            self._pending = (step, t0, time.perf_counter() - t0, copy_again)
            return True
        return self._saved(step, copy_again(), t0, copy_again=copy_again)

    def _persist_due(self, step: int) -> bool:
        """Whether the snapshot of `step` is persisted: a step due under persist_every fell
        in (step - snapshot_every, step]."""
        if self.snapshot_every == 1:
            return self._advisor.due(step)
        every = self._advisor.every
        return step // every > (step - self.snapshot_every) // every

    def _preemption_now(self) -> bool:
        """Whether this save is the preemption save: a notice reached some rank (with several
        ranks, a collective while no save has preempted yet). Sets ``preempted``."""
        if self._watch is None or self.preempted:
            return False
        if not agreed(self._group, self._watch.noticed):
            return False
        self.preempted = True
        return True

    def _save_preempted(self, client: Any, step: int, saveable: Any, t0: float) -> bool:
        """The preemption save: copied (never skipped: with on_busy="skip", the persists in
        flight are waited for first), persisted, and waited for until committed."""
        grace = self._watch.grace_s if self._watch is not None else None
        timeout = -1.0 if grace is None else float(grace)
        if self.on_busy == "skip":
            client.wait(timeout)

        def copy_again() -> Any:
            return client.save(step, saveable, True, self._pickler, notify=False)

        saved = self._saved(step, copy_again(), t0, copy_again=copy_again)
        client.wait(timeout)
        return saved

    def before_update(self) -> Optional[bool]:
        """Waits until the copy of an overlapped save (``save(..., overlap=True)``) is done, so
        that the state may change. Returns whether that snapshot was taken (False: skipped;
        None: no overlapped save was running). Called on its own before ``step()`` of the
        optimizers in the saved state."""
        if self._pending is None or self._client is None:
            return None
        step, t0, call_seconds, copy_again = self._pending
        self._pending = None
        t1 = time.perf_counter()
        snap = self._client.save_finish()
        if snap is None:
            return None
        return self._saved(step, snap, t0, (t1, call_seconds), copy_again)

    def _hook_optimizers(self, state: Any) -> None:
        """Registers before_update() as a step pre-hook of each optimizer among the values of
        `state`'s top-level mapping (once per optimizer)."""
        values = state.values() if isinstance(state, Mapping) else [state]
        for v in values:
            hook = getattr(v, "register_step_pre_hook", None)
            if hook is None or not callable(hook):
                continue
            try:
                if v in self._hooks:
                    continue
            except TypeError:  # not weakly referenceable: no hook, before_update() by hand
                continue
            me = weakref.ref(self)

            def pre_step(_opt: Any, _args: Any, _kwargs: Any, me: Any = me) -> None:
                ckpt = me()
                if ckpt is not None:
                    ckpt.before_update()
            self._hooks[v] = hook(pre_step)

    def _unhook(self) -> None:
        for handle in list(self._hooks.values()):
            handle.remove()
        self._hooks.clear()

    def _saved(self, step: int, snap: Any, t0: float,
               overlapped: Optional[tuple[float, float]] = None,
               copy_again: Optional[Callable[[], Any]] = None) -> bool:
        """Records a save's result (after its copy) and tells the agent, in one message: the
        snapshot note with the save's report (saves are made with notify=False for that); with
        dedupe, after the ranks agreed on the replicas. `overlapped`: (when before_update began
        waiting, how long the save call took) of an overlapped save. `copy_again`: saves the
        same state again (with dedupe, when this rank's copy left out tensors under a plan that
        no longer holds)."""
        res = _fields(snap)
        skip: list = []
        if self.dedupe:
            # Every rank calls save for the step: agree on who copies and who writes which
            # replica, then tell the agent. A rank that dies before this is flushed without
            # skipping (its snapshot leaves out only what its node's other ranks copied).
            again = False
            try:
                skip, again = self._replicas.skip_ranges(self._live, snap,
                                                         self.replication is None)
            except Exception as e:  # a peer is gone or out of step: write every tensor
                warnings.warn(f"safepoint: step {step}: the ranks could not agree on who writes "
                              f"the replicas ({e}); this rank writes all of its tensors and "
                              f"copies them all from the next save on",
                              RuntimeWarning, stacklevel=3)
                self._replicas.reset(self._live)
                skip = []
            else:
                # What follows is this rank's alone (the plans are agreed): a failure here
                # must not change what the ranks' next collectives are.
                try:
                    if again and copy_again is not None:
                        # The structure changed on some rank since this rank's copy plan was
                        # made: the tensors it left out may be in no other snapshot. The agent
                        # gets that copy as it is (its lease is the agent's to release; the
                        # step commits only once every tensor is held), and the same state,
                        # unchanged (still inside save, or before the optimizer's step), is
                        # copied again in full: the snapshot completed last is the step's.
                        self._live.notify([], step)
                        self._live.set_copy_skip([])
                        snap = copy_again()
                        res = _fields(snap)
                        if not res["saved"]:
                            skip = []
                    self._replicas.apply(self._live)
                except Exception as e:
                    warnings.warn(f"safepoint: step {step}: this rank could not copy its state "
                                  f"again in full or take its share of the next copies ({e}); "
                                  f"it copies every tensor from the next save on",
                                  RuntimeWarning, stacklevel=3)
                    with contextlib.suppress(Exception):
                        self._live.set_copy_skip([])
        now = time.perf_counter()
        if overlapped is None:
            res["blocking_seconds"] = now - t0
            res["overlap_wait_seconds"] = None
        else:  # training stalled in save() and in before_update(), not in between
            res["blocking_seconds"] = overlapped[1] + now - overlapped[0]
            res["overlap_wait_seconds"] = now - overlapped[0]
        res["agent_error"] = self._live.notify(
            skip, step, res["blocking_seconds"], int(res["image_bytes"]) if res["saved"] else 0)
        res["reused_plan"] = self._live.last_save_reused_plan()
        res["step"] = step
        self._advisor.saved(self, step, res["blocking_seconds"])
        self._stats["saves"] += 1
        self._stats["blocking_seconds_sum"] += res["blocking_seconds"]
        self._stats["last_save"] = res
        if not res["saved"]:
            self._stats["skipped_saves"] += 1
        if res["agent_error"]:
            self._stats["agent_errors"] += 1
            warnings.warn(f"safepoint: step {step} is snapshotted in memory but the agent could "
                          f"not be told: {res['agent_error']}", RuntimeWarning, stacklevel=3)
        return bool(res["saved"])

    def wait(self, timeout: Optional[float] = None) -> None:
        """Blocks until every step persisted so far is committed, and with ``redundancy`` until
        the newest snapshot reached its peers; raises if persisting failed (replication failures
        show in ``status()["replication"]``, they do not raise)."""
        self._live.wait(-1.0 if timeout is None else float(timeout))

    # -- loading ------------------------------------------------------------------------------
    def load(self, step: Optional[int] = None, *,
             _targets: Any = None) -> Optional[tuple[int, Any]]:
        """The newest (or the given) step from the fastest valid copy: this node's memory when
        it is at least as new as the newest committed step, else storage (falling back to older
        steps). None when there is nothing to load.

        With torch.distributed initialized and several ranks, all ranks first agree on the
        newest step that every rank can load (from its memory or from storage) and load that
        one; if any rank then fails to read it, all fall back together to the next older one.
        Ranks never resume from different steps."""
        t0 = time.perf_counter()
        self._io = {"storage_bytes_read": 0, "peer_bytes_sent": 0, "peer_bytes_received": 0}
        if self._group is not None:
            out = self._load_memory_agreed(step, _targets)
            if out is None:
                out = self._load_agreed(step, _targets)
        else:
            out = self._load_local(step, _targets)
        if out is None:
            return None
        result, source = out
        peers = ""
        if source.startswith("peer:"):
            source, peers = "peer", source[5:]
        seconds = time.perf_counter() - t0
        uri = self._io.pop("uri", None)
        uri = uri if source == "storage" else None
        self._stats["last_load"] = {"step": result[0], "source": source, "seconds": seconds,
                                    "peers": peers, "uri": uri, **self._io}
        self.last_restore = RestoreInfo(result[0], source, seconds, peers, uri)
        # The steps saved from now on descend from this one (of this checkpoint, wherever the
        # copy was read: memory, a peer, path or a tier).
        self._live.set_lineage(result[0], "", self._metadata)
        level = self._advisor.restored(source, uri, seconds)
        self._stats["restores"][source] = self._stats["restores"].get(source, 0) + 1
        self._live.report("restore", result[0], True, seconds,
                          int(self._io.get("storage_bytes_read") or 0), source, "", level)
        return result

    def _memory_steps(self) -> list[int]:
        return sorted(s.step for s in self._live.slots() if s.state == "COMPLETE")

    def _memory_attempts(self) -> dict[int, Any]:
        """step -> save attempt of the snapshot of it a load would read (of two snapshots of one
        step, the one completed last, as load_step picks)."""
        return newest_attempts((s for s in self._live.slots() if s.state == "COMPLETE"),
                               lambda s: s.complete_time_ns)

    def _committed(self) -> dict[int, list[str]]:
        """step -> the storages that hold it committed, fastest first (``path``, then the tiers
        in order). A tier that cannot be listed is skipped with a warning: the others serve."""
        where: dict[int, list[str]] = {}
        for uri in self._stores:
            try:
                found = storage_steps(uri)
            except Error as e:
                if len(self._stores) == 1:
                    raise
                warnings.warn(f"safepoint: cannot list the steps of {uri}: {e}", RuntimeWarning,
                              stacklevel=4)
                continue
            for s in found:
                where.setdefault(s, []).append(uri)
        return where

    def _read_storage(self, uri: str, step: Optional[int], targets: Any):
        """This rank's state of `step` from the storage at `uri`: with targets (restore), only
        the byte ranges the targets need, from whichever ranks' images hold them (any saving
        world size); else this rank's whole image."""
        self._io["uri"] = uri
        if targets is None:
            self._io["storage_bytes_read"] = None  # a whole image; not counted
            return storage_load(uri, step, rank=self.rank, allow_pickle=self.allow_pickle)
        return read_newest_into(uri, step, self.rank, targets, self._unpickler, self._io)

    def _from_storage(self, step: Optional[int], targets: Any, where: dict[int, list[str]]):
        """This rank's state of `step` (None: the newest that reads back) from the fastest
        storage that holds it. A damaged or unreadable copy falls back to the next tier that
        holds the step, and without an exact step to older steps."""
        if len(self._stores) == 1:  # path alone: its own fallback to older steps
            return self._read_storage(self.path, step, targets)
        candidates = [step] if step is not None else sorted(where, reverse=True)
        error: Optional[Error] = None
        for s in candidates:
            for uri in where.get(s, []):
                try:
                    return self._read_storage(uri, s, targets)
                except Error as e:
                    if isinstance(e, CorruptionError):
                        self._live.report("checksum", s, False, 0.0, 0, "storage", str(e))
                    warnings.warn(f"safepoint: step {s} cannot be read from {uri}, trying the "
                                  f"next copy: {e}", RuntimeWarning, stacklevel=4)
                    error = e
        if error is not None:
            raise error
        raise NotFoundError(f"{self.path}: step {step} is not committed on any storage tier "
                            f"({', '.join(self._stores)})")

    def _usable(self, snap: Optional[_core.Loaded]):
        """A memory snapshot, unless another world size saved it (then storage reshards) or it
        leaves out tensors (replicated state copied once per node) that no other rank's
        snapshot of it on this node holds intact: then None, and the load falls back like for
        any missing copy (the ranks agree again, peers, storage)."""
        if snap is None or snap.world_size != self.world_size:
            return None
        if snap.elsewhere:
            left = self._live.fill_from_siblings(snap.step, snap.attempt, snap.elsewhere)
            if left:
                warnings.warn(f"safepoint: step {snap.step} in memory leaves {len(left)} tensors "
                              f"to other ranks of this node, whose snapshots do not hold them "
                              f"(first: {left[0]}); loading another copy", RuntimeWarning,
                              stacklevel=4)
                return None
        return (snap.step, snap.state), "memory"

    def _load_local(self, step: Optional[int], targets: Any = None):
        committed = self._committed()
        newest_storage = max(committed) if committed else None
        want = step if step is not None else newest_storage
        snap = None
        damaged: Optional[CorruptionError] = None
        try:
            # restore (targets) reads the slot itself, once: its tensors are copied straight
            # into their targets in the pass that verifies every chunk
            in_place = targets is not None
            snap = (self._live.load_newest(want, self._unpickler, in_place, targets)
                    if step is None
                    else self._live.load_step(step, self._unpickler, in_place, targets))
        except CorruptionError as e:
            self._live.report("checksum", want or 0, False, 0.0, 0, "memory", str(e))
            damaged = e
            warnings.warn(
                f"safepoint: the snapshot in memory is damaged, loading from storage: {e}",
                RuntimeWarning, stacklevel=3)
        got = self._usable(snap)  # once: it may fill tensors from other ranks' slots
        if got is not None:
            return got
        if step is not None or committed:
            return self._from_storage(step, targets, committed), "storage"
        if damaged is not None and targets is not None:
            # The targets may hold bytes of the damaged snapshot: never report "nothing".
            raise CorruptionError(f"{damaged}; nothing on storage to restore from, so the "
                                  "state's tensors may hold damaged bytes")
        return None

    def _peer_attempts(self) -> dict[int, Any]:
        """step -> save attempt of the newest snapshot of this rank that peers can rebuild
        (empty without replication, or when the peers cannot be asked)."""
        if self.replication is None:
            return {}
        try:
            copies = self._live.peer_copies()
        except Error as e:
            warnings.warn(f"safepoint: cannot ask the peers for copies: {e}", RuntimeWarning,
                          stacklevel=4)
            return {}
        return newest_attempts(copies, lambda c: c.complete_ns)

    def _from_peers(self, step: int, attempt: int, targets: Any):
        """Has the agent rebuild this rank's snapshot of `step` from peers into a slot, then
        loads it from there like a hot reload (verified). None when that fails."""
        try:
            fetched = self._live.fetch_from_peers(step, attempt, -1.0)
            got = self._usable(self._live.load_step(step, self._unpickler, targets is not None,
                                                    targets))
        except Error as e:
            warnings.warn(f"safepoint: step {step} cannot be rebuilt from peer memory: {e}",
                          RuntimeWarning, stacklevel=6)
            return None
        if got is None:
            return None
        return got[0], f"peer:{fetched.source}"

    def _load_one(self, step: int, memory: list[int], committed: dict[int, list[str]],
                  targets: Any, peers: Optional[dict[int, Any]] = None,
                  share: Optional[str] = None):
        """This rank's copy of `step`: memory first, then peer memory, then storage. None if
        none reads back. With `share` (every rank restores with share_reads) this is a
        collective: the ranks that read from storage share the ranges several need
        (read_shared_into) from `share`, a storage every rank sees the step on, and a rank whose
        copy is in memory (or peer memory) takes part too."""
        got = None
        if step in memory:
            try:
                got = self._usable(self._live.load_step(step, self._unpickler,
                                                        targets is not None, targets))
            except CorruptionError as e:
                self._live.report("checksum", step, False, 0.0, 0, "memory", str(e))
                warnings.warn(f"safepoint: the snapshot of step {step} in memory is damaged: {e}",
                              RuntimeWarning, stacklevel=5)
        if got is None and peers and step in peers and peers[step] is not None:
            got = self._from_peers(step, peers[step], targets)
        if share:
            need = got is None and step in committed
            self._io["uri"] = share
            tree = read_shared_into(share, step, self.rank, targets, self._unpickler,
                                    self._group, need, self._io)
            if tree is not None:
                return (step, tree), "storage"
            if not need:
                return got
            # Some rank could not read its share: each reads on its own, as without sharing.
        if got is not None:
            return got
        if step in committed:
            try:
                return self._from_storage(step, targets, committed), "storage"
            except Error as e:
                warnings.warn(f"safepoint: step {step} cannot be read from storage: {e}",
                              RuntimeWarning, stacklevel=5)
        return None

    def _load_memory_agreed(self, step: Optional[int], targets: Any):
        """The hot reload: each rank loads its newest snapshot in memory (or the given step),
        verified, and the ranks check in one collective that they loaded the same one
        (_agreement.hot_reload_agreed). The result when they did; otherwise None, and every
        rank runs the full agreement (_load_agreed), which loads again. Not with replication:
        peers' copies may hold newer steps."""
        if self.replication is not None:
            return None
        attempts = self._memory_attempts()
        committed = self._committed()
        newest_committed = max(committed) if committed else -1
        s = step if step is not None else (max(attempts) if attempts else None)
        got = None
        if (s is not None and attempts.get(s) is not None
                and (step is not None or s >= newest_committed)):
            try:
                got = self._usable(self._live.load_step(s, self._unpickler, targets is not None,
                                                        targets))
            except CorruptionError:
                pass  # the full agreement reads it again, reports it and falls back
        attempt = attempts.get(s) if s is not None else None
        if not hot_reload_agreed(self._group, self.world_size, got is not None, s, attempt,
                                 newest_committed, step is None):
            return None
        return got

    def _load_agreed(self, step: Optional[int], targets: Any):
        """The full agreement (_agreement): every rank's committed steps and the attempt of
        each snapshot in its memory are gathered; all load the newest step every rank can, and
        fall back together. With replication, a snapshot that peers can rebuild counts like one
        in memory: per rank, a step's attempt comes from its own memory, else from its peers'
        copies."""
        committed = self._committed()
        memory = self._memory_steps()
        mine = self._memory_attempts()
        peers = {s: a for s, a in self._peer_attempts().items() if s not in mine}
        share = self.share_reads and targets is not None  # restore's shared storage reads
        agreed = gather_candidates(self._group, self.world_size, committed, {**peers, **mine},
                                   share, self._stores, step)
        memory = [s for s in memory if s in agreed.in_memory]
        peers = {s: a for s, a in peers.items() if s in agreed.in_memory}
        got = load_newest_agreed(
            self._group, agreed.steps,
            lambda s: self._load_one(s, memory, committed, targets, peers, agreed.shared_uri(s)))
        if got is None and step is not None:
            raise NotFoundError(f"{self.path}: step {step} cannot be loaded by every rank")
        return got

    def restore(self, state: Any, step: Optional[int] = None, *,
                from_: Optional[str] = None) -> Optional[int]:
        """Loads the newest (or the given) step *into* ``state`` in place, like DCP's load:
        tensors are copied into the existing tensors, Stateful values get ``load_state_dict``,
        other values are replaced; generator states saved with ``include_rng`` are restored.
        Returns the step, or None when there is nothing to load.

        ``from_`` branches from another checkpoint: ``"file:///runs/base@pretrained"`` (a tag),
        ``"...@step-100"`` or ``"...@100"`` (a step), or a location alone (its newest step). The
        step is read from storage there, resharded to this run's ranks, and the steps this run
        saves record it as their parent."""
        if from_ is not None:
            if step is not None:
                raise InvalidArgumentError(f"{self.path}: pass step= or from_=, not both")
            return self._restore_from(state, from_)
        # Without the cyclic GC while the state is walked and rebuilt: the thousands of
        # containers a large state creates would start collections over the whole heap (9% of a
        # hot restore's samples in perf); they are freed by reference counting.
        with _gc_paused():
            targets = to_saveable(state)
            loaded = self.load(step, _targets=targets)
            if loaded is None:
                return None
            got_step, got = loaded
            # From memory, `got` views the snapshot slot itself (read in place, verified): copy
            # out of it now, and never keep a reference to it.
            borrowed = self.last_load_source in ("memory", "peer")
            gpu = borrowed and pin_for_gpu_copies(got, targets)
            apply_loaded(state, got, borrowed=borrowed)
        if gpu:
            import torch

            torch.cuda.synchronize()
        return got_step

    def _restore_from(self, state: Any, from_: str) -> int:
        t0 = time.perf_counter()
        location, ref = split_ref(from_)
        got_step = resolve(location, ref)
        if self._group is not None:  # every rank branches from the same step
            got_step = agree_on_step(self._group, got_step)
        targets = to_saveable(state)
        self._io = {"storage_bytes_read": 0}
        tree = read_into(location, got_step, self.rank, targets, self._unpickler, stats=self._io)
        apply_loaded(state, tree)
        seconds = time.perf_counter() - t0
        self._stats["last_load"] = {"step": got_step, "source": "storage", "seconds": seconds,
                                    "peers": "", "uri": location, **self._io}
        self.last_restore = RestoreInfo(got_step, "storage", seconds, "", location)
        same = same_location(location, self.path)
        self._live.set_lineage(got_step, "" if same else location, self._metadata)
        return got_step

    @property
    def last_load_source(self) -> Optional[str]:
        last = self._stats["last_load"]
        return last["source"] if last else None

    # -- status -------------------------------------------------------------------------------
    def status(self) -> dict:
        """Snapshots in memory, pending persists, newest committed step, sizes and timings."""
        agent = json.loads(self._live.agent_status())
        mine: dict[str, Any] = next(
            (r for r in agent.get("ranks", []) if r["rank"] == self.rank), {})
        return {
            "job": self.job,
            "path": self.path,
            "rank": self.rank,
            "world_size": self.world_size,
            "snapshots": [_fields(s) for s in self._live.slots()],
            "pending_persists": mine.get("pending_persists", 0),
            "newest_committed": agent.get("newest_committed"),
            "last_persisted_step": mine.get("last_persisted_step"),
            "last_persist_seconds": mine.get("last_persist_seconds"),
            "last_persist_bytes": mine.get("last_persist_bytes"),
            "persists_ok": mine.get("persists_ok", 0),
            "persists_failed": mine.get("persists_failed", 0),
            "last_persist_error": mine.get("last_error") or None,
            "saves": self._stats["saves"],
            "skipped_saves": self._stats["skipped_saves"],
            "saves_not_due": self._stats["saves_not_due"],
            "preempted": self.preempted,
            "last_save": self._stats["last_save"],
            "last_load": self._stats["last_load"],
            "agent": {"pid": agent.get("agent_pid"), "job_dir": agent.get("job_dir"),
                      "queued": agent.get("queued"),
                      # frames from this process (status requests aside): one per save
                      "messages_received": mine.get("messages_received"),
                      # where the agent serving rank 0 keeps the job's measurement history
                      "history": agent.get("history")},
            "replication": agent.get("replication"),
            "tiers": agent.get("tiers", []),
            "metrics_url": agent.get("metrics_url"),
            "metrics_error": agent.get("metrics_error"),
            "event_log": agent.get("event_log"),
            "storage_layout": agent.get("storage_layout"),
            "last_restore": self.last_restore._asdict() if self.last_restore else None,
            "persist_interval": self._advisor.status(agent.get("tiers", [])),
            "memory": self._memory(agent.get("agent_pid"), agent.get("replication")),
        }

    def _memory(self, agent_pid: Optional[int],
                replication: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        """Host memory of the job (docs/operations.md, "Host memory"): the shared memory of
        this rank's snapshot slots and of every rank's of the job on this node, the slots this
        rank saves into (1 when ``max_shm_bytes`` holds fewer than two snapshots), the cap, the
        replica files this node keeps for other nodes (with replication; None without), and the
        resident memory of this process and of the node's agent (from /proc)."""
        rank_shm, node_shm = self._live.shm_bytes()
        me = _proc_memory("self")
        agent = _proc_memory(str(agent_pid)) if agent_pid else {}
        rep = replication or {}
        return {
            "shm_rank_bytes": rank_shm,
            "shm_node_bytes": node_shm,
            "replica_node_bytes": rep.get("held_bytes"),
            "replica_spare_bytes": rep.get("spare_bytes"),
            "slots": self._live.usable_slots(),
            "max_shm_bytes": self.max_shm_bytes,
            "rss_bytes": me.get("VmRSS"),
            "peak_rss_bytes": me.get("VmHWM"),
            "private_bytes": me.get("RssAnon"),
            "shared_rss_bytes": me.get("RssShmem"),
            "agent_rss_bytes": agent.get("VmRSS"),
            "agent_private_bytes": agent.get("RssAnon"),
        }

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
