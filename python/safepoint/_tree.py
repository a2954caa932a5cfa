"""Flattening of a state tree into tensors + a skeleton, and the reverse.

The skeleton is the state with every tensor replaced by a ``TensorRef`` (its index in the image's
tensor table); the C++ core encodes the skeleton as the image's extras, so the structure comes
back exactly: dict key types and order, lists vs tuples, None, bytes, big ints, nan/inf.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from safepoint import _core
from safepoint.errors import InvalidArgumentError

TensorRef = _core.TensorRef

KIND_TORCH, KIND_NUMPY, KIND_NUMPY_SCALAR = 0, 1, 2

_TORCH_DTYPES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float64: "float64",
    torch.int8: "int8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.uint8: "uint8",
    torch.bool: "bool",
}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        _TORCH_DTYPES[getattr(torch, _name)] = _name
_TORCH_BY_NAME = {v: k for k, v in _TORCH_DTYPES.items()}
_NUMPY_DTYPES = {
    "float32", "float16", "float64", "int8", "int16", "int32", "int64", "uint8", "bool",
}
_PRIMITIVES = (type(None), bool, int, float, str, bytes)


class Flattened:
    """What ``flatten`` produces: the skeleton and the tensors to write, kept alive."""

    __slots__ = ("skeleton", "tensors", "keepalive")

    def __init__(self) -> None:
        self.skeleton: Any = None
        # (name, dtype, shape, data_ptr, nbytes, global_shape, global_offset)
        self.tensors: list[tuple] = []
        self.keepalive: list[Any] = []


def _key_str(key: Any) -> str:
    return str(key)


def _where(path: list[str]) -> str:
    return ".".join(path) if path else "<root>"


def flatten(state: Any) -> Flattened:
    out = Flattened()
    names: set[str] = set()
    seen: dict[int, TensorRef] = {}  # id(tensor) -> ref: a tensor held twice is stored once

    def unique_name(path: list[str]) -> str:
        base = _where(path)
        name, k = base, 1
        while name in names:
            name = f"{base}#{k}"
            k += 1
        names.add(name)
        return name

    def add(name_path, dtype, shape, ptr, nbytes, keep) -> int:
        out.tensors.append((unique_name(name_path), dtype, tuple(shape), ptr, nbytes, None, None))
        out.keepalive.append(keep)
        return len(out.tensors) - 1

    def walk(obj: Any, path: list[str]) -> Any:
        t = type(obj)
        if t in _PRIMITIVES:
            return obj
        if isinstance(obj, torch.Tensor):
            ref = seen.get(id(obj))
            if ref is not None:
                return ref
            if obj.layout != torch.strided or obj.is_quantized:
                raise InvalidArgumentError(
                    f"{_where(path)}: cannot save a {obj.layout} tensor; use a dense tensor")
            dtype = _TORCH_DTYPES.get(obj.dtype)
            if dtype is None:
                raise InvalidArgumentError(
                    f"{_where(path)}: tensor dtype {obj.dtype} is not supported "
                    f"(supported: {', '.join(sorted(_TORCH_DTYPES.values()))})")
            src = obj.detach()
            if src.device.type != "cpu":
                src = src.cpu()
            if not src.is_contiguous():
                src = src.contiguous()
            idx = add(path, dtype, src.shape, src.data_ptr(), src.numel() * src.element_size(), src)
            ref = TensorRef(idx, KIND_TORCH)
            seen[id(obj)] = ref
            out.keepalive.append(obj)
            return ref
        if isinstance(obj, np.ndarray) or isinstance(obj, np.generic):
            kind = KIND_NUMPY if isinstance(obj, np.ndarray) else KIND_NUMPY_SCALAR
            arr = np.asarray(obj)
            if not arr.flags.c_contiguous:
                arr = np.ascontiguousarray(arr)
            if arr.dtype.name not in _NUMPY_DTYPES or not arr.dtype.isnative:
                raise InvalidArgumentError(
                    f"{_where(path)}: numpy dtype {arr.dtype} is not supported "
                    f"(supported: {', '.join(sorted(_NUMPY_DTYPES))})")
            idx = add(path, arr.dtype.name, arr.shape, arr.ctypes.data, arr.nbytes, arr)
            return TensorRef(idx, kind)
        if isinstance(obj, Mapping):
            d = {}
            for k, v in obj.items():
                if type(k) is not str and type(k) is not int:
                    raise InvalidArgumentError(
                        f"{_where(path)}: dict key {k!r} of type {type(k).__name__} is not "
                        "supported (keys must be str or int)")
                d[k] = walk(v, path + [_key_str(k)])
            return d
        if isinstance(obj, (list, tuple)):
            items = [walk(v, path + [str(i)]) for i, v in enumerate(obj)]
            return items if isinstance(obj, list) else tuple(items)
        raise InvalidArgumentError(
            f"{_where(path)}: cannot save a value of type {t.__module__}.{t.__qualname__}; "
            "supported: tensors, numpy arrays, None, bool, int, float, str, bytes, and "
            "dicts, lists and tuples of these")

    out.skeleton = walk(state, [])
    return out


def unflatten(skeleton: Any, buffer: np.ndarray, entries: list[tuple]) -> Any:
    """Rebuilds the state: tensors are views into ``buffer`` (the loaded image)."""
    base = torch.from_numpy(buffer)
    made: dict[tuple[int, int], Any] = {}

    def tensor(ref: TensorRef) -> Any:
        key = (ref.index, ref.kind)
        got = made.get(key)
        if got is not None:
            return got
        name, dtype, shape, offset, nbytes, _gshape, _goffset = entries[ref.index]
        if ref.kind == KIND_TORCH:
            flat = base[offset:offset + nbytes]
            t = flat.view(_TORCH_BY_NAME[dtype]).view(shape)
            got = t
        else:
            arr = buffer[offset:offset + nbytes].view(np.dtype(dtype)).reshape(shape)
            got = arr if ref.kind == KIND_NUMPY else arr[()]
        made[key] = got
        return got

    def walk(obj: Any) -> Any:
        t = type(obj)
        if t is TensorRef:
            return tensor(obj)
        if t is dict:
            return {k: walk(v) for k, v in obj.items()}
        if t is list:
            return [walk(v) for v in obj]
        if t is tuple:
            return tuple(walk(v) for v in obj)
        return obj

    return walk(skeleton)


__all__ = ["flatten", "unflatten", "TensorRef"]
