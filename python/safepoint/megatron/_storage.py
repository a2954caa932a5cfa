"""safepoint.megatron: where a checkpoint's step is (the pointer, the commit checks), the steps
this process has taken, and rank 0's verdicts."""

from __future__ import annotations

import json
import os
import threading
import time
import warnings
import weakref
from pathlib import Path
from typing import Any, Optional, Union

import torch.distributed as dist
from megatron.core.dist_checkpointing.core import CheckpointingException

import safepoint
import safepoint.errors
from safepoint import _core
from safepoint.errors import NotFoundError

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


# -- the order of this process's writes ---------------------------------------------------------
# After a commit, safepoint's core cleans up the uncommitted images of older steps (leftovers of
# failed saves, it assumes: their writers are gone). So no write may commit a step while an older
# step of the same directory is still being written by this process, or persisted by the node
# agent from a flash snapshot: a non-flash write waits for the write this process planned before
# it on that directory, and for the older flash steps to be committed (each wait at most the
# strategy's ``commit_timeout``; then it goes on, with a warning). Megatron's persistent worker
# runs its requests one after another, so it needs none of this.

_ORDER: dict[str, threading.Event] = {}  # per directory: the last planned write's "done"
_TICKETS: dict[str, tuple[Optional[threading.Event], threading.Event]] = {}  # by save id
_FLASH_STEPS: dict[str, set[int]] = {}  # per directory: flash steps not yet seen settled


def _queue_write(root: str, save_id: str) -> None:
    """A non-flash write planned (in planning order): it comes after the previous one."""
    here = _location(root)
    with _LOCK:
        mine = threading.Event()
        _TICKETS[save_id] = (_ORDER.get(here), mine)
        _ORDER[here] = mine


def _take_flash(root: str, step: int) -> None:
    with _LOCK:
        _FLASH_STEPS.setdefault(_location(root), set()).add(step)


def _ticket(save_id: str) -> tuple[Optional[threading.Event], Optional[threading.Event]]:
    with _LOCK:
        return _TICKETS.pop(save_id, (None, None))


def _after_older_writes(root: str, step: int, previous: Optional[threading.Event],
                        timeout: float) -> None:
    """Waits for the previous write of this process to ``root`` and for its flash steps older
    than ``step`` to be committed (or past: a newer step is committed)."""
    if previous is not None and not previous.wait(timeout):
        warnings.warn(f"safepoint.megatron: {root}: the previous save's write did not finish "
                      f"within {timeout:.0f} s (a request never scheduled?); step {step} is "
                      f"written now", RuntimeWarning, stacklevel=3)
    here, deadline, pause = _location(root), time.monotonic() + timeout, 0.005
    while True:
        with _LOCK:
            older = {s for s in _FLASH_STEPS.get(here, ()) if s < step}
        if not older:
            return
        committed = _steps(root)
        newest = max(committed, default=0)
        settled = {s for s in older if s in committed or s < newest}
        with _LOCK:
            _FLASH_STEPS[here] -= settled
        if settled == older:
            return
        if time.monotonic() > deadline:
            warnings.warn(f"safepoint.megatron: {root}: flash steps {sorted(older - settled)} are "
                          f"not committed after {timeout:.0f} s; step {step} is written now (its "
                          f"commit cleans up their images if the agent is still writing them)",
                          RuntimeWarning, stacklevel=3)
            return
        time.sleep(pause)
        pause = min(pause * 2, 0.1)


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
