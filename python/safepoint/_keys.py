"""The error of a restore whose state has a key the checkpoint lacks: it says what the checkpoint
holds at that place, and when the keys differ only by a wrapper's prefix (DDP's ``module.``,
``torch.compile``'s ``_orig_mod.``), which wrapper and what to do."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

from safepoint.errors import InvalidArgumentError

_RNG_KEY = "__safepoint_rng__"  # safepoint's own (_stateful.RNG_KEY), never a user's key
_SHOWN = 12  # keys of the checkpoint listed in the message (then how many more)
# Prefixes a wrapper adds to every key of a model's state dict: (prefix, what adds it).
_WRAPPERS = (("module.", "DistributedDataParallel or DataParallel"),
             ("_orig_mod.", "torch.compile"))


def _prefix_hint(key: str, held: list[str]) -> str:
    have = set(held)
    for prefix, wrapper in _WRAPPERS:
        if key.startswith(prefix) and key[len(prefix):] in have:
            return (f". The state's keys carry a {prefix!r} prefix the checkpoint's lack (a "
                    f"model wrapped by {wrapper} was saved unwrapped): restore into the "
                    f"unwrapped model (`model.module` for DDP), or strip the prefix from the "
                    f"state (torch.nn.modules.utils.consume_prefix_in_state_dict_if_present)")
        if prefix + key in have:
            return (f". The checkpoint's keys carry a {prefix!r} prefix the state's lack (it "
                    f"was saved from a model wrapped by {wrapper}): restore into the wrapped "
                    f"model, or save the unwrapped one (`model.module` for DDP) from now on")
    return ""


def missing_key(where: str, key: Any, held: Iterable[Any]) -> InvalidArgumentError:
    """The error for ``key`` of the state at ``where`` that the checkpoint's mapping there
    (whose keys are ``held``) lacks."""
    keys = [k for k in held if k != _RNG_KEY]
    if where.startswith("<root>."):  # the byte-range restore's paths start at the root
        where = where[len("<root>."):]
    msg = f"{where}: key {key!r} is not in the checkpoint"
    if not keys:
        return InvalidArgumentError(msg + ", which holds no keys there")
    shown = ", ".join(repr(k) for k in keys[:_SHOWN])
    if len(keys) > _SHOWN:
        shown += f", ... ({len(keys)} keys in all)"
    msg += f", which holds there: {shown}"
    strs = [k for k in keys if isinstance(k, str)]
    hint = _prefix_hint(key, strs) if isinstance(key, str) else ""
    if not hint and isinstance(key, str):
        close = difflib.get_close_matches(key, strs, n=1)
        if close:
            hint = f". Did you mean {close[0]!r}?"
    return InvalidArgumentError(msg + hint)
