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

import bisect
import ctypes
import warnings
from collections.abc import Mapping
from typing import Any, Optional

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


# GPU tensors smaller than this go to the slot in runs (issue 14: thousands of small tensors
# would cost one transfer each): neighbours in the slot, with no other staged tensor between
# them and less than _GAP bytes apart, are gathered on the device into a buffer laid out like
# that stretch of the slot, and the stretch is copied into the slot in one transfer of at most
# _RUN_BYTES. What lies between them in the slot (alignment padding, tensors that are not
# staged) is written with zeros here and filled after stage() returns: the client copies the
# other tensors and zeroes the padding then (ImageBuilder::Fill). A staged tensor is never
# under another's run: its own copy could land first. _GAP bounds the bytes a run ships for
# nothing (about what one more transfer costs).
_SMALL_BYTES = 1 << 20
_RUN_BYTES = 64 << 20
_GAP = 64 << 10


def _runs(items: list, others: list) -> list:
    """`items` ((tensor, offset, nbytes), ...) as runs (first byte, end, items) in slot order;
    `others`: the sorted offsets of every other staged tensor (none may lie inside a run)."""
    out: list = []
    cur: list = []
    start = end = 0
    for it in sorted(items, key=lambda it: it[1]):
        _, off, n = it
        if cur and (off < end or off - end >= _GAP or off + n - start > _RUN_BYTES
                    or bisect.bisect_left(others, end) < bisect.bisect_left(others, off)):
            out.append((start, end, cur))
            cur = []
        if not cur:
            start = off
        cur.append(it)
        end = off + n
    if cur:
        out.append((start, end, cur))
    return out


def copy_runs(runs: list, host: torch.Tensor, buffer: Optional[torch.Tensor],
              non_blocking: bool) -> None:
    """Copies small tensors into the slot (`host`: a uint8 view of all of it) run by run (runs
    from _runs): a run's tensors are gathered into `buffer` (on their device, at least as large
    as the largest run of several) by one batched copy on the device, then the run goes into the
    slot in one copy; a run of one tensor is copied straight. On a GPU all of it is queued on
    the current stream, in order, so the buffer is reused without waiting and the copies into
    the slot are asynchronous when `non_blocking` (the slot is pinned)."""
    for start, end, run in runs:
        if len(run) == 1:
            t, o, n = run[0]
            host[o:o + n].copy_(_bytes(t), non_blocking=non_blocking)
            continue
        assert buffer is not None
        span = buffer[:end - start]
        span.zero_()  # between the tensors: zeros, never stale device memory
        torch._foreach_copy_([span[o - start:o - start + n] for _, o, n in run],
                             [_bytes(t) for t, _, _ in run])
        host[start:end].copy_(span, non_blocking=non_blocking)


def stage(address: int, size: int, copies: list) -> None:
    """Copies each (tensor, offset) of `copies` into the slot at `address` (`size` bytes) and
    returns when all bytes are there. One batched copy per device (torch._foreach_copy_);
    the copies from a GPU run on a side stream that first waits for the current one, and small
    GPU tensors go in few transfers, one per run of neighbours in the slot (copy_runs), instead
    of one each."""
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
    keep: list[Any] = []  # device buffers and sources, until the copies from them are done
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
        stream = _streams.get(device.index)
        if stream is None:
            stream = _streams[device.index] = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        small = [i for i, (_, _, n) in enumerate(items) if n < _SMALL_BYTES]
        large = [i for i, (_, _, n) in enumerate(items) if n >= _SMALL_BYTES]
        with torch.cuda.stream(stream):
            # Everything below is allocated on this stream and referenced (keep) until it is
            # synchronized, before this returns: no record_stream needed.
            if small:
                mine = set(small)
                others = sorted(o for d, its in groups.items() for k, (_, o, _) in enumerate(its)
                                if d != device or k not in mine)
                runs = _runs([items[i] for i in small], others)
                span = max((end - start for start, end, run in runs if len(run) > 1), default=0)
                buffer = torch.empty(span, dtype=torch.uint8, device=device) if span else None
                copy_runs(runs, _host_view(address, size), buffer, True)
                keep.append(buffer)
            if large:
                srcs = [_bytes(items[i][0]) for i in large]
                torch._foreach_copy_([dsts[i] for i in large], srcs, non_blocking=True)
                keep.append(srcs)
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
