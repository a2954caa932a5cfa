"""Replica dedupe (``Checkpointer(dedupe=True)``): a tensor that several ranks hold (DDP's
parameters and optimizer state) is written to storage once in total instead of once per rank.

Every rank calls save for the same steps. Per save, one all-gather of a structure hash; when
some rank's tensors changed, the ranks all-gather their tensor lists and each computes the same
plan (``plan_replicas``): which rank writes each group of replicas, split by bytes. A rank then
tells its agent which of its tensors to skip (``Client.notify``); loading reads a skipped
tensor from the image of the rank that wrote it (``_shards.fill_elsewhere``).
"""

from __future__ import annotations

from typing import Any

from safepoint import _core


def replica_key(entry: tuple, rank: int, rank_local_prefix: str) -> Any:
    """What makes two ranks' tensors replicas of each other: the core's ReplicaKey (the same
    name, dtype, shape and box; DCP's convention for data parallelism). Tensors under
    `rank_local_prefix` (the generator states) are never replicas."""
    name, dtype, shape, gshape, goff, _ = entry
    if name.startswith(rank_local_prefix):
        return (name, rank)
    return _core.replica_key(name, dtype, shape, gshape or None, goff or None)


def plan_replicas(everyone: list[list[tuple]], rank: int, rank_local_prefix: str) -> list:
    """Which of this rank's tensors other ranks write to storage: of every group of replicas one
    rank writes, chosen greedily so that each rank writes about as many bytes (largest first,
    ties by rank). `everyone[r]` is rank r's list of entries (name, dtype, shape, global_shape,
    global_offset, nbytes). Returns this rank's skipped tensors as index ranges [first, last)."""
    holders: dict[tuple, list[int]] = {}
    size: dict[tuple, int] = {}
    for r, entries in enumerate(everyone):
        for e in entries:
            k = replica_key(e, r, rank_local_prefix)
            holders.setdefault(k, []).append(r)
            size[k] = e[5]
    load = [0] * len(everyone)
    owner: dict[tuple, int] = {}
    for k in sorted(holders, key=lambda k: (-size[k], repr(k))):
        o = min(holders[k], key=lambda r: (load[r], r))
        owner[k] = o
        load[o] += size[k]
    ranges: list[list[int]] = []
    for i, e in enumerate(everyone[rank]):
        if owner[replica_key(e, rank, rank_local_prefix)] != rank:
            if ranges and ranges[-1][1] == i:
                ranges[-1][1] = i + 1
            else:
                ranges.append([i, i + 1])
    return [tuple(x) for x in ranges]


class ReplicaPlan:
    """This rank's part of the plan for the structure of the last saves: which of its tensors
    other ranks write. Kept across saves; recomputed only when some rank's tensors changed.
    `rank_local_prefix`: tensors under it (the generator states) are never replicas."""

    def __init__(self, group: Any, rank: int, world_size: int, rank_local_prefix: str) -> None:
        self._group, self._rank, self._world_size = group, rank, world_size
        self._prefix = rank_local_prefix
        self._key: tuple = ()  # every rank's structure hash
        self._skip: list = []  # this rank's skip ranges under that key

    def reset(self) -> None:
        """Forgets the plan (the ranks could not agree on it): the next save plans again."""
        self._key, self._skip = (), []

    def skip_ranges(self, client: Any, res: _core.SnapshotResult) -> list:
        """This rank's replicas that other ranks write, for the save `res` of `client` (a
        collective: every rank calls it for the same step). One all-gather of a structure hash
        per save; the full plan is recomputed only when some rank's tensors changed."""
        import torch
        import torch.distributed as dist

        # Never wait in the collective without an agent: ranks in wait() for the previous
        # step need this node's images, which only an agent persists (a dead one is restarted
        # and its successor persists them). Its error, if any, comes again from notify().
        client.revive_agent()
        mine = client.structure_hash() if res.saved else 0
        h = torch.tensor([mine - (1 << 63)], dtype=torch.int64)  # u64 -> i64
        hashes = [torch.zeros(1, dtype=torch.int64) for _ in range(self._world_size)]
        dist.all_gather(hashes, h, group=self._group)
        key = tuple(int(x.item()) for x in hashes)
        if key != self._key:
            entries = client.last_entries() if res.saved else []
            everyone: list = [None] * self._world_size
            dist.all_gather_object(everyone, entries, group=self._group)
            if any(not e for e in everyone):  # a rank skipped its snapshot: write everything
                return []
            self._key, self._skip = key, plan_replicas(everyone, self._rank, self._prefix)
        return self._skip if res.saved else []
