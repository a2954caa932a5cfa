"""The restore agreement: with several ranks, every rank resumes from the same step.

Each rank states what it could load (the save attempt of each snapshot in its memory or its
peers' memory, and whether it already loaded its newest one: the hot reload); one rank, the
lister (rank 0 of the group), also states the committed steps and the storages each is on, which
it alone asked storage for (one List and the newest COMMIT record per storage, for the whole
job). One all-gather of fixed-size rows carries it all (``_collectives.all_gather``: recursive
doubling, log2 W rounds); from them every rank computes the same
outcome: the hot reload's step, or candidate steps that all try newest first, falling back
together to the next older one when any rank fails to read it (docs/architecture.md, "Loading:
the fastest valid copy, agreed by all ranks"). The lister's row also carries the COMMIT record it
read of the newest committed step, so that a rank that reads that step from storage reads its
image alone, checked against the record (no COMMIT read per rank). The collectives run over the
Checkpointer's own gloo group; the Checkpointer does the reading.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

from safepoint import _collectives

# The statement of one rank, a fixed row of int64 (ROW of them, whatever the world size): the
# head, then the newest MEMORY (step, attempt) pairs of its snapshots in memory (or its peers'),
# then, from the lister alone, the newest STORED (step, storages) pairs of the committed steps.
MEMORY = 6
STORED = 8
_HEAD = 8
ROW = _HEAD + 2 * MEMORY + 2 * STORED
_LOADED, _STEP, _ATTEMPT, _NEWEST, _SHARE, _FLAGS, _N_MEMORY, _N_STORED = range(_HEAD)
_FAILED = 1  # the lister could not list the storage (its error class: flags >> 8)
_MORE = 2  # the lister holds older committed steps than its row states
_NONE = -(1 << 63)  # an attempt of None

# After the ROW, the lister's COMMIT record of the newest committed step: [its step, its length
# in bytes | the index of the storage it was read from << 32], then its bytes in int64 words
# (zeros on the other ranks' rows). The slot holds the largest record of a step saved by this
# world (docs/format.md, "COMMIT record": 100 bytes, 16 a rank at most, generation and CRC)
# while that is at most RECORD_LIMIT bytes (W <= 249): every rank gathers every row, W slots.
# Beyond that the rows carry the two header words alone, and the lister broadcasts the bytes
# after the all-gather (one collective more, the record's size a rank), unless the rows decide
# a hot reload, which needs no record: every rank reading the record itself cost storage W
# COMMIT reads and the job (100 + 12 W) W bytes of them.
RECORD_LIMIT = 4096
_RECORD_FIXED = 100 + 8 + 4


def record_words(world_size: int) -> int:
    """The int64 words of the record slot in every rank's row for a world of `world_size` ranks
    (2: the header alone, the bytes follow in a broadcast)."""
    size = _RECORD_FIXED + 16 * world_size
    return 2 + (size + 7) // 8 if size <= RECORD_LIMIT else 2

# The error a rank that is not the lister raises when the lister could not list the storage:
# the class of the lister's error, by index.
_ERRORS = ("Error", "NotFoundError", "CorruptionError", "StorageError", "InvalidArgumentError",
           "UnavailableError", "PermissionDeniedError", "ResourceExhaustedError",
           "CancelledError", "AlreadyExistsError")


def _int64(v: Optional[int]) -> int:
    """An attempt (an unsigned 64-bit id, or None) as one int64, exactly."""
    if v is None:
        return _NONE
    return v - (1 << 64) if v >= 1 << 63 else v


def _uint64(v: int) -> Optional[int]:
    if v == _NONE:
        return None
    return v + (1 << 64) if v < 0 else v


class Statement:
    """What one rank states in the agreement: whether it loaded `step` (of save `attempt`) from
    its memory, verified, before the agreement (the hot reload); the save attempt of each
    snapshot it could read from memory (its own, else one its peers can rebuild); whether it
    shares its storage reads (restore with share_reads). The lister (rank 0 of the group, the
    one rank that asks storage) adds ``stored`` (step -> indexes into the storages, fastest
    first, of those that hold it committed), the newest committed step, or the ``error`` that
    kept it from listing, and ``record``: (step, index of the storage, the bytes of the COMMIT
    record it read of that step there), the newest step's, which the other ranks read against."""

    def __init__(self, loaded: bool, step: Optional[int], attempt: Optional[int],
                 attempts: dict[int, Any], share: bool,
                 stored: Optional[dict[int, list[int]]] = None, newest_committed: int = -1,
                 error: Optional[BaseException] = None,
                 record: Optional[tuple[int, int, bytes]] = None) -> None:
        self.loaded, self.step, self.attempt = loaded, step, attempt
        self.attempts, self.share = attempts, share
        self.stored, self.newest_committed, self.error = stored or {}, newest_committed, error
        self.record = record

    def row(self, asked: Optional[int], world_size: int = 0) -> list[int]:
        """This rank's row: ROW int64, then the record slot of a world of `world_size` ranks."""
        words = record_words(world_size)
        out = [0] * (ROW + words)
        if words and self.record is not None:
            s, store, data = self.record
            inline = words > 2
            if ((not inline or len(data) <= 8 * (words - 2)) and 0 < len(data) < 1 << 32
                    and (asked is None or s == asked)):
                out[ROW], out[ROW + 1] = s, len(data) | store << 32
                padded = data + bytes(-len(data) % 8) if inline else b""
                for i in range(len(padded) // 8):
                    out[ROW + 2 + i] = int.from_bytes(padded[8 * i:8 * i + 8], "little",
                                                      signed=True)
        out[_LOADED] = 1 if self.loaded else 0
        out[_STEP] = self.step if self.step is not None else -1
        out[_ATTEMPT] = _int64(self.attempt)
        out[_NEWEST] = self.newest_committed
        out[_SHARE] = 1 if self.share else 0
        flags = 0
        if self.error is not None:
            name = type(self.error).__name__
            flags |= _FAILED | ((_ERRORS.index(name) if name in _ERRORS else 0) << 8)
        memory = sorted(self.attempts.items(), reverse=True)[:MEMORY]
        out[_N_MEMORY] = len(memory)
        for i, (s, a) in enumerate(memory):
            out[_HEAD + 2 * i], out[_HEAD + 2 * i + 1] = s, _int64(a)
        stored = sorted((s, u) for s, u in self.stored.items()
                        if asked is None or s == asked)[::-1]
        if len(stored) > STORED:
            flags |= _MORE
        out[_N_STORED] = min(len(stored), STORED)
        at = _HEAD + 2 * MEMORY
        for i, (s, uris) in enumerate(stored[:STORED]):
            out[at + 2 * i], out[at + 2 * i + 1] = s, sum(1 << u for u in uris)
        out[_FLAGS] = flags
        return out


class Agreement:
    """The outcome, computed from every rank's row alone (so the same on every rank): ``hot``
    when every rank loaded the same step of the same save attempt from memory and, the newest
    step asked for, none is committed newer (that step is the one the candidates below would
    give first: the result, with no other collective); else the candidates: ``steps`` (the
    asked-for step, if any, among them), ``in_memory`` (those every rank holds a snapshot of, of
    one save attempt), ``committed`` (step -> the storages the lister found it committed on,
    fastest first) and whether every rank shares its storage reads (``share``)."""

    def __init__(self, rows: list[list[int]], stores: list[str], step: Optional[int],
                 group: Any, lister: Optional[Statement]) -> None:
        self._stores, self._group, self._lister, self._asked = stores, group, lister, step
        first = rows[0]
        self._failed = int(first[_FLAGS]) if first[_FLAGS] & _FAILED else 0
        self.hot = (all(r[_LOADED] == 1 and r[_STEP] == first[_STEP]
                        and r[_ATTEMPT] == first[_ATTEMPT] for r in rows)
                    and not (step is None and first[_STEP] < first[_NEWEST]))
        self.hot_step = first[_STEP] if self.hot else None
        self.share = all(r[_SHARE] == 1 for r in rows)
        memory = [{r[_HEAD + 2 * i]: _uint64(r[_HEAD + 2 * i + 1]) for i in range(r[_N_MEMORY])}
                  for r in rows]
        self.in_memory = {s for s, a in memory[0].items()
                          if a is not None and all(m.get(s) == a for m in memory[1:])}
        at = _HEAD + 2 * MEMORY
        self.committed = {first[at + 2 * i]: self._uris(first[at + 2 * i + 1])
                          for i in range(first[_N_STORED])}
        self.more = bool(first[_FLAGS] & _MORE)
        self.steps = self.in_memory | set(self.committed)
        if step is not None:
            self.steps &= {step}
        self._record: Optional[tuple[int, str, bytes]] = None
        # The record's header without its bytes (a world over 249 ranks): (step, storage, length)
        # for agree() to broadcast.
        self._to_broadcast: Optional[tuple[int, str, int]] = None
        if len(first) >= ROW + 2 and first[ROW + 1]:
            n, store = first[ROW + 1] & 0xFFFFFFFF, first[ROW + 1] >> 32
            if 0 <= store < len(stores) and len(first) == ROW + 2:
                self._to_broadcast = (first[ROW], stores[store], n)
            elif 0 <= store < len(stores):
                data = b"".join(int(w).to_bytes(8, "little", signed=True)
                                for w in first[ROW + 2:ROW + 2 + (n + 7) // 8])[:n]
                self._record = (first[ROW], stores[store], data)

    def record(self, s: int, uri: str) -> Optional[bytes]:
        """The bytes of the COMMIT record of step `s` on the storage at `uri` as the lister read
        it (a rank reads its image against it instead of reading the record), None when the
        lister's row does not carry that one."""
        if self._record is not None and self._record[0] == s and self._record[1] == uri:
            return self._record[2]
        return None

    def listing_error(self) -> Optional[BaseException]:
        """The error to raise on this rank when the lister could not list the storage (the
        lister's own, or one of its class naming rank 0), else None. Then ``hot`` says only
        whether every rank loaded the same snapshot from memory: no committed step is known."""
        if not self._failed:
            return None
        if self._lister is not None and self._lister.error is not None:
            return self._lister.error
        from safepoint import errors

        kind = getattr(errors, _ERRORS[(self._failed >> 8) % len(_ERRORS)])
        return kind(f"{self._stores[0]}: rank 0, which lists the committed steps for the job, "
                    "could not list them (its error says why)")

    def _uris(self, mask: int) -> list[str]:
        return [u for i, u in enumerate(self._stores) if mask >> i & 1]

    def shared_uri(self, s: int) -> Optional[str]:
        """The fastest storage step `s` is committed on (the ranks' shared reads are a
        collective over one storage); None: no sharing for it."""
        if not self.share:
            return None
        uris = self.committed.get(s)
        return uris[0] if uris else None

    def older(self) -> set[int]:
        """The committed steps older than those the lister's row stated (a second round, only
        when every stated one failed and the lister holds more: one broadcast from it). Adds
        them to ``committed`` and returns them."""
        if not self.more:
            return set()
        import torch.distributed as dist

        self.more = False
        rest: list[dict[int, list[str]]] = [{}]
        if self._lister is not None:
            oldest = min(self.committed) if self.committed else None
            rest = [{s: [self._stores[u] for u in uris]
                     for s, uris in self._lister.stored.items()
                     if (oldest is None or s < oldest)
                     and (self._asked is None or s == self._asked)}]
        dist.broadcast_object_list(rest, src=dist.get_global_rank(self._group, 0),
                                   group=self._group)
        self.committed.update(rest[0])
        return set(rest[0])


def agree(group: Any, world_size: int, mine: Statement, stores: list[str],
          step: Optional[int]) -> Agreement:
    """The restore agreement in one collective: one all-gather of every rank's statement as a
    fixed row of int64 (ROW and the record slot: at most 4.4 KiB a rank, nothing pickled). The
    storage view in it is the lister's alone (rank 0 of the group asks storage, once for the
    job; every rank restores what the lister found). When the lister could not list the
    storage, every rank learns its error (``listing_error``; the caller decides whether memory
    serves). The rows end in the record slot (``record_words``), which carries the lister's
    COMMIT record of the newest step (``Agreement.record``); in a world over 249 ranks it
    carries the record's header alone, and the lister broadcasts the bytes (a second
    collective) unless the rows decide a hot reload."""
    import torch
    import torch.distributed as dist

    row = torch.tensor(mine.row(step, world_size), dtype=torch.int64)
    everyone = _collectives.all_gather(row, group)  # log2 W rounds, not gloo's ring
    lister = mine if dist.get_rank(group) == 0 else None
    agreement = Agreement(everyone.tolist(), stores, step, group, lister)
    pending = agreement._to_broadcast
    if pending is not None and not agreement.hot:
        # A world whose record does not fit the rows: the lister sends its bytes to every rank
        # (decided from the rows alone, so alike on every rank).
        s, uri, n = pending
        if lister is not None and lister.record is not None:
            data = torch.frombuffer(bytearray(lister.record[2]), dtype=torch.uint8)
        else:
            data = torch.empty(n, dtype=torch.uint8)
        dist.broadcast(data, src=dist.get_global_rank(group, 0), group=group)
        agreement._record = (s, uri, data.numpy().tobytes())
    return agreement


class Known:
    """What a load of one step returned (``value``, None when it did not read back) together
    with whether every rank of the group read the step (``everyone``): the load ran a collective
    of its own that told every rank so (the shared read's all-reduce), so load_newest_agreed
    runs none of its own for that step."""

    __slots__ = ("value", "everyone")

    def __init__(self, value: Any, everyone: bool) -> None:
        self.value, self.everyone = value, everyone


def load_newest_agreed(group: Any, steps: set[int], load: Callable[[int], Any],
                       older: Optional[Callable[[], set[int]]] = None) -> Any:
    """Every rank loads the newest of `steps` (`load`: this rank's copy of a step, None when none
    reads back, or a ``Known``, the same on every rank); when any rank failed, all fall back
    together to the next older step. What `load` returned for the step every rank read, or None
    when there is none. `older`: when every step failed, more steps to try (a collective every
    rank calls alike; empty: none)."""
    import torch

    steps = set(steps)
    if not steps and older is not None:
        steps = older()
    while steps:
        candidate = max(steps)
        got = load(candidate)
        if isinstance(got, Known):
            ok, got = got.everyone, got.value
        else:
            failed = torch.tensor([0 if got is not None else 1], dtype=torch.int32)
            _collectives.all_reduce_max(failed, group)
            ok = int(failed.item()) == 0
        if ok:
            return got
        warnings.warn(f"safepoint: a rank could not read step {candidate}; all ranks fall "
                      "back to an older step", RuntimeWarning, stacklevel=4)
        steps.discard(candidate)
        if not steps and older is not None:
            steps = older()
    return None


def agree_on_step(group: Any, step: int) -> int:
    """Rank 0's `step`, on every rank (a branch: every rank starts from the step rank 0
    resolved)."""
    import torch.distributed as dist

    agreed = [step]
    dist.broadcast_object_list(agreed, src=0, group=group)
    return int(agreed[0])
