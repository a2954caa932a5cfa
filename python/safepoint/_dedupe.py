"""Replica dedupe (``Checkpointer(dedupe=True)``): a tensor that several ranks hold (DDP's
parameters and optimizer state) is copied into shared memory once per node and written to
storage once in total, instead of once per rank.

Every rank calls save for the same steps. Per save, one all-reduce (MAX) of two int64: the
preemption notice (``_preemption.notice_code``: the save's one collective carries it too) and
whether this rank's structure (its tensors' names, dtypes, shapes and boxes, as the core's
structure hash says) or its snapshot's being taken changed since the plans were made. Only when
some rank's did (the first save, a new structure, a skipped snapshot, a rank that forgot the
plans) do the ranks all-gather their tensor lists (and which node each is on), and each
computes the same two plans (``plan_replicas``): which rank of each node copies each
group of replicas into its snapshot (the copy plan, applied from the next save on through
``Client.set_copy_skip``), and which rank writes each to storage, among the ranks whose
snapshots hold it (the persist plan, ``Client.notify``). Both split by bytes. A hot reload fills
a tensor its snapshot leaves out from the slot of the rank of its node that copied it
(``Client.fill_from_siblings``); loading from storage reads it from the image of the rank that
wrote it (``_shards.fill_elsewhere``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Optional

from safepoint import _collectives, _core


def replica_key(entry: tuple, rank: int, rank_local_prefix: str) -> Any:
    """What makes two ranks' tensors replicas of each other: the core's ReplicaKey (the same
    name, dtype, shape and box; DCP's convention for data parallelism). Tensors under
    `rank_local_prefix` (the generator states) are never replicas."""
    name, dtype, shape, gshape, goff, _ = entry
    if name.startswith(rank_local_prefix):
        return (name, rank)
    return _core.replica_key(name, dtype, shape, gshape or None, goff or None)


def plan_replicas(everyone: list[list[tuple]], rank: int, rank_local_prefix: str,
                  lacking: Optional[list[set[int]]] = None) -> list:
    """Which of this rank's tensors other ranks write to storage: of every group of replicas one
    rank writes, chosen greedily so that each rank writes about as many bytes (largest first,
    ties by rank). `everyone[r]` is rank r's list of entries (name, dtype, shape, global_shape,
    global_offset, nbytes). `lacking[r]`: indexes of rank r's entries whose bytes its snapshot
    does not hold (the copy plan left them to another rank): r never writes those. Returns this
    rank's skipped tensors as index ranges [first, last)."""
    return _plan(everyone, rank_local_prefix, lacking)[rank]


def _plan(everyone: list[list[tuple]], rank_local_prefix: str,
          lacking: Optional[list[set[int]]] = None, min_bytes: int = 0) -> list[list]:
    """plan_replicas for every rank of `everyone` at once (one greedy pass). Tensors under
    `min_bytes` are nobody's replicas: each rank keeps its own."""
    holders: dict[tuple, list[int]] = {}
    size: dict[tuple, int] = {}
    keys: list[list] = []
    for r, entries in enumerate(everyone):
        gone = lacking[r] if lacking else ()
        keys.append([replica_key(e, r, rank_local_prefix) if e[5] >= min_bytes else (e[0], r)
                     for e in entries])
        for i, (k, e) in enumerate(zip(keys[r], entries)):
            if i not in gone:
                holders.setdefault(k, []).append(r)
            size[k] = e[5]
    load = [0] * len(everyone)
    owner: dict[tuple, int] = {}
    for k in sorted(holders, key=lambda k: (-size[k], repr(k))):
        o = min(holders[k], key=lambda r: (load[r], r))
        owner[k] = o
        load[o] += size[k]
    return [_ranges(i for i, k in enumerate(keys[r]) if owner.get(k) != r)
            for r in range(len(everyone))]


def _ranges(indexes: Iterable[int]) -> list:
    """Ascending indexes as ranges [first, last)."""
    ranges: list[list[int]] = []
    for i in indexes:
        if ranges and ranges[-1][1] == i:
            ranges[-1][1] = i + 1
        else:
            ranges.append([i, i + 1])
    return [tuple(x) for x in ranges]


def _indexes(ranges: list) -> set[int]:
    return {i for first, last in ranges for i in range(first, last)}


# Replicas smaller than this are copied by every rank of a node (the copy plan leaves them out):
# leaving one out saves a copy of a few KiB at each save, but a hot reload then fills it from
# another rank's slot, verifying the whole 4 MiB checksum chunk that holds it there (FSDP2's
# optimizer step counters: 44 scalars cost 5 ms of a 36 ms reload that way).
MIN_SHARED_BYTES = 64 << 10


def plan_copies(everyone: list[list[tuple]], nodes: list[str], rank_local_prefix: str) -> list:
    """The copy plan, for every rank: which of its tensors another rank of its node (same
    `nodes` entry) copies into its snapshot instead, so that each node's snapshots hold every
    tensor of its ranks once. Index ranges, as plan_replicas (one greedy pass per node, over
    its ranks alone); empty for a rank alone on its node. Tensors under MIN_SHARED_BYTES are
    rank-local here: every rank copies them."""
    out: list = [[] for _ in everyone]
    for node in set(nodes):
        members = [r for r in range(len(everyone)) if nodes[r] == node]
        if len(members) < 2:
            continue
        plans = _plan([everyone[r] for r in members], rank_local_prefix,
                      min_bytes=MIN_SHARED_BYTES)
        for r, ranges in zip(members, plans):
            out[r] = ranges
    return out


class ReplicaPlan:
    """This rank's part of the plans for the structure of the last saves: which of its tensors
    another rank of its node copies (applied to the client), and which other ranks write. Kept
    across saves; recomputed only when some rank's tensors changed. `rank_local_prefix`:
    tensors under it (the generator states) are never replicas. `node()`: names this rank's node
    (ranks with equal names read each other's snapshot slots).

    The plans are the same on every rank: they are made, kept and forgotten from what every
    rank sees alike (the all-reduce's result, the gathered lists). A rank that forgets them on
    its own (``reset``, after a collective failed there) says so at its next save (it has no
    structure hash of a plan: changed), and every rank plans again."""

    def __init__(self, group: Any, rank: int, world_size: int, rank_local_prefix: str,
                 node: Callable[[], str] = lambda: "") -> None:
        self._group, self._rank, self._world_size = group, rank, world_size
        self._prefix, self._node = rank_local_prefix, node
        self._node_name = ""  # node(), asked at the first plan (the shm directory exists then)
        self._mine: Optional[int] = None  # this rank's structure hash when the plans were made
        self._skip: list = []  # this rank's skip ranges under those plans
        self._copies: list = []  # this rank's share of the copy plan under them

    def reset(self, client: Any = None) -> None:
        """Forgets the plans (the ranks could not agree on them): the next save copies every
        tensor and plans again."""
        self._mine, self._skip, self._copies = None, [], []
        if client is not None:
            client.set_copy_skip([])

    def agree(self, client: Any, res: _core.SnapshotResult, notice: int = 0) -> tuple[int, bool]:
        """The save's one collective (every rank calls it for the same step, after its copy):
        one all-reduce (MAX) of [`notice`, changed], where changed says that this rank's
        snapshot of `res` was skipped, or its structure is not the one of the plans (or it has
        none). Returns the ranks' greatest notice and whether any rank's changed: then
        ``skip_ranges(..., changed=True)`` gathers the tensor lists and plans again. 16 bytes
        per rank whatever the world size, in log2 W rounds (``_collectives``)."""
        import torch

        # Never wait in the collective without an agent: ranks in wait() for the previous
        # step need this node's images, which only an agent persists (a dead one is restarted
        # and its successor persists them). Its error, if any, comes again from notify().
        client.revive_agent()
        changed = (not res.saved or self._mine is None
                   or client.structure_hash() != self._mine)
        flags = torch.tensor([notice, 1 if changed else 0], dtype=torch.int64)
        _collectives.all_reduce_max(flags, self._group)  # log2 W rounds, not gloo's ring
        agreed, any_changed = (int(x) for x in flags.tolist())
        return agreed, bool(any_changed)

    def skip_ranges(self, client: Any, res: _core.SnapshotResult, changed: bool,
                    copy_once: bool = True) -> tuple[list, bool]:
        """This rank's replicas that other ranks write, for the save `res` of `client`, and
        whether this rank must copy the step again in full first: its snapshot left out tensors
        under a plan that no longer holds (some rank's structure changed), so another rank may
        not hold them. `changed`: what ``agree`` returned for this save (the same on every
        rank). Unchanged: the plans hold, no collective. Changed: a collective (every rank
        calls it), the plans are made again from every rank's gathered tensor list.
        `copy_once`: plan the copies once per node (else every rank copies all of its
        tensors)."""
        if not changed:
            return self._skip, False  # every rank's snapshot was taken (else: changed)
        entries = client.last_entries() if res.saved else []
        everyone: list = [None] * self._world_size
        if not self._node_name:
            self._node_name = self._node()
        _collectives.all_gather_object(everyone, (entries, self._node_name), self._group)
        if any(not e for e, _ in everyone):
            # A rank skipped its snapshot: write everything, and forget the plans on every
            # rank alike (each sees the same gathered lists): the next save copies all and
            # plans again.
            self._mine, self._skip, self._copies = None, [], []
            return [], False
        again = bool(res.saved and client.last_copy_skip())
        lists = [e for e, _ in everyone]
        # This save: every snapshot holds every tensor (after copying again where needed).
        now = plan_replicas(lists, self._rank, self._prefix)
        # The next saves of this structure: each node's snapshots hold each tensor once, and
        # storage gets it from one of the ranks that hold it.
        nodes = [n for _, n in everyone]
        copies = (plan_copies(lists, nodes, self._prefix) if copy_once
                  else [[] for _ in range(self._world_size)])
        later = plan_replicas(lists, self._rank, self._prefix, [_indexes(c) for c in copies])
        self._mine, self._skip = client.structure_hash(), later
        self._copies = copies[self._rank]
        return now, again

    def apply(self, client: Any) -> None:
        """Leaves this rank's share of the copy plan out of its next snapshots (after a plan
        was made and the step of that save, copied again if needed, is safe)."""
        client.set_copy_skip(self._copies)
