"""safepoint's collectives on the Checkpointer's gloo group (the save's one all-reduce, the
restore's agreement, shared-read plan and all-reduce, the replica plan's all-gather), built so
that their messages in sequence grow as log2 W.

gloo's all-reduce is a ring: the values pass every rank in turn, twice, so its critical path
is about 4 W messages long whatever the payload (16 bytes here; 267 at W = 64, measured); on a
network where a message takes 20-50 us, W = 4,096 ranks would spend 0.3-0.8 s of every save in
it. Recursive doubling takes log2 W rounds of one exchange with one peer (ranks beyond the
largest power of two hand their value in first and get the result back after: two messages
more), the standard algorithm for small all-reduces. gloo's all-gather is a ring too (782
messages in sequence at W = 64 for the restore agreement's rows); by recursive doubling, a rank
sends in round k the 2^k rows it holds and receives as many, so the bytes are those of any
all-gather (W rows a rank) in log2 W rounds. Measured with every message delayed
(bench/collective_depth.py, docs/benchmarks.md "Collectives at scale").

The messages go point to point over the Checkpointer's own gloo group, each tagged with the
call's sequence number on that group (every rank of the group calls the same collectives in the
same order): a message of a call some rank gave up on (a peer's timeout) can never be taken for
one of a later call. A peer that never answers fails the call after the group's timeout, as gloo's
own collective does."""

from __future__ import annotations

import itertools
import weakref
from typing import Any

# Tags of these messages: above the shared reads' (1, 2, ... one per message of a plan), four
# per call (the hand-in, the rounds, the hand-back), the call's number mod 2**20.
_TAG_BASE = 1 << 24
_CALLS: weakref.WeakKeyDictionary[Any, itertools.count] = weakref.WeakKeyDictionary()


def _call_tag(group: Any) -> int:
    """The first of this call's four tags: the call's number on `group` (every rank of the group
    calls the same collectives in the same order)."""
    import torch.distributed as dist

    key = group if group is not None else dist.group.WORLD  # None: the default group
    seq = next(_CALLS.setdefault(key, itertools.count()))
    return _TAG_BASE + 4 * (seq % (1 << 20))


def _exchange(send: Any, recv: Any, group: Any, peer: int, tag: int) -> None:
    """One round: `send` to `peer` and `recv` from it, both at once."""
    import torch.distributed as dist

    works = [dist.isend(send, group=group, group_dst=peer, tag=tag),
             dist.irecv(recv, group=group, group_src=peer, tag=tag)]
    for work in works:
        if work is not None:  # None only for a rank outside the group
            work.wait()


def all_reduce_max(t: Any, group: Any) -> None:
    """`t` (a CPU tensor, the same shape and dtype on every rank of `group`) becomes the
    element-wise maximum over the ranks, in place. A collective: every rank of the group calls
    it, in the same order as the group's other collectives."""
    import torch
    import torch.distributed as dist

    size = dist.get_world_size(group)
    if size == 1:
        return
    rank = dist.get_rank(group)
    tag = _call_tag(group)
    p = 1 << (size.bit_length() - 1)  # the largest power of two <= size
    other = torch.empty_like(t)
    # Peers by their rank in the group (group_dst/group_src: no lookup of the default group's).
    if rank >= p:  # hand in, get the result back
        dist.send(t, group=group, group_dst=rank - p, tag=tag)
        dist.recv(t, group=group, group_src=rank - p, tag=tag + 2)
        return
    if rank + p < size:
        dist.recv(other, group=group, group_src=rank + p, tag=tag)
        torch.maximum(t, other, out=t)
    mask = 1
    while mask < p:
        # `t` itself is sent: it changes only once both messages are done.
        _exchange(t, other, group, rank ^ mask, tag + 1)
        torch.maximum(t, other, out=t)
        mask <<= 1
    if rank + p < size:
        dist.send(t, group=group, group_dst=rank + p, tag=tag + 2)


def all_gather(row: Any, group: Any) -> Any:
    """Every rank's `row` (a 1-D CPU tensor, the same length and dtype on every rank of
    `group`): a (W, len) tensor whose row r is rank r's. A collective, like all_reduce_max.

    Rank r < p (p the largest power of two <= W) holds slot r: its row and rank r + p's (handed
    in first, where there is one). In round k, ranks r and r ^ 2^k swap the 2^k slots each holds
    (neighbouring slots: one message each way); after log2 p rounds every rank < p holds all p
    slots and hands them to its rank r + p."""
    import torch
    import torch.distributed as dist

    size = dist.get_world_size(group)
    if size == 1:
        return row.reshape(1, -1).clone()
    rank = dist.get_rank(group)
    tag = _call_tag(group)
    p = 1 << (size.bit_length() - 1)
    # A slot holds a second row only where ranks hand in (W not a power of two): the buffer is
    # W rows where W is a power of two, as torch's all-gather's, and under 2 W otherwise.
    slots = torch.zeros((p, 2 if size > p else 1, row.numel()), dtype=row.dtype)
    if rank >= p:
        dist.send(row, group=group, group_dst=rank - p, tag=tag)
        dist.recv(slots, group=group, group_src=rank - p, tag=tag + 2)
    else:
        slots[rank, 0] = row
        if rank + p < size:
            dist.recv(slots[rank, 1], group=group, group_src=rank + p, tag=tag)
        mask = 1
        while mask < p:
            mine, theirs = rank & ~(mask - 1), (rank ^ mask) & ~(mask - 1)
            _exchange(slots[mine:mine + mask], slots[theirs:theirs + mask], group, rank ^ mask,
                      tag + 1)
            mask <<= 1
        if rank + p < size:
            dist.send(slots, group=group, group_dst=rank + p, tag=tag + 2)
    if size == p:
        return slots.view(p, -1)
    return torch.cat([slots[:, 0], slots[:size - p, 1]])


def all_gather_object(object_list: list, obj: Any, group: Any) -> None:
    """torch.distributed.all_gather_object on `group` by recursive doubling: `object_list` (W
    items) receives every rank's `obj`, pickled. Two all_gather calls (each pickle's length,
    then the pickles padded to the longest), as torch's own takes two of gloo's ring
    all-gathers. Unpickles what the job's own ranks sent, as torch's does."""
    import pickle

    import torch

    data = pickle.dumps(obj)
    sizes = all_gather(torch.tensor([len(data)], dtype=torch.int64), group)[:, 0].tolist()
    row = torch.zeros(max(sizes), dtype=torch.uint8)
    row[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    everyone = all_gather(row, group)
    for r, n in enumerate(sizes):
        object_list[r] = pickle.loads(everyone[r, :n].numpy().tobytes())
