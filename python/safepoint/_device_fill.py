"""Restore from storage into GPU tensors, pipelined through a ring of pinned host buffers.

The byte ranges that GPU targets need are cut into pieces laid out in staging buffers of
``STAGE_BYTES`` (pinned: page-locked, so the host-to-device copies are DMA transfers at the
link's bandwidth). Each buffer is read from storage (every checksum chunk verified, as any read),
then its pieces are copied to their GPU tensors asynchronously on a side stream, and the next
buffer is read while those copies run; a buffer is read into again only once its copies are done.
So a restore takes about the longer of the storage read and the copy, not their sum, and holds
``STAGES`` buffers of host memory, not a host copy of the whole state.

How the pieces are laid out:

- a range is split only at a checksum chunk boundary of its image (a chunk split between two
  buffers would be read and verified twice), unless a chunk does not fit a buffer at all;
- a range that holds a whole chunk starts at a buffer position that is aligned like its offset in
  the image (to the 4 KiB of direct I/O), so those chunks are read straight into the buffer
  instead of through the reader's own staging buffer and a copy; smaller ranges are packed at 64
  bytes, many to a buffer, and read in one call;
- a range that is exactly one GPU tensor (the usual restore) is copied straight into it; any
  other (resharding: part of a saved piece, or a piece several targets share) is copied into a
  temporary on the GPU and scattered from there by the GPU (strided copies on the device, not
  on the host).

Without CUDA the same path runs for the destinations ``staged`` picks (the tests pick CPU ones),
with pageable buffers and synchronous copies.
"""

from __future__ import annotations

import collections
import contextlib
from typing import Any, Callable, Optional

import torch

STAGE_BYTES = 64 << 20  # one staging buffer
STAGES = 2  # buffers in the ring: one is read while the other's copies run
_DIRECT_ALIGN = 4096  # a chunk is read straight into memory aligned like its image offset
_PACK_ALIGN = 64
_SMALL = 1 << 20  # smaller pieces go to the device through a mirror of the buffer (_Copies)


def staged(dst: torch.Tensor) -> bool:
    """Whether a destination is filled through the staging ring (GPU tensors)."""
    return dst.is_cuda


def takes(users: list, nbytes: int) -> bool:
    """Whether a range of `nbytes` with these destinations ((tensor, lengths, strides), ...)
    goes through the staging ring: every destination is staged, all on one device, and the
    range is exactly its one destination or needs a temporary of at most STAGE_BYTES on the
    device (larger ones take the host path, which bounds them in host memory)."""
    dst = users[0][0]
    if not all(staged(u[0]) and u[0].device == dst.device for u in users):
        return False
    return _direct(users, nbytes) or nbytes <= STAGE_BYTES


def _direct(users: list, nbytes: int) -> bool:
    """Whether the range is exactly its one destination's bytes, in its layout."""
    dst = users[0][0]
    return (len(users) == 1 and dst.is_contiguous()
            and dst.numel() * dst.element_size() == nbytes)


def plan(ranges: list[tuple[int, int, int]],
         stage_bytes: int) -> list[list[tuple[int, int, int, int]]]:
    """Lays out `ranges` ((offset in the image, bytes, the image's chunk size), in read order) in
    buffers of `stage_bytes`: one list per buffer of (range index, first byte of the piece in the
    range, bytes, position in the buffer). See the module's docstring for the rules."""
    if stage_bytes <= _DIRECT_ALIGN:
        raise ValueError(f"staging buffers of {stage_bytes} bytes: more than "
                         f"{_DIRECT_ALIGN} needed")
    batches: list[list[tuple[int, int, int, int]]] = []
    cur: list[tuple[int, int, int, int]] = []
    used = 0
    for i, (at, nbytes, chunk) in enumerate(ranges):
        done = 0
        while done < nbytes:
            left = nbytes - done
            start = at + done
            if left >= chunk:  # holds a whole chunk: align it for direct reads
                pos = used + (start - used) % _DIRECT_ALIGN
            else:
                pos = -(-used // _PACK_ALIGN) * _PACK_ALIGN
            n = min(left, stage_bytes - pos)
            if 0 < n < left:  # split: end on a chunk boundary when one lies inside the piece
                cut = (start + n) // chunk * chunk - start
                if cut > 0:
                    n = cut
                elif cur:
                    n = 0  # the piece would end inside its first chunk: start a new buffer
            if n <= 0:
                batches.append(cur)
                cur, used = [], 0
                continue
            cur.append((i, done, n, pos))
            used = pos + n
            done += n
    if cur:
        batches.append(cur)
    return batches


class _Target:
    """Where one range's bytes go on the device: the destination tensor's own bytes, or a
    temporary on its device from which the destinations are filled once the range is whole."""
    __slots__ = ("bytes", "users", "pieces_left")

    def __init__(self, users: list, nbytes: int, stream: Any) -> None:
        dst = users[0][0]
        self.pieces_left = 0  # set by fill()
        if _direct(users, nbytes):
            self.bytes = dst.detach().reshape(-1).view(torch.uint8)
            self.users: Optional[list] = None
        else:
            with _on(stream):
                self.bytes = torch.empty(nbytes, dtype=torch.uint8, device=dst.device)
            self.users = users

    def scatter(self, stream: Any) -> None:
        if self.users is None:
            return
        with torch.no_grad(), _on(stream):
            for dst, lengths, strides in self.users:
                dst.copy_(torch.as_strided(self.bytes.view(dst.dtype), lengths, strides))
        self.bytes = self.users = None


class _Copies:
    """One buffer's copies to one device. A piece of _SMALL bytes or more is copied from the
    host buffer into its target directly; the small ones (thousands of tensors of a few KiB
    each would cost one transfer each) go to the device in one transfer per run of neighbouring
    small pieces, into a mirror of the buffer on the device, and from there into their targets
    in one batched device-side copy (torch._foreach_copy_: a few kernels, not one a piece)."""
    __slots__ = ("stream", "dsts", "small", "runs", "joined")

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.dsts: list = []  # large pieces: (destination, position in the buffer, bytes)
        self.small: list = []  # small pieces, likewise
        self.runs: list = []  # [first, end) of the buffer: neighbouring small pieces
        self.joined = False  # whether the next small piece extends the last run

    def add(self, dst: torch.Tensor, pos: int, n: int) -> None:
        if n >= _SMALL:
            self.dsts.append((dst, pos, n))
            self.joined = False
            return
        self.small.append((dst, pos, n))
        if self.joined:
            self.runs[-1][1] = pos + n  # pieces come in buffer order: pos >= the run's end
        else:
            self.runs.append([pos, pos + n])
            self.joined = True

    def to_device(self, buf: torch.Tensor, mirror: Optional[torch.Tensor], cuda: bool) -> None:
        """The copies that read the host buffer: the large pieces into their targets, the runs
        of small ones into the mirror."""
        with torch.no_grad(), _on(self.stream):
            if self.dsts:
                torch._foreach_copy_([d for d, _, _ in self.dsts],
                                     [buf[p:p + n] for _, p, n in self.dsts], non_blocking=cuda)
            if self.small:
                assert mirror is not None
                for a, b in self.runs:
                    mirror[a:b].copy_(buf[a:b], non_blocking=cuda)

    def on_device(self, mirror: Optional[torch.Tensor]) -> None:
        """The small pieces from the mirror into their targets (after to_device, same stream)."""
        if self.small:
            assert mirror is not None
            with torch.no_grad(), _on(self.stream):
                torch._foreach_copy_([d for d, _, _ in self.small],
                                     [mirror[p:p + n] for _, p, n in self.small])


def _aligned(size: int, pinned: bool) -> torch.Tensor:
    """A host buffer whose first byte is aligned for direct I/O (plan() positions rely on it).
    Pinned memory (cudaHostAlloc) is page-aligned already: asked for a few bytes more, torch's
    pinned allocator would round the block up to twice the size."""
    raw = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
    if raw.data_ptr() % _DIRECT_ALIGN == 0:
        return raw
    raw = torch.empty(size + _DIRECT_ALIGN, dtype=torch.uint8, pin_memory=pinned)
    skip = -raw.data_ptr() % _DIRECT_ALIGN
    return raw[skip:skip + size]


def _on(stream: Any):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def fill(ranges: list, read: Callable[[list], None], stage_bytes: int = STAGE_BYTES,
         stages: int = STAGES) -> None:
    """Reads each range of `ranges` ((reader, tensor name, first byte, bytes, offset of the range
    in its image, the image's chunk size, users: [(destination, lengths, strides)]), in storage
    order) through the staging ring into its destinations. `read` reads a list of (reader, name,
    first, bytes, buffer), verified (StepReader.read). Returns once every byte is in place."""
    batches = plan([(r[4], r[3], r[5]) for r in ranges], stage_bytes)
    if not batches:
        return
    cuda = any(u[0].is_cuda for r in ranges for u in r[6])
    streams: dict[Any, Any] = {}

    def stream_of(device: torch.device) -> Any:
        if device.type != "cuda":
            return None
        s = streams.get(device)
        if s is None:
            s = streams[device] = torch.cuda.Stream(device=device)
            s.wait_stream(torch.cuda.current_stream(device))  # the targets' pending work first
        return s

    size = max(pos + n for b in batches for _, _, n, pos in b)
    bufs = [_aligned(size, cuda) for _ in range(min(stages, len(batches)))]
    pending: list[list] = [[] for _ in bufs]  # per buffer: the events its copies recorded
    pieces = collections.Counter(i for batch in batches for i, _, _, _ in batch)
    # A range's target is made at its first piece and let go after its last (a temporary on
    # the device lives only while its range is being copied).
    targets: dict[int, _Target] = {}
    mirrors: dict[Any, torch.Tensor] = {}  # per device: a buffer's small pieces land here first
    try:
        for b, batch in enumerate(batches):
            slot = b % len(bufs)
            for ev in pending[slot]:
                ev.synchronize()
            pending[slot] = []
            buf = bufs[slot]
            read([(ranges[i][0], ranges[i][1], ranges[i][2] + first, n, buf[pos:pos + n])
                  for i, first, n, pos in batch])
            copies: dict[Any, _Copies] = {}
            done = []
            last: Optional[_Copies] = None
            for i, first, n, pos in batch:
                users = ranges[i][6]
                device = users[0][0].device
                stream = stream_of(device)
                t = targets.get(i)
                if t is None:
                    t = targets[i] = _Target(users, ranges[i][3], stream)
                    t.pieces_left = pieces[i]
                c = copies.get(device)
                if c is None:
                    c = copies[device] = _Copies(stream)
                if last is not None and last is not c:
                    last.joined = False  # a piece for another device lies between: not its run
                last = c
                c.add(t.bytes if n == t.bytes.numel() else t.bytes[first:first + n], pos, n)
                t.pieces_left -= 1
                if t.pieces_left == 0:
                    done.append((t, stream))
                    del targets[i]
            for device, c in copies.items():
                mirror = mirrors.get(device)
                if c.runs and mirror is None:
                    with _on(c.stream):
                        mirror = mirrors[device] = torch.empty(size, dtype=torch.uint8,
                                                               device=device)
                c.to_device(buf, mirror, cuda)
                if c.stream is not None:  # the buffer may be read into again once this passed
                    ev = torch.cuda.Event()
                    ev.record(c.stream)
                    pending[slot].append(ev)
            for device, c in copies.items():
                c.on_device(mirrors.get(device))
            for t, stream in done:  # after the copies that completed them, on their stream
                t.scatter(stream)
    finally:
        # Also after a failed read: no copy may still be reading a buffer or writing a target
        # when this returns.
        for s in streams.values():
            s.synchronize()

