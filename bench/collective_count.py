"""Counting torch.distributed's collectives from inside a rank: one wrapper for the benchmarks
(bench/scale_torch.py) and the test workers (tests/python/workloads/collectives_worker.py,
restore_requests_worker.py), so that every count is taken the same way."""

from __future__ import annotations

import functools
import inspect
import pickle
import time
from typing import Any

# Every collective and point-to-point call of torch.distributed that a checkpoint library might
# make; those a torch version lacks are skipped.
NAMES = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast",
         "broadcast_object_list", "barrier", "monitored_barrier", "reduce", "reduce_scatter",
         "reduce_scatter_tensor", "gather", "gather_object", "scatter", "scatter_object_list",
         "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv", "batch_isend_irecv")


def _nbytes(x: Any) -> int:
    import torch

    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return 0


def _pickled(objs: Any) -> int:
    return sum(len(pickle.dumps(o)) for o in objs)


def _bytes(name: str, given: dict) -> tuple[int, int]:
    """What this rank sent and received: tensors their bytes, objects their pickles (`given`:
    the call's arguments by name, read after the call, when the output lists are filled)."""
    if name == "all_gather_object":
        return _pickled([given["obj"]]), _pickled(given["object_list"])
    if name == "broadcast_object_list":
        n = _pickled(given["object_list"])
        return n, n
    if name == "gather_object":  # the destination receives every rank's object
        return _pickled([given["obj"]]), _pickled(given.get("object_gather_list") or [])
    if name == "scatter_object_list":
        return (_pickled(given.get("scatter_object_input_list") or []),
                _pickled(given["scatter_object_output_list"]))
    if name == "all_gather" and "row" in given:  # safepoint's: returns W rows
        import torch.distributed as dist

        return _nbytes(given["row"]), _nbytes(given["row"]) * dist.get_world_size(given["group"])
    if name == "all_gather":
        return _nbytes(given["tensor"]), _nbytes(given["tensor_list"])
    n = _nbytes(list(given.values()))
    return n, n


class CollectiveCounter:
    """Wraps every function of NAMES in torch.distributed (and its c10d module), and safepoint's
    own collectives (``_collectives``, recorded under torch's names). While `on`, each
    outermost call is recorded in `calls` as [name, sent bytes, received bytes, seconds]; a call
    inside another (all_gather_object's own all_gathers) is part of the outer one."""

    def __init__(self, on: bool = True) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        self.calls: list[list] = []
        self.on = on
        self._depth = 0
        for name in NAMES:
            real = getattr(c10d, name, None)
            if real is None:
                continue
            wrapped = self._wrap(name, real)
            for mod in (dist, c10d):
                if getattr(mod, name, None) is not None:
                    setattr(mod, name, wrapped)
        # safepoint's own all-reduce of the save and all-gather of the restore agreement
        # (recursive doubling over point-to-point messages: the messages inside are part of
        # them), counted as what they are.
        try:
            from safepoint import _collectives
        except ImportError:  # a run without safepoint (DCP alone)
            return
        _collectives.all_reduce_max = self._wrap("all_reduce", _collectives.all_reduce_max)
        _collectives.all_gather = self._wrap("all_gather", _collectives.all_gather)
        _collectives.all_gather_object = self._wrap("all_gather_object",
                                                    _collectives.all_gather_object)

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]

    def _wrap(self, name: str, fn: Any) -> Any:
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self._depth or not self.on:
                return fn(*args, **kwargs)
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                seconds = time.perf_counter() - t0
                given = dict(sig.bind_partial(*args, **kwargs).arguments)
                self.calls.append([name, *_bytes(name, given), seconds])
        return wrapper

    def measure(self, fn: Any) -> dict:
        """Runs fn between barriers (not counted): its seconds, its collectives' names, the bytes
        each received (an all-reduce its result, an all-gather every rank's part) and the
        seconds each took, and their total."""
        import torch.distributed as dist

        self.on = False
        dist.barrier()
        self.calls.clear()
        self.on = True
        t0 = time.perf_counter()
        try:
            fn()
        finally:
            seconds = time.perf_counter() - t0
            self.on = False
        return {"seconds": seconds, "calls": self.names(),
                "received": [c[2] for c in self.calls],
                "call_seconds": [c[3] for c in self.calls],
                "collective_seconds": sum(c[3] for c in self.calls)}
