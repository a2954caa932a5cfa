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


# Hostile pickles (issue 35 item 4): a checkpoint is untrusted input. Each payload is written as
# a stored value through the real save path and loaded through the real load path.

def _s(text: str) -> bytes:  # SHORT_BINUNICODE
    raw = text.encode()
    return b"\x8c" + bytes([len(raw)]) + raw


def _glob(module: str, name: str) -> bytes:  # STACK_GLOBAL
    return _s(module) + _s(name) + b"\x93"


def _long(n: int) -> bytes:  # LONG1
    raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def _stored(tmp_path, monkeypatch, payload: bytes):
    """Saves a checkpoint whose one pickled value is `payload` (as an attacker would write it)."""
    import safepoint._api as api
    monkeypatch.setattr(api, "pickler", lambda allow: (lambda obj: payload))
    safepoint.save(tmp_path, 1, {"x": Config(0.1, "x"), "w": torch.ones(2)}, allow_pickle=True)
    return tmp_path


def _load_refused(path, allow, match):
    with pytest.raises(safepoint.CorruptionError, match=match):
        safepoint.load(path, allow_pickle=allow)


def test_prefix_entry_does_not_follow_dotted_names(tmp_path, monkeypatch):
    # json.decoder.__builtins__.get("eval")("...") passed the old prefix check ("json." prefix).
    marker = tmp_path / "ran"
    code = f"open({str(marker)!r}, 'w').write('pwned')"
    payload = (b"\x80\x04" + _glob("json.decoder", "__builtins__.get") + _s("eval") + b"\x85R" +
               _s(code) + b"\x85R.")
    path = _stored(tmp_path / "ck", monkeypatch, payload)
    _load_refused(path, ["json."], "dot")
    assert not marker.exists()


def test_prefix_entry_admits_only_classes_of_that_module(tmp_path, monkeypatch):
    # json.loads is a function, and json.decoder imports re: neither is a class of the module.
    path = _stored(tmp_path / "a", monkeypatch, b"\x80\x04" + _glob("json", "loads") + b".")
    _load_refused(path, ["json."], "not a class defined in json")
    # Named exactly, the same object is the caller's explicit choice.
    _, got = safepoint.load(path, allow_pickle=["json.loads"])
    import json
    assert got["x"] is json.loads
    path = _stored(tmp_path / "b", monkeypatch,
                   b"\x80\x04" + _glob("json.decoder", "JSONDecodeError") + b".")
    _, got = safepoint.load(path, allow_pickle=["json."])  # a class of a submodule: allowed
    import json.decoder
    assert got["x"] is json.decoder.JSONDecodeError


@pytest.mark.parametrize("payload,match", [
    (_glob("builtins", "bytes") + _long(1 << 40) + b"\x85R.", "bytes"),
    (_glob("builtins", "list") + _glob("builtins", "range") + _long(10 ** 12) + b"\x85R\x85R.",
     "items"),
    (_glob("builtins", "int") + _glob("decimal", "Decimal") + _s("1e999999999") + b"\x85R\x85R.",
     "Decimal"),
    (_glob("fractions", "Fraction") + _s("1e999999999") + b"\x85R.", "str"),
], ids=["bytes-1TiB", "list-range", "int-of-decimal", "fraction-of-exponent"])
def test_size_bombs_are_refused(tmp_path, monkeypatch, payload, match):
    path = _stored(tmp_path / "ck", monkeypatch, b"\x80\x04" + payload)
    _load_refused(path, True, match)


def test_build_on_a_class_is_refused(tmp_path, monkeypatch):
    # BUILD with slot state on the Counter class itself would set Counter.__missing__ = list for
    # the rest of the process.
    payload = (b"\x80\x04" + _glob("collections", "Counter") + b"N}" + _s("__missing__") +
               _glob("builtins", "list") + b"s\x86b.")
    path = _stored(tmp_path / "ck", monkeypatch, payload)
    try:
        _load_refused(path, True, "BUILD")
        assert collections.Counter()["ab"] == 0
    finally:
        if "__missing__" in collections.Counter.__dict__ and \
                collections.Counter.__dict__["__missing__"] is list:
            del collections.Counter.__missing__


@pytest.mark.parametrize("payload", [
    _glob("builtins", "complex") + _s("x") + _s("y") + b"\x86R.",  # TypeError
    _glob("datetime", "timedelta") + _long(10 ** 30) + b"\x85R.",   # OverflowError
    b"\x8c\x01\xff.",                                                # UnicodeDecodeError
], ids=["type-error", "overflow", "bad-utf8"])
def test_every_unpickling_failure_is_a_corruption_error(tmp_path, monkeypatch, payload):
    path = _stored(tmp_path / "ck", monkeypatch, b"\x80\x04" + payload)
    with pytest.raises(safepoint.CorruptionError):
        safepoint.load(path, allow_pickle=True)


def test_allow_entries_are_validated():
    from safepoint._pickle import unpickler
    for bad in ["Config", ".x", 7]:
        with pytest.raises(safepoint.InvalidArgumentError, match="allow_pickle entry"):
            unpickler([bad])


def test_unpicklable_value_names_its_type(tmp_path):
    with pytest.raises(safepoint.InvalidArgumentError, match="cannot pickle"):
        safepoint.save(tmp_path, 1, {"f": lambda: 1}, allow_pickle=True)
