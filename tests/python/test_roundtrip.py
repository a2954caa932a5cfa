"""safepoint.save / load / steps: every dtype and value type round-trips exactly."""

import collections
import math
import os
import struct
import sys
import threading
import time

import numpy as np
import pytest
import torch

import safepoint

# Complex buffers (Llama's freqs_cis), unsigned ints and every float8 variant torch has (older
# torch versions lack some: scripts/other-torch.sh runs these tests under them).
NEW_DTYPES = [
    getattr(torch, name) for name in (
        "complex64", "complex128", "uint16", "uint32", "uint64",
        "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, name)
]
ALL_DTYPES = [
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.int16,
    torch.int32, torch.int64, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2,
] + NEW_DTYPES


def random_tensor(dtype, shape, gen):
    """Random bits of `dtype` (every bit pattern, nan and the like included for floats)."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point or dtype.is_complex:
        size = torch.empty(0, dtype=dtype).element_size()
        raw = torch.randint(0, 256, (*shape, size), generator=gen, dtype=torch.int64)
        return raw.to(torch.uint8).view(dtype).reshape(shape)
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -2**63), min(info.max, 2**63 - 1)
    return torch.randint(lo, hi, shape, generator=gen, dtype=torch.int64).to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (nan == nan), dtypes and shapes included."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return a.reshape(-1).view(torch.uint8).equal(b.reshape(-1).view(torch.uint8))


def assert_same(a, b, path="state"):
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert same_bits(a, b), path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), path
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), path
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), path
        assert [type(k) for k in a] == [type(k) for k in b], path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b), path
    else:
        assert a == b, path


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: str(d)[6:])
def test_every_dtype_and_shape(ckpt, dtype):
    gen = torch.Generator().manual_seed(0)
    state = {
        "matrix": random_tensor(dtype, (33, 17), gen),
        "scalar": random_tensor(dtype, (), gen),
        "empty": random_tensor(dtype, (0, 4), gen),
        "big": random_tensor(dtype, (300, 257), gen),
        "noncontig": random_tensor(dtype, (8, 6), gen).t(),
        "sliced": random_tensor(dtype, (10, 10), gen)[::3, 1:7],
    }
    safepoint.save(ckpt, 1, state)
    step, loaded = safepoint.load(ckpt)
    assert step == 1
    for k, v in state.items():
        assert same_bits(v.contiguous(), loaded[k]), k
        assert loaded[k].dtype == dtype and loaded[k].shape == v.shape


def test_value_types_and_structure(ckpt):
    state = {
        "none": None, "true": True, "false": False, "zero": 0, "neg": -7,
        "i64max": 2**63 - 1, "i64min": -2**63, "big": 2**64, "huge": -(3**200), "pow": 2**63,
        "float": 0.1, "nan": float("nan"), "inf": float("inf"), "ninf": -math.inf, "negzero": -0.0,
        "str": "héllo ✓ 😀", "empty_str": "", "bytes": b"\x00\xff\x01", "empty_bytes": b"",
        "list": [1, [2, [3, []]], ()], "tuple": (1, (2,), [], {}), "empty_dict": {},
        "int_keys": {3: "a", -1: "b", 2**70: "c", 0: {1: 2}},
        "mixed_keys": {"1": "str one", 1: "int one"},
        "nested": {"a": {"b": {"c": [torch.ones(2), {"d": torch.zeros(1)}]}}},
    }
    safepoint.save(ckpt, 3, state)
    _, loaded = safepoint.load(ckpt, 3)
    assert_same(state, loaded)


def test_numpy_arrays_and_scalars(ckpt):
    state = {
        "f32": np.arange(12, dtype=np.float32).reshape(3, 4),
        "i64": np.array([-1, 2**40], dtype=np.int64),
        "bool": np.array([True, False]),
        "fortran": np.asfortranarray(np.arange(6, dtype=np.float64).reshape(2, 3)),
        "zero_d": np.array(5, dtype=np.int16),
        "scalar": np.float32(2.5),
        "uint8_scalar": np.uint8(7),
    }
    safepoint.save(ckpt, 1, state)
    _, loaded = safepoint.load(ckpt)
    for k in ("f32", "i64", "bool", "zero_d"):
        assert_same(state[k], loaded[k], k)
    assert np.array_equal(loaded["fortran"], state["fortran"])
    assert_same(state["scalar"], loaded["scalar"])
    assert_same(state["uint8_scalar"], loaded["uint8_scalar"])


def test_ordered_dict_and_module_state_dict(ckpt):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "od": collections.OrderedDict(b=1, a=2)}
    safepoint.save(ckpt, 9, state)
    _, loaded = safepoint.load(ckpt)
    # OrderedDict comes back as dict (documented), with the same keys in the same order.
    assert list(loaded["od"].items()) == [("b", 1), ("a", 2)]
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    fresh.load_state_dict(loaded["model"])
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert same_bits(a.detach(), b.detach())
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    opt2.load_state_dict(loaded["optim"])
    assert loaded["optim"]["param_groups"] == state["optim"]["param_groups"]
    assert sorted(loaded["optim"]["state"]) == sorted(state["optim"]["state"])


def test_shared_tensor_is_stored_once_and_stays_shared(ckpt, cli):
    w = torch.randn(64, 64)
    safepoint.save(ckpt, 1, {"embed": w, "lm_head": w, "other": w.clone()})
    _, loaded = safepoint.load(ckpt)
    assert loaded["embed"] is loaded["lm_head"]
    assert loaded["other"] is not loaded["embed"]
    out = cli("inspect", ckpt, "--json", check=0)
    import json
    assert len(json.loads(out.stdout)["tensors"]) == 2


def test_long_and_unicode_names(ckpt):
    key = "层" * 3000 + "/weight"
    safepoint.save(ckpt, 1, {key: torch.arange(3), "a.b": {"c": 1}, "a": {"b.c": torch.ones(1)}})
    _, loaded = safepoint.load(ckpt)
    assert torch.equal(loaded[key], torch.arange(3))
    assert loaded["a.b"] == {"c": 1}


def test_name_collisions_are_disambiguated(ckpt):
    state = {"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}}
    safepoint.save(ckpt, 1, state)
    _, loaded = safepoint.load(ckpt)
    assert_same(state, loaded)


def test_loaded_tensors_are_writable_and_independent(ckpt):
    t = torch.arange(10.0)
    safepoint.save(ckpt, 1, {"t": t})
    _, a = safepoint.load(ckpt)
    _, b = safepoint.load(ckpt)
    a["t"].add_(1)
    assert torch.equal(b["t"], t)


def test_steps_are_listed_ascending(ckpt):
    assert safepoint.steps(ckpt) == []  # a directory that does not exist yet has no steps
    for s in (10, 2, 7):
        safepoint.save(ckpt, s, {"s": s})
    assert safepoint.steps(ckpt) == [2, 7, 10]
    assert safepoint.load(ckpt)[1] == {"s": 10}
    assert safepoint.load(ckpt, 2)[1] == {"s": 2}


def test_a_committed_step_is_immutable_unless_overwrite(ckpt):
    # Regression (issue 9, defect 8): the second save silently replaced the committed step.
    safepoint.save(ckpt, 5, {"v": torch.zeros(3)})
    with pytest.raises(safepoint.AlreadyExistsError, match="step 5 is already committed"):
        safepoint.save(ckpt, 5, {"v": torch.ones(3)})
    assert torch.equal(safepoint.load(ckpt)[1]["v"], torch.zeros(3))
    for value in (1.0, 2.0):  # each overwrite of one rank draws its own attempt
        safepoint.save(ckpt, 5, {"v": torch.full((3,), value)}, overwrite=True)
        assert safepoint.steps(ckpt) == [5]
        assert torch.equal(safepoint.load(ckpt)[1]["v"], torch.full((3,), value))
    target = {"v": torch.empty(3)}
    assert safepoint.restore(ckpt, target) == 5 and torch.equal(target["v"], torch.full((3,), 2.0))
    assert sorted(p.name for p in (ckpt / f"step-{5:020d}").iterdir())[0] == "COMMIT"
    assert len(list((ckpt / f"step-{5:020d}").iterdir())) == 2  # the old images are gone


def test_readers_see_the_old_or_the_new_step_while_it_is_replaced(ckpt):
    safepoint.save(ckpt, 1, {"v": torch.full((1000,), 0.0)})
    seen, errors, stop = set(), [], threading.Event()

    def read():
        while not stop.is_set():
            try:
                v = safepoint.load(ckpt, 1)[1]["v"]
                assert bool((v == v[0]).all()), "a mix of two versions"
                seen.add(float(v[0]))
                target = {"v": torch.empty(1000)}
                safepoint.restore(ckpt, target, 1)
                assert bool((target["v"] == target["v"][0]).all())
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)
                return

    t = threading.Thread(target=read)
    t.start()
    try:
        for i in range(1, 40):
            safepoint.save(ckpt, 1, {"v": torch.full((1000,), float(i))}, overwrite=True)
    finally:
        stop.set()
        t.join()
    assert not errors, errors
    assert seen <= {float(i) for i in range(40)}


def test_gil_is_released_during_io(ckpt):
    # The main thread is never preempted (a switch interval of a minute), and the spinner gives
    # the GIL back at once (it sleeps between ticks): so the spinner ticks during a call only if
    # the call releases the GIL. Whether it gets a core in time on a busy machine is another
    # matter, so a few saves and loads are tried; one of each with ticks is the proof.
    state = {"w": torch.randn(64 << 20 // 4)}  # 64 MiB
    ticks = []
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            ticks.append(1)
            time.sleep(0.0002)

    old = sys.getswitchinterval()
    t = threading.Thread(target=spin)
    t.start()
    sys.setswitchinterval(60)
    saved = loaded = False
    try:
        for step in range(1, 21):
            before = len(ticks)
            safepoint.save(ckpt, step, state)
            saved |= len(ticks) > before
            before = len(ticks)
            safepoint.load(ckpt)
            loaded |= len(ticks) > before
            if saved and loaded:
                break
    finally:
        sys.setswitchinterval(old)
        stop.set()
        t.join()
    assert saved and loaded, (saved, loaded)


def test_multi_rank_step_never_commits_a_mix_of_attempts(ckpt):
    # Regression: re-saving a committed 2-rank step on one rank re-committed it at once with the
    # other rank's old image; then (defect 8) it un-committed the step until every rank had
    # re-saved it. Now the old step stays until the replacement is complete.
    for r in (0, 1):
        safepoint.save(ckpt, 5, {"v": torch.full((3,), float(r))}, rank=r, world_size=2, attempt=1)
    assert safepoint.steps(ckpt) == [5]
    with pytest.raises(safepoint.AlreadyExistsError, match="step 5"):
        safepoint.save(ckpt, 5, {"v": torch.full((3,), 10.0)}, rank=1, world_size=2, attempt=2)
    out = safepoint.save(ckpt, 5, {"v": torch.full((3,), 10.0)}, rank=1, world_size=2, attempt=2,
                         overwrite=True)
    assert not out["committed"] and safepoint.steps(ckpt) == [5]
    assert torch.equal(safepoint.load(ckpt, 5, rank=1)[1]["v"], torch.full((3,), 1.0))  # old
    out = safepoint.save(ckpt, 5, {"v": torch.full((3,), 20.0)}, rank=0, world_size=2, attempt=2,
                         overwrite=True)
    assert out["committed"] and safepoint.steps(ckpt) == [5]
    assert torch.equal(safepoint.load(ckpt, 5, rank=0)[1]["v"], torch.full((3,), 20.0))
    assert torch.equal(safepoint.load(ckpt, 5, rank=1)[1]["v"], torch.full((3,), 10.0))
    # A crashed save (attempt 3) left rank 0's image of step 6; the restarted one (attempt 4).
    safepoint.save(ckpt, 6, {"v": torch.zeros(3)}, rank=0, world_size=2, attempt=3)
    assert not safepoint.save(ckpt, 6, {"v": torch.ones(3)}, rank=1, world_size=2,
                              attempt=4)["committed"]
    assert safepoint.save(ckpt, 6, {"v": torch.ones(3)}, rank=0, world_size=2,
                          attempt=4)["committed"]
    assert torch.equal(safepoint.load(ckpt, 6, rank=0)[1]["v"], torch.ones(3))
    with pytest.raises(safepoint.InvalidArgumentError, match="attempt"):
        safepoint.save(ckpt, 6, {}, rank=0, world_size=2, attempt=-1)


def test_partial_reads_refuse_bad_requests_with_clear_errors(ckpt):
    from safepoint import _core

    safepoint.save(ckpt, 3, {"w": torch.arange(100, dtype=torch.float32)})
    good = torch.empty(10, dtype=torch.float32)
    _core.read_ranges(str(ckpt), 3, 0, [("w", 40, 40, good)])
    assert torch.equal(good, torch.arange(10, 20, dtype=torch.float32))
    with pytest.raises(safepoint.NotFoundError, match="no tensor named 'x'"):
        _core.read_ranges(str(ckpt), 3, 0, [("x", 0, 4, good)])
    with pytest.raises(safepoint.InvalidArgumentError, match="has 400 bytes"):
        _core.read_ranges(str(ckpt), 3, 0, [("w", 396, 8, good)])
    with pytest.raises(safepoint.InvalidArgumentError, match="destination holds 40 bytes"):
        _core.read_ranges(str(ckpt), 3, 0, [("w", 0, 80, good)])
    with pytest.raises(safepoint.InvalidArgumentError, match="contiguous CPU tensor"):
        _core.read_ranges(str(ckpt), 3, 0, [("w", 0, 4, "not a buffer")])
    with pytest.raises(safepoint.NotFoundError):
        _core.read_metadata(str(ckpt), 4, 0)


def test_partial_read_holds_its_destination_buffer_until_the_read_ends(ckpt):
    """A bytearray destination stays exported (cannot be resized or freed) while the read runs
    with the GIL released. The second destination runs Python code after the first was taken
    (tensor-like objects are asked is_contiguous()); resizing the bytearray there must fail."""
    from safepoint import _core

    data = torch.arange(100, dtype=torch.float32)
    safepoint.save(ckpt, 3, {"w": data})
    first = bytearray(400)
    second = torch.empty(100, dtype=torch.float32)
    resized = []

    class TensorLike:
        is_cpu = True
        nbytes = second.nbytes

        def data_ptr(self):
            return second.data_ptr()

        def is_contiguous(self):
            try:
                first.extend(bytes(1 << 20))  # moves the bytearray's memory unless exported
            except BufferError:
                resized.append(False)
                return True
            # Abort before the read writes into the memory the bytearray just gave up.
            raise AssertionError("the first destination's buffer was released before the read")

    _core.read_ranges(str(ckpt), 3, 0, [("w", 0, 400, first), ("w", 0, 400, TensorLike())])
    assert resized == [False]
    assert bytes(first) == data.numpy().tobytes()
    assert torch.equal(second, data)


@pytest.mark.parametrize("dtype", NEW_DTYPES, ids=lambda d: str(d)[6:])
def test_new_dtypes_restore_in_place_and_through_the_checkpointer(tmp_path, dtype):
    gen = torch.Generator().manual_seed(1)
    state = {"buf": random_tensor(dtype, (5, 7), gen), "arr": random_tensor(dtype, (3,), gen)}
    ckpt = tmp_path / "ckpt"
    safepoint.save(ckpt, 1, state)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    assert safepoint.restore(ckpt, target) == 1
    for k in state:
        assert same_bits(state[k], target[k]), k
    with safepoint.Checkpointer(tmp_path / "flash", job=f"dt{os.getpid()}-{str(dtype)[6:]}",
                                shm_dir=str(tmp_path), persist_every=1) as ck:
        ck.save(2, state)
        ck.wait()
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        assert ck.restore(target) == 2 and ck.last_load_source == "memory"
        for k in state:
            assert same_bits(state[k], target[k]), k
        ck._live.save(3, state, True, None, True, 2)  # the staged copy path GPU tensors take
        ck.wait()
        step, snap = ck.load()
        assert step == 3 and ck.last_load_source == "memory"
        assert all(same_bits(state[k], snap[k]) for k in state)
    step, loaded = safepoint.load(tmp_path / "flash")  # what the agent persisted
    assert step == 3 and all(same_bits(state[k], loaded[k]) for k in state)


@pytest.mark.parametrize("dtype", [np.complex64, np.complex128, np.uint16, np.uint32, np.uint64])
def test_new_numpy_dtypes_round_trip(ckpt, dtype):
    arr = (np.arange(12) * 7 + 3).astype(dtype).reshape(3, 4)
    safepoint.save(ckpt, 1, {"a": arr, "s": arr[1, 2]})
    _, loaded = safepoint.load(ckpt)
    assert loaded["a"].dtype == arr.dtype and np.array_equal(loaded["a"], arr)
    assert type(loaded["s"]) is type(arr[1, 2]) and loaded["s"] == arr[1, 2]


def test_a_meta_tensor_is_refused_with_its_key(ckpt):
    with pytest.raises(safepoint.InvalidArgumentError, match=r"model\.w: .*meta"):
        safepoint.save(ckpt, 1, {"model": {"w": torch.empty(3, device="meta")}})


def test_save_holds_every_tensor_until_it_is_written(ckpt):
    """The walker hands the writer raw pointers and the write runs without the GIL: a tensor
    whose only reference is the walk's (a mapping that makes its values on the fly) must stay
    alive until the image is written, not be freed and its memory reused by the next one."""

    class OnTheFly(collections.abc.Mapping):
        def __len__(self):
            return 8

        def __iter__(self):
            return iter(range(8))

        def __getitem__(self, i):
            return torch.full((4096,), float(i))

        def items(self):
            return ((i, self[i]) for i in range(8))

    safepoint.save(ckpt, 1, {"m": OnTheFly()})
    _, loaded = safepoint.load(ckpt)
    for i in range(8):
        assert torch.equal(loaded["m"][i], torch.full((4096,), float(i))), i
