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
_streams: dict[int, "torch.cuda.Stream"] = {}


def _host_view(address: int, size: int) -> torch.Tensor:
    """A uint8 CPU tensor over the slot's memory (no copy)."""
    return torch.frombuffer((ctypes.c_ubyte * size).from_address(address), dtype=torch.uint8)


_MIN_PIN_BYTES = 64 << 20  # smaller slots copy fast enough without; registering costs too


def _pin(address: int, size: int) -> None:
    if _pinned.get(address) == size or size < _MIN_PIN_BYTES:
        return
    cudart = torch.cuda.cudart()
    for old in [a for a in _pinned if a <= address < a + _pinned[a] or address <= a < address + size]:
        cudart.cudaHostUnregister(old)  # a slot that was re-laid out; errors are harmless here
        del _pinned[old]
    rc = cudart.cudaHostRegister(address, size, 0)
    if int(rc) != 0:
        # The failed call left its error as CUDA's "last error", which the next kernel launch
        # check in torch would report as its own: read it to clear it.
        getattr(cudart, "cudaGetLastError", lambda: None)()
        warnings.warn(f"safepoint: cudaHostRegister of a {size}-byte snapshot slot failed "
                      f"(error {int(rc)}); copies between it and the GPU will be slower",
                      RuntimeWarning)
        return
    _pinned[address] = size


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def stage(address: int, size: int, copies: list) -> None:
    """Copies each (tensor, offset) of `copies` into the slot at `address` (`size` bytes) and
    returns when all bytes are there."""
    host = _host_view(address, size)
    on_gpu: dict[torch.device, list] = {}
    for t, offset in copies:
        n = t.numel() * t.element_size()
        if n == 0:
            continue
        if offset + n > size:
            raise ValueError(f"tensor of {n} bytes at offset {offset} exceeds the {size}-byte slot")
        if t.is_cuda:
            on_gpu.setdefault(t.device, []).append((t, offset, n))
        else:
            host[offset:offset + n].copy_(_bytes(t))
    if not on_gpu:
        return
    _pin(address, size)
    pending = []
    for device, items in on_gpu.items():
        stream = _streams.get(device.index)
        if stream is None:
            stream = _streams[device.index] = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for t, offset, n in items:
                host[offset:offset + n].copy_(_bytes(t), non_blocking=True)
                t.record_stream(stream)
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
