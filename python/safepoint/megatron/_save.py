"""safepoint.megatron: the save strategy (sync, async, flash) and an async request's background
part."""

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
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.mapping import ShardedStateDict
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.base import (
    AsyncSaveShardedStrategy,
)
from megatron.core.dist_checkpointing.strategies.state_dict_saver import (
    save_state_dict_async_plan,
)
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict,
)
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem

import safepoint
import safepoint.errors
from safepoint import _core
from safepoint._attempt import new_attempt
from safepoint.dcp.writer import Writer, _RankPlan, prune
from safepoint.errors import InvalidArgumentError, NotFoundError
from safepoint.megatron._storage import (
    _AGENT_KEEP,
    _OPEN_FLASH,
    BACKEND,
    VERSION,
    _after_older_writes,
    _check_attempt,
    _committed_attempt,
    _newest_taken,
    _queue_write,
    _rank0_decides,
    _root_of,
    _settle,
    _steps,
    _take,
    _take_flash,
    _ticket,
    _write_pointer,
)

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
        _, mine = _ticket(writer.save_id)
        if mine is not None:
            mine.set()  # (the next write does not wait for this one)
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
        self.timeout = 600.0  # seconds a write waits for the older ones (commit_timeout)

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
    """Writes this rank's image (the last rank's write commits the step), after the older
    writes of this process to its directory (``_after_older_writes``)."""
    previous, mine = _ticket(writer.save_id)
    try:
        _after_older_writes(writer.path, cast(int, writer.step), previous, writer.timeout)
        writer.write_data(plan, cast(SavePlanner, staged))
    finally:
        if mine is not None:
            mine.set()


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
        writer.timeout = self.commit_timeout
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
        _queue_write(root, writer.save_id)
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
            _queue_write(root, writer.save_id)
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
        _take_flash(writer.path, cast(int, writer.step))
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
