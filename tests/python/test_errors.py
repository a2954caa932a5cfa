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


def test_a_key_missing_from_the_checkpoint_lists_what_it_holds(ckpt):
    safepoint.save(ckpt, 1, {"model": {"weights": torch.zeros(2), "b": torch.zeros(2)},
                             "step": 1})
    state = {"model": {"weight": torch.ones(2), "b": torch.ones(2)}, "step": 0}
    # safepoint.restore (the byte ranges a state needs) and the restore of a whole loaded state
    # (a Checkpointer's restore from memory): the same error.
    for restore in (lambda: safepoint.restore(ckpt, state), lambda: _restore_into(state, ckpt)):
        with pytest.raises(safepoint.InvalidArgumentError) as e:
            restore()
        msg = str(e.value)
        assert msg == ("model: key 'weight' is not in the checkpoint, which holds there: "
                       "'weights', 'b'. Did you mean 'weights'?"), msg


def _restore_into(state, ckpt):
    """The restore of a whole loaded state (what a restore from memory does)."""
    from safepoint._stateful import restore_into

    restore_into(state, safepoint.load(ckpt)[1])


@pytest.mark.parametrize("saved_wrapped", [False, True])
def test_a_ddp_module_prefix_is_named(ckpt, shm, saved_wrapped):
    """DDP's wrapper prefixes every key with `module.`: saved one way and restored the other,
    the error says so and what to do, and lists the checkpoint's keys."""
    net = torch.nn.Sequential(torch.nn.Linear(2, 2))
    wrapped = {f"module.{k}": v for k, v in net.state_dict().items()}
    plain = net.state_dict()
    safepoint.save(ckpt, 1, {"model": wrapped if saved_wrapped else plain})
    state = {"model": {k: v.clone() for k, v in (plain if saved_wrapped else wrapped).items()}}

    def from_memory():
        job = f"prefix-{os.getpid()}-{int(saved_wrapped)}"
        with safepoint.Checkpointer(ckpt.parent / "flash", job=job, shm_dir=shm) as c:
            c.save(1, {"model": wrapped if saved_wrapped else plain})
            c.restore(state)

    for restore in (lambda: safepoint.restore(ckpt, state), lambda: _restore_into(state, ckpt),
                    from_memory):
        with pytest.raises(safepoint.InvalidArgumentError) as e:
            restore()
        msg = str(e.value)
        assert msg.startswith("model: key "), msg
        assert "is not in the checkpoint, which holds there: " in msg, msg
        held = "'module.0.weight', 'module.0.bias'" if saved_wrapped else "'0.weight', '0.bias'"
        assert held in msg, msg
        assert "'module.' prefix" in msg and "DistributedDataParallel" in msg, msg
        assert ("The checkpoint's keys carry" if saved_wrapped else "The state's keys carry") \
            in msg, msg


def test_a_missing_key_lists_at_most_a_few_of_many(ckpt):
    from safepoint._keys import _RNG_KEY, _SHOWN
    from safepoint._stateful import RNG_KEY

    assert _RNG_KEY == RNG_KEY
    safepoint.save(ckpt, 1, {f"k{i:03d}": i for i in range(100)})
    with pytest.raises(safepoint.InvalidArgumentError, match=r"'k011', \.\.\. \(100 keys in all\)"):
        safepoint.restore(ckpt, {"other": 0})
    safepoint.save(ckpt, 2, {})
    with pytest.raises(safepoint.InvalidArgumentError, match="which holds no keys there"):
        safepoint.restore(ckpt, {"x": 0})
    assert _SHOWN == 12


def test_a_value_that_cannot_be_pickled_names_its_key(ckpt):
    state = {"cfg": {"schedule": [1, lambda step: step * 2]}, "w": torch.zeros(2)}
    with pytest.raises(safepoint.InvalidArgumentError,
                       match=r"^cfg\.schedule\.1: cannot pickle a builtins\.function"):
        safepoint.save(ckpt, 1, state, allow_pickle=True)
    assert safepoint.steps(ckpt) == []
