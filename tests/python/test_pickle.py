"""allow_pickle: refused by default, stored as pickles when allowed, loaded through an allow-list."""

import collections
import dataclasses
import datetime
import fractions
import os

import pytest
import torch

import safepoint


@dataclasses.dataclass
class Config:
    lr: float
    name: str


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /tmp/safepoint-evil",))


def test_refused_by_default_with_the_key(tmp_path):
    with pytest.raises(safepoint.InvalidArgumentError, match=r"cfg: cannot save .*allow_pickle"):
        safepoint.save(tmp_path, 1, {"cfg": Config(0.1, "x")})


def test_standard_types_round_trip_with_allow_pickle(tmp_path):
    state = {"s": {1, 2}, "dq": collections.deque([1, 2]), "when": datetime.date(2026, 11, 29),
             "frac": fractions.Fraction(1, 3), "c": 1 + 2j, "w": torch.ones(3)}
    safepoint.save(tmp_path, 1, state, allow_pickle=True)
    with pytest.raises(safepoint.InvalidArgumentError, match="allow_pickle=True"):
        safepoint.load(tmp_path)  # not without asking for it
    _, got = safepoint.load(tmp_path, allow_pickle=True)
    assert got["s"] == {1, 2} and got["dq"] == collections.deque([1, 2])
    assert got["when"] == datetime.date(2026, 11, 29) and got["frac"] == fractions.Fraction(1, 3)
    assert got["c"] == 1 + 2j and torch.equal(got["w"], torch.ones(3))


def test_user_classes_need_to_be_named(tmp_path):
    safepoint.save(tmp_path, 1, {"cfg": Config(0.1, "x")}, allow_pickle=True)
    with pytest.raises(safepoint.CorruptionError, match="Config"):
        safepoint.load(tmp_path, allow_pickle=True)
    name = f"{Config.__module__}.Config"
    _, got = safepoint.load(tmp_path, allow_pickle=[name])
    assert got["cfg"] == Config(0.1, "x")


def test_malicious_pickle_is_not_executed(tmp_path):
    marker = "/tmp/safepoint-evil"
    if os.path.exists(marker):
        os.unlink(marker)
    safepoint.save(tmp_path, 1, {"x": Evil()}, allow_pickle=True)
    with pytest.raises(safepoint.CorruptionError, match="posix.system|os.system"):
        safepoint.load(tmp_path, allow_pickle=True)
    assert not os.path.exists(marker)


def test_checkpointer_allow_pickle(tmp_path):
    with safepoint.Checkpointer(tmp_path / "ckpt", job=f"pickle-{abs(hash(str(tmp_path))) % 10**6}",
                                shm_dir=str(tmp_path), allow_pickle=True) as ck:
        ck.save(1, {"s": {3, 4}, "t": torch.zeros(2)}, persist=True)
        ck.wait()
        step, got = ck.load()
        assert step == 1 and got["s"] == {3, 4} and ck.last_load_source == "memory"
    _, got = safepoint.load(tmp_path / "ckpt", allow_pickle=True)
    assert got["s"] == {3, 4}
