"""Storage tiers below a Checkpointer's ``path`` (docs/guide.md, "Storage tiers").

The node agent fills each tier by copying committed, verified steps from the tier above it,
on the tier's own schedule, and keeps its newest ``keep`` steps there; restore reads the
fastest tier that holds the step it needs."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

from safepoint import _core
from safepoint.errors import InvalidArgumentError

_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")


@dataclass(frozen=True)
class Tier:
    """One storage tier: ``uri`` (``file:///nvme/run1``, ``s3://bucket/run1``,
    ``rados://pool/run1``, or a plain path), how often it receives a step (``every`` N steps:
    a step that is a multiple of N, or N steps after the last one it received; and/or
    ``every_seconds``; neither: every step committed on the tier above), and how many committed
    steps it keeps. ``every="auto"``: the interval advisor's schedule; copies to a tier cost
    training nothing (the agent makes them), so its goodput-optimal interval is as often as the
    tier accepts steps: every step committed above, the newest one whenever the previous copy is
    done (docs/guide.md, "Choosing the checkpoint interval"). ``compression`` and
    ``incremental`` choose how the tier stores steps, as on ``safepoint.save`` (the agent
    compresses while it copies a step down)."""
    uri: str
    every: Optional[Union[int, str]] = None
    every_seconds: Optional[float] = None
    keep: int = 3
    compression: str = "none"
    incremental: bool = False


TierLike = Union[Tier, str, os.PathLike, Mapping[str, Any]]



def check_layout(where: str, compression: Any, incremental: Any) -> None:
    """InvalidArgumentError unless ``compression`` is one of the codec's modes
    (``_core.COMPRESSIONS``) and ``incremental`` a bool."""
    if compression not in _core.COMPRESSIONS:
        raise InvalidArgumentError(f"{where}: compression must be one of "
                                   f"{', '.join(_core.COMPRESSIONS)}, got {compression!r}")
    if not isinstance(incremental, bool):
        raise InvalidArgumentError(f"{where}: incremental must be a bool, got {incremental!r}")


def normalize_tiers(path: str, tiers: Optional[Sequence[TierLike]]) -> list[Tier]:
    """The tiers as Tier objects with absolute URIs, checked; InvalidArgumentError naming the
    bad one otherwise."""
    if tiers is None:
        return []
    if isinstance(tiers, (str, bytes, Mapping, Tier)) or not isinstance(tiers, Sequence):
        raise InvalidArgumentError(f"{path}: tiers must be a list of Tier (or URIs), "
                                   f"got {tiers!r}")
    out: list[Tier] = []
    seen = {path}
    for i, t in enumerate(tiers, 1):
        if isinstance(t, (str, os.PathLike)):
            t = Tier(os.fspath(t))
        elif isinstance(t, Mapping):
            try:
                t = Tier(**t)
            except TypeError as e:
                raise InvalidArgumentError(f"{path}: tier {i}: {e}") from None
        if not isinstance(t, Tier):
            raise InvalidArgumentError(f"{path}: tier {i} is not a Tier, a URI or a dict: {t!r}")
        uri = t.uri
        if not isinstance(uri, str) or not uri:
            raise InvalidArgumentError(f"{path}: tier {i} needs a non-empty URI")
        if not _SCHEME.match(uri):
            uri = os.path.abspath(uri)  # the agent runs in another directory
        if uri in seen:
            raise InvalidArgumentError(f"{path}: tier {i} ({uri}) repeats a storage the job "
                                       "already uses")
        seen.add(uri)
        if t.every is not None and t.every != "auto" and (type(t.every) is not int
                                                           or t.every < 1):
            raise InvalidArgumentError(
                f"{path}: tier {i} ({uri}): every must be a positive int or 'auto'")
        if t.every_seconds is not None and (
                not isinstance(t.every_seconds, (int, float)) or isinstance(t.every_seconds, bool)
                or not math.isfinite(t.every_seconds) or t.every_seconds <= 0):
            raise InvalidArgumentError(
                f"{path}: tier {i} ({uri}): every_seconds must be a positive number")
        if type(t.keep) is not int or t.keep < 1:
            raise InvalidArgumentError(f"{path}: tier {i} ({uri}): keep must be a positive int")
        check_layout(f"{path}: tier {i} ({uri})", t.compression, t.incremental)
        out.append(Tier(uri, t.every, None if t.every_seconds is None else float(t.every_seconds),
                        t.keep, t.compression, t.incremental))
    return out


def core_tiers(tiers: Sequence[Tier]) -> list[tuple[str, int, float, int, str, bool]]:
    """The tiers as the extension module takes them: (uri, every, every_seconds, keep,
    compression, incremental)."""
    return [(t.uri, t.every if isinstance(t.every, int) else 0, float(t.every_seconds or 0.0),
             t.keep, t.compression,
             t.incremental) for t in tiers]
