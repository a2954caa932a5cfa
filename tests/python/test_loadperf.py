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


def test_a_streamed_hot_restore_detects_a_flipped_byte_and_falls_back(tmp_path):
    # With a restore plan the copy runs while the targets are walked (the streamed load): a
    # damaged chunk fails it like the first restore's, and storage's copy is loaded instead.
    want = pair(6)
    with checkpointer(tmp_path, "streamflip", persist_every=100) as ckpt:
        ckpt.save(6, want, persist=True)
        ckpt.wait()
        t = pair(0)
        t["step"] = 6
        assert ckpt.restore(t) == 6 and ckpt.last_load_source == "memory"
        assert ckpt.restore(t) == 6 and ckpt._live.last_restore_reused_plan()
        flip_in_slot(tmp_path, want["model"]["b"][500:516].numpy().tobytes())
        with pytest.warns(RuntimeWarning, match="damaged"):
            assert ckpt.restore(t) == 6
        assert ckpt.last_load_source == "storage"
        assert_pair(t, want)


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


# -- the whole restore in place (issue 21, item 3) -------------------------------------------
# When the restore plan is reused, the snapshot's extras are the bytes the targets flatten to
# and every tensor was filled from the image entry of its own index, the load returns the
# targets themselves: no extras decoded, no tree rebuilt, no Python walk of it.

def rich(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {f"l{i}.weight": torch.randn(64 + i, generator=g) for i in range(20)},
            "opt": {"state": {0: {"exp_avg": torch.randn(8, generator=g), "step": 3}},
                    "param_groups": [{"lr": 0.5, "betas": (0.9, 0.99), "params": [0]}]},
            "pair": (torch.randn(5, generator=g), "tag"),
            "step": step}


def zero_tensors(tree) -> None:
    """Overwrites every tensor of `tree` in place (its structure and values unchanged)."""
    if isinstance(tree, torch.Tensor):
        tree.zero_()
    elif isinstance(tree, dict):
        for v in tree.values():
            zero_tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            zero_tensors(v)


def assert_tree_equal(got, want, where="") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(got, want), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), where
        for k in want:
            assert_tree_equal(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            assert_tree_equal(a, b, f"{where}.{i}")
    else:
        assert type(got) is type(want) and got == want, where


def test_hot_restore_whole_in_place_is_taken_and_fills_every_tensor(tmp_path):
    want = rich(1)
    with checkpointer(tmp_path, "whole", persist_every=100) as ckpt:
        ckpt.save(1, want)
        t = rich(1)
        zero_tensors(t)
        # The first restore builds the plan (the full path), the next ones reuse it whole.
        assert ckpt.restore(t) == 1 and not ckpt._live.last_restore_whole()
        assert_tree_equal(t, want)
        # (the full path replaced the tuple by the loaded one, its tensor a copy)
        keep = (t["model"], t["model"]["l3.weight"], t["pair"], t["opt"]["state"][0]["exp_avg"])
        for _ in range(2):
            zero_tensors(t)
            assert ckpt.restore(t) == 1 and ckpt.last_load_source == "memory"
            assert ckpt._live.last_restore_reused_plan() and ckpt._live.last_restore_whole()
            assert_tree_equal(t, want)  # every tensor, the one in the tuple included
        assert all(a is b for a, b in zip(keep, (t["model"], t["model"]["l3.weight"], t["pair"],
                                                 t["opt"]["state"][0]["exp_avg"])))
        # The load hands back the targets themselves.
        snap = ckpt._live.load_step(1, None, True, t)
        assert snap.state is t and ckpt._live.last_restore_whole()


def restored_whole(ckpt):
    """Saves rich(1) as step 1 and restores it twice into one state, the second time whole (the
    plan of the first reused); returns that state."""
    ckpt.save(1, rich(1))
    t = rich(1)
    ckpt.restore(t)
    assert ckpt.restore(t) == 1 and ckpt._live.last_restore_whole()
    return t


def test_hot_restore_whole_falls_back_when_the_snapshot_values_differ(tmp_path):
    # The targets keep their structure (the plan is reused) but the newer snapshot holds other
    # non-tensor values: its extras differ, so they are decoded and assigned (the full path).
    with checkpointer(tmp_path, "values", persist_every=100) as ckpt:
        t = restored_whole(ckpt)
        newer = rich(1)
        newer["opt"]["param_groups"][0]["lr"] = 0.25
        ckpt.save(2, newer)
        zero_tensors(t)
        assert ckpt.restore(t) == 2 and ckpt._live.last_restore_reused_plan()
        assert not ckpt._live.last_restore_whole()
        assert t["opt"]["param_groups"][0]["lr"] == 0.25
        assert_tree_equal(t, newer)


def test_hot_restore_whole_falls_back_for_a_state_of_another_structure(tmp_path):
    # A snapshot whose tensors have the targets' names, dtypes and shapes (every one is filled)
    # but whose tree is another ("a.b" a key of its own, not "b" under "a"): the extras differ,
    # and the full path reports the missing key as it always did.
    mine = {"m": {"a": {"b": torch.ones(10)}}, "step": 1}
    other = {"m": {"a.b": torch.full((10,), 2.0)}, "step": 1}
    with checkpointer(tmp_path, "other", persist_every=100) as ckpt:
        ckpt.save(1, mine)
        t = {"m": {"a": {"b": torch.zeros(10)}}, "step": 1}
        ckpt.restore(t)
        assert ckpt.restore(t) == 1 and ckpt._live.last_restore_whole()
        ckpt.save(2, other)
        with pytest.raises(safepoint.InvalidArgumentError, match="key 'a' is not in the"):
            ckpt.restore(t)
        assert ckpt._live.last_restore_reused_plan() and not ckpt._live.last_restore_whole()
        # The snapshot's tensors in another order (same structure otherwise): each is filled
        # from the entry of its name, not its own index, so the tree is rebuilt.
        ckpt.save(3, {"step": 1, "m": {"a": {"b": torch.full((10,), 3.0)}}})
        assert ckpt.restore(t) == 3 and not ckpt._live.last_restore_whole()
        assert torch.equal(t["m"]["a"]["b"], torch.full((10,), 3.0))


def test_hot_restore_whole_falls_back_when_the_state_changed(tmp_path):
    with checkpointer(tmp_path, "changed", persist_every=100) as ckpt:
        t = restored_whole(ckpt)
        # A value of the state changed since: another signature, no plan; the value is
        # assigned back from the snapshot.
        t["step"] = 9
        assert ckpt.restore(t) == 1 and not ckpt._live.last_restore_reused_plan()
        assert not ckpt._live.last_restore_whole() and t["step"] == 1
        # A key the snapshot lacks: the full path's error.
        t["extra"] = torch.zeros(3)
        with pytest.raises(safepoint.InvalidArgumentError, match="extra"):
            ckpt.restore(t)
        assert not ckpt._live.last_restore_whole()


def test_hot_restore_whole_still_calls_load_state_dict(tmp_path):
    # A module at the top level is restored through load_state_dict either way; a nested
    # Stateful mapping (not in the plan's signature) keeps the restore off the whole path.
    class Counted(dict):
        loads = 0

        def state_dict(self):
            return dict(self)

        def load_state_dict(self, sd):
            Counted.loads += 1
            self.update(sd)

    model = torch.nn.Linear(4, 3)
    hooked = []
    model.register_load_state_dict_post_hook(lambda m, keys: hooked.append(1))
    with checkpointer(tmp_path, "stateful", persist_every=100) as ckpt:
        ckpt.save(1, {"model": model, "step": 1})
        want = {k: v.clone() for k, v in model.state_dict().items()}
        state = {"model": model, "step": 1}
        ckpt.restore(state)
        with torch.no_grad():
            model.weight.zero_()
        assert ckpt.restore(state) == 1 and ckpt._live.last_restore_whole()
        assert len(hooked) == 2 and torch.equal(model.weight, want["weight"])
        nested = {"x": {"inner": Counted(w=torch.ones(4))}}
        ckpt.save(2, nested)
        t = {"x": {"inner": Counted(w=torch.zeros(4))}}
        ckpt.restore(t)
        assert ckpt.restore(t) == 2 and ckpt._live.last_restore_reused_plan()
        assert not ckpt._live.last_restore_whole()
        assert Counted.loads == 2 and torch.equal(t["x"]["inner"]["w"], torch.ones(4))

        class CountedList(list):  # a Stateful sequence (review: only mappings were checked)
            loads = 0

            def state_dict(self):
                return list(self)

            def load_state_dict(self, sd):
                CountedList.loads += 1
                self[:] = sd

        ckpt.save(3, {"x": {"inner": CountedList([torch.ones(4)])}})
        t = {"x": {"inner": CountedList([torch.zeros(4)])}}
        ckpt.restore(t)
        assert ckpt.restore(t) == 3 and ckpt._live.last_restore_reused_plan()
        assert not ckpt._live.last_restore_whole()
        assert CountedList.loads == 2 and torch.equal(t["x"]["inner"][0], torch.ones(4))


def test_hot_restore_whole_detects_a_flipped_byte(tmp_path):
    want = rich(1)
    with checkpointer(tmp_path, "wholeflip", persist_every=100) as ckpt:
        ckpt.save(1, want)
        t = rich(1)
        ckpt.restore(t)
        assert ckpt.restore(t) == 1 and ckpt._live.last_restore_whole()
        flip_in_slot(tmp_path, want["model"]["l7.weight"][10:30].numpy().tobytes())
        with pytest.warns(RuntimeWarning, match="damaged"):
            with pytest.raises(safepoint.CorruptionError, match="may hold damaged bytes"):
                ckpt.restore(t)
        assert not ckpt._live.last_restore_whole()
