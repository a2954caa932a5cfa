"""Pointer files: the small JSON documents an adapter writes where a framework expects a
checkpoint file (Lightning's ``last.ckpt``, DeepSpeed's ``global_step100/*.pt``), naming the
safepoint directory and step that hold the data."""

from __future__ import annotations

import json
import os
from typing import Callable, Optional

from safepoint.errors import CorruptionError, InvalidArgumentError

MAX_BYTES = 64 * 1024  # a pointer is a few hundred bytes; anything larger is not one


def read_pointer(path: str | os.PathLike[str], fmt: str, version: int) -> Optional[dict]:
    """The pointer of format ``fmt`` at ``path`` (symlinks followed) as a dict, or None when
    ``path`` is not one (missing, a directory, another kind of file). Another ``version`` of
    the format raises ``CorruptionError``."""
    p = os.fspath(path)
    if not os.path.isfile(p):
        return None
    try:
        with open(p, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
        if len(raw) > MAX_BYTES or not raw.lstrip().startswith(b"{"):
            return None
        doc = json.loads(raw)
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != fmt:
        return None
    if doc.get("version") != version:
        raise CorruptionError(f"{p}: safepoint pointer version {doc.get('version')!r} is not "
                              f"supported (this safepoint reads version {version})")
    return doc


def require_pointer(path: str, read: Callable[[str], Optional[dict]], not_ours: str) -> dict:
    """``read(path)`` (a module's ``read_pointer``), for a load that needs a pointer:
    ``FileNotFoundError`` when nothing is at ``path``, ``InvalidArgumentError("<path>:
    <not_ours>")`` when something else is."""
    doc = read(path)
    if doc is None:
        if not os.path.exists(path):
            raise FileNotFoundError(f"checkpoint file not found: {path}")
        raise InvalidArgumentError(f"{path}: {not_ours}")
    return doc
