"""Opt-in pickling of values safepoint cannot store natively (``allow_pickle``).

By default a state may only hold tensors, numpy arrays and plain values, and anything else is
refused with an error naming its key. ``allow_pickle=True`` stores other objects as pickles and
loads them with a restricted unpickler that resolves only an allow-list of harmless standard
classes; ``allow_pickle=["mypkg.MyConfig", "mypkg.schedules."]`` adds classes (or every class
of a module, with a trailing dot) that the caller trusts.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterable
from typing import Any, Callable, Optional, Union

from safepoint.errors import CorruptionError

_SAFE = {
    "builtins": {"set", "frozenset", "complex", "slice", "range", "bytearray", "dict", "list",
                 "tuple", "int", "float", "str", "bytes", "bool", "object"},
    "collections": {"OrderedDict", "defaultdict", "deque", "Counter"},
    "datetime": {"datetime", "date", "time", "timedelta", "timezone"},
    "decimal": {"Decimal"},
    "fractions": {"Fraction"},
    "uuid": {"UUID"},
    "pathlib": {"PurePosixPath", "PosixPath", "PurePath", "Path"},
    "copyreg": {"_reconstructor", "__newobj__"},
}

AllowPickle = Union[bool, Iterable[str]]


class RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, extra: tuple[str, ...]):
        super().__init__(io.BytesIO(data))
        self._extra = extra

    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        if name in _SAFE.get(module, ()) or any(
                full == e or (e.endswith(".") and full.startswith(e)) for e in self._extra):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"refusing to load {full}: it is not in safepoint's allow-list; pass "
            f"allow_pickle=[{full!r}] if you trust this checkpoint")


def pickler(allow: AllowPickle) -> Optional[Callable[[Any], bytes]]:
    if not allow:
        return None
    return lambda obj: pickle.dumps(obj, protocol=5)


def unpickler(allow: AllowPickle) -> Optional[Callable[[bytes], Any]]:
    if not allow:
        return None
    extra = () if allow is True else tuple(allow)

    def load(data: bytes) -> Any:
        try:
            return RestrictedUnpickler(data, extra).load()
        except pickle.UnpicklingError as e:
            raise CorruptionError(str(e)) from None

    return load
