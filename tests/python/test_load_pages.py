"""A load lands in small pages (issue 33 item 2): the memory of a loaded state is not eligible for
transparent huge pages, because on a guest that reports its free memory to the hypervisor a
fresh huge page is one the host took back, and faulting those in made every other S3 load twice
as slow (docs/benchmarks.md, "Object storage tiers: S3"). The bytes are the saved ones."""

import os

import pytest
import torch

import safepoint

THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_eligible(address: int) -> bool:
    """THPeligible of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("THPeligible:"):
                return line.split()[1] == "1"
    pytest.skip("no THPeligible in /proc/self/smaps for the tensor's mapping")


def test_a_loaded_state_is_in_small_pages(tmp_path):
    if not os.path.exists(THP) or "[never]" in open(THP).read():
        pytest.skip("transparent huge pages are off: every mapping is in small pages")
    g = torch.Generator().manual_seed(3)
    state = {"w": torch.randn(16 << 20 >> 2, generator=g), "b": torch.randn(100, generator=g)}
    safepoint.save(str(tmp_path / "ckpt"), 1, state)
    step, back = safepoint.load(str(tmp_path / "ckpt"), 1)
    assert step == 1
    assert torch.equal(back["w"], state["w"]) and torch.equal(back["b"], state["b"])
    assert not thp_eligible(back["w"].data_ptr())
