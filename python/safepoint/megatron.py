"""Megatron-Core's ``dist_checkpointing`` in safepoint's format.

    from megatron.core import dist_checkpointing
    import safepoint.megatron                     # registers the backend "safepoint"

    dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir,
                            sharded_strategy=("safepoint", 1))                 # sync
    req = dist_checkpointing.save(sd, ckpt_dir, sharded_strategy=("safepoint", 1),
                                  async_sharded_save=True)                     # async
    dist_checkpointing.save(sd, ckpt_dir, sharded_strategy=("safepoint_flash", 1))  # flash
    state = dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir)     # any of them

``SafepointSaveStrategy`` is a Megatron ``AsyncSaveShardedStrategy`` and
``SafepointLoadStrategy`` a ``LoadShardedStrategy``; importing this module registers both with
Megatron's own registry (``strategies.base.register_default_strategy``) under the backend
``"safepoint"`` (version 1), and the flash save strategy under ``"safepoint_flash"``. Megatron
writes the backend's name into the checkpoint's ``metadata.json``, so ``dist_checkpointing.load``
picks ``SafepointLoadStrategy`` by itself. Tested with megatron-core 0.16.1.

Why on top of Megatron's ``torch_dist`` machinery. Megatron's ``torch_dist`` strategy is DCP
underneath: it turns Megatron's ``ShardedTensor``s (after the factories are applied and
replicas dropped: ``_replace_state_dict_keys_with_sharded_keys``, ``mcore_to_pyt_state_dict``)
into DCP-checkpointable tensors and ``ShardedObject``s into byte items, plans with its
``MCoreSavePlanner``, and loads with ``MCoreLoadPlanner`` (global-shape checks,
``allow_shape_mismatch``). All of that is format-independent, and resharding (another TP, PP or
DP layout) is DCP's planner reading the overlaps of the saved chunks. safepoint already has a
DCP storage layer (``safepoint.dcp.Writer``/``Reader``: one image per rank, CRC per 4 MiB chunk,
a commit record once every rank's image is durable, reads of only the byte ranges a rank needs).
So these strategies reuse Megatron's translation and planners unchanged and swap only the
storage: ``safepoint.dcp.Writer``'s image instead of ``FileSystemWriterAsync``'s ``.distcp``
files, ``safepoint.dcp.Reader`` instead of ``FileSystemReader``. What is not reused is Megatron's
``save_state_dict_async_finalize`` (it gathers every rank's write results and broadcasts a flag
on ``torch.cuda.current_device()``): a safepoint step needs neither a metadata file (the
Reader rebuilds DCP's metadata from the images) nor the gather (the step is committed when
every image is there), so the finalize here only checks the commit, on every rank.

Layout. Megatron's checkpoint directory (``ckpt_dir``, e.g. ``<save>/iter_0000100``) keeps
``metadata.json`` and ``common.pt`` (Megatron's common strategy: the non-sharded values,
``torch.save`` by rank 0, as with ``torch_dist``), and gets ``safepoint.json``, a pointer naming
the safepoint directory (``root``; default ``<parent of ckpt_dir>/safepoint``) and the step that
holds this checkpoint's tensors and ``ShardedObject``s. Each save takes the next free step of
``root`` (one more than any step committed there, in this node's memory, or holding an image of
an unfinished save), decided by the planning's coordinator, so re-saving an iteration never
collides with an earlier save. ``safepoint ls/inspect/verify ROOT`` work on it.

Modes:

- sync: ``save`` returns once every rank's image is durable and the step committed.
- async: ``save(..., async_sharded_save=True)`` returns Megatron's ``AsyncRequest``: its
  ``preload_fn`` copies device tensors to host memory, its ``async_fn`` writes this rank's image
  (Megatron's ``TemporalAsyncCaller`` runs it in a forked process; host tensors are that
  process's copy-on-write view, so training may go on); its finalize checks the commit on every
  rank, then rank 0 writes the pointer (and Megatron ``metadata.json``).
- flash (``SafepointSaveStrategy(flash=True)``, registered as ``"safepoint_flash"``): the state
  is copied into host shared memory by a ``safepoint.Checkpointer`` and ``save`` returns; the
  node agent persists it and commits the step once every rank's image is on storage (a process
  that dies after the copy loses nothing: the agent persists its snapshot). The pointer is
  written at once. ``async_sharded_save=True`` with flash: the copy happens in the call, and the
  request's ``async_fn`` waits in the background until the agent committed the step, so
  Megatron's finalize (``metadata.json``, Megatron-LM's ``latest_checkpointed_iteration.txt``)
  runs only once the checkpoint is durable. Loading a flash checkpoint waits (``load_timeout``)
  for its step to be committed; it reads storage, not the agent's memory (no hot reload here).
  ``close()`` (or the interpreter's exit) waits for every flash save and frees the memory.

Megatron's ``FullyParallelSaveStrategyWrapper`` (what Megatron-LM's ``--ckpt-fully-parallel-save``
puts around the save strategy) wraps ``SafepointSaveStrategy`` as it does ``torch_dist``'s: it
spreads the saves of replicated shards over the ranks, and these strategies write what it
marks as main replicas (tested). Its load counterpart exchanges the loaded tensors on CUDA
devices (``exchange_utils``), which the CPU tests cannot run.

Retention: ``keep=K`` deletes committed steps older than the newest K of ``root`` (sync/async:
rank 0 after a save, as ``safepoint.dcp.Writer``; flash: the agent's retention, default 3);
their Megatron directories then fail to load with ``NotFoundError`` naming the step. Megatron's
``remove_sharded_tensors`` is not supported.

On a CPU-only torch (the tests): Megatron 0.16.1's ``AsyncCallsQueue`` and
``TemporalAsyncCaller`` call ``torch.cuda.synchronize()`` and put their flags on
``torch.cuda.current_device()``, and so does ``torch_dist``'s own save finalize; these strategies
do not, but scheduling an async request through Megatron's queue needs those two calls to work
(the tests and bench/megatron.py make them CPU no-ops there). Megatron's ``GPTModel`` builds on
the CPU (``use_cpu_initialization=True``, the local layer spec) and its ``sharded_state_dict()``
works; its forward does not (``DotProductAttention`` takes a buffer from
``GlobalMemoryBuffer.get_tensor``, allocated on ``torch.cuda.current_device()``), nor does the
``DistributedOptimizer`` (its ``DistributedDataParallel`` grad buffers are allocated on
``torch.cuda.current_device()``), so its state is tested in the format its
``sharded_state_dict`` produces (``fully_reshardable`` and ``dp_reshardable``).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import json
import os
import sys
import time
import weakref
from pathlib import Path
from typing import Any, Optional, Union, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedStateDict, ShardedTensor
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.base import (
    AsyncSaveShardedStrategy,
    StrategyAction,
    register_default_strategy,
)
from megatron.core.dist_checkpointing.strategies.state_dict_saver import (
    save_state_dict_async_plan,
)
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreLoadPlanner,
    MCoreSavePlanner,
    TorchDistLoadShardedStrategy,
    _replace_sharded_keys_with_state_dict_keys,
    _replace_state_dict_keys_with_sharded_keys,
    _restore_dict_types,
    _unwrap_pyt_sharded_tensor,
    mcore_to_pyt_state_dict,
)
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem

import safepoint
from safepoint import _core
from safepoint._attempt import new_attempt
from safepoint.dcp.reader import Reader
from safepoint.dcp.writer import Writer, _RankPlan, prune
from safepoint.errors import InvalidArgumentError, NotFoundError

BACKEND = "safepoint"
FLASH_BACKEND = "safepoint_flash"  # registry name of the flash save strategy (format: BACKEND)
VERSION = 1
POINTER = "safepoint.json"
POINTER_FORMAT = "safepoint-megatron"
POINTER_VERSION = 1

_SCHEME = "://"


# -- where a checkpoint's step is ----------------------------------------------------------------

def _root_of(checkpoint_dir: Union[str, Path], root: Optional[str]) -> str:
    if root is not None:
        return root if _SCHEME in root else os.path.abspath(root)
    return os.path.join(os.path.dirname(os.path.abspath(os.fspath(checkpoint_dir))), "safepoint")


def _write_pointer(checkpoint_dir: Union[str, Path], root: str, step: int) -> None:
    """``<checkpoint_dir>/safepoint.json`` naming the step (rank 0; durable, atomic)."""
    path = os.path.join(os.fspath(checkpoint_dir), POINTER)
    doc = {"format": POINTER_FORMAT, "version": POINTER_VERSION, "root": root, "step": step}
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_pointer(checkpoint_dir: Union[str, Path]) -> tuple[str, int]:
    """The (safepoint directory, step) a Megatron checkpoint directory saved by
    ``SafepointSaveStrategy`` points to."""
    path = os.path.join(os.fspath(checkpoint_dir), POINTER)
    try:
        with open(path) as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise NotFoundError(f"{checkpoint_dir}: no {POINTER}: not saved by safepoint's Megatron "
                            f"strategy (or its save did not finish)") from None
    except (OSError, ValueError) as e:
        raise CheckpointingException(f"{path}: unreadable safepoint pointer: {e}") from None
    if (not isinstance(doc, dict) or doc.get("format") != POINTER_FORMAT
            or doc.get("version") != POINTER_VERSION or not isinstance(doc.get("root"), str)
            or type(doc.get("step")) is not int):
        raise CheckpointingException(f"{path}: not a safepoint pointer of version "
                                     f"{POINTER_VERSION}: {doc!r}")
    return doc["root"], doc["step"]


def _steps(root: str) -> list[int]:
    if _SCHEME not in root and not os.path.isdir(root):
        return []
    return list(_core.steps(root))


def _wait_committed(root: str, step: int, timeout: float) -> None:
    """Returns once ``step`` is committed in ``root``; NotFoundError when a newer step is and
    this one is not (retention deleted it) or after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        steps = _steps(root)
        if step in steps:
            return
        if steps and steps[-1] > step and not _core.image_ranks(root, step):
            raise NotFoundError(f"{root}: step {step} is not committed and newer steps are "
                                f"(retention deleted it?)")
        if time.monotonic() > deadline:
            present = _core.image_ranks(root, step)
            raise NotFoundError(
                f"{root}: step {step} is not committed after {timeout:.0f} s (images of ranks "
                f"{present or 'none'} present): its save did not finish, or the node agent of a "
                f"flash save did not persist it")
        time.sleep(0.02)


def _wait_commit_record(root: str, step: int, timeout: float, record: Optional[str]) -> None:
    """A flash ``async_sharded_save``'s async part, in Megatron's forked process: returns once
    the agent wrote the step's commit record (the finalize then checks the commit itself). For
    a local directory it only looks for the file, so that the forked process never enters the
    core library, whose locks a thread of the parent (the Checkpointer's) may have held at the
    fork; a URI is asked through the core. ``record``: the commit record's path (a local
    directory's), computed before the fork."""
    if record is None:
        _wait_committed(root, step, timeout)
        return
    deadline = time.monotonic() + timeout
    while not os.path.exists(record) and time.monotonic() < deadline:
        time.sleep(0.02)


# -- saving ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _StepPlan(_RankPlan):
    """``SavePlan.storage_data`` from the coordinator: a rank's assignment and the step all save."""

    step: int = 0


class _Staged:
    """Resolves write items to data taken earlier (``Writer._image``'s ``planner``)."""

    def __init__(self, data: dict[MetadataIndex, Any]) -> None:
        self.data = data

    def resolve_data(self, item: WriteItem) -> Any:
        return self.data[item.index]


def _to_host(data: Any) -> Any:
    if isinstance(data, torch.Tensor) and data.device.type != "cpu":
        return data.to("cpu")
    return data


class _StepWriter(Writer):
    """``safepoint.dcp.Writer`` whose step is the next free one of its directory, chosen by the
    planning's coordinator from what every rank knows (its local plan's ``storage_data``)."""

    def __init__(self, root: str, job: str, known: Any) -> None:
        super().__init__(root, None, job=job)
        self._known = known  # () -> steps this rank knows of (storage, its node's memory)
        self.plan: Optional[SavePlan] = None
        self.staged: Optional[_Staged] = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = dist.get_rank() if dist.is_initialized() else 0

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return dataclasses.replace(plan, storage_data=max(self._known(), default=0))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        step = max(int(p.storage_data) for p in plans) + 1
        while _core.image_ranks(self.path, step):  # an unfinished save's images: skip its step
            step += 1
        attempt, world = new_attempt(), len(plans)
        return [dataclasses.replace(p, storage_data=_StepPlan(i, world, attempt, step))
                for i, p in enumerate(plans)]

    def prepare_write_data(self, plan: SavePlan, planner: SavePlanner) -> None:
        """Called by Megatron's ``save_state_dict_async_plan`` with the final plan: takes the
        step and this rank's data (references, not copies)."""
        info = plan.storage_data
        if not isinstance(info, _StepPlan):
            raise InvalidArgumentError(f"{self.path}: the save plan carries no safepoint step "
                                       f"(storage_data={info!r})")
        # (No _refuse_existing here: other ranks may be writing this step already; the
        # coordinator chose a step neither committed nor holding an earlier save's images.)
        self.step = info.step
        self.plan = plan
        self.staged = _Staged({item.index: planner.resolve_data(item) for item in plan.items})


def _preload(staged: _Staged) -> _Staged:
    """The async request's ``preload_fn``: device tensors copied to host memory (before the
    fork, or in Megatron's persistent worker)."""
    return _Staged({k: _to_host(v) for k, v in staged.data.items()})


def _write_image(writer: _StepWriter, staged: _Staged, plan: SavePlan) -> None:
    """The async part: writes this rank's image (the last rank's write commits the step)."""
    writer.write_data(plan, cast(SavePlanner, staged))


def _close_at_exit(ref: weakref.ref, ckpt: safepoint.Checkpointer) -> None:
    """A flash strategy's Checkpointer still open at exit: closed, or abandoned when the
    program ended by an uncaught exception (the agent persists what is not on storage)."""
    strategy: Optional[SafepointSaveStrategy] = ref()
    if strategy is not None and strategy._ckpt is ckpt:
        strategy._ckpt = strategy._at_exit = None
    if getattr(sys, "last_value", None) is not None:
        ckpt.abandon()
    else:
        ckpt.close()


class SafepointSaveStrategy(AsyncSaveShardedStrategy):
    """Megatron save strategy writing safepoint steps (module doc).

    ``root``: the safepoint directory (a path or a URI safepoint stores to; default
    ``<parent of ckpt_dir>/safepoint``). ``flash``: copy into shared memory and let the node
    agent persist (module doc). ``keep``: committed steps of ``root`` to keep (sync/async:
    ``None`` keeps all; flash: the agent's retention, default 3). ``job``, ``shm_dir``,
    ``tiers``: as for ``safepoint.Checkpointer`` (flash). ``commit_timeout``: seconds a flash
    ``async_sharded_save`` waits in the background for the agent's commit.
    """

    def __init__(self, root: Optional[Union[str, os.PathLike[str]]] = None, *,
                 flash: bool = False, keep: Optional[int] = None, job: str = "",
                 shm_dir: Optional[str] = None, tiers: Optional[list[Any]] = None,
                 commit_timeout: float = 600.0) -> None:
        super().__init__(BACKEND, VERSION)
        self.root = os.fspath(root) if root is not None else None
        if keep is not None and (type(keep) is not int or keep < 1):
            raise InvalidArgumentError(f"keep must be a positive int or None, got {keep!r}")
        self.flash, self.keep, self.job = bool(flash), keep, job
        self.shm_dir, self.tiers, self.commit_timeout = shm_dir, tiers, commit_timeout
        self._ckpt: Optional[safepoint.Checkpointer] = None
        self._at_exit: Optional[Any] = None
        self.last_step: Optional[int] = None  # the safepoint step of the last save

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    # -- planning (every mode) -------------------------------------------------------------------
    def _plan(self, sharded_state_dict: ShardedStateDict,
              checkpoint_dir: Union[str, Path]) -> tuple[str, _StepWriter]:
        root = _root_of(checkpoint_dir, self.root)
        flat, _, _ = _replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict, keep_only_main_replica=True)
        pyt_state_dict = mcore_to_pyt_state_dict(flat, False)
        writer = _StepWriter(root, self.job, functools.partial(self._known_steps, root))
        save_state_dict_async_plan(
            pyt_state_dict, writer, None, 0,
            planner=MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False))
        assert writer.step is not None and writer.plan is not None
        self.last_step = writer.step
        return root, writer

    def _known_steps(self, root: str) -> list[int]:
        known = _steps(root)
        if self.flash:
            known += [s["step"] for s in self._checkpointer(root).status()["snapshots"]]
        return known

    def _checkpointer(self, root: str) -> safepoint.Checkpointer:
        if self._ckpt is not None and self._ckpt.path != root:
            raise InvalidArgumentError(
                f"{root}: this flash strategy saves to {self._ckpt.path}; use one "
                f"SafepointSaveStrategy per safepoint directory (or pass root=)")
        if self._ckpt is None:
            kwargs: dict[str, Any] = {}
            if self.keep is not None:
                kwargs["keep"] = self.keep
            self._ckpt = safepoint.Checkpointer(
                root, job=self.job or None, rank=dist.get_rank(),
                world_size=dist.get_world_size(), shm_dir=self.shm_dir, tiers=self.tiers,
                dedupe=False, preemption=False, **kwargs)
            self._at_exit = functools.partial(_close_at_exit, weakref.ref(self), self._ckpt)
            atexit.register(self._at_exit)
        return self._ckpt

    # -- Megatron's entry points -----------------------------------------------------------------
    def save(self, sharded_state_dict: ShardedStateDict,
             checkpoint_dir: Union[str, Path]) -> None:
        """Sync: returns once the step is committed. Flash: once the state is in shared memory."""
        root, writer = self._plan(sharded_state_dict, checkpoint_dir)
        assert writer.plan is not None and writer.staged is not None
        if self.flash:
            self._snapshot(writer)
            if dist.get_rank() == 0:
                _write_pointer(checkpoint_dir, root, cast(int, writer.step))
            return
        _write_image(writer, writer.staged, writer.plan)
        self._finalize(checkpoint_dir, root, cast(int, writer.step))

    def async_save(self, sharded_state_dict: ShardedStateDict,
                   checkpoint_dir: Union[str, Path]) -> AsyncRequest:
        """Megatron's async save: the request's ``async_fn`` writes this rank's image (flash:
        waits for the agent's commit after the copy made here); its finalize checks the commit
        on every rank and writes the pointer."""
        root, writer = self._plan(sharded_state_dict, checkpoint_dir)
        assert writer.plan is not None and writer.staged is not None
        step = cast(int, writer.step)
        finalize = functools.partial(self._finalize, checkpoint_dir, root, step)
        if self.flash:
            self._snapshot(writer)
            record = (None if _SCHEME in root
                      else os.path.join(_core.step_path(root, step), "COMMIT"))
            return AsyncRequest(_wait_commit_record, (root, step, self.commit_timeout, record),
                                [finalize])
        staged = writer.staged
        writer.staged = None  # the request holds the data, not the strategy
        writer._known = None  # (picklable without the strategy: Megatron's persistent caller)
        return AsyncRequest(_write_image, (writer, staged, writer.plan), [finalize],
                            preload_fn=functools.partial(_preload, staged))

    def _snapshot(self, writer: _StepWriter) -> None:
        assert writer.plan is not None and writer.staged is not None
        _, state, _ = writer._image(writer.plan, cast(SavePlanner, writer.staged))
        writer.staged = None
        self._checkpointer(writer.path).save(cast(int, writer.step), state, persist=True)

    def _finalize(self, checkpoint_dir: Union[str, Path], root: str, step: int) -> None:
        """Every rank: the step must be committed; rank 0 prunes and writes the pointer."""
        # Once every rank's write is done, the last one has committed the step. (Megatron's
        # blocking finalize runs a rank's finalize once its own writer exited, whatever the
        # others' are doing.)
        dist.barrier()
        if step not in _steps(root):
            present = _core.image_ranks(root, step)
            raise CheckpointingException(
                f"{checkpoint_dir}: safepoint step {step} of {root} is not committed (images "
                f"of ranks {present or 'none'} present); see the ranks' errors")
        if dist.get_rank() == 0:
            if self.keep is not None and not self.flash:
                prune(root, self.keep, spare=step)
            _write_pointer(checkpoint_dir, root, step)

    # -- lifetime --------------------------------------------------------------------------------
    @property
    def checkpointer(self) -> Optional[safepoint.Checkpointer]:
        """The flash ``Checkpointer`` while one is open (``status()``), else None."""
        return self._ckpt

    def wait(self, timeout: Optional[float] = None) -> None:
        """Blocks until every flash save of this rank so far is committed."""
        if self._ckpt is not None:
            self._ckpt.wait(timeout)

    def close(self) -> None:
        """Waits for the flash saves, then frees their shared memory. Call it at the end of
        training (else it runs at interpreter exit)."""
        if self._at_exit is not None:
            atexit.unregister(self._at_exit)
            self._at_exit = None
        if self._ckpt is not None:
            ckpt, self._ckpt = self._ckpt, None
            ckpt.close()


# -- loading ---------------------------------------------------------------------------------

class SafepointLoadStrategy(TorchDistLoadShardedStrategy):
    """Megatron load strategy for checkpoints ``SafepointSaveStrategy`` saved: Megatron's
    ``torch_dist`` loading (its planner, shape checks and state dict translation) over
    ``safepoint.dcp.Reader``, which reads only the byte ranges each rank's shards overlap.
    ``load_timeout``: seconds to wait for a flash save's step to be committed."""

    def __init__(self, load_timeout: float = 120.0) -> None:
        super().__init__()
        self.load_timeout = load_timeout
        self.last_reader: Optional[Reader] = None  # of the last load (bytes_read, for tests)

    def _reader(self, checkpoint_dir: Union[str, Path]) -> Reader:
        root, step = read_pointer(checkpoint_dir)
        _wait_committed(root, step, self.load_timeout)
        return Reader(root, step=step)

    def load(self, sharded_state_dict: ShardedStateDict,
             checkpoint_dir: Union[str, Path]) -> dict:
        # As TorchDistLoadShardedStrategy.load (megatron-core 0.16.1), with safepoint's reader.
        flexible_shape = [t for t in nested_values(sharded_state_dict)
                          if isinstance(t, ShardedTensor) and not t.allow_shape_mismatch]
        allow_mismatch = {t.key: t for t in nested_values(sharded_state_dict)
                          if isinstance(t, ShardedTensor) and t.allow_shape_mismatch}
        orig = sharded_state_dict
        flat, flat_mapping, rename_mapping = _replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict)
        pyt_state_dict = mcore_to_pyt_state_dict(flat, True)
        reader = self._reader(checkpoint_dir)
        dcp.load(pyt_state_dict, storage_reader=reader,
                 planner=MCoreLoadPlanner(shapes_validation_sharded_tensors=flexible_shape,
                                          allow_shape_mismatch_sharded_tensors=allow_mismatch))
        self.last_reader = reader
        mcore = {k: _unwrap_pyt_sharded_tensor(v) for k, v in pyt_state_dict.items()}
        out = _replace_sharded_keys_with_state_dict_keys(mcore, flat_mapping, rename_mapping)
        _restore_dict_types(out, orig)
        return out

    def load_tensors_metadata(self, checkpoint_dir: Union[str, Path],
                              metadata: Any = None) -> dict:
        if metadata is None:
            metadata = self._reader(checkpoint_dir).read_metadata()
        return super().load_tensors_metadata(Path(checkpoint_dir), metadata)

    def load_sharded_metadata(self, checkpoint_dir: Union[str, Path]) -> dict:
        metadata = self._reader(checkpoint_dir).read_metadata()
        out: dict[str, Any] = {}
        for key, md in metadata.state_dict_metadata.items():
            if isinstance(md, BytesStorageMetadata):
                obj = ShardedObject.empty_from_unique_key(key)
                out[obj.unique_key] = obj
        out.update(self.load_tensors_metadata(checkpoint_dir, metadata))
        return out

    def remove_sharded_tensors(self, checkpoint_dir: Union[str, Path], key_prefix: str) -> None:
        raise CheckpointingException(
            f"{checkpoint_dir}: remove_sharded_tensors is not supported for safepoint "
            f"checkpoints (a committed step is never rewritten); save a new checkpoint without "
            f"the {key_prefix!r} tensors instead")

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if loaded_backend != BACKEND:
            raise CheckpointingException(f"SafepointLoadStrategy loads the backend {BACKEND!r}, "
                                         f"not {loaded_backend!r}")

    def check_version_compatibility(self, loaded_version: int) -> None:
        if loaded_version != VERSION:
            raise CheckpointingException(f"SafepointLoadStrategy loads version {VERSION} of "
                                         f"{BACKEND!r}, not {loaded_version!r}")


_FLASH = SafepointSaveStrategy(flash=True)


def register() -> None:
    """Registers the strategies with Megatron (done on import): save ``("safepoint", 1)``
    (sync and async) and ``("safepoint_flash", 1)`` (flash, this process's one instance:
    ``close()`` it); load ``("safepoint", 1)``, which ``metadata.json`` names."""
    register_default_strategy(StrategyAction.SAVE_SHARDED, BACKEND, VERSION,
                              SafepointSaveStrategy())
    register_default_strategy(StrategyAction.SAVE_SHARDED, FLASH_BACKEND, VERSION, _FLASH)
    register_default_strategy(StrategyAction.LOAD_SHARDED, BACKEND, VERSION,
                              SafepointLoadStrategy())


def close() -> None:
    """Closes the registered flash strategy (``"safepoint_flash"``): waits for its saves."""
    _FLASH.close()


register()

__all__ = ["SafepointSaveStrategy", "SafepointLoadStrategy", "register", "close", "read_pointer",
           "BACKEND", "FLASH_BACKEND", "VERSION", "POINTER"]
