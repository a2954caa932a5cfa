"""Versioning helpers: user metadata of a checkpoint's lineage and step references of other
checkpoints (``Checkpointer.restore(state, from_="URI@tag")``). The lineage itself is recorded by
the C++ core in every image's header (docs/format.md, "Lineage"); tags are objects of the
checkpoint directory (docs/format.md, "Tags")."""

from __future__ import annotations

import json
import os
import re
from typing import Any, Optional

from safepoint import _core
from safepoint.errors import InvalidArgumentError, NotFoundError

MAX_METADATA_BYTES = 2048  # kMaxLineageMetadataLength (include/safepoint/image.h)
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")


def encode_metadata(where: str, metadata: Any) -> str:
    """The JSON text a lineage records for ``metadata``: a dict of str keys to str, int, float,
    bool or None values, at most 2048 bytes of UTF-8 JSON. '' for None."""
    if metadata is None:
        return ""
    if not isinstance(metadata, dict):
        raise InvalidArgumentError(
            f"{where}: metadata must be a dict of str to str/int/float/bool/None, got "
            f"{type(metadata).__name__}")
    for k, v in metadata.items():
        if not isinstance(k, str):
            raise InvalidArgumentError(f"{where}: metadata keys must be str, got {k!r}")
        if v is not None and not isinstance(v, (str, int, float, bool)):
            raise InvalidArgumentError(
                f"{where}: metadata[{k!r}] must be str, int, float, bool or None, got "
                f"{type(v).__name__}")
    try:
        text = json.dumps(metadata, ensure_ascii=False, sort_keys=True, separators=(",", ":"),
                          allow_nan=False)
    except ValueError as e:  # nan / inf
        raise InvalidArgumentError(f"{where}: metadata is not JSON: {e}") from None
    size = len(text.encode("utf-8"))
    if size > MAX_METADATA_BYTES:
        raise InvalidArgumentError(
            f"{where}: metadata is {size} bytes as JSON, more than {MAX_METADATA_BYTES} (keep "
            "it to short strings: a commit id, a config hash)")
    return text


def decode_metadata(text: str) -> Optional[dict]:
    return json.loads(text) if text else None


def split_ref(ref: str) -> tuple[str, Optional[str]]:
    """``"URI@ref"`` -> (location, ref); a location without ``@`` -> (location, None): its newest
    step. Plain paths become absolute (the agent and the lineage need a location that does not
    depend on the working directory)."""
    if not isinstance(ref, (str, os.PathLike)):
        raise InvalidArgumentError(f"from_ must be 'PATH@TAG' or 'URI@step-N', got {ref!r}")
    text = os.fspath(ref)
    location, sep, name = text.rpartition("@")
    if not sep:
        location, name = text, ""
    if not location:
        raise InvalidArgumentError(f"from_={text!r}: no checkpoint location before '@'")
    if sep and not name:
        raise InvalidArgumentError(f"from_={text!r}: nothing after '@' (a tag, step-N or N)")
    if not _SCHEME.match(location):
        location = os.path.abspath(location)
    return location, (name or None)


def _canonical(location: str) -> str:
    if location.startswith("file://localhost/"):
        location = location[len("file://localhost"):]
    elif location.startswith("file:///"):
        location = location[len("file://"):]
    if not _SCHEME.match(location):
        location = os.path.normpath(os.path.abspath(location))
    return location.rstrip("/") or "/"


def same_location(a: str, b: str) -> bool:
    """Whether two spellings name one checkpoint (a path and its file:// URI): a parent there is
    recorded as "this checkpoint", which stays true wherever the steps are copied."""
    return _canonical(a) == _canonical(b)


def resolve(location: str, ref: Optional[str]) -> int:
    """The committed step ``ref`` names in ``location`` (None: the newest)."""
    if ref is None:
        steps = _core.steps(location)
        if not steps:
            raise NotFoundError(f"{location}: no committed checkpoint")
        return int(steps[-1])
    return int(_core.resolve_step(location, ref))


def lineage(path: str, step: int) -> dict:
    """What step ``step`` of ``path`` records: ``{"attempt", "parent": None | {"step",
    "location"}, "metadata"}`` (the parent's location is ``path`` for a resume)."""
    attempt, parent_step, parent_location, metadata = _core.step_lineage(path, step)
    parent = None
    if parent_step is not None:
        parent = {"step": parent_step, "location": parent_location or path}
    return {"attempt": attempt, "parent": parent, "metadata": decode_metadata(metadata)}
