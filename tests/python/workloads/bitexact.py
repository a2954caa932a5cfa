"""Bit-exact comparison of nested states, shared by the test workloads, the crash campaign and the
adapter tests: tensors compare by dtype, shape and bytes (so -0.0, NaN payloads and bfloat16
bits count), containers by type and contents, everything else by type and ==."""

from __future__ import annotations


def _same_tensor(a, b) -> bool:
    import torch

    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                       b.contiguous().reshape(-1).view(torch.uint8))


def first_difference(got, want, where: str = "state"):
    """None when `got` equals `want` bit for bit (tensors byte-wise), else where they differ."""
    import torch

    if isinstance(want, torch.Tensor):
        return None if _same_tensor(got, want) else where
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            have = sorted(got) if isinstance(got, dict) else type(got)
            return f"{where}: keys {have} != {sorted(want)}"
        for k in want:
            d = first_difference(got[k], want[k], f"{where}[{k!r}]")
            if d:
                return d
        return None
    if isinstance(want, (list, tuple)):
        if type(got) is not type(want) or len(got) != len(want):
            return f"{where}: {got!r} != {want!r}"
        for i, (g, w) in enumerate(zip(got, want)):
            d = first_difference(g, w, f"{where}[{i}]")
            if d:
                return d
        return None
    if type(got) is not type(want) or got != want:
        return f"{where}: {got!r} != {want!r}"
    return None


def assert_bit_identical(got, want, where: str = "state") -> None:
    difference = first_difference(got, want, where)
    assert difference is None, difference
