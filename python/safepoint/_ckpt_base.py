"""What the parts of a ``Checkpointer`` share: the attributes its constructor sets (typed here,
set in ``_checkpointer.Checkpointer.__init__``), ``_live`` (the agent client, once an overlapped
save's copy is done) and the types of its results.

``safepoint.Checkpointer`` (python/safepoint/_checkpointer.py: the constructor and the lifetime)
is one class made of parts by job, each a mixin of ``CheckpointerBase`` in its own module: the
preemption watch (``_ckpt_preemption``), the save path (``_ckpt_save``), the restore path
(``_ckpt_restore``) and status (``_ckpt_status``).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, NamedTuple, Optional, Union

from safepoint import _core
from safepoint._advisor import Advisor
from safepoint._dedupe import ReplicaPlan
from safepoint._pickle import AllowPickle
from safepoint._preemption import PreemptionWatch
from safepoint._tiers import Tier
from safepoint.errors import InvalidArgumentError


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



class CheckpointerBase:
    """The state of a Checkpointer that its parts share (set by its constructor)."""

    path: str
    job: str
    rank: int
    world_size: int
    persist_every: Union[int, str]
    keep: int
    on_busy: str
    shm_dir: str
    allow_pickle: AllowPickle
    _pickler: Optional[Callable[[Any], bytes]]
    _unpickler: Optional[Callable[[bytes], Any]]
    _group: Any  # the gloo group of the ranks' agreements (None: one rank)
    attempt: int
    dedupe: bool
    share_reads: bool
    _io: dict[str, Any]  # bytes moved by the current load (see load())
    _replicas: ReplicaPlan
    max_shm_bytes: Optional[int]
    # an overlapped save copying: (step, t0, seconds of the save call, copy_again)
    _pending: Optional[tuple[int, float, float, Callable[[], Any]]]
    # optimizer -> the handle of its step pre-hook (before_update)
    _hooks: weakref.WeakKeyDictionary
    _client: Optional[_core.Client]
    _advisor: Advisor
    _stats: dict[str, Any]
    _metadata: str
    tiers: list[Tier]
    _stores: list[str]  # where committed steps may be, fastest first
    snapshot_every: int
    preempted: bool
    _watch: Optional[PreemptionWatch]
    replication: Optional[dict[str, Any]]
    commit_relay: Optional[dict[str, Any]]  # the membership the commit relay uses (no replicas)
    last_restore: Optional[RestoreInfo]

    @property
    def _live(self):
        if self._client is None:
            raise InvalidArgumentError(f"{self.path}: the checkpointer is closed")
        if self._pending is not None:
            self.before_update()  # an overlapped save finishes before anything else
        return self._client

    def before_update(self) -> Optional[bool]:  # the save path's (_ckpt_save.SaveMixin)
        raise NotImplementedError
