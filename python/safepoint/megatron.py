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
every image is there), so the finalize here only checks the commit: rank 0 looks at storage
and every rank gets its verdict (success, or its error raised on every rank), so ranks never
part ways on what one of them saw; loads likewise.

Layout. Megatron's checkpoint directory (``ckpt_dir``, e.g. ``<save>/iter_0000100``) keeps
``metadata.json`` and ``common.pt`` (Megatron's common strategy: the non-sharded values,
``torch.save`` by rank 0, as with ``torch_dist``), and gets ``safepoint.json``, a pointer naming
the safepoint directory (``root``; default ``<parent of ckpt_dir>/safepoint``), the step that
holds this checkpoint's tensors and ``ShardedObject``s and the save attempt that commits it (a
load checks it). Each save takes the next free step of ``root``: past every step committed there
(the coordinator lists storage), holding an image of an unfinished save, or taken by any save
strategy of any rank's process and not yet seen committed (an async request still writing, a
flash snapshot in the agent's memory: each rank reports those in its local plan), so saves in
flight at once, sync, async and flash ones to one ``root``, never share a step; the finalize
checks that the step was committed by this save's attempt. ``safepoint ls/inspect/verify ROOT``
work on it.

Modes:

- sync: ``save`` returns once every rank's image is durable and the step committed.
- async: ``save(..., async_sharded_save=True)`` returns Megatron's ``AsyncRequest``: its
  ``preload_fn`` copies this rank's tensors to host memory (device tensors copied, host tensors
  cloned: training may mutate them once it returns) and writes the image on a thread of the
  process that called it (the core releases the GIL); its ``async_fn``, which Megatron's
  ``TemporalAsyncCaller`` runs in a forked process, only waits for that thread's result (a small
  file, at most ``commit_timeout`` seconds): safepoint's core never runs in a forked process,
  whose copy of the parent's core state (a connected cluster's threads, locks) is not usable.
  The finalize reports the thread's error on every rank, then rank 0 writes the pointer (and
  Megatron ``metadata.json``). Under Megatron's ``PersistentAsyncCaller`` (a spawned worker)
  ``preload_fn`` and ``async_fn`` both run in the worker, which writes; the finalize reads the
  same result file (untested: its worker needs CUDA in 0.16.1).
- flash (``SafepointSaveStrategy(flash=True)``, registered as ``"safepoint_flash"``): the state
  is copied into host shared memory by a ``safepoint.Checkpointer`` and ``save`` returns; the
  node agent persists it and commits the step once every rank's image is on storage (a process
  that dies after the copy loses nothing: the agent persists its snapshot). The pointer is
  written at once, so a sync flash checkpoint is durable only once the agent committed its step
  (``wait()``); Megatron-LM writes ``latest_checkpointed_iteration.txt`` right after a sync save,
  so use flash with ``--async-save``. ``async_sharded_save=True`` with flash: the copy happens in
  the call, and the request's ``preload_fn`` starts a thread that waits until the agent committed
  the step (as this save's attempt), so Megatron's finalize (``metadata.json``, Megatron-LM's
  ``latest_checkpointed_iteration.txt``) runs only once the checkpoint is durable. With a small
  ``keep``, a step the agent committed and already deleted for newer ones by then finalizes with
  a warning (that checkpoint does not load, as any pruned one). Loading a flash checkpoint waits
  (``load_timeout``) for its step to be committed; it reads storage, not the agent's memory (no
  hot reload here).
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
import tempfile
import threading
import time
import uuid
import warnings
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
import safepoint.errors
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
_AGENT_KEEP = 3  # safepoint.Checkpointer's default keep (the flash strategy's retention)


# -- where a checkpoint's step is ----------------------------------------------------------------

def _root_of(checkpoint_dir: Union[str, Path], root: Optional[str]) -> str:
    if root is not None:
        return root if _SCHEME in root else os.path.abspath(root)
    return os.path.join(os.path.dirname(os.path.abspath(os.fspath(checkpoint_dir))), "safepoint")


def _write_pointer(checkpoint_dir: Union[str, Path], root: str, step: int,
                   attempt: int) -> None:
    """``<checkpoint_dir>/safepoint.json`` naming the step and the save attempt that commits it
    (rank 0; durable, atomic)."""
    path = os.path.join(os.fspath(checkpoint_dir), POINTER)
    doc = {"format": POINTER_FORMAT, "version": POINTER_VERSION, "root": root, "step": step,
           "attempt": attempt}
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
    root, step, _ = _read_pointer(checkpoint_dir)
    return root, step


def _read_pointer(checkpoint_dir: Union[str, Path]) -> tuple[str, int, int]:
    """(root, step, save attempt: 0 when the pointer names none)."""
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
            or type(doc.get("step")) is not int or type(doc.get("attempt", 0)) is not int):
        raise CheckpointingException(f"{path}: not a safepoint pointer of version "
                                     f"{POINTER_VERSION}: {doc!r}")
    return doc["root"], doc["step"], doc.get("attempt", 0)


def _steps(root: str) -> list[int]:
    if _SCHEME not in root and not os.path.isdir(root):
        return []
    return list(_core.steps(root))


def _location(root: str) -> str:
    """One name per safepoint directory: a local path resolved (``file://`` as its path), any
    other URI as given."""
    if root.startswith("file://"):
        root = root[len("file://"):]
    return root.rstrip("/") if _SCHEME in root else os.path.realpath(root)


def _committed_attempt(root: str, step: int) -> Optional[int]:
    """The save attempt that committed ``step`` (its images' attempt), None when not committed."""
    if step not in _steps(root):
        return None
    return _core.step_lineage(root, step)[0]


def _check_attempt(root: str, step: int, attempt: int, got: int) -> None:
    if attempt and got != attempt:
        raise CheckpointingException(
            f"{root}: step {step} was committed by another save (attempt {got:x}, this "
            f"checkpoint's is {attempt:x}): two saves took the same step")


def _wait_committed(root: str, step: int, timeout: float, attempt: int = 0) -> None:
    """Returns once ``step`` is committed in ``root`` (by save ``attempt`` when not 0);
    NotFoundError when a newer step is and this one is not (retention deleted it) or after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        steps = _steps(root)
        if step in steps:
            _check_attempt(root, step, attempt, _core.step_lineage(root, step)[0])
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


# -- the steps this process has taken ------------------------------------------------------------
# A step is taken from the planning on, not once committed: an async request still writing, or
# a flash snapshot only in the agent's memory, holds a step that storage does not show. Every
# save strategy of this process (sync, async and flash instances alike) records the steps it
# planned here, per safepoint directory; each rank reports the newest it knows in its local
# plan, so the coordinator's choice is past every rank's. A step leaves once its finalize saw it
# committed (the listing shows it from then on); a failed save's step stays taken.

_LOCK = threading.Lock()
_TAKEN: dict[str, set[int]] = {}
_OPEN_FLASH: weakref.WeakSet = weakref.WeakSet()  # flash strategies with an open Checkpointer


def _take(root: str, step: int) -> None:
    with _LOCK:
        _TAKEN.setdefault(_location(root), set()).add(step)


def _settle(root: str, step: int) -> None:
    with _LOCK:
        _TAKEN.get(_location(root), set()).discard(step)


def _newest_taken(root: str) -> int:
    """The newest step of ``root`` this process has planned and not seen committed, or holds in
    an open flash Checkpointer's memory (its snapshots); 0 when none."""
    here = _location(root)
    with _LOCK:
        newest = max(_TAKEN.get(here, ()), default=0)
    for strategy in list(_OPEN_FLASH):
        ckpt = strategy._ckpt
        if ckpt is not None and _location(ckpt.path) == here:
            newest = max([newest, *(s.step for s in ckpt._live.slots())])
    return newest


# -- the background part of an async request -----------------------------------------------------
# Megatron's TemporalAsyncCaller runs a request's async_fn in a forked process. The core never
# runs there: the parent may hold process-global core state the child has only a copy of (a
# connected cluster whose messenger threads do not exist in the child, locks a thread held at
# the fork). So the request's preload_fn (called in the parent before the fork, or in Megatron's
# persistent worker before its async_fn) starts the work on a thread of its own process, and the
# async_fn only waits for that thread's result, a small file named before the fork; the finalize
# reads the same file and reports the thread's error on every rank.

@dataclasses.dataclass(frozen=True)
class _Pending:
    """What preload_fn returns (the async_fn's second argument): the result file to wait for and
    the process whose thread writes it."""

    result: str
    pid: int


def _result_path() -> str:
    return os.path.join(tempfile.gettempdir(),
                        f"safepoint-megatron-{os.getpid()}-{uuid.uuid4().hex}.json")


def _put_result(path: str, error: Optional[str] = None, warning: Optional[str] = None) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"error": error, "warning": warning}, f)
    os.replace(tmp, path)


def _get_result(path: str, timeout: float, what: str) -> dict:
    deadline = time.monotonic() + timeout
    pause = 0.002
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return {"error": f"{what}: not done after {timeout:.0f} s", "warning": None}
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    with open(path) as f:
        return cast(dict, json.load(f))


def _in_background(result: str, what: str, daemon: bool, fn: Any, *args: Any) -> _Pending:
    """Runs ``fn(*args)`` on a thread of this process; its outcome (an error, or the warning
    ``fn`` returns) goes to the file ``result``. ``daemon``: the thread only watches (a write
    is finished before the interpreter exits)."""
    def run() -> None:
        try:
            warning = fn(*args)
        except BaseException as e:  # noqa: BLE001 (reported by the finalize on every rank)
            _put_result(result, error=f"{what}: {type(e).__name__}: {e}")
        else:
            _put_result(result, warning=warning)

    threading.Thread(target=run, name=f"safepoint.megatron {what}", daemon=daemon).start()
    return _Pending(result, os.getpid())


def _await_background(timeout: float, pending: Any, result: str) -> None:
    """The async request's ``async_fn``: waits (at most ``timeout`` seconds) for the work its
    ``preload_fn`` started; never enters the core. In a forked process a failure is raised (its
    log; Megatron ignores the exit status); in the preload's own process (Megatron's persistent
    worker, ``execute_sync``) it returns, the finalize raising it on every rank."""
    if not isinstance(pending, _Pending) or pending.result != result:
        raise CheckpointingException(
            f"safepoint.megatron: the async request's async_fn got {pending!r}, not what its "
            f"preload_fn returns: call preload_fn first and pass its result as the second "
            f"argument (as Megatron's AsyncRequest callers do)")
    outcome = _get_result(result, timeout, "the background save")
    if outcome["error"] and os.getpid() != pending.pid:
        raise CheckpointingException(outcome["error"])


def _host_copy(data: Any) -> Any:
    """A tensor's copy in host memory that training cannot mutate (device tensors copied, host
    tensors cloned); other data (the ShardedObjects' bytes, made at planning) as is."""
    if isinstance(data, torch.Tensor):
        return data.detach().to("cpu") if data.device.type != "cpu" else data.detach().clone()
    return data


def _preload_and_write(staged: _Staged, writer: _StepWriter, plan: SavePlan,
                       result: str) -> _Pending:
    """A non-flash async request's ``preload_fn``: copies this rank's data to host memory, then
    writes its image on a thread of this process (the core releases the GIL)."""
    what = f"rank {writer.rank}'s image of step {writer.step} of {writer.path}"
    try:
        host = _Staged({k: _host_copy(v) for k, v in staged.data.items()})
    except Exception as e:  # reported by the finalize on every rank, as a write error
        _put_result(result, error=f"{what}: copy to host memory: {type(e).__name__}: {e}")
        return _Pending(result, os.getpid())
    return _in_background(result, what, False, _write_image, writer, host, plan)


def _preload_and_wait(root: str, step: int, attempt: int, keep: int, timeout: float,
                      result: str) -> _Pending:
    """A flash async request's ``preload_fn`` (the copy was made in ``async_save``): waits for
    the agent's commit on a thread of this process."""
    return _in_background(result, f"step {step} of {root}", True, _await_commit, root, step,
                          attempt, keep, timeout)


def _await_commit(root: str, step: int, attempt: int, keep: int, timeout: float) -> Optional[str]:
    """Returns once the agent committed ``step`` as this save (``attempt``); a warning when the
    step is not committed and ``keep`` newer ones are (the agent's retention deleted it before
    this look, or its persist failed: the checkpoint does not load either way); raises when
    another save committed the step, or after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    pause = 0.005
    while True:
        steps = _steps(root)
        if step in steps:
            got = _committed_attempt(root, step)
            if got is not None:
                _check_attempt(root, step, attempt, got)
                return None
        elif sum(s > step for s in steps) >= keep:
            return (f"{root}: step {step} is not committed and {keep} newer steps are: the "
                    f"agent's retention (keep={keep}) deleted it, or its persist failed; this "
                    f"checkpoint does not load")
        if time.monotonic() > deadline:
            present = _core.image_ranks(root, step)
            raise NotFoundError(
                f"{root}: step {step} is not committed after {timeout:.0f} s (images of ranks "
                f"{present or 'none'} present): the node agent did not persist it")
        time.sleep(pause)
        pause = min(pause * 2, 0.2)


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


class _StepWriter(Writer):
    """``safepoint.dcp.Writer`` whose step is the next free one of its directory: each rank
    reports the newest step its process has taken (``_newest_taken``) in its local plan, the
    coordinator alone lists storage and takes the next step past all of them."""

    def __init__(self, root: str, job: str) -> None:
        super().__init__(root, None, job=job)
        self.plan: Optional[SavePlan] = None
        self.staged: Optional[_Staged] = None
        self.attempt = 0

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = dist.get_rank() if dist.is_initialized() else 0

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return dataclasses.replace(plan, storage_data=_newest_taken(self.path))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # (An error here reaches every rank: DCP sends the coordinator's to all.)
        step = max([*_steps(self.path), *(int(p.storage_data) for p in plans)]) + 1
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
        # coordinator chose a step neither committed, nor taken, nor holding images.)
        self.step, self.attempt = info.step, info.attempt
        _take(self.path, info.step)
        self.plan = plan
        self.staged = _Staged({item.index: planner.resolve_data(item) for item in plan.items})


def _write_image(writer: _StepWriter, staged: _Staged, plan: SavePlan) -> None:
    """Writes this rank's image (the last rank's write commits the step)."""
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


def _rank0_decides(decide: Any) -> Any:
    """Rank 0 runs ``decide()`` and every rank gets its value (or its error, raised on every
    rank): the ranks never part ways on what one rank saw of storage."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return decide()
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", decide())
        except Exception as e:
            box[0] = ("error", type(e).__name__, str(e))
    dist.broadcast_object_list(box, src=0)
    if box[0][0] == "ok":
        return box[0][1]
    cls = getattr(safepoint.errors, box[0][1], None)
    if isinstance(cls, type) and issubclass(cls, safepoint.errors.Error):
        raise cls(box[0][2])
    raise CheckpointingException(f"{box[0][1]}: {box[0][2]}")


class SafepointSaveStrategy(AsyncSaveShardedStrategy):
    """Megatron save strategy writing safepoint steps (module doc).

    ``root``: the safepoint directory (a path or a URI safepoint stores to; default
    ``<parent of ckpt_dir>/safepoint``). ``flash``: copy into shared memory and let the node
    agent persist (module doc). ``keep``: committed steps of ``root`` to keep (sync/async:
    ``None`` keeps all; flash: the agent's retention, default 3). ``job``, ``shm_dir``,
    ``tiers``: as for ``safepoint.Checkpointer`` (flash). ``commit_timeout``: seconds an
    ``async_sharded_save`` request waits in the background for its image write (flash: for the
    agent's commit).
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
        writer = _StepWriter(root, self.job)
        save_state_dict_async_plan(
            pyt_state_dict, writer, None, 0,
            planner=MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False))
        assert writer.step is not None and writer.plan is not None
        self.last_step = writer.step
        return root, writer

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
            _OPEN_FLASH.add(self)
        return self._ckpt

    # -- Megatron's entry points -----------------------------------------------------------------
    def save(self, sharded_state_dict: ShardedStateDict,
             checkpoint_dir: Union[str, Path]) -> None:
        """Sync: returns once the step is committed. Flash: once the state is in shared memory
        (the pointer is written then: the checkpoint is durable once the agent committed)."""
        root, writer = self._plan(sharded_state_dict, checkpoint_dir)
        assert writer.plan is not None and writer.staged is not None
        step = cast(int, writer.step)
        if self.flash:
            attempt = self._snapshot(writer)
            if dist.get_rank() == 0:
                _write_pointer(checkpoint_dir, root, step, attempt)
            return
        error = None
        try:
            _write_image(writer, writer.staged, writer.plan)
        except Exception as e:  # every rank goes on to the finalize, which raises it everywhere
            error = f"rank {writer.rank}'s image of step {step}: {type(e).__name__}: {e}"
        writer.staged = None
        self._finalize(checkpoint_dir, root, step, writer.attempt, None, error)

    def async_save(self, sharded_state_dict: ShardedStateDict,
                   checkpoint_dir: Union[str, Path]) -> AsyncRequest:
        """Megatron's async save. The request's ``preload_fn`` copies this rank's data to host
        memory and writes the image on a thread of the calling process (flash: the copy is made
        here, and the thread waits for the agent's commit); its ``async_fn`` only waits for that
        thread; its finalize checks, on rank 0, that this save committed the step, and raises on
        every rank when not; then rank 0 writes the pointer."""
        root, writer = self._plan(sharded_state_dict, checkpoint_dir)
        assert writer.plan is not None and writer.staged is not None
        step, result = cast(int, writer.step), _result_path()
        if self.flash:
            attempt = self._snapshot(writer)
            preload = functools.partial(_preload_and_wait, root, step, attempt,
                                        self.keep or _AGENT_KEEP, self.commit_timeout, result)
        else:
            attempt = writer.attempt
            preload = functools.partial(_preload_and_write, writer.staged, writer, writer.plan,
                                        result)
            writer.staged = None  # the request holds the data, not the writer
        finalize = functools.partial(self._finalize, checkpoint_dir, root, step, attempt, result)
        # Picklable (Megatron's persistent caller sends it to its worker): module functions and
        # partials of plain data; the finalize, which holds the strategy, is not sent.
        return AsyncRequest(_await_background, (self.commit_timeout, None, result), [finalize],
                            preload_fn=preload)

    def _snapshot(self, writer: _StepWriter) -> int:
        """The flash copy; returns the Checkpointer's save attempt (what commits the step)."""
        assert writer.plan is not None and writer.staged is not None
        _, state, _ = writer._image(writer.plan, cast(SavePlanner, writer.staged))
        writer.staged = None
        ckpt = self._checkpointer(writer.path)
        ckpt.save(cast(int, writer.step), state, persist=True)
        return int(ckpt.attempt)

    def _finalize(self, checkpoint_dir: Union[str, Path], root: str, step: int, attempt: int,
                  result: Optional[str], error: Optional[str] = None) -> None:
        """Every rank: its background result is gathered; rank 0 checks that this save
        committed the step, prunes and writes the pointer, and its verdict (success or an error)
        is every rank's."""
        warning = None
        if result is not None:
            outcome = _get_result(result, self.commit_timeout, f"step {step} of {root}")
            error, warning = outcome["error"], outcome["warning"]
            try:
                os.unlink(result)
            except OSError:
                pass
        errors: list[Optional[str]] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)  # (also: every rank's write is done)

        def decide() -> None:
            failed = [e for e in errors if e]
            if failed:
                raise CheckpointingException(
                    f"{checkpoint_dir}: safepoint step {step} of {root} was not saved: "
                    + "; ".join(failed))
            if warning is not None:
                warnings.warn(f"safepoint.megatron: {checkpoint_dir}: {warning}",
                              RuntimeWarning, stacklevel=4)
            elif not self.flash:  # (flash: the background thread saw this save's commit)
                got = _committed_attempt(root, step)
                if got is None:
                    present = _core.image_ranks(root, step)
                    raise CheckpointingException(
                        f"{checkpoint_dir}: safepoint step {step} of {root} is not committed "
                        f"(images of ranks {present or 'none'} present)")
                _check_attempt(root, step, attempt, got)
                if self.keep is not None:
                    try:
                        prune(root, self.keep, spare=step)
                    except Exception as e:  # the save stands; the next one tries again
                        warnings.warn(f"safepoint.megatron: {root}: retention failed: "
                                      f"{type(e).__name__}: {e}", RuntimeWarning, stacklevel=4)
            _write_pointer(checkpoint_dir, root, step, attempt)

        _rank0_decides(decide)
        _settle(root, step)

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
        _OPEN_FLASH.discard(self)
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

    def _reader(self, checkpoint_dir: Union[str, Path], collective: bool = False) -> Reader:
        """``collective`` (``load``, which every rank calls): rank 0 alone reads the pointer
        and waits for the commit, and every rank gets its verdict (or raises its error)."""
        def committed() -> tuple[str, int]:
            root, step, attempt = _read_pointer(checkpoint_dir)
            _wait_committed(root, step, self.load_timeout, attempt)
            return root, step

        root, step = _rank0_decides(committed) if collective else committed()
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
        reader = self._reader(checkpoint_dir, collective=True)
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
