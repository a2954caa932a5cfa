"""The chunk codec through safepoint._core: compress_chunk / decompress_chunk(_into)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from safepoint import _core
from safepoint.errors import CorruptionError, InvalidArgumentError


def trained_like(n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(n, generator=g) * 0.02).to(dtype)


def raw_of(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint8).numpy()


@pytest.mark.parametrize("mode", ["auto", "none", "zstd", "planes"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64,
                                   torch.int8])
def test_round_trip_every_dtype_and_mode(dtype, mode):
    t = trained_like(100_003, torch.float32).to(dtype) if dtype != torch.int8 else \
        torch.randint(-3, 3, (100_003,), dtype=torch.int8)
    raw = raw_of(t)
    frame, method = _core.compress_chunk(raw, t.element_size(), mode)
    assert isinstance(frame, bytes)
    assert method in ("raw", "zstd", "planes")
    if mode == "none":
        assert method == "raw"
    assert len(frame) <= raw.nbytes + _core.FRAME_HEADER_SIZE
    assert _core.decompress_chunk(frame) == raw.tobytes()
    assert _core.decompress_chunk(frame, raw.nbytes) == raw.tobytes()
    out = bytearray(raw.nbytes)
    _core.decompress_chunk_into(memoryview(frame), out)
    assert bytes(out) == raw.tobytes()


def test_planes_shrink_bf16_weights_more_than_zstd():
    raw = raw_of(trained_like(1 << 20, torch.bfloat16))
    planes, m1 = _core.compress_chunk(raw, 2, "planes")
    zstd, m2 = _core.compress_chunk(raw, 2, "zstd")
    assert (m1, m2) == ("planes", "zstd")
    assert len(planes) < len(zstd) < raw.nbytes
    assert raw.nbytes / len(planes) > 1.4


def test_bytes_like_inputs():
    data = b"abc" * 10_000
    for obj in (data, bytearray(data), memoryview(data), np.frombuffer(data, np.uint8)):
        frame, method = _core.compress_chunk(obj, 1, "auto")
        assert method == "zstd"
        assert _core.decompress_chunk(frame) == data


def test_bad_arguments():
    with pytest.raises(InvalidArgumentError, match="auto, none, zstd, planes"):
        _core.compress_chunk(b"x", 1, "lz4")
    with pytest.raises(InvalidArgumentError, match="element size 3"):
        _core.compress_chunk(b"xyz", 3, "auto")
    with pytest.raises(TypeError):
        _core.compress_chunk("text", 1, "auto")


def test_corrupt_frames_raise():
    raw = raw_of(trained_like(50_000, torch.float32))
    frame, method = _core.compress_chunk(raw, 4, "planes")
    assert method == "planes"
    for at in (0, 20, _core.FRAME_HEADER_SIZE + 5, len(frame) - 1):
        bad = bytearray(frame)
        bad[at] ^= 0x01
        with pytest.raises(CorruptionError):
            _core.decompress_chunk(bytes(bad))
    with pytest.raises(CorruptionError):
        _core.decompress_chunk(frame[:-1])
    with pytest.raises(CorruptionError, match="expected"):
        _core.decompress_chunk(frame, raw.nbytes + 1)
    with pytest.raises(CorruptionError):
        _core.decompress_chunk_into(frame, bytearray(raw.nbytes - 1))
    with pytest.raises(BufferError):
        _core.decompress_chunk_into(frame, bytes(raw.nbytes))  # not writable
