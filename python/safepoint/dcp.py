"""torch.distributed.checkpoint (DCP) in safepoint's format.

``Writer`` is a DCP ``StorageWriter`` and ``Reader`` a ``StorageReader``::

    import torch.distributed.checkpoint as dcp
    import safepoint.dcp

    dcp.save(state, storage_writer=safepoint.dcp.Writer("/ckpt/run1", step=100))
    dcp.load(state, storage_reader=safepoint.dcp.Reader("/ckpt/run1"))          # newest step
    dcp.load(state, storage_reader=safepoint.dcp.Reader("/ckpt/run1", step=100))

The step can also be given as DCP's ``checkpoint_id``: ``dcp.save(state,
checkpoint_id="/ckpt/run1/step-100", storage_writer=safepoint.dcp.Writer("/ckpt/run1"))``
(the last path component ``step-<N>`` names the step, the rest the checkpoint directory).

What lands on storage is a normal safepoint checkpoint: one image per rank per step
(``step-<N>/rank-<r>.img``) holding that rank's DCP write items, checksummed per 4 MiB chunk, and
a ``COMMIT`` record written once every rank's image is durable; ``safepoint ls``, ``inspect`` and
``verify`` work on it. Each image holds:

- ``tensors``: one tensor per tensor write item, keyed ``"<fqn>@<chunk offsets>"`` (the chunk of
  the global tensor that rank saved);
- ``bytes``: one uint8 tensor per byte write item (DCP's ``torch.save`` of non-tensor values),
  keyed by fqn, so that loading reads only the items it needs;
- ``dcp``: what DCP's ``Metadata`` is rebuilt from (per item: fqn, chunk offsets and sizes, the
  global size, dtype, requires_grad; the planner's fqn mappings; the save id) in safepoint's
  tagged encoding. There is no pickled metadata file.

``Reader.read_metadata`` rebuilds DCP's ``Metadata`` from the images' headers, indexes and extras
(not their data), and ``Reader.read_data`` reads only the byte ranges of the items the rank needs,
verifying the CRC of every 4 MiB chunk it reads: resharding to another world size reads what the
new shards overlap, never whole images.

``ShmStager`` is an ``AsyncStager`` for ``dcp.async_save`` that copies the state dict into
shared-memory buffers allocated once and reused, so training blocks only for that copy.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import math
import mmap
import os
import re
import secrets
import threading
import time
import uuid
import weakref
from collections.abc import Mapping
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
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from safepoint import _core
from safepoint._pickle import pickler
from safepoint.errors import (
    AlreadyExistsError,
    CorruptionError,
    InvalidArgumentError,
    NotFoundError,
    StorageError,
)

__all__ = ["Writer", "Reader", "ShmStager", "FORMAT_VERSION"]

#: Version of the layout of the ``dcp`` entry inside an image (not the image format's version).
FORMAT_VERSION = 1
_DCP_VERSION = "1.0.0"  # DCP's own metadata version, as FileSystemWriter records it

# dtypes safepoint's image format stores natively; others are stored as their raw bytes (uint8).
_NATIVE = {torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.int16,
           torch.int32, torch.int64, torch.uint8, torch.bool}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        _NATIVE.add(getattr(torch, _name))

_CRC_CHUNK = 4 << 20      # the image's checksum chunk: reading a byte costs its whole chunk
_SPAN_LIMIT = 64 << 20    # largest temporary buffer for one strided read
_BATCH_BYTES = 256 << 20  # temporary bytes gathered before one read_ranges call
_REUSE_WAIT_S = 0.05      # how long stage() waits for a just-finished save to let go of a buffer

_STEP_DIR = re.compile(r"^step-(\d{1,20})$")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")


# -- paths and steps ---------------------------------------------------------------------------

def _fspath(path: Any, what: str) -> str:
    try:
        p = os.fspath(path)
    except TypeError:
        p = None
    if not isinstance(p, str) or not p:
        raise InvalidArgumentError(f"{what} must be a non-empty str or os.PathLike, got {path!r}")
    return p


def _check_step(path: str, step: Any) -> Optional[int]:
    if step is not None and (type(step) is not int or step < 0):
        raise InvalidArgumentError(f"{path}: step must be a non-negative int or None, got {step!r}")
    return step


def _split_checkpoint_id(checkpoint_id: Any) -> tuple[str, Optional[int]]:
    """``"<dir>/step-<N>"`` -> (dir, N); any other path -> (path, None)."""
    cid = _fspath(checkpoint_id, "checkpoint_id").rstrip("/") or "/"
    head, tail = cid.rsplit("/", 1) if "/" in cid else ("", cid)
    m = _STEP_DIR.match(tail)
    if m is None:
        return cid, None
    return (head or "."), int(m.group(1))


def _step_dir(path: str, step: int) -> str:
    return f"{path.rstrip('/')}/step-{step:020d}"


def _storage_key(fqn: str, offsets) -> str:
    return f"{fqn}@{','.join(str(int(o)) for o in offsets)}"


# -- writing ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _RankPlan:
    """``SavePlan.storage_data``: who writes which image of how many."""

    rank: int
    world_size: int


@dataclasses.dataclass(frozen=True)
class _Written:
    """``WriteResult.storage_data``: where an item went."""

    rank: int
    key: str


def _encode_planner_data(data: Any) -> Any:
    """DefaultSavePlanner's fqn -> object path mapping (tuples of str/int) as lists; None for
    anything else (a custom planner's data is not stored)."""
    if not isinstance(data, Mapping):
        return None
    out = {}
    for k, v in data.items():
        if not isinstance(k, str) or not isinstance(v, (tuple, list)) or not all(
                type(x) in (str, int) for x in v):
            return None
        out[k] = list(v)
    return out


class Writer(StorageWriter):
    """A DCP ``StorageWriter`` that saves one step of a safepoint checkpoint directory.

    ``path`` is the checkpoint directory (what ``safepoint.load``/``safepoint ls`` read); ``step``
    the step to write. Alternatively pass ``checkpoint_id="<path>/step-<N>"`` to ``dcp.save``.
    Every rank writes one image with its write items; the step is committed (visible) once every
    rank's image is durable, and ``dcp.save`` returns only then. A step that is already committed,
    or that holds images of an earlier unfinished save, is refused: use a new step.
    """

    def __init__(self, path: "str | os.PathLike[str]", step: Optional[int] = None, *,
                 job: str = "") -> None:
        super().__init__()
        self.path = _fspath(path, "checkpoint path")
        self.step = _check_step(self.path, step)
        self.job = job
        self.save_id = uuid.uuid4().hex
        self.rank: Optional[int] = None
        self.is_coordinator = False
        self.use_collectives = True

    # -- the DCP protocol ------------------------------------------------------------------------
    def reset(self, checkpoint_id: "str | os.PathLike[str] | None" = None) -> None:
        if checkpoint_id:
            path, step = _split_checkpoint_id(checkpoint_id)
            self.path = path
            if step is not None:
                self.step = step
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank", 0 if is_coordinator else None)
        self.use_collectives = kwargs.get("use_collectives", True)
        if self.step is None:
            raise InvalidArgumentError(
                f"{self.path}: no step to save: pass safepoint.dcp.Writer(path, step=N) or "
                f"dcp.save(..., checkpoint_id='{self.path}/step-N')")
        if not self.use_collectives and self.rank not in (None, 0):
            raise InvalidArgumentError(
                f"{self.path}: safepoint.dcp.Writer needs dcp.save(use_collectives=True) with "
                f"several ranks: a step is committed once every rank's image is there, so every "
                f"rank must know the world size")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self._refuse_existing()
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        world = len(plans)
        return [dataclasses.replace(p, storage_data=_RankPlan(rank=i, world_size=world))
                for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        info = plan.storage_data
        if not isinstance(info, _RankPlan):
            raise InvalidArgumentError(
                f"{self.checkpoint_id}: the save plan carries no safepoint rank assignment "
                f"(storage_data={info!r}); was prepare_global_plan skipped?")
        if self.rank is not None and self.rank != info.rank:
            raise InvalidArgumentError(
                f"{self.checkpoint_id}: rank {self.rank} was given the plan of rank {info.rank}")
        tensors: dict[str, torch.Tensor] = {}
        blobs: dict[str, torch.Tensor] = {}
        items: dict[str, dict] = {}
        results: list[WriteResult] = []
        for item in plan.items:
            fqn = item.index.fqn
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                key = fqn
                if key in blobs:
                    raise InvalidArgumentError(
                        f"{self.checkpoint_id}: two byte items named {fqn!r}")
                blobs[key] = (torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw
                              else torch.empty(0, dtype=torch.uint8))
                items[key] = {"fqn": fqn, "kind": "bytes"}
                nbytes = len(raw)
            else:
                td = item.tensor_data
                if td is None or td.chunk is None:
                    raise InvalidArgumentError(
                        f"{self.checkpoint_id}: tensor item {fqn!r} has no chunk bounds")
                t = data.detach() if isinstance(data, torch.Tensor) else data
                if not isinstance(t, torch.Tensor):
                    raise InvalidArgumentError(
                        f"{self.checkpoint_id}: item {fqn!r} resolved to {type(data).__name__}, "
                        f"not a tensor")
                if tuple(t.shape) != tuple(td.chunk.sizes):
                    raise InvalidArgumentError(
                        f"{self.checkpoint_id}: item {fqn!r} has shape {tuple(t.shape)} but its "
                        f"chunk is {tuple(td.chunk.sizes)}")
                if t.dtype != td.properties.dtype:
                    raise InvalidArgumentError(
                        f"{self.checkpoint_id}: item {fqn!r} is {t.dtype} but was planned as "
                        f"{td.properties.dtype}")
                key = _storage_key(fqn, td.chunk.offsets)
                if key in tensors:
                    raise InvalidArgumentError(f"{self.checkpoint_id}: two chunks keyed {key!r}")
                raw_bytes = t.dtype not in _NATIVE
                if raw_bytes:  # complex, uint16, ...: stored as their bytes
                    t = t.cpu().contiguous().reshape(-1).view(torch.uint8)
                tensors[key] = t
                items[key] = {
                    "fqn": fqn, "kind": "tensor",
                    "offsets": [int(x) for x in td.chunk.offsets],
                    "sizes": [int(x) for x in td.chunk.sizes],
                    "size": [int(x) for x in td.size],
                    "dtype": str(td.properties.dtype).removeprefix("torch."),
                    "requires_grad": bool(td.properties.requires_grad),
                    "raw": raw_bytes,
                }
                nbytes = t.numel() * t.element_size()
            results.append(WriteResult(index=item.index, size_in_bytes=nbytes,
                                       storage_data=_Written(info.rank, key)))
        meta = {
            "version": FORMAT_VERSION,
            "dcp_version": _DCP_VERSION,
            "rank": info.rank,
            "world_size": info.world_size,
            "items": items,
            "planner_data": _encode_planner_data(plan.planner_data),
            "save_id": self.save_id,
        }
        state = {"tensors": tensors, "bytes": blobs, "dcp": meta}
        _core.save(self.path, self.step, info.rank, info.world_size, self.job, state,
                   pickler(False))
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        # Every rank's write_data has returned, so every image is durable, and the rank that
        # finished last has committed the step (the synchronous save commits once all are there).
        metadata.version = _DCP_VERSION
        metadata.storage_meta = self.storage_meta()
        metadata.storage_data = {r.index: r.storage_data for rs in results for r in rs}
        if self.step in _core.steps(self.path):
            return
        step_dir = _step_dir(self.path, self.step)
        present = []
        if not _SCHEME.match(self.path) and os.path.isdir(step_dir):
            present = sorted(n for n in os.listdir(step_dir) if n.endswith(".img"))
        raise StorageError(
            f"{step_dir}: every rank reported its image written but the step is not committed "
            f"(images present: {present or 'none'}); see the ranks' errors")

    def storage_meta(self) -> Optional[StorageMeta]:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str:
        return self.path if self.step is None else f"{self.path.rstrip('/')}/step-{self.step}"

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: "str | os.PathLike[str]") -> bool:
        try:
            return _split_checkpoint_id(checkpoint_id)[1] is not None
        except InvalidArgumentError:
            return False

    # -- helpers ---------------------------------------------------------------------------------
    def _refuse_existing(self) -> None:
        if self.step in _core.steps(self.path):
            raise AlreadyExistsError(
                f"{self.path}: step {self.step} is already committed; save DCP checkpoints to a "
                f"new step (re-writing a committed step is not atomic across ranks)")
        if _SCHEME.match(self.path):
            return
        step_dir = _step_dir(self.path, self.step)
        rank = self.rank if self.rank is not None else 0
        mine = f"{step_dir}/rank-{rank:05d}.img"
        if os.path.exists(mine):
            raise AlreadyExistsError(
                f"{mine}: an image of an earlier, unfinished save of step {self.step} is there; "
                f"a new save could be committed together with it. Save to a new step, or remove "
                f"{step_dir}")


# -- reading ---------------------------------------------------------------------------------

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

    def __init__(self, path: "str | os.PathLike[str]", step: Optional[int] = None) -> None:
        super().__init__()
        self.path = _fspath(path, "checkpoint path")
        self.step = _check_step(self.path, step)
        self._loaded_step: Optional[int] = None
        self.load_id = uuid.uuid4().hex
        self.storage_data: dict = {}
        self.bytes_read = 0  # bytes requested by the last read_data (for tests and logs)

    def reset(self, checkpoint_id: "str | os.PathLike[str] | None" = None) -> None:
        if checkpoint_id:
            path, step = _split_checkpoint_id(checkpoint_id)
            self.path, self.step = path, step
        self.storage_data = {}
        self._loaded_step = None
        self.load_id = uuid.uuid4().hex

    @property
    def checkpoint_id(self) -> str:
        step = self._loaded_step if self._loaded_step is not None else self.step
        return self.path if step is None else f"{self.path.rstrip('/')}/step-{step}"

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: "str | os.PathLike[str]") -> bool:
        return Writer.validate_checkpoint_id(checkpoint_id)

    def read_metadata(self) -> Metadata:  # no **kwargs: there is no rank-local metadata to retry
        step = self.step
        if step is None:
            committed = _core.steps(self.path)
            if not committed:
                raise NotFoundError(f"{self.path}: no committed step to load")
            step = committed[-1]
        where = _step_dir(self.path, step)
        md: dict[str, Any] = {}
        storage: dict[MetadataIndex, _Location] = {}
        planner_data: Optional[dict] = {}
        save_id = version = None
        world = 1
        r = 0
        while r < world:  # header, index and extras of each rank's image; no tensor data
            meta = _core.read_metadata(self.path, step, r)
            world = meta["world_size"]
            img = f"{where}/rank-{r:05d}.img"
            dcpm = meta["extras"].get("dcp") if isinstance(meta["extras"], dict) else None
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
        return Metadata(
            state_dict_metadata=md,
            planner_data=planner_data or None,
            storage_data=storage,
            storage_meta=StorageMeta(checkpoint_id=self.checkpoint_id, save_id=save_id,
                                     load_id=self.load_id),
            version=version,
        )

    @staticmethod
    def _add_image(img: str, rank: int, meta: dict, dcpm: dict, md: dict, storage: dict) -> None:
        slots = meta["extras"]
        entries = meta["tensors"]

        def entry(section: str, key: str) -> dict:
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
                                   _Location(rank, e["name"], (), torch.uint8, e["nbytes"]))
                continue
            e = entry("tensors", key)
            dtype = _dtype(it.get("dtype"), f"{img}: {key!r}")
            sizes, offsets, size = tuple(it["sizes"]), tuple(it["offsets"]), tuple(it["size"])
            nbytes = math.prod(sizes) * dtype.itemsize
            if e["nbytes"] != nbytes or len(sizes) != len(size) or len(offsets) != len(size) or any(
                    o < 0 or o + s > g for o, s, g in zip(offsets, sizes, size)):
                raise CorruptionError(
                    f"{img}: item {key!r}: chunk {offsets}+{sizes} of {size} ({dtype}) does not "
                    f"match its tensor {e['name']!r} of {e['nbytes']} bytes")
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
            storage[index] = _Location(rank, e["name"], sizes, dtype, nbytes)

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
        _RangeReader(self, planner).run(plan.items)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut


class _RangeReader:
    """Turns ReadItems into byte-range requests per image, batched, then places the bytes."""

    def __init__(self, reader: Reader, planner: LoadPlanner) -> None:
        self.reader, self.planner = reader, planner
        self.step = reader._loaded_step
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
        pieces = list(_pieces(offs, lens, sizes, loc.dtype.itemsize))
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
        strides = _strides(sizes)
        elem = loc.dtype.itemsize
        for p_offs, p_lens in pieces:
            start, span = _span(p_offs, p_lens, strides, elem)
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


def _strides(sizes: tuple) -> tuple:
    out, acc = [], 1
    for s in reversed(sizes):
        out.append(acc)
        acc *= s
    return tuple(reversed(out))


def _span(offs: tuple, lens: tuple, strides: tuple, elem: int) -> tuple[int, int]:
    """(first byte, bytes up to the end of the last element) of a box in a row-major chunk."""
    first = sum(o * s for o, s in zip(offs, strides))
    last = sum((o + n - 1) * s for o, n, s in zip(offs, lens, strides))
    return first * elem, (last - first + 1) * elem


def _pieces(offs: tuple, lens: tuple, sizes: tuple, elem: int):
    """Splits a box of a row-major chunk into sub-boxes that are each read as one byte range.

    A range is read whole, gaps included, while the gaps between its runs are shorter than a
    checksum chunk (a gap that short costs no extra I/O: its chunk is read anyway) and it fits a
    64 MiB buffer; otherwise the box is split along its outer dimensions."""
    if any(n == 0 for n in lens):
        return
    strides = _strides(sizes)
    # k: the innermost dimension the box does not cover fully; everything inside it is contiguous.
    k = next((d for d in reversed(range(len(sizes))) if lens[d] != sizes[d]), None)
    if k is None or all(n == 1 for n in lens[:k]):
        yield offs, lens  # one contiguous run
        return
    run = lens[k] * strides[k] * elem
    j = next(d for d in reversed(range(k)) if lens[d] > 1)  # innermost dimension with several runs
    gap = strides[j] * elem - run
    _, span = _span(offs, lens, strides, elem)
    if gap < _CRC_CHUNK and span <= _SPAN_LIMIT:
        yield offs, lens
        return
    if gap >= _CRC_CHUNK:
        d, per = j, 1
        for d0 in range(j):  # split the outer dimensions too, one index at a time
            if lens[d0] > 1:
                d = d0
                break
    else:
        d = next(d for d in range(len(sizes)) if lens[d] > 1)
        per = max(1, _SPAN_LIMIT // (strides[d] * elem))
        if per >= lens[d]:
            per = max(1, lens[d] // 2)
    for i in range(offs[d], offs[d] + lens[d], per):
        n = min(per, offs[d] + lens[d] - i)
        yield from _pieces(offs[:d] + (i,) + offs[d + 1:], lens[:d] + (n,) + lens[d + 1:],
                           sizes, elem)


# -- staging for async_save ------------------------------------------------------------------

class _ShmBuffer:
    """One shared-memory file (mode 0600) mapped into this process, carved into tensors."""

    def __init__(self, shm_dir: str, nbytes: int) -> None:
        self.path = os.path.join(shm_dir, f"safepoint-dcp-stage-{os.getuid()}-{os.getpid()}-"
                                          f"{secrets.token_hex(8)}")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        try:
            size = max(nbytes, 1)
            os.ftruncate(fd, size)
            try:  # reserve the pages now: a full /dev/shm fails here, not with SIGBUS later
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                raise StorageError(f"{self.path}: cannot reserve {size} bytes of shared memory "
                                   f"for staging: {e}") from e
            self.map = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            self.unlink()
            raise
        os.close(fd)
        self.base = torch.frombuffer(self.map, dtype=torch.uint8)
        self.nbytes = nbytes

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _busy(slot: dict) -> bool:
    """Whether a staged state dict handed out from this buffer may still be in use."""
    return any(r() is not None for r in slot["handed"])


class ShmStager(AsyncStager):
    """An ``AsyncStager`` for ``dcp.async_save`` that copies the state dict into shared memory.

    The first ``stage()`` allocates one shared-memory file (``shm_dir``, default ``/dev/shm`` or
    ``$SAFEPOINT_SHM_DIR``; mode 0600, its space reserved up front) that holds every tensor of
    the state dict (plain tensors and DTensors' local shards); later stages with the same tensor
    shapes and dtypes copy into the same buffer, so ``async_save`` blocks the training loop only
    for that copy. A buffer is never overwritten while the state dict staged into it last time
    is still referenced (its save may be running): after waiting up to 50 ms for it to be let go,
    a second buffer is used. Non-tensor
    values are deep-copied. ``close()`` (or leaving a ``with`` block) removes the files. Use it
    with the thread executor (``AsyncCheckpointerType.THREAD``, the default).
    """

    _synchronize_after_execute = False  # stage() copies synchronously

    def __init__(self, shm_dir: Optional[str] = None) -> None:
        self.shm_dir = shm_dir or os.environ.get("SAFEPOINT_SHM_DIR", "/dev/shm")
        self._lock = threading.Lock()
        self._slots: list[dict] = []  # {"buf", "layout", "views", "handed": [weakrefs]}
        self._closed = False
        self.allocations = 0  # shared-memory files created so far (for tests and logs)
        weakref.finalize(self, ShmStager._unlink_all, self._slots)

    def __enter__(self) -> "ShmStager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def files(self) -> list[str]:
        """The shared-memory files in use."""
        return [s["buf"].path for s in self._slots]

    def stage(self, state_dict: dict) -> dict:
        from torch.distributed.tensor import DTensor

        with self._lock:
            if self._closed:
                raise InvalidArgumentError("safepoint.dcp.ShmStager: stage() after close()")
            sources: list[torch.Tensor] = []
            _collect(state_dict, sources, set(), "", DTensor)
            slot = self._slot([(t.dtype, tuple(t.shape)) for t in sources])
            handed: list = []
            with torch.no_grad():
                for src, dst in zip(sources, slot["views"]):
                    dst.copy_(src.detach())
                staged = _rebuild(state_dict, {id(s): v for s, v in zip(sources, slot["views"])},
                                  {}, handed, DTensor)
            slot["handed"] = [weakref.ref(x) for x in handed]
            return staged

    def _slot(self, layout: list) -> dict:
        same = [s for s in self._slots if s["layout"] == layout]
        # A save that has just completed may still hold its state dict for a moment (DCP's
        # executor thread drops its arguments after it sets the future's result): wait briefly
        # for that before paying for a second buffer.
        deadline = time.monotonic() + _REUSE_WAIT_S
        while same:
            for s in same:
                if not _busy(s):
                    return s
            if time.monotonic() >= deadline:
                break
            time.sleep(0.001)
        for s in list(self._slots):  # free buffers of another layout go
            if s["layout"] != layout and not _busy(s):
                s["buf"].unlink()
                self._slots.remove(s)
        offsets, total = [], 0
        for dtype, shape in layout:
            total = (total + 63) // 64 * 64
            offsets.append(total)
            total += math.prod(shape) * dtype.itemsize
        buf = _ShmBuffer(self.shm_dir, total)
        self.allocations += 1
        views = []
        for (dtype, shape), off in zip(layout, offsets):
            n = math.prod(shape) * dtype.itemsize
            views.append(buf.base[off:off + n].view(dtype).view(shape) if n
                         else torch.empty(shape, dtype=dtype))
        slot = {"buf": buf, "layout": layout, "views": views, "handed": []}
        self._slots.append(slot)
        return slot

    def close(self) -> None:
        with self._lock:
            self._closed = True
            ShmStager._unlink_all(self._slots)

    @staticmethod
    def _unlink_all(slots: list) -> None:
        for s in slots:
            s["buf"].unlink()
        slots.clear()

    def synchronize_staging(self) -> None:  # stage() is synchronous
        return None


def _collect(obj: Any, out: list, seen: set, key: str, dtensor: type) -> None:
    """The tensors to stage, in a fixed order, each once (tied tensors share one buffer)."""
    if isinstance(obj, dtensor):
        obj = obj._local_tensor  # to_local() may return a new view each call
    if isinstance(obj, torch.Tensor):
        if type(obj) not in (torch.Tensor, torch.nn.Parameter):
            raise InvalidArgumentError(f"{key or '<root>'}: cannot stage a {type(obj).__name__}")
        if obj.layout != torch.strided:
            raise InvalidArgumentError(f"{key or '<root>'}: cannot stage a {obj.layout} tensor")
        if id(obj) not in seen:
            seen.add(id(obj))
            out.append(obj)
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            _collect(v, out, seen, f"{key}.{k}" if key else str(k), dtensor)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _collect(v, out, seen, f"{key}.{i}" if key else str(i), dtensor)


def _rebuild(obj: Any, staged: dict, memo: dict, handed: list, dtensor: type) -> Any:
    """``obj`` with every tensor replaced by a new tensor object over its staged buffer."""
    if id(obj) in memo:
        return memo[id(obj)]
    if isinstance(obj, dtensor):
        local = staged[id(obj._local_tensor)]
        out = dtensor.from_local(local.view(local.shape), obj.device_mesh, obj.placements,
                                 run_check=False, shape=obj.shape, stride=obj.stride())
    elif isinstance(obj, torch.Tensor):
        dst = staged[id(obj)]
        out = dst.view(dst.shape)  # a new object: its liveness tells whether the save still runs
    elif isinstance(obj, Mapping):
        return {k: _rebuild(v, staged, memo, handed, dtensor) for k, v in obj.items()}
    elif isinstance(obj, list):
        return [_rebuild(v, staged, memo, handed, dtensor) for v in obj]
    elif isinstance(obj, tuple):
        return tuple(_rebuild(v, staged, memo, handed, dtensor) for v in obj)
    elif obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return obj
    else:
        return copy.deepcopy(obj)
    memo[id(obj)] = out
    handed.append(out)
    return out
