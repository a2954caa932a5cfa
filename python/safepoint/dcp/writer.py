"""``safepoint.dcp.Writer``: a DCP ``StorageWriter`` that saves one step of a safepoint checkpoint
directory (see the package docstring for the layout of what it writes)."""

from __future__ import annotations

import dataclasses
import io
import os
import uuid
import warnings
import weakref
from collections.abc import Mapping
from typing import Any, Optional

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from safepoint import _core
from safepoint._attempt import new_attempt
from safepoint._pickle import pickler
from safepoint._shards import _DTYPES
from safepoint.errors import AlreadyExistsError, Error, InvalidArgumentError, StorageError

#: Version of the layout of the ``dcp`` entry inside an image (not the image format's version).
FORMAT_VERSION = 1
_DCP_VERSION = "1.0.0"  # DCP's own metadata version, as FileSystemWriter records it

# dtypes safepoint's image format stores natively (_core.DTYPES, as torch dtypes); the others
# torch has (complex32, sub-byte and bit types) are stored as their raw bytes (uint8).
_NATIVE = frozenset(_DTYPES.values())


# -- paths and steps ---------------------------------------------------------------------------

def _fspath(path: Any, what: str) -> str:
    try:
        p = os.fspath(path)
    except TypeError:
        p = None
    if not isinstance(p, str) or not p:
        raise InvalidArgumentError(f"{what} must be a non-empty str or os.PathLike, got {path!r}")
    return p


def _check_step(path: str, step: Any) -> Optional[int]:
    if step is not None and (type(step) is not int or step < 0):
        raise InvalidArgumentError(f"{path}: step must be a non-negative int or None, got {step!r}")
    return step


def _split_checkpoint_id(checkpoint_id: Any) -> tuple[str, Optional[int]]:
    """``"<dir>/step-<N>"`` (a step directory) -> (dir, N); any other path -> (path, None)."""
    cid = _fspath(checkpoint_id, "checkpoint_id")
    split = _core.split_step_path(cid)
    return split if split is not None else (cid, None)


def _checkpoint_id(path: str, step: Optional[int]) -> str:
    """DCP's name of a step: its step directory (the checkpoint directory without a step)."""
    return path if step is None else _core.step_path(path, step)


def _storage_key(fqn: str, offsets) -> str:
    return f"{fqn}@{','.join(str(int(o)) for o in offsets)}"


def _check_keep(path: str, keep: Any) -> Optional[int]:
    if keep is not None and (type(keep) is not int or keep < 1):
        raise InvalidArgumentError(f"{path}: keep must be a positive int or None (keep every "
                                   f"step), got {keep!r}")
    return keep


# -- retention -------------------------------------------------------------------------------

# The Readers of this process (safepoint.dcp.Reader): a step one of them has resolved and not
# finished reading (read_metadata done, read_data not yet returned) is never pruned.
_READERS: weakref.WeakSet = weakref.WeakSet()


def _location(path: str) -> str:
    return path if "://" in path else os.path.realpath(path)


def _steps_being_read(path: str) -> set[int]:
    here = _location(path)
    return {r._reading for r in list(_READERS)
            if r._reading is not None and _location(r.path) == here}


def prune(path: str, keep: int, spare: Optional[int] = None) -> list[int]:
    """Deletes the committed steps of ``path`` older than its newest ``keep`` (as the agent's
    retention does: the commit record first); returns them. Never deleted: the newest ``keep``
    steps, ``spare`` (the step a save just wrote, even when older), tagged steps
    (``safepoint tag``), and steps a ``Reader`` of this process is reading. A step that cannot
    be deleted, or tags that cannot be read, are warned about: the save stands."""
    committed = list(_core.steps(path))
    old = [s for s in committed[:-keep] if s != spare]
    if not old:
        return []
    try:
        tagged = set(dict(_core.tags(path)).values())
    except Error as e:  # a tag could name any step: delete nothing this time
        warnings.warn(f"safepoint.dcp: {path}: retention deletes nothing this time, its tags "
                      f"cannot be read: {e}", RuntimeWarning, stacklevel=3)
        return []
    reading = _steps_being_read(path)
    pruned = []
    for s in old:
        if s in tagged or s in reading:
            continue
        try:
            _core.delete_step(path, s)
        except Error as e:
            warnings.warn(f"safepoint.dcp: {path}: retention could not delete step {s} (the "
                          f"next save tries again): {e}", RuntimeWarning, stacklevel=3)
            continue
        pruned.append(s)
    return pruned


# -- writing ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _RankPlan:
    """``SavePlan.storage_data``: who writes which image of how many, and the save attempt
    every image carries (drawn by the coordinator: a step commits only from images of one
    attempt, so an image an earlier, unfinished save left is never committed beside these)."""

    rank: int
    world_size: int
    attempt: int


@dataclasses.dataclass(frozen=True)
class _Written:
    """``WriteResult.storage_data``: where an item went."""

    rank: int
    key: str


def _encode_planner_data(data: Any) -> Any:
    """DefaultSavePlanner's fqn -> object path mapping (tuples of str/int) as lists; None for
    anything else (a custom planner's data is not stored)."""
    if not isinstance(data, Mapping):
        return None
    out = {}
    for k, v in data.items():
        if not isinstance(k, str) or not isinstance(v, (tuple, list)) or not all(
                type(x) in (str, int) for x in v):
            return None
        out[k] = list(v)
    return out


class Writer(StorageWriter):
    """A DCP ``StorageWriter`` that saves one step of a safepoint checkpoint directory.

    ``path`` is the checkpoint directory (what ``safepoint.load``/``safepoint ls`` read); ``step``
    the step to write. Alternatively pass ``checkpoint_id="<path>/step-<N>"`` to ``dcp.save``.
    Every rank writes one image with its write items; the step is committed (visible) once every
    rank's image is durable, and ``dcp.save`` returns only then. A step that is already committed,
    or that holds images of an earlier unfinished save, is refused: use a new step.

    ``keep``: once a save is committed, the coordinator deletes the committed steps older than
    the newest ``keep`` (``prune``), except tagged steps (``safepoint tag``), the step it just
    wrote and steps a ``Reader`` of this process is reading. ``None`` (the default) keeps every
    step: nothing else prunes a directory DCP writes to.
    """

    def __init__(self, path: str | os.PathLike[str], step: Optional[int] = None, *,
                 job: str = "", keep: Optional[int] = None) -> None:
        super().__init__()
        self.path = _fspath(path, "checkpoint path")
        self.step = _check_step(self.path, step)
        self.keep = _check_keep(self.path, keep)
        self.job = job
        self.save_id = uuid.uuid4().hex
        self.rank: Optional[int] = None
        self.is_coordinator = False
        self.use_collectives = True

    # -- the DCP protocol ------------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            path, step = _split_checkpoint_id(checkpoint_id)
            self.path = path
            if step is not None:
                self.step = step
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank", 0 if is_coordinator else None)
        self.use_collectives = kwargs.get("use_collectives", True)
        self._step_to_save()
        if not self.use_collectives and self.rank not in (None, 0):
            raise InvalidArgumentError(
                f"{self.path}: safepoint.dcp.Writer needs dcp.save(use_collectives=True) with "
                f"several ranks: a step is committed once every rank's image is there, so every "
                f"rank must know the world size")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self._refuse_existing()
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Runs on the coordinator only; DCP hands every rank its plan, so all ranks share the
        # attempt, like the Checkpointer's rank 0 broadcasts its (safepoint._attempt).
        world = len(plans)
        attempt = new_attempt()
        return [dataclasses.replace(p, storage_data=_RankPlan(i, world, attempt))
                for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        info, state, results = self._image(plan, planner)
        _core.save(self.path, self._step_to_save(), info.rank, info.world_size, self.job, state,
                   pickler(False), info.attempt)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _image(self, plan: SavePlan,
               planner: SavePlanner) -> tuple[_RankPlan, dict, list[WriteResult]]:
        """This rank's image as the state ``_core.save`` stores (``tensors``, ``bytes``, ``dcp``)
        and the items' write results (also what safepoint.megatron snapshots in flash mode)."""
        info = plan.storage_data
        if not isinstance(info, _RankPlan):
            raise InvalidArgumentError(
                f"{self.checkpoint_id}: the save plan carries no safepoint rank assignment "
                f"(storage_data={info!r}); was prepare_global_plan skipped?")
        if self.rank is not None and self.rank != info.rank:
            raise InvalidArgumentError(
                f"{self.checkpoint_id}: rank {self.rank} was given the plan of rank {info.rank}")
        tensors: dict[str, torch.Tensor] = {}
        blobs: dict[str, torch.Tensor] = {}
        items: dict[str, dict] = {}
        results: list[WriteResult] = []
        for item in plan.items:
            fqn = item.index.fqn
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                key = fqn
                if key in blobs:
                    raise InvalidArgumentError(
                        f"{self.checkpoint_id}: two byte items named {fqn!r}")
                blobs[key] = (torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw
                              else torch.empty(0, dtype=torch.uint8))
                items[key] = {"fqn": fqn, "kind": "bytes"}
                nbytes = len(raw)
            else:
                td = item.tensor_data
                if td is None or td.chunk is None:
                    raise InvalidArgumentError(
                        f"{self.checkpoint_id}: tensor item {fqn!r} has no chunk bounds")
                t = data.detach() if isinstance(data, torch.Tensor) else data
                if not isinstance(t, torch.Tensor):
                    raise InvalidArgumentError(
                        f"{self.checkpoint_id}: item {fqn!r} resolved to {type(data).__name__}, "
                        f"not a tensor")
                if tuple(t.shape) != tuple(td.chunk.sizes):
                    raise InvalidArgumentError(
                        f"{self.checkpoint_id}: item {fqn!r} has shape {tuple(t.shape)} but its "
                        f"chunk is {tuple(td.chunk.sizes)}")
                if t.dtype != td.properties.dtype:
                    raise InvalidArgumentError(
                        f"{self.checkpoint_id}: item {fqn!r} is {t.dtype} but was planned as "
                        f"{td.properties.dtype}")
                key = _storage_key(fqn, td.chunk.offsets)
                if key in tensors:
                    raise InvalidArgumentError(f"{self.checkpoint_id}: two chunks keyed {key!r}")
                raw_bytes = t.dtype not in _NATIVE
                if raw_bytes:  # complex32, ...: stored as their bytes
                    t = t.cpu().contiguous().reshape(-1).view(torch.uint8)
                tensors[key] = t
                items[key] = {
                    "fqn": fqn, "kind": "tensor",
                    "offsets": [int(x) for x in td.chunk.offsets],
                    "sizes": [int(x) for x in td.chunk.sizes],
                    "size": [int(x) for x in td.size],
                    "dtype": str(td.properties.dtype).removeprefix("torch."),
                    "requires_grad": bool(td.properties.requires_grad),
                    "raw": raw_bytes,
                }
                nbytes = t.numel() * t.element_size()
            results.append(WriteResult(index=item.index, size_in_bytes=nbytes,
                                       storage_data=_Written(info.rank, key)))
        meta = {
            "version": FORMAT_VERSION,
            "dcp_version": _DCP_VERSION,
            "rank": info.rank,
            "world_size": info.world_size,
            "items": items,
            "planner_data": _encode_planner_data(plan.planner_data),
            "save_id": self.save_id,
        }
        return info, {"tensors": tensors, "bytes": blobs, "dcp": meta}, results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        # Every rank's write_data has returned, so every image is durable, and the rank that
        # finished last has committed the step (the synchronous save commits once all are there).
        metadata.version = _DCP_VERSION
        metadata.storage_meta = self.storage_meta()
        metadata.storage_data = {r.index: r.storage_data for rs in results for r in rs}
        step = self._step_to_save()
        if step in _core.steps(self.path):
            if self.keep is not None:
                prune(self.path, self.keep, spare=step)
            return
        present = _core.image_ranks(self.path, step)
        raise StorageError(
            f"{self.checkpoint_id}: every rank reported its image written but the step is not "
            f"committed (images of ranks {present or 'none'} present); see the ranks' errors")

    def storage_meta(self) -> Optional[StorageMeta]:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str:
        return _checkpoint_id(self.path, self.step)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            return _split_checkpoint_id(checkpoint_id)[1] is not None
        except InvalidArgumentError:
            return False

    # -- helpers ---------------------------------------------------------------------------------
    def _step_to_save(self) -> int:
        if self.step is None:
            raise InvalidArgumentError(
                f"{self.path}: no step to save: pass safepoint.dcp.Writer(path, step=N) or "
                f"dcp.save(..., checkpoint_id='{self.path}/step-N')")
        return self.step

    def _refuse_existing(self) -> None:
        step = self._step_to_save()
        if step in _core.steps(self.path):
            raise AlreadyExistsError(
                f"{self.path}: step {step} is already committed; save DCP checkpoints to a "
                f"new step (re-writing a committed step is not atomic across ranks)")
        # Any storage: the attempt keeps such images out of this save's commit, but a step whose
        # images are half old and half new until every rank wrote would be a trap to debug.
        left = _core.image_ranks(self.path, step)
        if left:
            raise AlreadyExistsError(
                f"{self.checkpoint_id}: images of an earlier, unfinished save of step "
                f"{step} are there (ranks {left}). Save to a new step, or remove them")
