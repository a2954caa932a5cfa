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

import collections
import functools
import math
import sys
import time
import warnings
from collections.abc import Mapping, MutableMapping
from typing import Any, Optional

import torch

from safepoint import _core, _device_fill
from safepoint._keys import missing_key
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

    if any(isinstance(p, Partial) for p in t.placements):
        raise InvalidArgumentError("a DTensor with Partial placement holds unreduced values; "
                                   "redistribute it to Shard/Replicate before saving")
    with torch.no_grad():  # the DTensor's own local tensor (as the C++ plan walk reads it)
        local = t.to_local()
    mesh = t.device_mesh
    shape, offset = _shard_box(tuple(t.shape), mesh, tuple(t.placements), _coordinate(mesh))
    if tuple(local.shape) != tuple(shape):
        raise InvalidArgumentError(f"local shard shape {tuple(local.shape)} does not match the "
                                   f"placement's {tuple(shape)}")
    return local, tuple(t.shape), offset


def _coordinate(mesh: Any) -> Optional[tuple[int, ...]]:
    c = mesh.get_coordinate()
    return None if c is None else tuple(c)


@functools.lru_cache(maxsize=1 << 14)
def _shard_box(shape: tuple[int, ...], mesh: Any, placements: tuple[Any, ...],
               coordinate: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offset) of this rank's shard: computed once per (global shape, mesh,
    placements, this rank's mesh coordinate) instead of at every save and load of the DTensor.

    No placements (a 0-dimensional mesh, as ``DeviceMesh("cpu", 1)`` builds: nothing is split,
    every dimension is replicated): the local tensor is the whole tensor, on every rank. torch's
    own computation gives an empty box there on a rank the mesh's one device does not name (its
    coordinate is None), while ``to_local()`` is the whole tensor."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    del coordinate  # part of the key: the offset is this rank's
    if not placements:
        return tuple(shape), (0,) * len(shape)
    local, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    return tuple(int(x) for x in local), tuple(int(x) for x in offset)


def _box(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    dt = _dtensor_type()
    if dt is not None and isinstance(t, dt):
        return dtensor_box(t)
    return t, tuple(t.shape), (0,) * t.dim()


def copy_tensor(target: torch.Tensor, loaded: torch.Tensor, where: str) -> None:
    """Copies a loaded tensor (a whole tensor or this rank's saved shard) into `target`, which
    may be a DTensor (its local shard is written). A loaded DTensor (a whole restore hands back
    the state's own tensors, which a Stateful's state_dict() may give anew) gives its shard."""
    local, _, _ = _box(target)
    loaded, _, _ = _box(loaded)
    if tuple(local.shape) != tuple(loaded.shape):
        raise InvalidArgumentError(f"{where}: shape {tuple(loaded.shape)} in the checkpoint, "
                                   f"{tuple(local.shape)} in the state")
    with torch.no_grad():
        # From pinned memory (a registered snapshot slot) to a GPU the copy is asynchronous;
        # the restore synchronizes before the slot can be written again.
        local.copy_(loaded, non_blocking=local.is_cuda and loaded.is_pinned())


# What a rank tells the others of an image it opened (the shared read's exchange), so that they
# need not open it to learn which boxes it holds: one row per entry whose bytes the image holds,
# (index, name, dtype, shape, global shape or None, global offset or None, data offset).
IndexRow = tuple[int, str, str, tuple, Optional[tuple], Optional[tuple], int]


def index_rows(entries: list) -> list[IndexRow]:
    """The rows (IndexRow) of an image's index entries (ShardReader.tensors())."""
    return [(i, e.name, e.dtype, tuple(e.shape),
             None if e.global_shape is None else tuple(e.global_shape),
             None if e.global_offset is None else tuple(e.global_offset), e.offset)
            for i, e in enumerate(entries) if not e.elsewhere]


class _Piece:
    __slots__ = ("reader", "image", "index", "name", "dtype", "shape", "global_shape", "offset",
                 "at")

    def __init__(self, reader, image: int, row: IndexRow) -> None:
        self.reader = reader
        self.image, self.index = image, row[0]  # (rank of the image, entry): where the bytes are
        self.name, self.dtype, self.shape = row[1], row[2], row[3]
        self.global_shape = row[4] or self.shape
        self.offset = row[5] or (0,) * len(self.shape)
        self.at = row[6]  # where its bytes start in the image


class _Image:
    """An image of the step that this rank knows from another rank's index rows (the shared
    read's exchange) and has not opened: it is opened when a range of it is first read, and
    its index checked against the rows."""
    __slots__ = ("_step", "image")

    def __init__(self, step_reader: StepReader, image: int) -> None:
        self._step, self.image = step_reader, image

    def _reader(self) -> Any:
        return self._step.opened(self.image)

    def read(self, batch: list) -> None:
        self._reader().read(batch)

    @property
    def chunk_size(self) -> int:
        return self._reader().chunk_size


# A byte range of one image that a loading rank needs: (image rank, tensor name, first byte,
# bytes). Two ranks that need the same key need the same bytes.
ReadKey = tuple[int, str, int, int]


class _Read:
    """A byte range to read (see ReadKey) and where it lies in the step (image, entry, first
    byte), the order in which ranges are read; `at`: where it starts in its image."""
    __slots__ = ("reader", "name", "first", "nbytes", "pos", "at")

    def __init__(self, piece: _Piece, first: int, nbytes: int) -> None:
        self.reader, self.name, self.first, self.nbytes = piece.reader, piece.name, first, nbytes
        self.pos = (piece.image, piece.index, first)
        self.at = piece.at + first


def _add_stat(stats: Optional[dict], key: str, n: float) -> None:
    if stats is not None:
        stats[key] = stats.get(key, 0) + n


class StepReader:
    """The images of one committed step, opened for partial reads (metadata only).

    With `rank` (the loading rank), only that rank's image is opened at first (rank 0's for a
    rank the saving world did not have), and the others only when a restore needs a tensor it
    does not hold (replicas written once, resharding): a restore into the world that saved the
    step, where each rank's own image holds its tensors, costs each rank one image's header and
    index instead of every image's (W x W opens across the job). Without `rank`, every image is
    opened (export, inspection). A shared read (_shared_reads) learns the other images' index
    rows from the ranks that opened them (``learn``) and opens an image only to read from it.

    `known`: build the reader from index rows alone, opening nothing (a rank that takes part in
    a shared read without reading: it plans with the others); `commit` is then the step's
    generation and world size, (generation, world_size).

    `commit`: the step's COMMIT record, already read (the restore agreement's lister read it and
    handed its bytes to every rank: ``_core.commit_from_bytes``): the images are opened against
    it and the record is not read, unless an image is gone (the step replaced meanwhile)."""

    def __init__(self, path: str, step: int, rank: Optional[int] = None,
                 known: Optional[tuple[int, int, dict[int, list[IndexRow]]]] = None,
                 commit: Optional[_core.Commit] = None) -> None:
        self.path, self.step = path, step
        self.readers: dict[int, Any] = {}
        self.entries: dict[int, list] = {}
        self.rows: dict[int, list[IndexRow]] = {}  # images known by their rows, not opened
        # name -> replica key -> the copies of that box (replicas on several ranks)
        self.pieces: dict[str, dict[bytes, list[_Piece]]] = {}
        if known is not None:
            self._commit: Any = None
            self._generation, self.world_size, rows = known
            self.learn(rows)
            return
        for tries in range(4):
            # One COMMIT record for every image opened, now or later: each is checked against
            # it, so a step replaced meanwhile (safepoint.save(overwrite=True)) fails the open
            # (NotFoundError: its images are named by attempt) rather than mixing versions.
            if commit is None or commit.step != step or tries:
                commit = _core.step_commit(path, step)
            self._commit = commit
            self._generation = commit.generation
            self.world_size = commit.world_size
            self.readers, self.entries, self.pieces = {}, {}, {}
            try:
                if rank is None:
                    self.open_all()
                else:
                    self._open(rank if rank < self.world_size else 0)
                return
            except NotFoundError:  # an old image removed after the COMMIT record was replaced
                if tries == 3 or step not in _core.steps(path):
                    raise
        raise NotFoundError(f"{path}: step {step} was replaced again and again while being read")

    def _open(self, image: int) -> None:
        if image in self.rows:
            self.opened(image)  # its pieces are known already
        elif image not in self.readers:
            reader = self._shard_reader(image)
            self._add(image, reader, reader.tensors())

    def _shard_reader(self, image: int) -> Any:
        if self._commit is None:  # built from rows: the record is read now, and must agree
            self._commit = _core.step_commit(self.path, self.step)
            if self._commit.generation != self._generation:
                raise NotFoundError(f"{self.path}: step {self.step} was replaced while it was "
                                    "being read")
        return _core.ShardReader(self.path, self.step, image, self._commit)

    def _add(self, image: int, reader: Any, entries: list) -> None:
        self.readers[image], self.entries[image] = reader, entries
        for row in index_rows(entries):
            self._add_piece(image, reader, row)

    def _add_piece(self, image: int, reader: Any, row: IndexRow) -> None:
        _, name, dtype, shape, gshape, goff, _ = row
        self.pieces.setdefault(name, {}).setdefault(
            _core.replica_key(name, dtype, shape, gshape, goff), []).append(
            _Piece(reader, image, row))

    def open_all(self) -> None:
        """Opens every image not opened yet. The copies of a box are listed in image order
        whatever was opened first, so that every rank picks the same copies as needs() does."""
        if len(self.readers) == self.world_size:
            return
        for image in range(self.world_size):
            if image not in self.readers:
                reader = self._shard_reader(image)
                self.readers[image], self.entries[image] = reader, reader.tensors()
                self.rows.pop(image, None)
        self._rebuild()

    def _rebuild(self) -> None:
        """The pieces of every image opened or known by its rows, in image order."""
        self.pieces = {}
        for image in sorted(set(self.readers) | set(self.rows)):
            if image in self.readers:
                for row in index_rows(self.entries[image]):
                    self._add_piece(image, self.readers[image], row)
            else:
                handle = _Image(self, image)
                for row in self.rows[image]:
                    self._add_piece(image, handle, row)

    def known_rows(self) -> dict[int, list[IndexRow]]:
        """The index rows of the images this reader opened (what it tells the other ranks)."""
        return {image: index_rows(entries) for image, entries in self.entries.items()}

    def learn(self, rows: Mapping[int, list[IndexRow]]) -> None:
        """Adds the images that other ranks opened, by their index rows: their boxes are found
        without opening them (opened() opens one when a range of it is read)."""
        fresh = {i: r for i, r in rows.items()
                 if i not in self.readers and i not in self.rows and 0 <= i < self.world_size}
        if fresh:
            self.rows.update(fresh)
            self._rebuild()

    def missing(self) -> list[int]:
        """The images neither opened nor known by their rows."""
        return [i for i in range(self.world_size) if i not in self.readers and i not in self.rows]

    def opened(self, image: int) -> Any:
        """The ShardReader of `image`, opened now if it is not yet. An image known by its rows
        is checked (its index must be what the rows said); one not known adds its pieces."""
        if image not in self.readers:
            reader = self._shard_reader(image)
            entries = reader.tensors()
            known = self.rows.get(image)
            if known is not None and index_rows(entries) != known:
                raise CorruptionError(f"{self.path}: step {self.step}: the index of rank "
                                      f"{image}'s image differs from the one another rank read")
            self.readers[image], self.entries[image] = reader, entries
            if known is None:
                self._rebuild()
        return self.readers[image]

    def generation(self) -> int:
        return self._generation

    def skeleton(self, rank: int, unpickler: Any) -> tuple[Any, list[_core.TensorInfo]]:
        """The state tree a rank saved (its non-tensor values), for rank `rank` of the loading
        world: the same rank when it existed, else rank 0."""
        r = rank if rank < self.world_size else 0
        self._open(r)
        return self.readers[r].state(unpickler), self.entries[r]

    def needs(self, requests: list[tuple[str, torch.Tensor, tuple, tuple]],
              rank: int) -> tuple[dict[ReadKey, _Read], list]:
        """What fill() reads and copies: (the byte ranges, by key; the copies, each (local
        destination, key of its source range, strided view of that range)). Of a box saved by
        several ranks (replicas), loading rank r reads copy r mod (number of copies), which
        spreads the reads across images. Where the images opened (or known) so far do not hold
        every box, every image is opened and the plan made again."""
        if self.missing():
            try:
                return self.needs_known(requests, rank)
            except NotFoundError:
                self.open_all()
        return self.needs_known(requests, rank)

    def needs_known(self, requests: list[tuple[str, torch.Tensor, tuple, tuple]],
                    rank: int) -> tuple[dict[ReadKey, _Read], list]:
        """needs() from the images opened or known so far alone (NotFoundError where they do
        not hold every box). The tensors of `requests` may be on the meta device: another
        rank's requests, planned here (_shared_reads)."""
        reads: dict[ReadKey, _Read] = {}
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
                if p.offset == goff and p.shape == tuple(local.shape):
                    # The usual restore: the saved piece is exactly this tensor's box, so the
                    # range is the whole piece and the destination the whole tensor.
                    nbytes = math.prod(p.shape) * local.element_size()
                    if nbytes == 0:
                        continue
                    key = (p.image, p.name, 0, nbytes)
                    reads.setdefault(key, _Read(p, 0, nbytes))
                    copies.append((local, key, p.shape, row_major_strides(p.shape)))
                    covered += local.numel()
                    continue
                box = overlap(goff, tuple(local.shape), p.offset, p.shape)
                if box is None:
                    continue
                lo, hi = box
                # The smallest contiguous span of the piece that holds the overlap.
                plo = tuple(l - o for l, o in zip(lo, p.offset))
                lengths = tuple(h - l for l, h in zip(lo, hi))
                strides = row_major_strides(p.shape)
                first, nbytes = box_span(plo, lengths, strides, local.element_size())
                key = (p.image, p.name, first, nbytes)
                reads.setdefault(key, _Read(p, first, nbytes))
                dst = local[tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, goff))]
                copies.append((dst, key, lengths, strides))
                covered += math.prod(h - l for l, h in zip(lo, hi))
            if covered < local.numel():
                raise NotFoundError(f"{self.path}: step {self.step} does not cover all of "
                                    f"'{name}' for this rank's shard (box {goff} + "
                                    f"{tuple(local.shape)})")
        return reads, copies

    @staticmethod
    def read(items: list[tuple[Any, str, int, int, torch.Tensor]],
             stats: Optional[dict] = None) -> None:
        """Reads each (image reader, tensor name, first byte, bytes, uint8 buffer), every chunk
        verified, batched per image. Counts the bytes and the time under
        stats["storage_bytes_read"] and ["storage_read_seconds"]."""
        batches: dict[int, list] = {}
        for reader, name, first, nbytes, buf in items:
            batches.setdefault(id(reader), [reader, []])[1].append((name, first, nbytes, buf))
        t0 = time.perf_counter()
        for reader, batch in batches.values():
            reader.read(batch)
            _add_stat(stats, "storage_bytes_read", sum(b[2] for b in batch))
        _add_stat(stats, "storage_read_seconds", time.perf_counter() - t0)

    @staticmethod
    def copy_out(copies: list, bufs: Mapping[ReadKey, torch.Tensor]) -> None:
        """Copies each read range (a strided view of its buffer) into its destination."""
        with torch.no_grad():
            for dst, key, lengths, strides in copies:
                # as_strided keeps the view's storage offset (a buffer may be part of a larger)
                dst.copy_(torch.as_strided(bufs[key].view(dst.dtype), lengths, strides))

    def fill(self, requests: list[tuple[str, torch.Tensor, tuple, tuple]], rank: int,
             stats: Optional[dict] = None) -> None:
        """For each (name, local tensor, global shape, global offset of the local tensor),
        assembles that box from the saved pieces into the local tensor (see needs())."""
        reads, copies = self.needs(requests, rank)
        users = collections.Counter(key for _, key, _, _ in copies)
        # The ranges only GPU tensors need go through the pipelined staging ring
        # (_device_fill): read into pinned buffers, copied to the device while the next is read.
        staged = _device_fill.staged
        device: list[ReadKey] = []
        wanted = {key for dst, key, _, _ in copies if staged(dst)}
        if wanted:
            by_key: dict[ReadKey, list] = {}
            for dst, key, lengths, strides in copies:
                if key in wanted:
                    by_key.setdefault(key, []).append((dst, lengths, strides))
            device = sorted((k for k, us in by_key.items()
                             if _device_fill.takes(us, reads[k].nbytes)),
                            key=lambda k: reads[k].pos)
        # A range that is the whole of one contiguous CPU destination, in its layout (the usual
        # restore: same tensor, same shape), is read straight into it: no buffer to fault in,
        # no second copy. Everything else goes through a buffer and a (strided) copy.
        bufs: dict[ReadKey, torch.Tensor] = {}
        rest = []
        skip = set(device)
        for dst, key, lengths, strides in copies:
            if key in skip:
                continue
            if (users[key] == 1 and dst.device.type == "cpu" and dst.is_contiguous()
                    and dst.numel() * dst.element_size() == reads[key].nbytes > 0):
                bufs[key] = dst.detach().reshape(-1).view(torch.uint8)
            else:
                rest.append((dst, key, lengths, strides))
        for k, r in reads.items():
            if k not in bufs and k not in skip:
                bufs[k] = torch.empty(r.nbytes, dtype=torch.uint8)
        self.read([(r.reader, r.name, r.first, r.nbytes, bufs[k]) for k, r in reads.items()
                   if k not in skip], stats)
        self.copy_out(rest, bufs)
        if device:
            chunk: dict[int, int] = {}  # per image reader
            for k in device:
                if id(reads[k].reader) not in chunk:
                    chunk[id(reads[k].reader)] = reads[k].reader.chunk_size
            _device_fill.fill([(reads[k].reader, reads[k].name, reads[k].first, reads[k].nbytes,
                                reads[k].at, chunk[id(reads[k].reader)], by_key[k])
                               for k in device], lambda items: self.read(items, stats))


def read_newest_into(path: str, step: Optional[int], rank: int, targets: Any,
                     unpickler: Any = None, stats: Optional[dict] = None,
                     commit: Optional[_core.Commit] = None) -> tuple[int, Any]:
    """read_into() of `step`, or with step None of the newest committed step that reads back
    (a damaged newer one is skipped with a warning). Returns (step, tree). With step None each
    candidate step's every image is opened, as every rank restoring on its own (no agreement
    among them) must see the same missing or damaged image to skip the same steps. `commit`:
    the record of `step`, already read (StepReader)."""
    if step is not None:
        return step, read_into(path, step, rank, targets, unpickler, stats=stats, commit=commit)
    candidates = sorted(_core.steps(path), reverse=True)
    if not candidates:
        raise NotFoundError(f"{path}: no committed checkpoint")
    for s in candidates[:-1]:
        try:
            return s, read_into(path, s, rank, targets, unpickler, stats=stats,
                                every_image=True)
        except (CorruptionError, NotFoundError) as e:
            warnings.warn(f"safepoint: skipped a damaged checkpoint: step {s}: {e}",
                          RuntimeWarning, stacklevel=3)
    return candidates[-1], read_into(path, candidates[-1], rank, targets, unpickler, stats=stats,
                                     every_image=True)


def read_into(path: str, step: int, rank: int, targets: Any, unpickler: Any = None,
              reader: Optional[StepReader] = None, stats: Optional[dict] = None,
              every_image: bool = False, commit: Optional[_core.Commit] = None) -> Any:
    """Loads step `step` into `targets` (a state tree of tensors/DTensors, e.g. state dicts) for
    rank `rank` of the loading world, reading only the byte ranges its tensors need. Returns the
    tree to restore from: `targets` with its tensors filled in place, and the non-tensor values
    and the tensors the target does not have (e.g. optimizer state before the first step) taken
    from the checkpoint as the rank (or rank 0, for a rank the saving world did not have)
    saved them. Only the images the rank needs are opened, unless `every_image`. `commit`: the
    step's record, already read (StepReader; a step replaced meanwhile is read anew)."""
    for tries in range(4):
        sr = reader or StepReader(path, step, None if every_image else rank,
                                  commit=None if tries else commit)
        try:
            out, requests = _requests(sr, rank, targets, unpickler)
            sr.fill(requests, rank, stats)
            return out
        except (NotFoundError, CorruptionError):
            # The step was replaced while its ranges were read (its old images removed): read
            # the new version. Anything else is a real error.
            if reader is not None or tries == 3:
                raise
            if _core.step_commit(path, step).generation == sr.generation():
                raise
    raise AssertionError("unreachable")


def _requests(sr: StepReader, rank: int, targets: Any,
              unpickler: Any) -> tuple[Any, list[tuple[str, torch.Tensor, tuple, tuple]]]:
    """(the tree to restore from, what fill() must load into its tensors) for `targets`."""
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
                    raise missing_key(where, k, saved.keys())
            return {k: merge(target.get(k), v, f"{where}.{k}") for k, v in saved.items()}
        if isinstance(saved, (list, tuple)):
            same = isinstance(target, (list, tuple)) and len(target) == len(saved)
            return type(saved)(merge(target[i] if same else None, v, f"{where}.{i}")
                               for i, v in enumerate(saved))
        if isinstance(saved, Mapping):
            return {k: merge(None, v, f"{where}.{k}") for k, v in saved.items()}
        return saved

    return merge(targets, skeleton, "<root>"), requests


def fill_elsewhere(path: str, step: int, rank: int, elsewhere: list,
                   generation: Optional[int] = None,
                   commit: Optional[_core.Commit] = None) -> bool:
    """Fills the tensors a loaded image left to other ranks' images (replicas written once).
    With `generation` (the loaded image's COMMIT record), returns False, filling nothing, when
    the step has been replaced since (safepoint.save(overwrite=True)): load it again. `commit`:
    the step's record, already read (StepReader)."""
    if elsewhere:
        reader = StepReader(path, step, commit=commit)
        if generation is not None and reader.generation() != generation:
            return False
        reader.fill([(n, t, tuple(gs), tuple(go)) for n, t, gs, go in elsewhere], rank)
    return True
