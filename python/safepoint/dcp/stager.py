"""``safepoint.dcp.ShmStager``: an ``AsyncStager`` for ``dcp.async_save`` that copies the state dict
into shared-memory staging files allocated once and reused, so training blocks only for that copy.
The files are the core's (``_core.StageFile``): in this user's staging directory under the shm
directory, named after this process, so ``safepoint gc`` removes those a killed process left."""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import threading
import time
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch.distributed.checkpoint.staging import AsyncStager

from safepoint import _core
from safepoint.dcp.writer import Writer
from safepoint.errors import InvalidArgumentError

if TYPE_CHECKING:  # stage() imports it when it runs
    from torch.distributed.tensor import DTensor

_REUSE_WAIT_S = 0.05  # how long stage() waits for a just-finished save to let go of a buffer


class _ShmBuffer:
    """One staging file mapped into this process, carved into tensors."""

    def __init__(self, shm_dir: str, nbytes: int) -> None:
        self.file = _core.StageFile(shm_dir, nbytes)  # reserved and pre-faulted, mode 0600
        self.path = self.file.path
        self.base = torch.from_numpy(self.file.buffer())  # keeps the mapping alive
        self.nbytes = nbytes

    def unlink(self) -> None:
        self.file.remove()


@dataclasses.dataclass
class _Slot:
    """A staging buffer, the tensor layout it was carved for, and what was handed out of it."""

    buf: _ShmBuffer
    layout: list                 # [(dtype, shape)] of the tensors, in staging order
    views: list[torch.Tensor]    # one per layout entry, over buf
    handed: list[weakref.ref] = dataclasses.field(default_factory=list)  # the last stage's

    def busy(self) -> bool:
        """Whether a staged state dict handed out from this buffer may still be in use."""
        return any(r() is not None for r in self.handed)


class ShmStager(AsyncStager):
    """An ``AsyncStager`` for ``dcp.async_save`` that copies the state dict into shared memory.

    The first ``stage()`` allocates one shared-memory file that holds every tensor of the state
    dict (plain tensors and DTensors' local shards): under ``shm_dir`` (default ``/dev/shm`` or
    ``$SAFEPOINT_SHM_DIR``) in ``safepoint-stage-<uid>/``, mode 0600, its space reserved and
    every page written up front. Later stages with the same tensor shapes and dtypes copy into
    the same buffer, so ``async_save`` blocks the training loop only for that copy. A buffer is
    never overwritten while the state dict staged into it last time is still referenced (its
    save may be running): after waiting up to 50 ms for it to be let go, a second buffer is
    used. Non-tensor values are deep-copied. ``close()`` (or leaving a ``with`` block) removes
    the files; those of a process killed before it could are removed by ``safepoint gc``. Use it
    with the thread executor (``AsyncCheckpointerType.THREAD``, the default).

    Two ways to hand it to DCP: ``dcp.async_save(state, storage_writer=stager.writer(path, step))``
    works with every torch; ``dcp.async_save(state, storage_writer=Writer(path, step),
    async_stager=stager)`` needs a torch whose ``async_save`` has ``async_stager`` (2.8 and older
    have none).
    """

    _synchronize_after_execute = False  # stage() copies synchronously

    def __init__(self, shm_dir: Optional[str] = None) -> None:
        self.shm_dir = shm_dir or os.environ.get("SAFEPOINT_SHM_DIR", "/dev/shm")
        self._lock = threading.Lock()
        self._slots: list[_Slot] = []
        self._closed = False
        self.allocations = 0  # shared-memory files created so far (for tests and logs)
        weakref.finalize(self, ShmStager._unlink_all, self._slots)

    def __enter__(self) -> ShmStager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def files(self) -> list[str]:
        """The shared-memory files in use."""
        return [s.buf.path for s in self._slots]

    def stage(self, state_dict: dict) -> dict:
        from torch.distributed.tensor import DTensor

        with self._lock:
            if self._closed:
                raise InvalidArgumentError("safepoint.dcp.ShmStager: stage() after close()")
            sources: list[torch.Tensor] = []
            _collect(state_dict, sources, set(), "", DTensor)
            slot = self._slot([(t.dtype, tuple(t.shape)) for t in sources])
            handed: list = []
            with torch.no_grad():
                for src, dst in zip(sources, slot.views):
                    dst.copy_(src.detach())
                staged = _rebuild(state_dict, {id(s): v for s, v in zip(sources, slot.views)},
                                  {}, handed, DTensor)
            slot.handed = [weakref.ref(x) for x in handed]
            return staged

    def _slot(self, layout: list) -> _Slot:
        same = [s for s in self._slots if s.layout == layout]
        # A save that has just completed may still hold its state dict for a moment (DCP's
        # executor thread drops its arguments after it sets the future's result): wait briefly
        # for that before paying for a second buffer.
        deadline = time.monotonic() + _REUSE_WAIT_S
        while same:
            for s in same:
                if not s.busy():
                    return s
            if time.monotonic() >= deadline:
                break
            time.sleep(0.001)
        for s in list(self._slots):  # free buffers of another layout go
            if s.layout != layout and not s.busy():
                s.buf.unlink()
                self._slots.remove(s)
        offsets, total = [], 0
        for dtype, shape in layout:
            total = (total + 63) // 64 * 64
            offsets.append(total)
            total += math.prod(shape) * dtype.itemsize
        buf = _ShmBuffer(self.shm_dir, total)
        self.allocations += 1
        views = []
        for (dtype, shape), off in zip(layout, offsets):
            n = math.prod(shape) * dtype.itemsize
            views.append(buf.base[off:off + n].view(dtype).view(shape) if n
                         else torch.empty(shape, dtype=dtype))
        slot = _Slot(buf, layout, views)
        self._slots.append(slot)
        return slot

    def writer(self, path: str | os.PathLike[str], step: Optional[int] = None, *,
               job: str = "", keep: Optional[int] = None) -> Writer:
        """A ``safepoint.dcp.Writer`` of ``step`` that stages through this stager.

        DCP's ``async_save`` stages with a storage writer that is itself an ``AsyncStager`` (in
        every torch version, whether or not its ``async_save`` takes ``async_stager``): pass this
        as ``storage_writer``. ``keep``: as for ``Writer``."""
        return _StagingWriter(self, path, step, job=job, keep=keep)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            ShmStager._unlink_all(self._slots)

    @staticmethod
    def _unlink_all(slots: list[_Slot]) -> None:
        for s in slots:
            s.buf.unlink()
        slots.clear()

    def synchronize_staging(self) -> None:  # stage() is synchronous
        return None


class _StagingWriter(Writer, AsyncStager):
    """A ``Writer`` that is also an ``AsyncStager``, staging through its ``ShmStager``."""

    _synchronize_after_execute = False  # stage() copies synchronously

    def __init__(self, stager: ShmStager, path: str | os.PathLike[str], step: Optional[int],
                 *, job: str, keep: Optional[int] = None) -> None:
        super().__init__(path, step, job=job, keep=keep)
        self.stager = stager

    def stage(self, state_dict: dict) -> dict:
        return self.stager.stage(state_dict)

    def synchronize_staging(self) -> None:
        return None

    def close(self) -> None:  # the stager outlives the save: its owner closes it
        return None


def _collect(obj: Any, out: list, seen: set, key: str, dtensor: type[DTensor]) -> None:
    """The tensors to stage, in a fixed order, each once (tied tensors share one buffer)."""
    if isinstance(obj, dtensor):
        obj = obj._local_tensor  # to_local() may return a new view each call
    if isinstance(obj, torch.Tensor):
        if type(obj) not in (torch.Tensor, torch.nn.Parameter):
            raise InvalidArgumentError(f"{key or '<root>'}: cannot stage a {type(obj).__name__}")
        if obj.layout != torch.strided:
            raise InvalidArgumentError(f"{key or '<root>'}: cannot stage a {obj.layout} tensor")
        if id(obj) not in seen:
            seen.add(id(obj))
            out.append(obj)
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            _collect(v, out, seen, f"{key}.{k}" if key else str(k), dtensor)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _collect(v, out, seen, f"{key}.{i}" if key else str(i), dtensor)


def _rebuild(obj: Any, staged: dict, memo: dict, handed: list, dtensor: type[DTensor]) -> Any:
    """``obj`` with every tensor replaced by a new tensor object over its staged buffer."""
    if id(obj) in memo:
        return memo[id(obj)]
    if isinstance(obj, dtensor):
        local = staged[id(obj._local_tensor)]
        out = dtensor.from_local(local.view(local.shape), obj.device_mesh, obj.placements,
                                 run_check=False, shape=obj.shape, stride=obj.stride())
    elif isinstance(obj, torch.Tensor):
        dst = staged[id(obj)]
        out = dst.view(dst.shape)  # a new object: its liveness tells whether the save still runs
    elif isinstance(obj, Mapping):
        return {k: _rebuild(v, staged, memo, handed, dtensor) for k, v in obj.items()}
    elif isinstance(obj, list):
        return [_rebuild(v, staged, memo, handed, dtensor) for v in obj]
    elif isinstance(obj, tuple):
        return tuple(_rebuild(v, staged, memo, handed, dtensor) for v in obj)
    elif obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return obj
    else:
        return copy.deepcopy(obj)
    memo[id(obj)] = out
    handed.append(out)
    return out
