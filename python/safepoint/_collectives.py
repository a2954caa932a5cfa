"""The save's one collective, built so that its messages in sequence grow as log2 W.

gloo's all-reduce is a ring: the values pass every rank in turn, twice, so its critical path
is about 4 W messages long whatever the payload (16 bytes here; 267 at W = 64, measured); on a
network where a message takes 20-50 us, W = 4,096 ranks would spend 0.3-0.8 s of every save in
it. Recursive doubling takes log2 W rounds of one exchange with one peer (ranks beyond the
largest power of two hand their value in first and get the result back after: two messages
more), the standard algorithm for small all-reduces. Measured with every message delayed
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
    seq = next(_CALLS.setdefault(group, itertools.count()))
    tag = _TAG_BASE + 4 * (seq % (1 << 20))
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
        peer = rank ^ mask
        # `t` itself is sent: it changes only once both messages are done.
        works = [dist.isend(t, group=group, group_dst=peer, tag=tag + 1),
                 dist.irecv(other, group=group, group_src=peer, tag=tag + 1)]
        for work in works:
            if work is not None:  # None only for a rank outside the group
                work.wait()
        torch.maximum(t, other, out=t)
        mask <<= 1
    if rank + p < size:
        dist.send(t, group=group, group_dst=rank + p, tag=tag + 2)
