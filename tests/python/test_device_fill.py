"""The pipelined restore from storage into GPU tensors (safepoint._device_fill): ranges read into
a ring of staging buffers and copied to their destinations while the next buffer is read.

Without CUDA the same path is driven with CPU destinations (``staged`` patched to take them) and
small staging buffers, so splitting, packing, resharding and failures are all exercised; the
CUDA test runs where a GPU exists."""

import os

import pytest
import torch

import safepoint
from safepoint import _core, _device_fill, _shards

CHUNK = _core.CHUNK_SIZE


def state(seed: int = 5) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(3 * CHUNK // 4 + 1234, generator=g),  # 12 MiB: whole chunks
        "mat": torch.randn(700, 1100, generator=g),  # ~2.9 MiB
        "small": {f"s{i}": torch.randn(i * 37 + 1, generator=g) for i in range(60)},
        "half": torch.randn(5000, generator=g).to(torch.bfloat16),
        "ints": torch.arange(12345, dtype=torch.int64),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "step": 7,
    }


def zeros(tree):
    if isinstance(tree, dict):
        return {k: zeros(v) for k, v in tree.items()}
    return torch.zeros_like(tree) if isinstance(tree, torch.Tensor) else tree


def equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


@pytest.fixture
def staged(monkeypatch):
    """Every CPU destination through the staging ring, in buffers of cfg["stage_bytes"] (1 MiB,
    smaller than a checksum chunk, unless a test sets another); cfg["calls"] records what each
    fill laid out."""
    cfg: dict = {"stage_bytes": 1 << 20, "calls": []}
    real_fill, real_plan = _device_fill.fill, _device_fill.plan

    def fill(ranges, read):
        cfg["calls"].append({"ranges": len(ranges)})
        return real_fill(ranges, read, cfg["stage_bytes"])

    def plan(ranges, stage_bytes):
        out = real_plan(ranges, stage_bytes)
        cfg["calls"][-1]["batches"] = out
        return out

    monkeypatch.setattr(_device_fill, "staged", lambda dst: True)
    monkeypatch.setattr(_device_fill, "fill", fill)
    monkeypatch.setattr(_device_fill, "plan", plan)
    return cfg


@pytest.mark.parametrize("stage_bytes", [1 << 20, 64 << 20])
def test_restore_through_the_staging_ring_is_bit_exact(tmp_path, staged, stage_bytes):
    safepoint.save(tmp_path, 1, state())
    staged["stage_bytes"] = stage_bytes
    target = zeros(state())
    assert safepoint.restore(tmp_path, target) == 1
    assert equal(target, state())
    (call,) = staged["calls"]
    assert call["ranges"] == 65  # every non-empty tensor's range, none through the host path
    if stage_bytes == 1 << 20:
        assert len(call["batches"]) > 15  # ~15 MiB in 1 MiB buffers
    else:
        assert len(call["batches"]) == 1  # all of it packed into one buffer, one read


def test_parts_of_saved_tensors_are_scattered_from_a_temporary(tmp_path, staged):
    """Resharding: a target that is a box inside a saved tensor (strided copies from the range
    read whole into a temporary), and two targets that need the same range."""
    g = torch.Generator().manual_seed(9)
    a = torch.randn(600, 900, generator=g)
    b = torch.randn(3000, generator=g).to(torch.float64)
    safepoint.save(tmp_path, 1, {"a": a, "b": b})
    sr = _shards.StepReader(str(tmp_path), 1)
    box = torch.zeros(300, 400)
    b1, b2 = torch.zeros(3000, dtype=torch.float64), torch.zeros(3000, dtype=torch.float64)
    sr.fill([("a", box, (600, 900), (100, 200)), ("b", b1, (3000,), (0,)),
             ("b", b2, (3000,), (0,))], rank=0)
    assert torch.equal(box, a[100:400, 200:600])
    assert torch.equal(b1, b) and torch.equal(b2, b)
    (call,) = staged["calls"]
    assert call["ranges"] == 2  # the box's span of `a`, and `b` once for both targets


def test_a_range_that_would_need_a_large_device_temporary_takes_the_host_path(tmp_path, staged,
                                                                           monkeypatch):
    """A range that is not exactly its one target needs a temporary on the device: above
    STAGE_BYTES it is read through host memory instead (GPU memory stays bounded)."""
    g = torch.Generator().manual_seed(11)
    a = torch.randn(600, 900, generator=g)
    b = torch.randn(3000, generator=g)
    safepoint.save(tmp_path, 1, {"a": a, "b": b})
    monkeypatch.setattr(_device_fill, "STAGE_BYTES", 1 << 20)
    sr = _shards.StepReader(str(tmp_path), 1)
    box = torch.zeros(300, 400)  # its span of `a`: 1.03 MiB
    b1, b2 = torch.zeros(3000), torch.zeros(3000)
    sr.fill([("a", box, (600, 900), (100, 200)), ("b", b1, (3000,), (0,)),
             ("b", b2, (3000,), (0,))], rank=0)
    assert torch.equal(box, a[100:400, 200:600]) and torch.equal(b1, b) and torch.equal(b2, b)
    (call,) = staged["calls"]
    assert call["ranges"] == 1  # `b`; the box's span went through host memory


def test_plan_splits_only_at_chunk_boundaries_and_aligns_whole_chunks():
    mib = 1 << 20
    chunk = 4 * mib
    stage = 16 * mib
    ranges = [(4096, 20 * mib, chunk),  # holds whole chunks: split across buffers
              (20 * mib + 4096 + 64, 1000, chunk),  # small: packed
              (20 * mib + 8192, 3 * mib + 17, chunk),
              (30 * mib + 100, 9 * mib, chunk)]  # not 4 KiB aligned in its image
    batches = _device_fill.plan(ranges, stage)
    seen = {i: 0 for i in range(len(ranges))}
    for batch in batches:
        end = 0
        for i, first, n, pos in batch:
            at, nbytes, _ = ranges[i]
            assert first == seen[i] and n > 0 and pos >= end and pos + n <= stage
            seen[i] += n
            end = pos + n
            if nbytes - first >= chunk:  # a piece that may hold a whole chunk: aligned like it
                assert (pos - (at + first)) % 4096 == 0
            if first + n < nbytes:  # cut: on a chunk boundary of the image
                assert (at + first + n) % chunk == 0
    assert seen == {i: r[1] for i, r in enumerate(ranges)}  # every byte once
    # plan()'s positions are relative to buffers whose first byte is aligned like that.
    assert all(_device_fill._aligned(n, False).data_ptr() % 4096 == 0 for n in (1, 5000, 1 << 20))
    # A buffer smaller than a chunk still makes progress (a chunk is then read twice).
    small = _device_fill.plan([(0, 10 * mib, chunk)], mib)
    assert sum(n for b in small for _, _, n, _ in b) == 10 * mib and len(small) == 10


def test_a_damaged_chunk_fails_the_restore_and_no_copy_is_left_running(tmp_path, staged):
    safepoint.save(tmp_path, 1, state())
    image = os.path.join(tmp_path, "step-00000000000000000001", "rank-00000.img")
    with open(image, "r+b") as f:  # a bit in the middle of the data
        f.seek(2 * CHUNK // 3)
        byte = f.read(1)
        f.seek(2 * CHUNK // 3)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(safepoint.CorruptionError):
        safepoint.restore(tmp_path, zeros(state()), step=1)
    assert staged["calls"]  # it failed in the staged read, not before


def test_ranges_a_cpu_tensor_also_needs_take_the_host_path(tmp_path, monkeypatch):
    """A range is staged only when every destination of it is; here only `big` is."""
    safepoint.save(tmp_path, 1, state())
    ranges_seen = []
    real = _device_fill.fill
    monkeypatch.setattr(_device_fill, "staged", lambda dst: dst.numel() == state()["big"].numel())
    monkeypatch.setattr(_device_fill, "fill",
                        lambda ranges, read: (ranges_seen.append(len(ranges)),
                                              real(ranges, read, 1 << 20)))
    target = zeros(state())
    safepoint.restore(tmp_path, target)
    assert equal(target, state()) and ranges_seen == [1]


def test_reads_are_counted_like_any_restore(tmp_path, staged):
    safepoint.save(tmp_path, 1, state())
    stats: dict = {}
    target = zeros(state())
    _shards.read_into(str(tmp_path), 1, 0, target, stats=stats)
    assert equal(target, state())

    def nbytes(tree):
        if isinstance(tree, dict):
            return sum(nbytes(v) for v in tree.values())
        return tree.numel() * tree.element_size() if isinstance(tree, torch.Tensor) else 0

    assert stats["storage_bytes_read"] == nbytes(state())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_restore_from_storage_into_gpu_tensors_is_pipelined_and_bit_exact(tmp_path, monkeypatch):
    safepoint.save(tmp_path, 1, state())
    calls = []
    real = _device_fill.fill
    monkeypatch.setattr(_device_fill, "fill",
                        lambda ranges, read: (calls.append(len(ranges)),
                                              real(ranges, read, 1 << 20)))
    target = {k: (v.cuda() if isinstance(v, torch.Tensor) else v)
              for k, v in zeros(state()).items()}
    target["small"] = {k: v.cuda() for k, v in zeros(state()["small"]).items()}
    assert safepoint.restore(tmp_path, target) == 1
    torch.cuda.synchronize()
    want = state()
    assert calls == [65]
    for k in ("big", "mat", "half", "ints", "scalar"):
        assert torch.equal(target[k].cpu(), want[k])
    assert all(torch.equal(target["small"][k].cpu(), want["small"][k]) for k in want["small"])
