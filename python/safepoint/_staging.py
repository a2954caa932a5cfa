"""Copies tensors straight into a snapshot slot: GPU tensors with asynchronous device-to-host
copies into pinned slot memory.

The C++ client reserves the slot and calls ``stage`` before it fills the rest of the image and
checksums it; ``stage`` returns once every byte is in place. For GPU tensors the slot's pages are
registered with CUDA once (``cudaHostRegister``: page-locked, so the copies are DMA transfers at
the link's bandwidth instead of bouncing through a pageable buffer) and the copies run on a side
stream per device that first waits for the work already queued on the current stream, so a
save sees the values the training step produced. Without CUDA only the CPU branch runs.
"""

from __future__ import annotations

import ctypes
import warnings
from collections.abc import Mapping
from typing import Any

import torch

_pinned: dict[int, int] = {}  # slot address -> size, registered with CUDA
_streams: dict[int, torch.cuda.Stream] = {}


def _host_view(address: int, size: int) -> torch.Tensor:
    """A uint8 CPU tensor over the slot's memory (no copy)."""
    return torch.frombuffer((ctypes.c_ubyte * size).from_address(address), dtype=torch.uint8)


_MIN_PIN_BYTES = 64 << 20  # smaller slots copy fast enough without; registering costs too


def _pin(address: int, size: int) -> None:
    if _pinned.get(address) == size or size < _MIN_PIN_BYTES:
        return
    cudart = torch.cuda.cudart()
    overlapping = [a for a in _pinned
                   if a <= address < a + _pinned[a] or address <= a < address + size]
    for old in overlapping:
        cudart.cudaHostUnregister(old)  # a slot that was re-laid out; errors are harmless here
        del _pinned[old]
    rc = cudart.cudaHostRegister(address, size, 0)
    if int(rc) != 0:
        # The failed call left its error as CUDA's "last error", which the next kernel launch
        # check in torch would report as its own: read it to clear it.
        getattr(cudart, "cudaGetLastError", lambda: None)()
        warnings.warn(f"safepoint: cudaHostRegister of a {size}-byte snapshot slot failed "
                      f"(error {int(rc)}); copies between it and the GPU will be slower",
                      RuntimeWarning, stacklevel=3)
        return
    _pinned[address] = size


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's values as bytes: a conjugate or negative view (x.conj(), x.conj().imag)
    holds the values before the conjugation or negation, so it is resolved first."""
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    return t.reshape(-1).view(torch.uint8)


_views: dict = {}  # (address, size, layout) -> destination views, for the two slots of a rank


def _destinations(address: int, size: int, layout: tuple) -> list:
    """uint8 views of the slot for each (offset, nbytes) of `layout`; a save with the layout of
    an earlier one into the same slot reuses them (no per-tensor Python work)."""
    key = (address, size, layout)
    views = _views.get(key)
    if views is None:
        if len(_views) >= 4:
            _views.clear()
        host = _host_view(address, size)
        views = _views[key] = [host[o:o + n] for o, n in layout]
    return views


# GPU tensors smaller than this are packed into few large transfers (issue 14: thousands of
# small tensors cost one DMA launch each otherwise); the packed batches are at most _PACK_BYTES.
_SMALL_BYTES = 1 << 20
_PACK_BYTES = 64 << 20
_pack_buffers: dict = {}  # device index -> a pinned host buffer of _PACK_BYTES


def _batches(items: list) -> list:
    """`items` ((tensor, offset, nbytes), ...) in batches of at most _PACK_BYTES."""
    out: list = []
    cur: list = []
    n = 0
    for it in items:
        if cur and n + it[2] > _PACK_BYTES:
            out.append(cur)
            cur, n = [], 0
        cur.append(it)
        n += it[2]
    if cur:
        out.append(cur)
    return out


def copy_packed(items: list, dsts: list, host: torch.Tensor, stream: Any = None) -> None:
    """Copies small tensors into their destinations (`dsts`, uint8 views of the slot) through
    one packed transfer per batch: the tensors are concatenated where they are (one kernel on a
    GPU), the packed bytes copied to `host` (pinned) in one transfer, then scattered into the
    slot on the CPU. `stream`: the side stream the GPU work runs on (None: the CPU)."""
    start = 0
    for batch in _batches(items):
        k = sum(n for _, _, n in batch)
        packed = torch.cat([_bytes(t) for t, _, _ in batch])
        staging = host[:k]
        staging.copy_(packed, non_blocking=stream is not None)
        if stream is not None:
            stream.synchronize()  # the packed bytes are in host memory
        del packed
        torch._foreach_copy_(dsts[start:start + len(batch)],
                             list(staging.split([n for _, _, n in batch])))
        start += len(batch)


def _pack_buffer(device: Any) -> torch.Tensor:
    buf = _pack_buffers.get(device.index)
    if buf is None:
        buf = _pack_buffers[device.index] = torch.empty(_PACK_BYTES, dtype=torch.uint8,
                                                        pin_memory=True)
    return buf


def stage(address: int, size: int, copies: list) -> None:
    """Copies each (tensor, offset) of `copies` into the slot at `address` (`size` bytes) and
    returns when all bytes are there. One batched copy per device (torch._foreach_copy_);
    the copies from a GPU run on a side stream that first waits for the current one, and small
    GPU tensors go through few packed transfers (copy_packed) instead of one each."""
    groups: dict = {}
    for t, offset in copies:
        n = t.numel() * t.element_size()
        if n == 0:
            continue
        if offset + n > size:
            raise ValueError(f"tensor of {n} bytes at offset {offset} exceeds the {size}-byte slot")
        groups.setdefault(t.device if t.is_cuda else None, []).append((t, offset, n))
    if any(d is not None for d in groups):
        _pin(address, size)
    pending = []
    for device, items in groups.items():
        dsts = _destinations(address, size, tuple((o, n) for _, o, n in items))
        if device is None:
            # Strided CPU tensors are copied as they are into typed views of their ranges (a
            # temporary contiguous copy would cost their size in private memory).
            flat = [i for i, (t, _, _) in enumerate(items) if t.is_contiguous()]
            if flat:
                torch._foreach_copy_([dsts[i] for i in flat],
                                     [_bytes(items[i][0]) for i in flat])
            for (t, _, _), dst in zip(items, dsts):
                if not t.is_contiguous():
                    dst.view(t.dtype).view(t.shape).copy_(t)
            continue
        srcs = [_bytes(t) for t, _, _ in items]
        stream = _streams.get(device.index)
        if stream is None:
            stream = _streams[device.index] = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        small = [i for i, (_, _, n) in enumerate(items) if n < _SMALL_BYTES]
        large = [i for i, (_, _, n) in enumerate(items) if n >= _SMALL_BYTES]
        with torch.cuda.stream(stream):
            # No record_stream: the sources stay referenced until the stream is synchronized
            # below, before this returns.
            if large:
                torch._foreach_copy_([dsts[i] for i in large], [srcs[i] for i in large],
                                     non_blocking=True)
            if len(small) > 1:  # overlaps the large copies already queued
                copy_packed([items[i] for i in small], [dsts[i] for i in small],
                            _pack_buffer(device), stream)
            elif small:
                torch._foreach_copy_([dsts[small[0]]], [srcs[small[0]]], non_blocking=True)
        pending.append(stream)
    for stream in pending:
        stream.synchronize()


def _walk_tensors(tree: Any):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, Mapping):
        for v in tree.values():
            yield from _walk_tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _walk_tensors(v)


def pin_for_gpu_copies(loaded: Any, targets: Any) -> bool:
    """Before restoring a snapshot read in place (tensors that view its slot) into `targets`:
    when some target is on a GPU, registers the slot with CUDA (once; saves pinned it already
    in a process that saved), so the copies to the GPU are asynchronous DMA transfers; the
    caller synchronizes after them. Returns whether there are GPU targets."""
    if not torch.cuda.is_available():
        return False
    if not any(t.is_cuda for t in _walk_tensors(targets)):
        return False
    slots = {}
    for t in _walk_tensors(loaded):
        if not t.is_cuda and t.numel():
            st = t.untyped_storage()
            slots[st.data_ptr()] = st.nbytes()
    for address, size in slots.items():
        _pin(address, size)
    return True
