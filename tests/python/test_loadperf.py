"""The fast load paths (issue 14): restores that read straight into their targets, from storage
and from memory, keep every check of the slow paths: each byte verified, a flipped byte
detected and never handed out, the same errors for targets that do not match."""

import glob
import os

import pytest
import torch
from conftest import flip_byte

import safepoint

CHUNK = 4 << 20
BIG = (3 << 20) + 1234  # float32 elements: 12 MiB + a bit, not a multiple of the chunk size


def state_of(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"big": torch.randn(BIG, generator=g),
            "mat": torch.randn(300, 700, generator=g),        # for a transposed target
            "half": torch.randn(5000, generator=g).to(torch.bfloat16),
            "small": [torch.randn(17, generator=g) for _ in range(5)],
            "step": step}


def targets() -> dict:
    return {"big": torch.zeros(BIG), "mat": torch.zeros(700, 300).t(),  # not contiguous
            "half": torch.zeros(5000, dtype=torch.bfloat16),
            "small": [torch.zeros(17) for _ in range(5)], "step": 0}


def assert_same(got: dict, want: dict) -> None:
    assert got["step"] == want["step"]
    for k in ("big", "mat", "half"):
        assert torch.equal(got[k], want[k]), k
    for a, b in zip(got["small"], want["small"]):
        assert torch.equal(a, b)


def image(path, step: int) -> str:
    (img,) = glob.glob(os.path.join(str(path), f"step-{step:020d}", "rank-00000*.img"))
    return img


def test_restore_from_storage_in_place_every_layout(tmp_path):
    want = state_of(1)
    safepoint.save(tmp_path, 1, want)
    t = targets()
    keep = {k: t[k] for k in ("big", "mat", "half")}
    assert safepoint.restore(tmp_path, t) == 1
    assert_same(t, want)
    for k, v in keep.items():
        assert t[k] is v  # in place
    assert not t["mat"].is_contiguous()


def test_restore_from_storage_detects_a_flip_in_a_chunk_read_in_place(tmp_path):
    one, two = state_of(1), state_of(2)
    safepoint.save(tmp_path, 1, one)
    safepoint.save(tmp_path, 2, two)
    # A byte in the middle of "big" (in a chunk it covers whole, read straight into the target).
    _, loaded = safepoint.load(tmp_path, 2)
    img = image(tmp_path, 2)
    data = open(img, "rb").read()
    at = data.find(two["big"][BIG // 2:BIG // 2 + 64].numpy().tobytes())
    assert at > CHUNK and (at // CHUNK + 1) * CHUNK < at + (BIG // 2) * 4
    flip_byte(img, at + 5, 0x20)
    t = targets()
    with pytest.raises(safepoint.CorruptionError, match="chunk"):
        safepoint.restore(tmp_path, t, step=2)
    # Without a step it falls back to step 1, whose bytes replace whatever step 2 left.
    t = targets()
    with pytest.warns(RuntimeWarning, match="step 2"):
        assert safepoint.restore(tmp_path, t) == 1
    assert_same(t, one)


def test_restore_from_storage_refuses_mismatched_targets(tmp_path):
    safepoint.save(tmp_path, 1, state_of(1))
    t = targets()
    t["big"] = torch.zeros(BIG, dtype=torch.float64)
    with pytest.raises(safepoint.InvalidArgumentError, match="big: dtype float32 in the checkpoint"):
        safepoint.restore(tmp_path, t)
    t = targets()
    t["half"] = torch.zeros(4999, dtype=torch.bfloat16)
    with pytest.raises(safepoint.InvalidArgumentError, match=r"half: shape \(5000,\) in the "):
        safepoint.restore(tmp_path, t)


def checkpointer(tmp_path, name: str, **kw) -> safepoint.Checkpointer:
    return safepoint.Checkpointer(tmp_path / "ckpt", job=f"{name}-{id(tmp_path) % 10**8}",
                                  shm_dir=str(tmp_path), **kw)


def flip_in_slot(tmp_path, marker: bytes) -> None:
    """Flips one byte of the slot file that holds `marker` (the snapshot in memory)."""
    for slot in glob.glob(os.path.join(str(tmp_path), "**", "rank-00000.slot-*"), recursive=True):
        data = open(slot, "rb").read()
        at = data.find(marker)
        if at >= 0:
            flip_byte(slot, at + 3, 0x20)
            return
    raise AssertionError("marker not in any slot")


def test_hot_restore_fills_targets_in_the_verifying_pass(tmp_path):
    want = state_of(3)
    with checkpointer(tmp_path, "hot", persist_every=100) as ckpt:
        ckpt.save(3, want)
        t = targets()
        # The core's load in place copies the tensors straight into the targets and hands the
        # targets back (restore then has nothing left to copy); a non-contiguous target gets a
        # filled contiguous copy, which restore copies in.
        snap = ckpt._live.load_step(3, None, True, t)
        for k in ("big", "half"):
            assert snap.state[k] is t[k] and torch.equal(t[k], want[k])
        assert snap.state["small"][2] is t["small"][2]
        assert snap.state["mat"] is not t["mat"] and torch.equal(snap.state["mat"], want["mat"])
        del snap
        t = targets()
        keep = t["big"]
        assert ckpt.restore(t) == 3 and ckpt.last_load_source == "memory"
        assert t["big"] is keep
        assert_same(t, want)


def test_hot_restore_detects_a_flipped_byte_and_falls_back(tmp_path):
    want = state_of(4)
    with checkpointer(tmp_path, "flip", persist_every=100) as ckpt:
        ckpt.save(4, want, persist=True)
        ckpt.wait()
        flip_in_slot(tmp_path, want["big"][BIG // 2:BIG // 2 + 64].numpy().tobytes())
        t = targets()
        with pytest.warns(RuntimeWarning, match="damaged"):
            assert ckpt.restore(t) == 4
        assert ckpt.last_load_source == "storage"
        assert_same(t, want)  # the storage copy replaced whatever the damaged slot left


def test_hot_restore_of_a_damaged_slot_with_nothing_on_storage_raises(tmp_path):
    want = state_of(5)
    with checkpointer(tmp_path, "alone", persist_every=100) as ckpt:
        ckpt.save(5, want)
        flip_in_slot(tmp_path, want["half"][1000:1100].view(torch.int16).numpy().tobytes())
        t = targets()
        # The targets may hold the damaged bytes now: restore must not say "nothing to load".
        with pytest.warns(RuntimeWarning, match="damaged"):
            with pytest.raises(safepoint.CorruptionError, match="may hold damaged bytes"):
                ckpt.restore(t)


def test_hot_restore_keeps_the_shape_error(tmp_path):
    with checkpointer(tmp_path, "shape", persist_every=100) as ckpt:
        ckpt.save(1, state_of(1))
        t = targets()
        t["big"] = torch.zeros(BIG - 1)
        with pytest.raises(safepoint.InvalidArgumentError, match=r"big: shape \(3146962,\) in the"):
            ckpt.restore(t)


def test_hot_restore_into_strided_views(tmp_path):
    # A restore from memory copies the slot's bytes straight into contiguous targets only: a
    # transposed target and a view with a step get theirs through their strides, and the
    # memory between a strided view's elements is left alone.
    want = {"w": torch.arange(12, dtype=torch.float32).reshape(4, 3), "v": torch.arange(4.0)}
    base = torch.full((8,), -1.0)
    with checkpointer(tmp_path, "strided", persist_every=100) as ckpt:
        ckpt.save(1, want)
        t = {"w": torch.zeros(3, 4).t(), "v": base[::2]}
        assert ckpt.restore(t) == 1 and ckpt.last_load_source == "memory"
        assert torch.equal(t["w"], want["w"])
        assert torch.equal(base, torch.tensor([0.0, -1, 1, -1, 2, -1, 3, -1]))


def pair(step: int, order: str = "ab") -> dict:
    g = torch.Generator().manual_seed(step)
    made = {"a": torch.randn(1000, generator=g), "b": torch.randn(1000, generator=g)}
    return {"model": {k: made[k] for k in order}, "step": step}


def test_hot_restore_plan_is_kept_only_for_the_same_structure(tmp_path):
    with checkpointer(tmp_path, "plan", persist_every=100) as ckpt:
        ckpt.save(1, pair(1))
        # The plan is the structure's, non-tensor values included (as the save's plan): the
        # targets hold the step value the snapshot has, as after a first restore.
        t = pair(0)
        t["step"] = 1
        assert ckpt.restore(t) == 1 and not ckpt._live.last_restore_reused_plan()
        assert ckpt.restore(t) == 1 and ckpt._live.last_restore_reused_plan()
        assert_pair(t, pair(1))
        # The same keys in another order: another structure, so another plan (a stale one would
        # fill "b" with "a"'s bytes: the same shapes, the same tensor count).
        t = pair(0, "ba")
        t["step"] = 1
        assert ckpt.restore(t) == 1 and not ckpt._live.last_restore_reused_plan()
        assert_pair(t, pair(1))
        assert ckpt.restore(t) == 1 and ckpt._live.last_restore_reused_plan()
        assert_pair(t, pair(1))
        # The targets' structure unchanged, the snapshot's changed (its tensors in another
        # order): the plan's image indexes are hints, checked by name.
        ckpt.save(2, pair(2, "ba"))
        assert ckpt.restore(t) == 2 and ckpt._live.last_restore_reused_plan()
        assert_pair(t, pair(2))
        # Another tensor shape in the targets: no plan, and the shape error of the slow path.
        t["model"]["a"] = torch.zeros(999)
        with pytest.raises(safepoint.InvalidArgumentError, match="shape"):
            ckpt.restore(t)
        assert not ckpt._live.last_restore_reused_plan()


def assert_pair(got: dict, want: dict) -> None:
    assert got["step"] == want["step"]
    for k in ("a", "b"):
        assert torch.equal(got["model"][k], want["model"][k]), k
