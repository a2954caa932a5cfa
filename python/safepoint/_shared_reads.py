"""Restore at scale: ranks that need the same bytes of a step read them from storage once and
share them over the job's gloo group (``Checkpointer(share_reads=True)``, the default for
``restore`` with several ranks).

Each rank opens its own image (its state tree and the boxes it holds) and tells the others, in
the shared read's one all-gather, that image's index rows together with its byte ranges, or,
where its image does not hold every box it needs (replicas written once by another rank,
resharding), its requests: every rank then finds those boxes in the rows the others sent and
plans the same reads, and a rank opens another image only to read a range of it. So a restore
costs each rank its own image's metadata and the images it reads from, not every image of the
step (W x W opens across the job)."""

from __future__ import annotations

import time
import warnings
from typing import Any, Optional

import torch

from safepoint import _collectives, _core
from safepoint._shards import (
    ReadKey,
    StepReader,
    _add_stat,
    _Read,
    _requests,
    index_rows,
)
from safepoint.errors import Error, NotFoundError

_ALIGN = 64  # offset of each range in a shared buffer (any dtype can view it)
_MESSAGE_LIMIT = 32 << 20  # a reader reads and sends its part in messages of this size
_CUT = 1 << 20  # readers' parts of a shared buffer start at multiples of this


def _water_fill(loads: list[int], total: int) -> list[float]:
    """How many of `total` bytes each rank takes so that the ranks' loads end up as even as
    they can: the least loaded are filled up to a common level."""
    order = sorted(loads)
    level = float(total + order[0])
    for j in range(1, len(order) + 1):
        level = (total + sum(order[:j])) / j
        if j == len(order) or level <= order[j]:
            break
    return [max(0.0, level - x) for x in loads]


class SharedGroup:
    """Byte ranges that the same set of ranks all need, laid out in one buffer that each of
    them fills: `layout` gives each range's offset in it (in storage order, each aligned), and
    `shares` the part [lo, hi) of the buffer each reader reads from storage and sends to the
    other ranks of the set."""
    __slots__ = ("ranks", "layout", "size", "shares")

    def __init__(self, ranks: tuple, keys: list[ReadKey]) -> None:
        self.ranks = ranks
        self.layout: list[tuple[ReadKey, int]] = []
        self.size = 0
        for k in keys:
            self.layout.append((k, self.size))
            self.size += -(-k[3] // _ALIGN) * _ALIGN
        self.shares: list[tuple[int, int, int]] = []

    def pieces(self, lo: int, hi: int):
        """(key, offset of the key in the buffer, first, last byte of the key within [lo, hi))
        for every range that overlaps [lo, hi)."""
        for k, off in self.layout:
            a, b = max(lo, off), min(hi, off + k[3])
            if a < b:
                yield k, off, a - off, b - off


def plan_shared_reads(wants: list[list[tuple[ReadKey, tuple]]]) -> list[SharedGroup]:
    """Who reads which bytes from storage, when several ranks need the same ones.

    `wants[r]` is rank r's list of (key, position in the step) (empty for a rank that reads
    nothing). A range one rank needs, that rank reads. The ranges a set of ranks all need are
    laid out in storage order in one buffer, which is cut into one contiguous part per rank of
    the set (at MiB boundaries), sized so that every rank's total read (its own ranges included)
    ends up as even as it can be; each rank reads its part (neighbouring ranges, so no two
    readers read many of the same checksum chunks) and sends it to the rest of the set. Every
    rank computes the same plan. Only ranges that several ranks need appear in it."""
    wanters: dict[ReadKey, list[int]] = {}
    pos: dict[ReadKey, tuple] = {}
    for r, ws in enumerate(wants):
        for key, p in ws:
            if r not in wanters.setdefault(key, []):
                wanters[key].append(r)
            pos[key] = p
    load = [0] * len(wants)
    by_set: dict[tuple, list[ReadKey]] = {}
    for key, rs in wanters.items():
        if len(rs) == 1:
            load[rs[0]] += key[3]
        else:
            by_set.setdefault(tuple(sorted(rs)), []).append(key)
    groups = []
    for ranks in sorted(by_set, key=lambda w: (-sum(k[3] for k in by_set[w]), w)):
        g = SharedGroup(ranks, sorted(by_set[ranks], key=lambda k: (pos[k], k)))
        quota = _water_fill([load[r] for r in ranks], g.size)
        lo, acc = 0, 0.0
        for i, r in enumerate(ranks):
            acc += quota[i]
            hi = g.size if i == len(ranks) - 1 else min(g.size, round(acc / _CUT) * _CUT)
            if hi > lo:
                g.shares.append((r, lo, hi))
                load[r] += hi - lo
                lo = hi
        groups.append(g)
    return groups


def _wants(path: str, step: int, rank: int, everyone: list, sr: Optional[StepReader],
           group: Any) -> list[list[tuple[ReadKey, tuple]]]:
    """Every rank's byte ranges (key, position in the step), for plan_shared_reads, from what
    the ranks said in the all-gather: a rank whose opened images held every box it needs said
    its ranges; for a rank that asked (its requests), every rank plans them alike from the
    index rows of every image the ranks opened. Where some image is in nobody's rows (its
    rank restores from memory and opened nothing), one more all-gather brings them: the rank
    of the group numbered image mod group size opens it."""
    import torch.distributed as dist

    planned = [e for e in everyone if e is not None]
    wants: list[list[tuple[ReadKey, tuple]]] = [(e[3] or []) if e is not None else []
                                                 for e in everyone]
    asking = [q for q, e in enumerate(everyone) if e is not None and e[4] is not None]
    if not asking:
        return wants
    generation, world = planned[0][0], planned[0][1]
    rows: dict[int, list] = {}
    for e in planned:
        rows.update(e[2])
    view = sr if sr is not None else StepReader(path, step, known=(generation, world, {}))
    view.learn(rows)
    missing = view.missing()
    if missing:
        size = dist.get_world_size(group)
        more: Any = None
        try:
            more = {}
            for i in missing:
                if i % size == rank:
                    view.opened(i)
                    more[i] = index_rows(view.entries[i])
        except Error as e:
            more = f"{e}"
        gathered: list = [None] * size
        _collectives.all_gather_object(gathered, more, group)
        for m in gathered:
            if isinstance(m, str):
                raise NotFoundError(f"{path}: step {step}: another rank could not open an "
                                    f"image: {m}")
            view.learn(m)
    for q in asking:
        wanted = [(name, torch.empty(shape, dtype=dtype, device="meta"), gshape, goff)
                  for name, dtype, shape, gshape, goff in everyone[q][4]]
        reads, _ = view.needs_known(wanted, q)
        wants[q] = [(k, r.pos) for k, r in reads.items()]
    return wants


def read_shared_into(path: str, step: int, rank: int, targets: Any, unpickler: Any, group: Any,
                     need: bool, has_copy: bool = False, stats: Optional[dict] = None,
                     commit: Optional[_core.Commit] = None
                     ) -> tuple[Optional[Any], Optional[bool]]:
    """read_into() as a collective of every rank of `group` (a gloo group of the whole world),
    for the ranks whose `need` is true: the bytes that several of them need are read from
    storage once, split among them (plan_shared_reads), and each reader sends its part to the
    others over the group in a few large messages (not one per tensor). Ranges that only one
    rank needs it reads itself. `has_copy`: a rank that needs nothing holds its copy of the step
    already (memory, peers).

    Returns (the tree to restore from, whether every rank of the group now holds its copy of the
    step). The tree is None for a rank that needs nothing, and for every rank when any rank could
    not plan or read its part (a damaged range, a step replaced meanwhile): then none of them
    has loaded anything, the second item is None (not known: each can read on its own as
    read_into() does, and the caller's agreement decides), and False only where the shared read
    worked but some rank neither needed it nor holds a copy. The answer comes from the shared
    read's own all-reduce: no other collective is needed to know that every rank read the step.
    Raises only when the group itself fails (a peer died). Counts bytes under
    stats["storage_bytes_read"], ["peer_bytes_sent"] and ["peer_bytes_received"], and the time
    this rank spent reading from storage and waiting for the exchange to end after its reads
    under ["storage_read_seconds"] and ["exchange_seconds"]. `commit`: the step's COMMIT record,
    already read (the agreement's lister handed it over): the rank reads no record."""
    import torch.distributed as dist

    size = dist.get_world_size(group)
    said: Any = None
    sr: Optional[StepReader] = None
    reads: dict[ReadKey, _Read] = {}
    copies: list = []
    requests: list = []
    out: Any = None
    if need:
        try:
            sr = StepReader(path, step, rank, commit=commit)
            # The images of saving ranks this world does not have (a step saved by more
            # ranks): every size-th one is this rank's to open, so that the all-gather holds
            # every image's rows.
            for image in range(size + rank, sr.world_size, size):
                sr.opened(image)
            out, requests = _requests(sr, rank, targets, unpickler)
            ask = None
            try:
                reads, copies = sr.needs_known(requests, rank)
            except NotFoundError:  # boxes in images this rank has not opened: planned below
                ask = [(name, local.dtype, tuple(local.shape), gshape, goff)
                       for name, local, gshape, goff in requests]
            said = (sr.generation(), sr.world_size, sr.known_rows(),
                    None if ask is not None else [(k, r.pos) for k, r in reads.items()], ask)
        except Error as e:
            warnings.warn(f"safepoint: step {step}: cannot plan the shared read: {e}",
                          RuntimeWarning, stacklevel=3)
            said = "failed"
    everyone: list = [None] * size
    _collectives.all_gather_object(everyone, said, group)
    planned = [e for e in everyone if e is not None]
    if any(e == "failed" for e in planned) or len({e[0] for e in planned}) > 1:
        return None, None  # one rank cannot take part, or the ranks see different versions
    try:
        wants = _wants(path, step, rank, everyone, sr, group)
        if need and everyone[rank][4] is not None:
            assert sr is not None
            reads, copies = sr.needs_known(requests, rank)
    except Error as e:
        # The same on every rank (the same rows and requests): none reads, each can on its own.
        warnings.warn(f"safepoint: step {step}: cannot plan the shared read: {e}",
                      RuntimeWarning, stacklevel=3)
        return None, None
    plan = plan_shared_reads(wants)

    # This rank's buffers: one per set of ranks it is in, one per range only it needs.
    bufs: dict[ReadKey, torch.Tensor] = {}
    flats: dict[int, torch.Tensor] = {}
    for i, g in enumerate(plan):
        if rank in g.ranks:
            flat = flats[i] = torch.empty(g.size, dtype=torch.uint8)
            for k, off in g.layout:
                bufs[k] = flat[off:off + k[3]]
    own = []  # the ranges only this rank needs
    if need:
        for k, r in reads.items():
            if k not in bufs:
                bufs[k] = torch.empty(r.nbytes, dtype=torch.uint8)
                own.append((r.reader, r.name, r.first, r.nbytes, bufs[k]))

    ok = True

    def read(items: list) -> None:
        nonlocal ok
        if ok:
            try:
                StepReader.read(items, stats)
            except Error as e:
                warnings.warn(f"safepoint: step {step}: cannot read this rank's share: {e}",
                              RuntimeWarning, stacklevel=4)
                ok = False

    # Every rank numbers the messages of the whole plan alike (the tag of each). A rank posts
    # its receives first, then reads its parts message by message and sends each as soon as it
    # is read, so its reads overlap its sends; its own ranges it reads last. A rank whose read
    # failed still sends (what it has) so that no one waits forever: the all-reduce after the
    # exchange tells every rank not to use any of it.
    works, tag = [], 0
    mine = []
    for i, g in enumerate(plan):
        for reader, lo, hi in g.shares:
            for first in range(lo, hi, _MESSAGE_LIMIT):
                tag += 1
                last = min(hi, first + _MESSAGE_LIMIT)
                if reader == rank:
                    mine.append((i, g, first, last, tag))
                elif i in flats:
                    part = flats[i][first:last]
                    works.append(dist.irecv(part, dist.get_global_rank(group, reader),
                                            group=group, tag=tag))
                    _add_stat(stats, "peer_bytes_received", part.numel())
    for i, g, first, last, tag in mine:
        flat = flats[i]
        read([(reads[k].reader, reads[k].name, reads[k].first + a, b - a,
               flat[off + a:off + b]) for k, off, a, b in g.pieces(first, last)])
        for dst in g.ranks:
            if dst != rank:
                works.append(dist.isend(flat[first:last], dist.get_global_rank(group, dst),
                                        group=group, tag=tag))
                _add_stat(stats, "peer_bytes_sent", last - first)
    read(own)
    t0 = time.perf_counter()
    for w in works:
        if w is not None:
            w.wait()
    _add_stat(stats, "exchange_seconds", time.perf_counter() - t0)
    # [a read failed somewhere, a rank ends without a copy]
    failed = torch.tensor([0 if ok else 1, 0 if need or has_copy else 1], dtype=torch.int32)
    _collectives.all_reduce_max(failed, group)
    if int(failed[0].item()):
        return None, None
    all_have = int(failed[1].item()) == 0
    if not need:
        return None, all_have
    StepReader.copy_out(copies, bufs)
    return out, all_have
