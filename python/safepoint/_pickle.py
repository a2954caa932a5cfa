"""Opt-in pickling of values safepoint cannot store natively (``allow_pickle``).

By default a state may only hold tensors, numpy arrays and plain values, and anything else is
refused with an error naming its key. ``allow_pickle=True`` stores other objects as pickles and
loads them with a restricted unpickler that resolves only an allow-list of harmless standard
classes; ``allow_pickle=["mypkg.MyConfig", "mypkg.schedules."]`` adds names the caller trusts:
an exact ``module.name`` (any object of that name, e.g. ``torch.float16``), or with a trailing
dot every *class defined in* that module or its submodules.

A checkpoint is untrusted input, so the unpickler also holds where an allowed name could still
be turned against the loading process (docs/reliability.md, "Hostile input"):
- a name is never followed through attributes: ``find_class("mypkg.schedules",
  "__builtins__.get")`` is refused, a prefix matches the module only, and a prefix admits only
  classes whose ``__module__`` is that module (not functions or objects imported into it);
- a call (REDUCE, NEWOBJ, INST, OBJ) may only call a name the unpickler resolved, and its
  arguments are bounded: no integer size for ``bytes``/``bytearray`` beyond ``MAX_BYTES``, no
  sized argument (a ``range``, say) of more than ``MAX_ITEMS`` items, no ``Decimal`` or string
  turned into an ``int`` or a ``Fraction`` (``int(Decimal("1e999999999"))`` allocates without
  bound);
- BUILD sets state on instances only, never on a class or another resolved global (that would
  change ``pathlib.PurePath`` or ``Counter.__missing__`` for the rest of the process);
- any failure while unpickling, of whatever type, is a ``CorruptionError``.
"""

from __future__ import annotations

import decimal
import fractions
import io
import pickle
import types
from collections.abc import Iterable
from typing import Any, Callable, Optional, Union

from safepoint.errors import CorruptionError, InvalidArgumentError

_SAFE = {
    "builtins": {"set", "frozenset", "complex", "slice", "range", "bytearray", "dict", "list",
                 "tuple", "int", "float", "str", "bytes", "bool", "object"},
    "collections": {"OrderedDict", "defaultdict", "deque", "Counter"},
    "datetime": {"datetime", "date", "time", "timedelta", "timezone"},
    "decimal": {"Decimal"},
    "fractions": {"Fraction"},
    "uuid": {"UUID"},
    "pathlib": {"PurePosixPath", "PosixPath", "PurePath", "Path"},
}

MAX_BYTES = 64 << 20  # the largest integer size a stored value may hand bytes() or bytearray()
MAX_ITEMS = 1 << 24   # the most items a sized argument of a stored call may have

AllowPickle = Union[bool, Iterable[str]]

_NOT_INSTANCES = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
                  types.MethodType)


def _parse_allow(extra: Iterable[str]) -> tuple[frozenset[tuple[str, str]], tuple[str, ...]]:
    """Splits allow entries into exact (module, name) pairs and module prefixes."""
    exact, prefixes = set(), []
    for e in extra:
        if not isinstance(e, str) or e.startswith(".") or e in ("", ".") or \
                (not e.endswith(".") and "." not in e):
            raise InvalidArgumentError(
                f"allow_pickle entry {e!r}: expected 'module.Name' or a module prefix ending in "
                f"'.' ('mypkg.schedules.')")
        if e.endswith("."):
            prefixes.append(e[:-1])
        else:
            module, _, name = e.rpartition(".")
            exact.add((module, name))
    return frozenset(exact), tuple(prefixes)


def _refuse(what: str) -> pickle.UnpicklingError:
    return pickle.UnpicklingError(f"refusing to load a stored value: {what}")


def _check_call(func: Any, args: tuple, kwargs: dict) -> None:
    """Refuses arguments that make a small pickle allocate or compute without bound."""
    values = list(args) + list(kwargs.values())
    is_type = isinstance(func, type)
    name = getattr(func, "__qualname__", type(func).__name__)
    for a in values:
        if isinstance(a, int) and not isinstance(a, bool):
            if is_type and issubclass(func, (bytes, bytearray)) and abs(a) > MAX_BYTES:
                raise _refuse(f"{name}({a}) asks for more than {MAX_BYTES} bytes")
        if is_type and issubclass(func, int) and isinstance(a, (decimal.Decimal,
                                                                fractions.Fraction)):
            raise _refuse(f"{name}() of a {type(a).__name__} (its size is unbounded)")
        if is_type and issubclass(func, fractions.Fraction) and isinstance(a, (str,
                                                                              decimal.Decimal)):
            raise _refuse(f"{name}() of a {type(a).__name__} (its size is unbounded)")
        if hasattr(type(a), "__len__") and not isinstance(a, (str, bytes, bytearray)):
            try:
                n = len(a)
            except (OverflowError, TypeError, ValueError):
                n = MAX_ITEMS + 1
            if n > MAX_ITEMS:
                raise _refuse(f"{name}() of an argument with more than {MAX_ITEMS} items")


# The pure-Python unpickler (typeshed knows it only as the C one's alias, without its dispatch
# table, stack and helpers).
_PyUnpickler: Any = pickle._Unpickler


class RestrictedUnpickler(_PyUnpickler):
    """The pure-Python unpickler, so that every call and BUILD passes through the checks above
    (the C unpickler's opcodes cannot be intercepted)."""

    dispatch: dict[int, Any] = dict(_PyUnpickler.dispatch)

    def __init__(self, data: bytes, exact: frozenset[tuple[str, str]],
                 prefixes: tuple[str, ...]):
        super().__init__(io.BytesIO(data), fix_imports=False)
        self._exact, self._prefixes = exact, prefixes
        self._resolved: dict[int, Any] = {}  # id -> every object find_class handed out

    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        if "." in name or not name or not module:
            raise _refuse(f"{full}: a name with a dot is never resolved (it would follow "
                          f"attributes)")
        in_safe = name in _SAFE.get(module, ())
        exact = (module, name) in self._exact
        prefixed = any(module == p or module.startswith(p + ".") for p in self._prefixes)
        if not (in_safe or exact or prefixed):
            raise _refuse(f"{full} is not in safepoint's allow-list; pass "
                          f"allow_pickle=[{full!r}] if you trust this checkpoint")
        obj = super().find_class(module, name)
        if not exact and not (isinstance(obj, type) and obj.__module__ == module):
            raise _refuse(f"{full} is not a class defined in {module} (a module prefix admits "
                          f"only those; name it exactly to allow it)")
        self._resolved[id(obj)] = obj
        return obj

    def _callable(self, func: Any, opcode: str) -> None:
        if id(func) not in self._resolved:
            raise _refuse(f"{opcode} on {type(func).__name__}, which is not a resolved name")

    def load_reduce(self) -> None:
        stack = self.stack
        args = stack.pop()
        func = stack[-1]
        self._callable(func, "REDUCE")
        if not isinstance(args, tuple):
            raise _refuse("REDUCE arguments are not a tuple")
        _check_call(func, args, {})
        stack[-1] = func(*args)
    dispatch[pickle.REDUCE[0]] = load_reduce

    def _new(self, cls: Any, args: Any, kwargs: Any, opcode: str) -> None:
        self._callable(cls, opcode)
        if not isinstance(cls, type) or not isinstance(args, tuple) or \
                not isinstance(kwargs, dict):
            raise _refuse(f"{opcode} of a {type(cls).__name__}")
        _check_call(cls, args, kwargs)
        self.append(cls.__new__(cls, *args, **kwargs))

    def load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        self._new(cls, args, {}, "NEWOBJ")
    dispatch[pickle.NEWOBJ[0]] = load_newobj

    def load_newobj_ex(self) -> None:
        kwargs = self.stack.pop()
        args = self.stack.pop()
        cls = self.stack.pop()
        self._new(cls, args, kwargs, "NEWOBJ_EX")
    dispatch[pickle.NEWOBJ_EX[0]] = load_newobj_ex

    def _instantiate(self, klass: Any, args: Any) -> None:
        self._callable(klass, "INST/OBJ")
        args = tuple(args)
        _check_call(klass, args, {})
        super()._instantiate(klass, args)

    def load_build(self) -> None:
        if len(self.stack) < 2:
            raise _refuse("BUILD without an instance")
        inst = self.stack[-2]  # the state is on top
        if id(inst) in self._resolved or isinstance(inst, _NOT_INSTANCES):
            raise _refuse(f"BUILD on {getattr(inst, '__qualname__', type(inst).__name__)}, "
                          f"which is not an instance (it would change it for the process)")
        super().load_build()
    dispatch[pickle.BUILD[0]] = load_build


def pickler(allow: AllowPickle) -> Optional[Callable[[Any], bytes]]:
    if not allow:
        return None

    def dump(obj: Any) -> bytes:
        try:
            return pickle.dumps(obj, protocol=5)
        except Exception as e:  # noqa: BLE001 - any pickling failure is the value's
            raise InvalidArgumentError(
                f"cannot pickle a {type(obj).__module__}.{type(obj).__qualname__}: "
                f"{type(e).__name__}: {e}") from None

    return dump


def unpickler(allow: AllowPickle) -> Optional[Callable[[bytes], Any]]:
    if not allow:
        return None
    exact, prefixes = _parse_allow(() if allow is True else tuple(allow))

    def load(data: bytes) -> Any:
        try:
            return RestrictedUnpickler(data, exact, prefixes).load()
        except pickle.UnpicklingError as e:
            raise CorruptionError(str(e)) from None
        except Exception as e:  # noqa: BLE001 - a hostile value may raise anything
            raise CorruptionError(
                f"a stored value cannot be unpickled: {type(e).__name__}: {e}") from None

    return load
