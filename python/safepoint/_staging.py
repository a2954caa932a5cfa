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


def stage(address: int, size: int, copies: list) -> None:
    """Copies each (tensor, offset) of `copies` into the slot at `address` (`size` bytes) and
    returns when all bytes are there. One batched copy per device (torch._foreach_copy_);
    the copies from a GPU run on a side stream that first waits for the current one."""
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
        srcs = [_bytes(t) for t, _, _ in items]
        if device is None:
            torch._foreach_copy_(dsts, srcs)
            continue
        stream = _streams.get(device.index)
        if stream is None:
            stream = _streams[device.index] = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            # No record_stream: the sources stay referenced until the stream is synchronized
            # below, before this returns.
            torch._foreach_copy_(dsts, srcs, non_blocking=True)
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
