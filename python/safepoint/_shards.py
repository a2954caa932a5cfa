"""Sharded tensors: DTensor boxes on save, and loading into any sharding from storage.

Every tensor in an image may record the box it covers in a global tensor (``global_shape`` and
``global_offset``; docs/format.md). A DTensor is saved as its local shard with that box; a plain
tensor is its own whole box. Loading *into* a state (``restore``) from storage does not read
whole images: for each tensor of the target state it finds, across every rank's image of the
step, the saved pieces that overlap the box the target needs, and reads just those byte ranges
(whole 4 MiB checksum chunks, each verified). So a step saved by N ranks loads into M ranks
(resharding), with any Shard/Replicate placements, uneven splits included.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Mapping, MutableMapping
from typing import Any, Optional

import torch

from safepoint import _core
from safepoint.errors import CorruptionError, InvalidArgumentError, NotFoundError

# The dtypes images store, by the name an index entry gives (the same as torch's).
_DTYPES = {n: getattr(torch, n) for n in _core.DTYPES
           if isinstance(getattr(torch, n, None), torch.dtype)}

_SPAN_LIMIT = 64 << 20  # largest temporary buffer for one strided read


# -- box arithmetic: a box is (offset, lengths) in a row-major tensor of some shape -------------

def row_major_strides(shape: tuple) -> tuple:
    """Element strides of a contiguous tensor of `shape`."""
    strides, s = [], 1
    for n in reversed(shape):
        strides.append(s)
        s *= max(n, 1)
    return tuple(reversed(strides))


def box_span(offset: tuple, lengths: tuple, strides: tuple, itemsize: int) -> tuple[int, int]:
    """(first byte, bytes up to the end of the last element) of a non-empty box: the smallest
    contiguous byte range of the tensor that holds it."""
    first = sum(o * s for o, s in zip(offset, strides))
    last = sum((o + n - 1) * s for o, n, s in zip(offset, lengths, strides))
    return first * itemsize, (last - first + 1) * itemsize


def overlap(offset_a: tuple, lengths_a: tuple, offset_b: tuple,
            lengths_b: tuple) -> Optional[tuple[list, list]]:
    """(lo, hi) corners of the intersection of two boxes in one global tensor; None when it is
    empty (a 0-d tensor always overlaps itself)."""
    lo = [max(a, b) for a, b in zip(offset_a, offset_b)]
    hi = [min(a + n, b + m) for a, n, b, m in zip(offset_a, lengths_a, offset_b, lengths_b)]
    if lo and any(h <= l for l, h in zip(lo, hi)):
        return None
    return lo, hi


def split_box(offset: tuple, lengths: tuple, shape: tuple, itemsize: int):
    """Splits a box of a row-major tensor into sub-boxes that are each read as one byte range.

    A range is read whole, gaps included, while the gaps between its runs are shorter than a
    checksum chunk (a gap that short costs no extra I/O: its chunk is read anyway) and it fits a
    64 MiB buffer; otherwise the box is split along its outer dimensions."""
    if any(n == 0 for n in lengths):
        return
    strides = row_major_strides(shape)
    # k: the innermost dimension the box does not cover fully; everything inside it is contiguous.
    k = next((d for d in reversed(range(len(shape))) if lengths[d] != shape[d]), None)
    if k is None or all(n == 1 for n in lengths[:k]):
        yield offset, lengths  # one contiguous run
        return
    run = lengths[k] * strides[k] * itemsize
    j = next(d for d in reversed(range(k)) if lengths[d] > 1)  # innermost with several runs
    gap = strides[j] * itemsize - run
    _, span = box_span(offset, lengths, strides, itemsize)
    if gap < _core.CHUNK_SIZE and span <= _SPAN_LIMIT:
        yield offset, lengths
        return
    if gap >= _core.CHUNK_SIZE:
        d, per = j, 1
        for d0 in range(j):  # split the outer dimensions too, one index at a time
            if lengths[d0] > 1:
                d = d0
                break
    else:
        d = next(d for d in range(len(shape)) if lengths[d] > 1)
        per = max(1, _SPAN_LIMIT // (strides[d] * itemsize))
        if per >= lengths[d]:
            per = max(1, lengths[d] // 2)
    for i in range(offset[d], offset[d] + lengths[d], per):
        n = min(per, offset[d] + lengths[d] - i)
        yield from split_box(offset[:d] + (i,) + offset[d + 1:],
                             lengths[:d] + (n,) + lengths[d + 1:], shape, itemsize)


def _dtensor_type():
    """DTensor, if torch.distributed.tensor is loaded (no DTensor exists before it is, and
    importing it costs seconds)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return getattr(mod, "DTensor", None) if mod is not None else None


def dtensor_box(t: Any) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(local shard, global shape, global offset of the shard) of a DTensor. Called by the C++
    state walker for every DTensor it saves."""
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if any(isinstance(p, Partial) for p in t.placements):
        raise InvalidArgumentError("a DTensor with Partial placement holds unreduced values; "
                                   "redistribute it to Shard/Replicate before saving")
    local = t.to_local()
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if tuple(local.shape) != tuple(shape):
        raise InvalidArgumentError(f"local shard shape {tuple(local.shape)} does not match the "
                                   f"placement's {tuple(shape)}")
    return local, tuple(t.shape), tuple(int(x) for x in offset)


def _box(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    dt = _dtensor_type()
    if dt is not None and isinstance(t, dt):
        return dtensor_box(t)
    return t, tuple(t.shape), (0,) * t.dim()


def copy_tensor(target: torch.Tensor, loaded: torch.Tensor, where: str) -> None:
    """Copies a loaded tensor (a whole tensor or this rank's saved shard) into `target`, which
    may be a DTensor (its local shard is written)."""
    local, _, _ = _box(target)
    if tuple(local.shape) != tuple(loaded.shape):
        raise InvalidArgumentError(f"{where}: shape {tuple(loaded.shape)} in the checkpoint, "
                                   f"{tuple(local.shape)} in the state")
    with torch.no_grad():
        # From pinned memory (a registered snapshot slot) to a GPU the copy is asynchronous;
        # the restore synchronizes before the slot can be written again.
        local.copy_(loaded, non_blocking=local.is_cuda and loaded.is_pinned())


class _Piece:
    __slots__ = ("reader", "name", "dtype", "shape", "global_shape", "offset")

    def __init__(self, reader, entry) -> None:
        self.reader = reader
        self.name = entry.name
        self.dtype = entry.dtype
        self.shape = tuple(entry.shape)
        self.global_shape = tuple(entry.global_shape or entry.shape)
        self.offset = tuple(entry.global_offset or (0,) * len(self.shape))


class StepReader:
    """Every rank's image of one committed step, opened for partial reads (metadata only)."""

    def __init__(self, path: str, step: int) -> None:
        self.path, self.step = path, step
        self.readers = self._open_one_version(path, step)
        self.world_size = self.readers[0].world_size
        self.entries = [r.tensors() for r in self.readers]
        # name -> replica key -> the copies of that box (replicas on several ranks)
        self.pieces: dict[str, dict[bytes, list[_Piece]]] = {}
        for reader, entries in zip(self.readers, self.entries):
            for e in entries:
                if not e.elsewhere:  # the bytes are in this image
                    self.pieces.setdefault(e.name, {}).setdefault(
                        _core.replica_key(e.name, e.dtype, e.shape, e.global_shape,
                                          e.global_offset), []).append(_Piece(reader, e))

    @staticmethod
    def _open_one_version(path: str, step: int) -> list:
        """Every rank's reader, all of one COMMIT record: a step replaced meanwhile
        (safepoint.save(overwrite=True)) is opened again rather than mixed."""
        for tries in range(4):
            try:
                first = _core.ShardReader(path, step, 0)
                readers = [first] + [_core.ShardReader(path, step, r)
                                     for r in range(1, first.world_size)]
            except NotFoundError:  # an old image removed after the COMMIT record was replaced
                if tries == 3 or step not in _core.steps(path):
                    raise
                continue
            if all(r.generation == first.generation for r in readers):
                return readers
        raise NotFoundError(f"{path}: step {step} was replaced again and again while being read")

    def generation(self) -> int:
        return self.readers[0].generation

    def skeleton(self, rank: int, unpickler: Any) -> tuple[Any, list[_core.TensorInfo]]:
        """The state tree a rank saved (its non-tensor values), for rank `rank` of the loading
        world: the same rank when it existed, else rank 0."""
        r = rank if rank < self.world_size else 0
        return self.readers[r].state(unpickler), self.entries[r]

    def fill(self, requests: list[tuple[str, torch.Tensor, tuple, tuple]], rank: int) -> None:
        """For each (name, local tensor, global shape, global offset of the local tensor),
        assembles that box from the saved pieces into the local tensor. Of a box saved by
        several ranks (replicas), loading rank r reads copy r mod (number of copies), which
        spreads the reads across images."""
        reads: dict[int, list] = {}
        copies = []
        for name, local, gshape, goff in requests:
            boxes = self.pieces.get(name)
            if not boxes:
                raise NotFoundError(f"{self.path}: step {self.step} has no tensor '{name}'")
            want_dtype = str(local.dtype).removeprefix("torch.")
            covered = 0
            for copies_of_box in boxes.values():
                p = copies_of_box[rank % len(copies_of_box)]
                if p.global_shape != gshape:
                    what = "shape" if gshape == tuple(local.shape) else "global shape"
                    raise InvalidArgumentError(f"{name}: {what} {p.global_shape} in the "
                                               f"checkpoint, {gshape} in the state")
                if p.dtype != want_dtype:
                    raise InvalidArgumentError(f"{name}: dtype {p.dtype} in the checkpoint, "
                                               f"{want_dtype} in the state")
                box = overlap(goff, tuple(local.shape), p.offset, p.shape)
                if box is None:
                    continue
                lo, hi = box
                # The smallest contiguous span of the piece that holds the overlap.
                plo = tuple(l - o for l, o in zip(lo, p.offset))
                lengths = tuple(h - l for l, h in zip(lo, hi))
                strides = row_major_strides(p.shape)
                itemsize = local.element_size()
                first, nbytes = box_span(plo, lengths, strides, itemsize)
                buf = torch.empty(nbytes // itemsize, dtype=local.dtype)
                reads.setdefault(id(p.reader), [p.reader, []])[1].append(
                    (p.name, first, nbytes, buf.view(torch.uint8)))
                src = torch.as_strided(buf, lengths, strides, 0)
                dst = local[tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, goff))]
                copies.append((dst, src))
                covered += math.prod(h - l for l, h in zip(lo, hi))
            if covered < local.numel():
                raise NotFoundError(f"{self.path}: step {self.step} does not cover all of "
                                    f"'{name}' for this rank's shard (box {goff} + "
                                    f"{tuple(local.shape)})")
        for reader, batch in reads.values():
            reader.read(batch)
        with torch.no_grad():
            for dst, src in copies:
                dst.copy_(src)


def read_newest_into(path: str, step: Optional[int], rank: int, targets: Any,
                     unpickler: Any = None) -> tuple[int, Any]:
    """read_into() of `step`, or with step None of the newest committed step that reads back
    (a damaged newer one is skipped with a warning). Returns (step, tree)."""
    if step is not None:
        return step, read_into(path, step, rank, targets, unpickler)
    candidates = sorted(_core.steps(path), reverse=True)
    if not candidates:
        raise NotFoundError(f"{path}: no committed checkpoint")
    for s in candidates[:-1]:
        try:
            return s, read_into(path, s, rank, targets, unpickler)
        except (CorruptionError, NotFoundError) as e:
            warnings.warn(f"safepoint: skipped a damaged checkpoint: step {s}: {e}",
                          RuntimeWarning, stacklevel=3)
    return candidates[-1], read_into(path, candidates[-1], rank, targets, unpickler)


def read_into(path: str, step: int, rank: int, targets: Any, unpickler: Any = None,
              reader: Optional[StepReader] = None) -> Any:
    """Loads step `step` into `targets` (a state tree of tensors/DTensors, e.g. state dicts) for
    rank `rank` of the loading world, reading only the byte ranges its tensors need. Returns the
    tree to restore from: `targets` with its tensors filled in place, and the non-tensor values
    and the tensors the target does not have (e.g. optimizer state before the first step) taken
    from the checkpoint as the rank (or rank 0, for a rank the saving world did not have)
    saved them."""
    for tries in range(4):
        sr = reader or StepReader(path, step)
        try:
            return _read_into(sr, rank, targets, unpickler)
        except (NotFoundError, CorruptionError):
            # The step was replaced while its ranges were read (its old images removed): read
            # the new version. Anything else is a real error.
            if reader is not None or tries == 3:
                raise
            if StepReader(path, step).generation() == sr.generation():
                raise
    raise AssertionError("unreachable")


def _read_into(sr: StepReader, rank: int, targets: Any, unpickler: Any) -> Any:
    skeleton, entries = sr.skeleton(rank, unpickler)
    requests: list[tuple[str, torch.Tensor, tuple, tuple]] = []

    def merge(target: Any, saved: Any, where: str) -> Any:
        if isinstance(saved, _core.TensorSlot):
            e = entries[saved.index]
            if isinstance(target, torch.Tensor):
                local, gshape, goff = _box(target)
                requests.append((e.name, local, gshape, goff))
                return target
            t = torch.empty(e.shape, dtype=_DTYPES[e.dtype])
            requests.append((e.name, t, tuple(e.global_shape or e.shape),
                             tuple(e.global_offset or (0,) * len(e.shape))))
            return t
        if isinstance(target, MutableMapping) and isinstance(saved, Mapping):
            for k in target:
                if k not in saved:
                    raise InvalidArgumentError(f"{where}: key {k!r} is not in the checkpoint")
            return {k: merge(target.get(k), v, f"{where}.{k}") for k, v in saved.items()}
        if isinstance(saved, (list, tuple)):
            same = isinstance(target, (list, tuple)) and len(target) == len(saved)
            return type(saved)(merge(target[i] if same else None, v, f"{where}.{i}")
                               for i, v in enumerate(saved))
        if isinstance(saved, Mapping):
            return {k: merge(None, v, f"{where}.{k}") for k, v in saved.items()}
        return saved

    out = merge(targets, skeleton, "<root>")
    sr.fill(requests, rank)
    return out


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


def fill_elsewhere(path: str, step: int, rank: int, elsewhere: list,
                   generation: Optional[int] = None) -> bool:
    """Fills the tensors a loaded image left to other ranks' images (replicas written once).
    With `generation` (the loaded image's COMMIT record), returns False, filling nothing, when
    the step has been replaced since (safepoint.save(overwrite=True)): load it again."""
    if elsewhere:
        reader = StepReader(path, step)
        if generation is not None and reader.generation() != generation:
            return False
        reader.fill([(n, t, tuple(gs), tuple(go)) for n, t, gs, go in elsewhere], rank)
    return True
