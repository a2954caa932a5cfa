"""``safepoint.dcp.Reader``: a DCP ``StorageReader`` for checkpoints ``Writer`` wrote. It rebuilds
DCP's ``Metadata`` from the images' headers, indexes and extras, and reads only the byte ranges
of the items the loading rank needs (safepoint._shards' box arithmetic)."""

from __future__ import annotations

import dataclasses
import io
import math
import os
import uuid
from typing import Any, Optional

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from safepoint import _core
from safepoint._shards import box_span, row_major_strides, split_box
from safepoint.dcp.writer import (
    _READERS,
    FORMAT_VERSION,
    Writer,
    _check_step,
    _checkpoint_id,
    _fspath,
    _split_checkpoint_id,
)
from safepoint.errors import CorruptionError, InvalidArgumentError, NotFoundError

_BATCH_BYTES = 256 << 20  # temporary bytes gathered before one read_ranges call


def _build(cls: Any, **fields: Any) -> Any:
    """``cls(**fields)`` with only the fields this torch's dataclass has (DCP's Metadata gained
    ``version`` after torch 2.8, the oldest supported; StorageMeta ``load_id`` after 2.4)."""
    have = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in fields.items() if k in have})


@dataclasses.dataclass(frozen=True)
class _Location:
    """``Metadata.storage_data`` entry: where an item's bytes are."""

    rank: int
    name: str           # the tensor's name in the image
    sizes: tuple        # chunk shape (tensor items)
    dtype: torch.dtype  # logical dtype (the stored one may be raw uint8)
    nbytes: int


def _dtype(name: Any, where: str) -> torch.dtype:
    dt = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dt, torch.dtype):
        raise CorruptionError(f"{where}: unknown dtype {name!r}")
    return dt


class Reader(StorageReader):
    """A DCP ``StorageReader`` for DCP checkpoints written by ``Writer``.

    ``step=None`` loads the newest committed step (resolved once per ``dcp.load``; with several
    ranks pass the step explicitly if a save may commit while ranks start loading: ranks that
    resolved different steps are refused). ``checkpoint_id="<path>/step-<N>"`` also selects it.
    Only the byte ranges the loading rank needs are read and checksum-verified.
    """

    def __init__(self, path: str | os.PathLike[str], step: Optional[int] = None) -> None:
        super().__init__()
        self.path = _fspath(path, "checkpoint path")
        self.step = _check_step(self.path, step)
        self._loaded_step: Optional[int] = None
        self._reading: Optional[int] = None  # the step a Writer's retention must not delete now
        self.load_id = uuid.uuid4().hex
        self.storage_data: dict = {}
        self.bytes_read = 0  # bytes requested by the last read_data (for tests and logs)
        _READERS.add(self)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            path, step = _split_checkpoint_id(checkpoint_id)
            self.path, self.step = path, step
        self.storage_data = {}
        self._loaded_step = self._reading = None
        self.load_id = uuid.uuid4().hex

    @property
    def checkpoint_id(self) -> str:
        step = self._loaded_step if self._loaded_step is not None else self.step
        return _checkpoint_id(self.path, step)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return Writer.validate_checkpoint_id(checkpoint_id)

    def read_metadata(self) -> Metadata:  # no **kwargs: there is no rank-local metadata to retry
        step = self.step
        if step is None:
            committed = _core.steps(self.path)
            if not committed:
                raise NotFoundError(f"{self.path}: no committed step to load")
            step = committed[-1]
        self._reading = step  # until read_data is done (Writer's retention spares it)
        try:
            return self._read_metadata(step)
        except BaseException:
            self._reading = None
            raise

    def _read_metadata(self, step: int) -> Metadata:
        md: dict[str, Any] = {}
        storage: dict[MetadataIndex, _Location] = {}
        planner_data: Optional[dict] = {}
        save_id = version = None
        world = 1
        r = 0
        while r < world:  # header, index and extras of each rank's image; no tensor data
            meta = _core.read_metadata(self.path, step, r)
            world = meta.world_size
            img = _core.image_path(self.path, step, r)
            dcpm = meta.extras.get("dcp") if isinstance(meta.extras, dict) else None
            if not isinstance(dcpm, dict) or dcpm.get("version") != FORMAT_VERSION:
                raise InvalidArgumentError(
                    f"{img}: not written by safepoint.dcp.Writer (no DCP metadata of version "
                    f"{FORMAT_VERSION}); load it with safepoint.load")
            if dcpm.get("rank") != r or dcpm.get("world_size") != world:
                raise CorruptionError(f"{img}: DCP metadata says rank {dcpm.get('rank')} of "
                                      f"{dcpm.get('world_size')}, expected rank {r} of {world}")
            save_id = save_id or dcpm.get("save_id")
            version = version or dcpm.get("dcp_version")
            self._add_image(img, r, meta, dcpm, md, storage)
            pd = dcpm.get("planner_data")
            if pd is None or planner_data is None:
                planner_data = None
            else:
                for k, v in pd.items():
                    planner_data.setdefault(k, tuple(v))
            r += 1
        self._loaded_step = step
        self.storage_data = storage
        # Fields that older torch versions' Metadata and StorageMeta lack are left out.
        return _build(Metadata, state_dict_metadata=md, planner_data=planner_data or None,
                      storage_data=storage,
                      storage_meta=_build(StorageMeta, checkpoint_id=self.checkpoint_id,
                                          save_id=save_id, load_id=self.load_id),
                      version=version)

    @staticmethod
    def _add_image(img: str, rank: int, meta: _core.ShardMetadata, dcpm: dict, md: dict,
                   storage: dict) -> None:
        slots = meta.extras if isinstance(meta.extras, dict) else {}
        entries = meta.tensors

        def entry(section: str, key: str) -> _core.TensorInfo:
            slot = slots.get(section, {}).get(key) if isinstance(slots.get(section), dict) else None
            idx = getattr(slot, "index", None)
            if type(idx) is not int or not 0 <= idx < len(entries):
                raise CorruptionError(f"{img}: item {key!r} has no tensor in the image")
            return entries[idx]

        items = dcpm.get("items")
        if not isinstance(items, dict):
            raise CorruptionError(f"{img}: DCP metadata without items")
        for key, it in items.items():
            fqn = it.get("fqn")
            if it.get("kind") == "bytes":
                e = entry("bytes", key)
                if fqn in md and not isinstance(md[fqn], BytesStorageMetadata):
                    raise CorruptionError(f"{img}: {fqn!r} is both a tensor and bytes")
                md[fqn] = BytesStorageMetadata()
                storage.setdefault(MetadataIndex(fqn),
                                   _Location(rank, e.name, (), torch.uint8, e.nbytes))
                continue
            e = entry("tensors", key)
            dtype = _dtype(it.get("dtype"), f"{img}: {key!r}")
            sizes, offsets, size = tuple(it["sizes"]), tuple(it["offsets"]), tuple(it["size"])
            nbytes = math.prod(sizes) * dtype.itemsize
            if e.nbytes != nbytes or len(sizes) != len(size) or len(offsets) != len(size) or any(
                    o < 0 or o + s > g for o, s, g in zip(offsets, sizes, size)):
                raise CorruptionError(
                    f"{img}: item {key!r}: chunk {offsets}+{sizes} of {size} ({dtype}) does not "
                    f"match its tensor {e.name!r} of {e.nbytes} bytes")
            tmd = md.get(fqn)
            if tmd is None:
                tmd = md[fqn] = TensorStorageMetadata(
                    properties=TensorProperties(dtype=dtype,
                                                requires_grad=bool(it.get("requires_grad"))),
                    size=torch.Size(size), chunks=[])
            elif (not isinstance(tmd, TensorStorageMetadata) or tuple(tmd.size) != size
                  or tmd.properties.dtype != dtype):
                raise CorruptionError(
                    f"{img}: chunk {key!r} disagrees with other chunks of {fqn!r}")
            index = MetadataIndex(fqn, offsets)
            if index in storage:
                continue  # the same chunk saved twice (replicated): either copy serves
            tmd.chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets),
                                                   sizes=torch.Size(sizes)))
            storage[index] = _Location(rank, e.name, sizes, dtype, nbytes)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        if not isinstance(metadata.storage_data, dict):
            raise InvalidArgumentError(
                f"{self.path}: metadata was not read by safepoint.dcp.Reader")
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return dataclasses.replace(plan, storage_data=self._loaded_step)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        steps = sorted({p.storage_data for p in plans}, key=str)
        if len(steps) > 1:
            raise InvalidArgumentError(
                f"{self.path}: ranks resolved different steps to load ({steps}); pass "
                f"safepoint.dcp.Reader(path, step=N)")
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self._loaded_step is None:
            raise InvalidArgumentError(f"{self.path}: read_data before read_metadata")
        try:
            _RangeReader(self, planner, self._loaded_step).run(plan.items)
        finally:
            self._reading = None
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut


class _RangeReader:
    """Turns ReadItems into byte-range requests per image, batched, then places the bytes."""

    def __init__(self, reader: Reader, planner: LoadPlanner, step: int) -> None:
        self.reader, self.planner, self.step = reader, planner, step
        self.pending: dict[int, list] = {}     # rank -> [(name, off, n, dest, after)]
        self.pending_bytes: dict[int, int] = {}
        self.left: dict[int, int] = {}         # id(read item) -> pieces not yet placed
        reader.bytes_read = 0

    def run(self, items: list[ReadItem]) -> None:
        for req in items:
            loc = self.reader.storage_data.get(req.storage_index)
            if loc is None:
                at = tuple(req.storage_index.offset or ())
                raise NotFoundError(f"{self.reader.checkpoint_id}: no stored item "
                                    f"{req.storage_index.fqn!r} at offsets {at}")
            if req.type == LoadItemType.BYTE_IO:
                self._bytes(req, loc)
            else:
                self._tensor(req, loc)
        for rank in list(self.pending):
            self._flush(rank)

    def _add(self, rank: int, name: str, off: int, n: int, dest, after, temp: int) -> None:
        self.pending.setdefault(rank, []).append((name, off, n, dest, after))
        self.pending_bytes[rank] = self.pending_bytes.get(rank, 0) + temp
        if self.pending_bytes[rank] >= _BATCH_BYTES:
            self._flush(rank)

    def _flush(self, rank: int) -> None:
        reqs = self.pending.pop(rank, [])
        self.pending_bytes.pop(rank, None)
        if not reqs:
            return
        # Reads and CRC-checks only the 4 MiB chunks that cover these ranges.
        _core.read_ranges(self.reader.path, self.step, rank,
                          [(name, off, n, dest) for name, off, n, dest, _ in reqs])
        self.reader.bytes_read += sum(n for _, _, n, _, _ in reqs)
        for *_, after in reqs:
            after()

    def _bytes(self, req: ReadItem, loc: _Location) -> None:
        buf = torch.empty(loc.nbytes, dtype=torch.uint8)

        def after() -> None:
            self.planner.load_bytes(req, io.BytesIO(buf.numpy().tobytes()))

        if loc.nbytes == 0:
            after()
            return
        self._add(loc.rank, loc.name, 0, loc.nbytes, buf, after, loc.nbytes)

    def _tensor(self, req: ReadItem, loc: _Location) -> None:
        sizes = loc.sizes
        offs, lens = tuple(req.storage_offsets), tuple(req.lengths)
        if len(offs) != len(sizes) or len(lens) != len(sizes) or any(
                o < 0 or o + n > s for o, n, s in zip(offs, lens, sizes)):
            raise InvalidArgumentError(
                f"{self.reader.checkpoint_id}: read of {req.storage_index.fqn!r} "
                f"{offs}+{lens} lies outside its stored chunk {sizes}")
        target = self.planner.resolve_tensor(req).detach()
        if tuple(target.shape) != lens:
            raise InvalidArgumentError(
                f"{self.reader.checkpoint_id}: {req.storage_index.fqn!r}: destination shape "
                f"{tuple(target.shape)} differs from the read {lens}")
        pieces = list(split_box(offs, lens, sizes, loc.dtype.itemsize))
        key = id(req)
        self.left[key] = len(pieces)

        def done() -> None:
            self.left[key] -= 1
            if self.left[key] == 0:
                del self.left[key]
                self.planner.commit_tensor(req, target)

        if not pieces:  # an empty box
            self.left[key] = 1
            done()
            return
        strides = row_major_strides(sizes)
        elem = loc.dtype.itemsize
        for p_offs, p_lens in pieces:
            start, span = box_span(p_offs, p_lens, strides, elem)
            dst = target
            for d, (po, pl, o) in enumerate(zip(p_offs, p_lens, offs)):
                if pl != lens[d]:
                    dst = dst.narrow(d, po - o, pl)
            direct = (dst.device.type == "cpu" and dst.dtype == loc.dtype and dst.is_contiguous()
                      and span == math.prod(p_lens) * elem)
            if direct:
                self._add(loc.rank, loc.name, start, span, dst, done, 0)
                continue
            buf = torch.empty(span, dtype=torch.uint8)

            def place(buf=buf, dst=dst, p_lens=p_lens) -> None:
                src = buf.view(loc.dtype).as_strided(p_lens, strides)
                dst.copy_(src)
                done()

            self._add(loc.rank, loc.name, start, span, buf, place, span)
