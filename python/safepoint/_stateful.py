"""Stateful objects, in-place restore and random-number-generator state.

A state handed to ``save`` may hold, as values of its top-level mapping, objects with
``state_dict()`` / ``load_state_dict()`` (``nn.Module``, optimizers, LR schedulers, ``GradScaler``,
samplers, user objects: DCP's Stateful protocol); they are saved as their state dicts.
``restore`` loads a checkpoint *into* such a state, like ``torch.distributed.checkpoint.load``:
tensors are copied into the existing tensors, Stateful objects get ``load_state_dict``, other
values are replaced.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, MutableMapping, MutableSequence
from typing import Any

import numpy as np
import torch

from safepoint._keys import missing_key
from safepoint._shards import copy_tensor
from safepoint.errors import InvalidArgumentError

RNG_KEY = "__safepoint_rng__"


def is_stateful(obj: Any) -> bool:
    return (callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None)))


def to_saveable(state: Any, include_rng: bool = False) -> Any:
    """Replaces the Stateful values of a top-level mapping by their state dicts."""
    if is_stateful(state):
        out: Any = state.state_dict()
    elif isinstance(state, Mapping):
        out = {k: (v.state_dict() if is_stateful(v) else v) for k, v in state.items()}
    else:
        out = state
    if include_rng:
        if not isinstance(out, Mapping):
            raise InvalidArgumentError("include_rng=True needs a state that is a mapping")
        out = dict(out)
        out[RNG_KEY] = capture_rng()
    return out


def capture_rng() -> dict:
    """The states of this process's generators: torch (CPU and every CUDA device), numpy's
    global generator and Python's ``random``, in a form safepoint saves without pickle."""
    np_state: Any = np.random.get_state()  # the legacy tuple
    py_state = random.getstate()
    rng: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": np_state[0], "key": np_state[1].astype(np.int64), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "random": {"version": py_state[0], "state": list(py_state[1]), "gauss_next": py_state[2]},
    }
    if torch.cuda.is_available():
        rng["cuda"] = [s for s in torch.cuda.get_rng_state_all()]
    return rng


def restore_rng(rng: Mapping) -> None:
    """Restores what ``capture_rng`` returned (a saved and loaded copy of it)."""
    torch.set_rng_state(_cpu_uint8(rng["torch"]))
    n = rng["numpy"]
    np.random.set_state((n["kind"], np.asarray(n["key"], dtype=np.uint32), n["pos"],
                         n["has_gauss"], n["cached_gaussian"]))
    r = rng["random"]
    random.setstate((r["version"], tuple(r["state"]), r["gauss_next"]))
    if "cuda" in rng and torch.cuda.is_available():
        states = [_cpu_uint8(s) for s in rng["cuda"]]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)


def _cpu_uint8(t: Any) -> torch.Tensor:
    t = torch.as_tensor(t)
    return t.to(device="cpu", dtype=torch.uint8).contiguous().clone()


def filled_in_place(current: Any, loaded: Any) -> bool:
    """Whether a restore from memory already copied `loaded` into `current` (the load filled
    the target itself): `loaded` is `current`, or `current` is a DTensor and `loaded` its own
    local shard, or the two (their local shards for DTensors) are views of the same bytes:
    a Stateful's state_dict() gives new tensor objects on every call, over the same memory."""
    if loaded is current:
        return True
    cur = getattr(current, "_local_tensor", current)
    got = getattr(loaded, "_local_tensor", loaded)
    if cur is got:
        return True
    return (isinstance(cur, torch.Tensor) and isinstance(got, torch.Tensor)
            and cur.layout == got.layout == torch.strided
            and not (cur.is_conj() or got.is_conj() or cur.is_neg() or got.is_neg())
            and cur.device == got.device and cur.dtype == got.dtype
            and cur.shape == got.shape and cur.stride() == got.stride()
            and cur.storage_offset() == got.storage_offset() and cur.numel() > 0
            and cur.untyped_storage().data_ptr() == got.untyped_storage().data_ptr() != 0)


def restore_into(state: Any, loaded: Any, path: str = "", borrowed: bool = False) -> Any:
    """Loads ``loaded`` into ``state`` in place; returns the restored state (the same object
    where it could be updated in place). ``borrowed``: ``loaded`` lives in memory that will be
    reused (a snapshot slot read in place), so values taken from it as they are get copied."""
    where = path or "<root>"
    if loaded is state and not is_stateful(state):
        # The load filled the state where it is and found the checkpoint's other values equal
        # to the state's (Client.last_restore_whole): nothing to copy or assign.
        return state
    if is_stateful(state):
        # Through the object's current state dict, so its tensors (DTensor shards of FSDP2/TP
        # parameters included) are written in place, then load_state_dict with the result.
        state.load_state_dict(_overlay(state.state_dict(), loaded, where, borrowed))
        return state
    if isinstance(state, torch.Tensor):
        if not isinstance(loaded, torch.Tensor):
            raise InvalidArgumentError(f"{where}: the checkpoint holds a {type(loaded).__name__} "
                                       "where the state has a tensor")
        if not filled_in_place(state, loaded):
            copy_tensor(state, loaded, where)
        return state
    if isinstance(state, MutableMapping) and isinstance(loaded, Mapping):
        for k in list(state.keys()):
            if k == RNG_KEY:
                continue
            if k not in loaded:
                raise missing_key(where, k, loaded.keys())
            current = state[k]
            got = loaded[k]
            if isinstance(current, torch.Tensor) and filled_in_place(current, got):
                continue  # filled in place by the load (a restore from memory): nothing to do
            if got is current and not is_stateful(current):
                continue  # the state's own value (a whole restore in place): nothing to do
            state[k] = restore_into(state[k], loaded[k], f"{path}.{k}" if path else str(k),
                                    borrowed)
        return state
    if isinstance(state, MutableSequence) and isinstance(loaded, (list, tuple)):
        if len(state) != len(loaded):
            raise InvalidArgumentError(f"{where}: {len(loaded)} items in the checkpoint, "
                                       f"{len(state)} in the state")
        for i in range(len(state)):
            state[i] = restore_into(state[i], loaded[i], f"{path}.{i}" if path else str(i),
                                    borrowed)
        return state
    return _owned(loaded) if borrowed else loaded


def _owned(value: Any) -> Any:
    """`value` with every tensor and array copied out of the memory it views."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, Mapping):
        return {k: _owned(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_owned(v) for v in value)
    return value


def _overlay(current: Any, loaded: Any, where: str, borrowed: bool = False) -> Any:
    """`loaded`, with each of its tensors copied into the tensor `current` has at the same place
    (in place; a DTensor gets its local shard) and that tensor used instead. Values only
    `loaded` has (optimizer state before the first step, say) are taken as loaded."""
    if isinstance(loaded, torch.Tensor):
        if isinstance(current, torch.Tensor):
            if not filled_in_place(current, loaded):
                copy_tensor(current, loaded, where)
            return current
        return loaded.clone() if borrowed else loaded
    if isinstance(loaded, np.ndarray) and borrowed:
        return loaded.copy()
    if isinstance(loaded, Mapping):
        cur = current if isinstance(current, Mapping) else {}
        return {k: _overlay(cur.get(k), v, f"{where}.{k}", borrowed) for k, v in loaded.items()}
    if isinstance(loaded, (list, tuple)):
        same = isinstance(current, (list, tuple)) and len(current) == len(loaded)
        return type(loaded)(_overlay(current[i] if same else None, v, f"{where}.{i}", borrowed)
                            for i, v in enumerate(loaded))
    return loaded


def apply_loaded(state: Any, loaded: Any, borrowed: bool = False) -> None:
    """restore_into(state, loaded), then the generator states the checkpoint carries
    (``include_rng``)."""
    restore_into(state, loaded, borrowed=borrowed)
    if isinstance(loaded, Mapping) and RNG_KEY in loaded:
        restore_rng(loaded[RNG_KEY])
