"""Save attempts (docs/format.md, "attempt"): the id every image of a run carries, so that a step
commits only from images of one incarnation of the job, never beside images an earlier or
crashed one left; and, per step, the attempt of the snapshot a rank would restore (from its
memory or its peers' copies), which the restore agreement (``_agreement``) compares across
ranks."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from typing import Any, Callable


def new_attempt() -> int:
    """A fresh save attempt id: random, never 0 (0 means "none given")."""
    return int.from_bytes(os.urandom(7), "little") + 1


def run_attempt(group: Any = None) -> int:
    """The id every image of this run carries (docs/format.md, "attempt"): a step commits only
    from images of one attempt, so what a crashed or earlier incarnation of the job left on
    storage is never committed beside this one's images. All ranks must share it: with a
    process group, rank 0 draws it and broadcasts it; else $SAFEPOINT_ATTEMPT, or torchrun's
    run id and restart count; else 0 (no check: single-rank runs need none)."""
    if group is not None:
        import torch
        import torch.distributed as dist

        t = torch.tensor([new_attempt()], dtype=torch.int64)
        dist.broadcast(t, src=dist.get_global_rank(group, 0), group=group)
        return int(t.item())
    env = os.environ.get("SAFEPOINT_ATTEMPT")
    if env:
        return int(hashlib.sha1(env.encode()).hexdigest()[:14], 16) + 1
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id is not None and "TORCHELASTIC_RESTART_COUNT" in os.environ:
        key = f"{run_id}/{os.environ['TORCHELASTIC_RESTART_COUNT']}"
        return int(hashlib.sha1(key.encode()).hexdigest()[:14], 16) + 1
    return 0


def newest_attempts(snapshots: Iterable[Any], completed: Callable[[Any], int]) -> dict[int, Any]:
    """step -> save attempt of the snapshot of it a load would read: of several snapshots of one
    step (``.step``, ``.attempt``), the one completed last (``completed(snapshot)``, in ns), as
    the client's load_step picks in memory and the agents among peers' copies."""
    newest: dict[int, Any] = {}
    for s in snapshots:
        if s.step not in newest or completed(s) > completed(newest[s.step]):
            newest[s.step] = s
    return {step: s.attempt for step, s in newest.items()}
