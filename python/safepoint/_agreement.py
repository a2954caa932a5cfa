"""The restore agreement: with several ranks, every rank resumes from the same step.

Each rank states what it could load (the storages each committed step is on, the save attempt
of each snapshot in its memory or its peers' memory); from the gathered statements every rank
computes the same candidate steps, all try the newest, and when any rank fails to read it all
fall back together to the next older one (docs/architecture.md, "Restore at scale"). The
collectives run over the Checkpointer's own gloo group; the Checkpointer does the reading.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional


def hot_reload_agreed(group: Any, world_size: int, loaded: bool, step: Optional[int],
                      attempt: Optional[int], newest_committed: int, newest: bool) -> bool:
    """The hot reload's agreement in one collective (the usual case after a restart in place):
    one all-gather of (loaded, step, save attempt, newest committed step) per rank, where
    `loaded` says this rank loaded its snapshot of `step` from memory, verified. True when every
    rank loaded the same step of the same attempt and, when the newest step was asked for
    (`newest`), no rank has a newer step committed on storage: that step is then the one the
    full agreement would choose. The decision is taken from the gathered values alone, so every
    rank takes the same one."""
    import torch
    import torch.distributed as dist

    mine = torch.tensor([1 if loaded else 0, step if step is not None else -1,
                         attempt if attempt is not None else -1, newest_committed],
                        dtype=torch.int64)
    everyone = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine, group=group)
    rows = [e.tolist() for e in everyone]
    agreed = all(r[0] == 1 and r[1] == rows[0][1] and r[2] == rows[0][2] for r in rows)
    return agreed and not (newest and rows[0][1] < max(r[3] for r in rows))


class Candidates:
    """The steps every rank can load, computed from every rank's statement (so the same on
    every rank): ``steps`` (restricted to the asked-for step, if any), ``in_memory`` (those
    every rank holds a snapshot of, of one save attempt) and whether every rank shares its
    storage reads (``share``)."""

    def __init__(self, everyone: list, stores: list[str], step: Optional[int]) -> None:
        self._everyone, self._stores = everyone, stores
        self.share = all(e[2] for e in everyone)
        first = everyone[0][1]
        self.in_memory = {s for s, a in first.items()
                          if a is not None and all(other.get(s) == a
                                                   for _, other, _ in everyone[1:])}
        self.steps = self.in_memory | set(everyone[0][0]).intersection(
            *(set(c) for c, _, _ in everyone[1:]))
        if step is not None:
            self.steps &= {step}

    def shared_uri(self, s: int) -> Optional[str]:
        """The fastest storage every rank sees step `s` committed on (the ranks' shared reads
        are a collective over one storage); None: no sharing for it."""
        if not self.share:
            return None
        for uri in self._stores:
            if all(uri in c.get(s, ()) for c, _, _ in self._everyone):
                return uri
        return None


def gather_candidates(group: Any, world_size: int, committed: dict[int, list[str]],
                      attempts: dict[int, Any], share: bool, stores: list[str],
                      step: Optional[int]) -> Candidates:
    """One all-gather of every rank's statement: its committed steps (step -> the storages
    holding it), the attempt of each snapshot it could read from memory (its own, else one its
    peers can rebuild) and whether it shares reads (restore with share_reads). A step is loaded
    from memory only where every rank's snapshot of it is of one save attempt: snapshots that two
    runs (before and after a restart) left of the same step are never combined; such a step
    comes from storage, where a commit is one attempt. `stores`: the storages, fastest first."""
    import torch.distributed as dist

    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, (committed, attempts, share), group=group)
    return Candidates(everyone, stores, step)


def load_newest_agreed(group: Any, steps: set[int], load: Callable[[int], Any]) -> Any:
    """Every rank loads the newest of `steps` (`load`: this rank's copy of a step, None when none
    reads back); when any rank failed, all fall back together to the next older step. What
    `load` returned for the step every rank read, or None when there is none."""
    import torch
    import torch.distributed as dist

    steps = set(steps)
    while steps:
        candidate = max(steps)
        got = load(candidate)
        failed = torch.tensor([0 if got is not None else 1], dtype=torch.int32)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
        if int(failed.item()) == 0:
            return got
        warnings.warn(f"safepoint: a rank could not read step {candidate}; all ranks fall "
                      "back to an older step", RuntimeWarning, stacklevel=4)
        steps.discard(candidate)
    return None


def agree_on_step(group: Any, step: int) -> int:
    """Rank 0's `step`, on every rank (a branch: every rank starts from the step rank 0
    resolved)."""
    import torch.distributed as dist

    agreed = [step]
    dist.broadcast_object_list(agreed, src=0, group=group)
    return int(agreed[0])
