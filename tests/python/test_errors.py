"""Bad input, corrupted, truncated and malicious files: clear errors, never wrong data."""

import os
import random

import numpy as np
import pytest
import torch

import safepoint


def image_path(ckpt, step, rank=0):
    return ckpt / f"step-{step:020d}" / f"rank-{rank:05d}.img"


def commit_path(ckpt, step):
    return ckpt / f"step-{step:020d}" / "COMMIT"


def save_two(ckpt):
    safepoint.save(ckpt, 1, {"w": torch.arange(300_000, dtype=torch.float32), "step": 1})
    safepoint.save(ckpt, 2, {"w": torch.arange(300_000, dtype=torch.float32) * 2, "step": 2})


def test_error_hierarchy():
    for cls in (safepoint.NotFoundError, safepoint.CorruptionError, safepoint.StorageError,
                safepoint.InvalidArgumentError, safepoint.ResourceExhaustedError):
        assert issubclass(cls, safepoint.Error)


def test_every_exception_is_exported_once_from_errors():
    import safepoint.errors as errors

    defined = sorted(n for n, v in vars(errors).items()
                     if isinstance(v, type) and issubclass(v, safepoint.Error))
    assert sorted(errors.__all__) == defined
    assert [n for n in safepoint.__all__ if n in defined] == errors.__all__
    assert len(set(safepoint.__all__)) == len(safepoint.__all__)
    for name in defined:
        assert getattr(safepoint, name) is getattr(errors, name)
    assert {"Checkpointer", "save", "load", "steps"} <= set(safepoint.__all__)


def test_load_missing(tmp_path):
    with pytest.raises(safepoint.NotFoundError, match="no committed checkpoint"):
        safepoint.load(tmp_path / "nothing")
    safepoint.save(tmp_path / "c", 1, {})
    with pytest.raises(safepoint.NotFoundError, match="step 5"):
        safepoint.load(tmp_path / "c", 5)


@pytest.mark.parametrize("bad, match", [
    ({"x": object()}, r"x: cannot save a value of type builtins\.object"),
    ({"a": {"b": [1, {2.5: 1}]}}, r"a\.b\.1: dict key 2\.5"),
    ({"a": {True: 1}}, r"dict key True of type bool"),
    ({"c": torch.zeros(2, dtype=torch.uint8).view(torch.bits8)}, r"c: tensor dtype torch\.bits8"),
    ({"u": np.array(["text"])}, r"u: numpy dtype <U4"),
    ({"s": torch.zeros(3).to_sparse()}, r"s: cannot save a torch\.sparse_coo tensor"),
    ({"set": {1, 2}}, r"set: cannot save a value of type builtins\.set"),
])
def test_unsupported_values_name_the_key(ckpt, bad, match):
    with pytest.raises(safepoint.InvalidArgumentError, match=match):
        safepoint.save(ckpt, 1, bad)
    assert safepoint.steps(ckpt) == []


@pytest.mark.parametrize("kwargs, match", [
    (dict(step=-1), "step"), (dict(step=1.5), "step"), (dict(rank=2, world_size=2), "rank"),
    (dict(world_size=0), "world_size"), (dict(job="a/b"), "job"),
])
def test_bad_arguments(ckpt, kwargs, match):
    args = dict(step=1, state={"x": 1})
    args.update(kwargs)
    with pytest.raises(safepoint.InvalidArgumentError, match=match):
        safepoint.save(ckpt, args.pop("step"), args.pop("state"), **args)


def test_bad_path_is_a_clear_error(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(safepoint.Error, match=str(f)):
        safepoint.save(f, 1, {"x": 1})
    with pytest.raises(safepoint.InvalidArgumentError, match="scheme"):
        safepoint.save("nosuch://x", 1, {"x": 1})


def test_bit_flips_everywhere_are_detected(ckpt):
    save_two(ckpt)
    img = image_path(ckpt, 2)
    data = bytearray(img.read_bytes())
    rng = random.Random(1)
    positions = sorted({0, 8, 100, 4092, 4096, len(data) - 1, *(rng.randrange(len(data)) for _ in range(40))})
    for pos in positions:
        bad = bytearray(data)
        bad[pos] ^= 1 << rng.randrange(8)
        img.write_bytes(bad)
        with pytest.raises(safepoint.CorruptionError, match=str(img)):
            safepoint.load(ckpt, 2)
        # Without an explicit step, loading falls back to step 1, with a warning.
        with pytest.warns(RuntimeWarning, match="step 2"):
            step, state = safepoint.load(ckpt)
        assert step == 1 and state["step"] == 1
        assert torch.equal(state["w"], torch.arange(300_000, dtype=torch.float32))
    img.write_bytes(data)
    assert safepoint.load(ckpt)[0] == 2


@pytest.mark.parametrize("cut", [0, 1, 4095, 4096, 8192, -4096, -1])
def test_truncated_image(ckpt, cut):
    save_two(ckpt)
    img = image_path(ckpt, 2)
    data = img.read_bytes()
    img.write_bytes(data[:cut] if cut >= 0 else data[:len(data) + cut])
    with pytest.raises(safepoint.CorruptionError, match=str(img)):
        safepoint.load(ckpt, 2)
    with pytest.warns(RuntimeWarning):
        assert safepoint.load(ckpt)[0] == 1


def test_missing_image_of_committed_step(ckpt):
    save_two(ckpt)
    os.unlink(image_path(ckpt, 2))
    with pytest.raises(safepoint.NotFoundError):
        safepoint.load(ckpt, 2)
    with pytest.warns(RuntimeWarning):
        assert safepoint.load(ckpt)[0] == 1


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "garbage"])
def test_corrupt_commit_record_hides_the_step(ckpt, damage):
    save_two(ckpt)
    c = commit_path(ckpt, 2)
    data = bytearray(c.read_bytes())
    if damage == "flip":
        data[20] ^= 0x80
    elif damage == "truncate":
        data = data[:-5]
    elif damage == "empty":
        data = bytearray()
    else:
        data = bytearray(os.urandom(len(data)))
    c.write_bytes(bytes(data))
    assert safepoint.steps(ckpt) == [1]
    with pytest.warns(RuntimeWarning, match="COMMIT"):
        assert safepoint.load(ckpt)[0] == 1


def test_all_copies_corrupt_raises(ckpt):
    save_two(ckpt)
    for s in (1, 2):
        p = image_path(ckpt, s)
        d = bytearray(p.read_bytes())
        d[5000] ^= 0xFF
        p.write_bytes(d)
    with pytest.raises(safepoint.CorruptionError, match="no committed checkpoint that can be read"):
        safepoint.load(ckpt)


def test_symlinks_cannot_escape_the_checkpoint_directory(ckpt, tmp_path):
    save_two(ckpt)
    outside = tmp_path / "outside.img"
    outside.write_bytes(image_path(ckpt, 1).read_bytes())
    # A committed step whose image is replaced by a symlink to a file outside the directory.
    img = image_path(ckpt, 2)
    img.unlink()
    img.symlink_to(outside)
    with pytest.raises(safepoint.Error):
        safepoint.load(ckpt, 2)
    # A whole step directory that is a symlink to somewhere else is not a step.
    other = tmp_path / "other"
    safepoint.save(other, 7, {"x": 1})
    os.symlink(other / "step-00000000000000000007", ckpt / "step-00000000000000000007")
    assert 7 not in safepoint.steps(ckpt)


def test_leftover_temporaries_are_never_read(ckpt):
    save_two(ckpt)
    d = ckpt / "step-00000000000000000003"
    d.mkdir()
    (d / "rank-00000.img.tmp.0123456789abcdef").write_bytes(image_path(ckpt, 2).read_bytes())
    (d / "COMMIT.tmp.0123456789abcdef").write_bytes(commit_path(ckpt, 2).read_bytes())
    assert safepoint.steps(ckpt) == [1, 2]
    assert safepoint.load(ckpt)[0] == 2
