"""Save-side performance features (issue 14): the reused save plan, saves that overlap with
compute (save(..., overlap=True), before_update()), and the host-memory cap and report.

Every test asserts what the snapshot holds (loaded back and compared bit for bit), never how
long something took.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

import safepoint

_jobs = iter(range(1 << 30))


@pytest.fixture(autouse=True, params=["probe", "python"])
def tensor_reads(request):
    """Every test runs twice: tensors read through safepoint._torchprobe (one C++ call a
    tensor; the default, built wherever torch's headers are, as here) and through torch's
    Python API (where the probe is not built, or is for another torch)."""
    from safepoint import _core

    probe = request.param == "probe"
    assert _core.set_torch_probe(probe) == probe, "safepoint._torchprobe was not built"
    yield request.param
    _core.set_torch_probe(True)


@pytest.fixture
def make(tmp_path, shm):
    made = []

    def checkpointer(**kw) -> safepoint.Checkpointer:
        kw.setdefault("job", f"sp{os.getpid() % 10000}-{next(_jobs)}")
        ck = safepoint.Checkpointer(tmp_path / "ckpt", shm_dir=shm, **kw)
        made.append(ck)
        return ck

    yield checkpointer
    for ck in made:
        ck.abandon()


def loaded(ck: safepoint.Checkpointer, step: int):
    got = ck.load(step)
    assert got is not None and got[0] == step and ck.last_load_source == "memory"
    return got[1]


def same(a, b) -> bool:
    """Bit-for-bit equality of two state trees (tensors compared as bytes)."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.reshape(-1).contiguous().view(torch.uint8),
                                b.reshape(-1).contiguous().view(torch.uint8)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (isinstance(b, (list, tuple)) and len(a) == len(b)
                and all(same(x, y) for x, y in zip(a, b)))
    return type(a) is type(b) and a == b


def clone(state):
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: clone(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(clone(v) for v in state)
    return state


def small_state(n: int = 300):
    g = torch.Generator().manual_seed(n)
    return {
        "model": {f"layer{i}.weight": torch.randn(7 + i % 5, 3, generator=g) for i in range(n)},
        "optim": {"step": torch.tensor(3.0), "lr": 0.1, "betas": (0.9, 0.999), "name": "adam",
                  "ids": [1, 2, 3], "flag": True, "none": None, "blob": b"\x00\x01"},
        "half": torch.randn(64, generator=g).to(torch.bfloat16),
    }


# --- the reused save plan ------------------------------------------------------------------------

def test_a_save_with_the_same_structure_reuses_the_plan_and_writes_the_new_values(make):
    ck = make(keep=1)
    state = small_state()
    assert ck.save(1, state)
    assert ck.status()["last_save"]["reused_plan"] is False
    for t in state["model"].values():
        t.add_(1)
    assert ck.save(2, state)
    assert ck.status()["last_save"]["reused_plan"] is True
    assert same(loaded(ck, 2), state)
    # A tensor replaced by another one of the same shape (new memory): its new bytes are saved.
    state["model"]["layer5.weight"] = torch.full((7, 3), 42.0)
    state["half"] = state["half"] * 2
    assert ck.save(3, state)
    assert ck.status()["last_save"]["reused_plan"] is True
    assert same(loaded(ck, 3), state)
    ck.close()


@pytest.mark.parametrize("change", [
    "scalar", "float", "string", "bytes", "key", "shape", "dtype", "tied", "untied", "order",
    "tuple", "nested", "bool", "fewer", "more",
])
def test_any_change_of_structure_or_non_tensor_values_is_saved(make, change):
    """The plan is reused only for the very same structure and non-tensor values: each change
    here must show in the loaded snapshot (a reused plan would keep the old extras or index)."""
    ck = make(keep=1)
    shared = torch.arange(6.0)
    state = small_state(20)
    state["tied"] = {"a": shared, "b": shared}
    assert ck.save(1, state)
    assert ck.save(2, state)
    assert ck.status()["last_save"]["reused_plan"] is True
    if change == "scalar":
        state["optim"]["ids"][1] = 7
    elif change == "float":
        state["optim"]["lr"] = 0.05
    elif change == "string":
        state["optim"]["name"] = "adan"
    elif change == "bytes":
        state["optim"]["blob"] = b"\x00\x02"
    elif change == "key":
        state["model"]["layer3.weigh"] = state["model"].pop("layer3.weight")
    elif change == "shape":
        state["model"]["layer3.weight"] = state["model"]["layer3.weight"].reshape(3, -1)
    elif change == "dtype":
        state["half"] = state["half"].to(torch.float16)
    elif change == "tied":
        state["tied"]["b"] = shared.clone()
    elif change == "untied":
        state["model"]["layer0.weight"] = state["model"]["layer1.weight"]
    elif change == "order":
        state["optim"] = dict(reversed(list(state["optim"].items())))
    elif change == "tuple":
        state["optim"]["betas"] = [0.9, 0.999]
    elif change == "nested":
        state["optim"]["ids"] = [1, [2], 3]
    elif change == "bool":
        state["optim"]["flag"] = 1
    elif change == "fewer":  # the walk matches the plan all along, then ends early
        state.pop("tied")
    elif change == "more":   # ... or goes on past its end
        state["extra"] = torch.ones(3)
    assert ck.save(3, state)
    assert ck.status()["last_save"]["reused_plan"] is False
    got = loaded(ck, 3)
    assert same(got, state)
    assert list(got["optim"]) == list(state["optim"])  # key order too
    if "tied" in got:
        tied = got["tied"]["a"].data_ptr() == got["tied"]["b"].data_ptr()
        assert tied == (change != "tied")
    if change == "untied":
        assert got["model"]["layer0.weight"].data_ptr() == got["model"]["layer1.weight"].data_ptr()
    # And the next save with that new structure reuses the new plan.
    assert ck.save(4, state)
    assert ck.status()["last_save"]["reused_plan"] is True
    assert same(loaded(ck, 4), state)
    ck.close()


def test_parameters_reuse_the_plan_and_strided_tensors_are_copied_as_they_are(make):
    """nn.Parameter tensors take the plan; a strided (non-contiguous) tensor makes the save take
    the full walk, which copies it straight into the slot (no temporary contiguous copy)."""
    ck = make(keep=1)
    model = torch.nn.Linear(8, 4)
    state = {"model": model}
    assert ck.save(1, state)
    with torch.no_grad():
        model.weight.mul_(3)
    assert ck.save(2, state)
    assert ck.status()["last_save"]["reused_plan"] is True
    assert same(loaded(ck, 2)["model"], dict(model.state_dict()))
    state["t"] = torch.arange(12.0).reshape(3, 4).t()
    for step in (3, 4):
        state["t"].add_(1)
        assert ck.save(step, state)
        assert ck.status()["last_save"]["reused_plan"] is False
        got = loaded(ck, step)
        assert same(got["t"], state["t"].contiguous()) and same(got["model"], model.state_dict())
    ck.close()


def test_states_the_plan_does_not_cover_are_saved_as_before(make):
    """numpy scalars, big ints and values to pickle go through the full walk every time."""
    import numpy as np

    ck = make(keep=1, allow_pickle=True)
    state = {"w": torch.ones(4), "n": np.float32(1.5), "big": 1 << 80, "obj": {1, 2}}
    for step in (1, 2):
        state["w"].add_(1)
        assert ck.save(step, state)
        assert ck.status()["last_save"]["reused_plan"] is False
        got = loaded(ck, step)
        assert torch.equal(got["w"], state["w"]) and got["big"] == 1 << 80 and got["obj"] == {1, 2}
    ck.close()


def test_conjugate_and_negative_views_are_saved_as_their_values(make, tmp_path):
    """x.conj() and x.conj().imag hold the values before the conjugation or negation: their raw
    bytes are not their values (both were saved wrong before)."""
    g = torch.Generator().manual_seed(3)
    conj = torch.randn(6, dtype=torch.complex64, generator=g).conj()
    neg = torch.randn(6, dtype=torch.complex64, generator=g).conj().imag
    assert conj.is_conj() and neg.is_neg()
    state = {"conj": conj, "neg": neg, "model": small_state(100)["model"]}
    ck = make(keep=1)
    for step in (1, 2):
        assert ck.save(step, state)
        got = loaded(ck, step)
        assert torch.equal(got["conj"], conj) and torch.equal(got["neg"], neg)
        assert not got["conj"].is_conj() and same(got["model"], state["model"])
    ck.close()
    safepoint.save(tmp_path / "sync", 1, state)
    got = safepoint.load(tmp_path / "sync")[1]
    assert torch.equal(got["conj"], conj) and torch.equal(got["neg"], neg)


def test_plan_reuse_with_include_rng(make):
    ck = make(keep=1)
    state = small_state(10)
    assert ck.save(1, state, include_rng=True)
    torch.manual_seed(5)
    assert ck.save(2, state, include_rng=True)
    assert ck.status()["last_save"]["reused_plan"] is True
    got = loaded(ck, 2)
    assert torch.equal(got["__safepoint_rng__"]["torch"], torch.get_rng_state())
    ck.close()


# --- saves that overlap with compute -------------------------------------------------------------

def test_overlapped_save_is_the_state_of_its_step_once_before_update_returns(make):
    ck = make(keep=2)
    state = {"w": torch.randn(1 << 20), "b": torch.randn(300), "n": 3}
    want = clone(state)
    assert ck.save(1, state, overlap=True) is True
    assert ck.before_update() is True
    state["w"].add_(1)  # the optimizer step, right after before_update returned
    state["b"].zero_()
    assert ck.before_update() is None  # nothing pending
    assert same(loaded(ck, 1), want)
    st = ck.status()["last_save"]
    assert st["step"] == 1 and st["overlap_wait_seconds"] is not None
    ck.close()


def test_overlapped_save_reads_the_live_tensors_until_before_update(make, shm):
    """The control for the test above: a change made before before_update() returns does reach
    the snapshot. Deterministic: the agent is stopped holding the only slot the save could
    take, so the copy cannot start before the change is made."""
    ck = make(keep=1, persist_every=1000)
    state = {"w": torch.zeros(1 << 16)}
    assert ck.save(1, state) and ck.save(2, state)
    agent = ck.status()["agent"]["pid"]
    os.kill(agent, signal.SIGSTOP)
    try:
        assert ck.save(3, state, persist=True)  # leased until persisted: the agent is stopped
        assert ck.save(4, state)                # the other slot, the newest
        assert ck.save(5, state, overlap=True)  # waits for a slot on its thread
        state["w"].fill_(5.0)                   # no before_update(): the copy has not begun
    finally:
        os.kill(agent, signal.SIGCONT)
    assert ck.before_update() is True
    got = loaded(ck, 5)
    assert torch.equal(got["w"], torch.full((1 << 16,), 5.0))
    ck.close()


def test_optimizer_step_waits_for_the_overlapped_save(make):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    state = {"model": model, "optim": opt}
    ck = make(keep=2)
    x = torch.randn(32, 64)
    wants = {}
    for step in range(1, 4):
        wants[step] = clone({"model": model.state_dict(), "optim": opt.state_dict()})
        ck.save(step, state, overlap=True)
        model(x).square().mean().backward()  # overlaps with the copy
        opt.step()                           # its pre-hook waits for the copy
        opt.zero_grad()
        got = loaded(ck, step)
        assert same(got["model"], wants[step]["model"])
        assert same(got["optim"]["state"], wants[step]["optim"]["state"])
    assert ck.status()["saves"] == 3
    ck.close()
    # Closed: the hooks are gone, the optimizer steps on its own.
    model(x).sum().backward()
    opt.step()


def test_every_other_call_waits_for_an_overlapped_save(make):
    ck = make(keep=1)
    state = {"w": torch.randn(1 << 18)}
    ck.save(1, state, overlap=True)
    st = ck.status()  # waits: the save is recorded
    assert st["saves"] == 1 and st["last_save"]["step"] == 1 and st["last_save"]["saved"]
    ck.save(2, state, overlap=True)
    ck.save(3, state, overlap=True)  # the previous one finishes first
    assert same(loaded(ck, 3), state) and ck.status()["saves"] == 3
    ck.save(4, state, overlap=True)
    ck.close()  # finishes the copy, persists step 4
    assert safepoint.steps(ck.path)[-1] == 4


# --- host memory ---------------------------------------------------------------------------------

def test_max_shm_bytes_refuses_a_save_beyond_the_cap_with_a_clear_error(make, shm):
    ck = make(keep=1, max_shm_bytes=24 << 20)
    small = {"w": torch.ones(1 << 20)}  # 4 MiB: two slots fit under 24 MiB
    assert ck.save(1, small) and ck.save(2, small)
    with pytest.raises(safepoint.ResourceExhaustedError) as e:
        ck.save(3, {"w": torch.ones(7 << 20)})  # 28 MiB: not even one slot would fit
    msg = str(e.value)
    assert "max_shm_bytes=25165824" in msg and "rank 0" in msg and "needs" in msg, msg
    mem = ck.status()["memory"]
    assert mem["max_shm_bytes"] == 24 << 20
    assert mem["shm_node_bytes"] <= 24 << 20, mem  # nothing was grown past the cap
    # The job goes on with what fits, and the refused step is not in memory.
    assert ck.save(4, small)
    assert same(loaded(ck, 4), small)
    with pytest.raises(safepoint.Error):
        ck.load(3)
    ck.close()


def test_max_shm_bytes_below_two_snapshots_runs_with_one_slot(make, shm):
    from processes import job_dir as job_directory

    # Slot files are laid out in 2 MiB steps with headroom: a 4 MiB state takes 6 MiB, 16 MiB 18.
    ck = make(keep=2, max_shm_bytes=26 << 20)
    small, big = {"w": torch.ones(1 << 20)}, {"w": torch.arange(4 << 20, dtype=torch.float32)}
    assert ck.save(1, small) and ck.save(2, small)
    assert ck.status()["memory"]["slots"] == 2
    slots_dir = job_directory(shm, ck.job)
    assert len(list(slots_dir.glob("rank-*.slot-*"))) == 2
    # 16 MiB: two slots would not fit under 26 MiB, one does (beside the small one the agent may
    # still be persisting). Each save overwrites the only slot once the agent persisted it
    # (on_busy="wait"), and the other slot file is given back once nobody leases it: at the
    # latest at step 4, whose save waited for step 3's persist (the agent persists in order).
    for step in (3, 4, 5):
        big["w"][0] = step
        assert ck.save(step, big)
        mem = ck.status()["memory"]
        assert mem["slots"] == 1, mem
        assert mem["shm_node_bytes"] <= 26 << 20, mem
        if step >= 4:
            assert len(list(slots_dir.glob("rank-*.slot-*"))) == 1
        assert same(loaded(ck, step), big)  # hot reload of the newest step, from memory
    ck.wait()
    assert safepoint.steps(ck.path)[-2:] == [4, 5]  # every step was persisted before reuse
    # A smaller state fits twice again: the second slot comes back.
    assert ck.save(6, small) and ck.save(7, small)
    assert ck.status()["memory"]["slots"] == 2
    assert len(list(slots_dir.glob("rank-*.slot-*"))) == 2
    ck.close()


def test_max_shm_bytes_one_slot_with_on_busy_skip_skips_while_the_agent_persists(make, shm):
    ck = make(keep=1, max_shm_bytes=24 << 20, on_busy="skip", persist_every=1)
    big = {"w": torch.ones(4 << 20)}
    saved = [bool(ck.save(step, big)) for step in range(1, 30)]
    # The first save always has a slot; a save that finds the only slot still being persisted is
    # skipped (counted), never blocked and never over the cap.
    assert saved[0]
    st = ck.status()
    assert st["memory"]["slots"] == 1
    assert st["skipped_saves"] == saved.count(False)
    assert st["memory"]["shm_node_bytes"] <= 24 << 20
    ck.close()


def test_max_shm_bytes_counts_the_other_ranks_of_the_job(make, tmp_path, shm):
    job = f"cap{os.getpid() % 10000}-{next(_jobs)}"
    cap = 30 << 20
    r0 = make(job=job, rank=0, world_size=2, max_shm_bytes=cap)
    r1 = make(job=job, rank=1, world_size=2, max_shm_bytes=cap)
    state = {"w": torch.ones(1 << 20)}  # 4 MiB states: two 6 MiB slot files per rank
    assert r0.save(1, state) and r0.save(2, state)
    assert r1.save(1, state)
    with pytest.raises(safepoint.ResourceExhaustedError, match="other ranks on this node hold"):
        r1.save(2, {"w": torch.ones(5 << 20)})  # one 22 MiB slot beside rank 0's 12 MiB
    # 12 MiB (a 14 MiB slot) fits once beside rank 0's slots, not twice: rank 1 goes on with one.
    assert r1.save(3, {"w": torch.ones(3 << 20)})
    mem0, mem1 = r0.status()["memory"], r1.status()["memory"]
    assert (mem0["slots"], mem1["slots"]) == (2, 1)
    assert mem0["shm_node_bytes"] == mem1["shm_node_bytes"] == (
        mem0["shm_rank_bytes"] + mem1["shm_rank_bytes"]), (mem0, mem1)
    assert mem1["shm_node_bytes"] <= cap


def test_status_reports_the_shared_memory_of_the_rank_and_of_the_node(make, shm):
    from processes import job_dir as job_directory

    ck = make(keep=1)
    assert ck.save(1, {"w": torch.ones(1 << 20)}) and ck.save(2, {"w": torch.ones(1 << 20)})
    mem = ck.status()["memory"]
    job_dir = job_directory(shm, ck.job)
    slots = sorted(job_dir.glob("rank-*.slot-*"))
    assert len(slots) == 2
    assert mem["shm_rank_bytes"] == sum(p.stat().st_size for p in slots)
    assert mem["shm_node_bytes"] == sum(p.stat().st_blocks * 512 for p in slots)
    assert mem["max_shm_bytes"] is None
    assert mem["replica_node_bytes"] is None  # no replication: no replicas kept here
    for k in ("rss_bytes", "peak_rss_bytes", "private_bytes", "agent_rss_bytes"):
        assert isinstance(mem[k], int) and mem[k] > 0, (k, mem)
    assert isinstance(mem["shared_rss_bytes"], int)  # 0 where the kernel does not count it
    ck.close()


def test_invalid_max_shm_bytes(tmp_path, shm):
    with pytest.raises(safepoint.InvalidArgumentError, match="max_shm_bytes"):
        safepoint.Checkpointer(tmp_path / "c", shm_dir=shm, max_shm_bytes=0)



def _memory() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon"):
                out[key] = int(value.split()[0]) * 1024
    return out


@pytest.mark.parametrize("overlap,strided", [(False, False), (True, False), (False, True)])
def test_a_save_allocates_no_private_copy_of_the_state(make, overlap, strided):
    """A save copies tensors straight into the slot: the process's peak memory grows by its
    plan (per tensor, not per byte), never by the state's size (64 MiB here), not even for a
    moment (VmHWM, reset after the slots exist)."""
    ck = make(keep=1)
    state = {"m": {f"t{i}": torch.randn(16 << 10) for i in range(1000)}}  # 64 MiB
    if strided:  # one 64 MiB tensor that is not contiguous (a transposed view)
        state = {"t": torch.randn(4096, 4096).t(), "m": {"a": torch.ones(3)}}
    ck.save(1, state)
    ck.save(2, state)  # both slots exist and are mapped: one-time costs
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        pytest.skip("cannot reset the peak RSS here")
    before = _memory()
    for step in range(3, 6):
        state["m"]["t0"] = torch.randn(16 << 10)
        if strided:
            state["t"].mul_(2)
        ck.save(step, state, overlap=overlap)
        if step == 4:  # the next save takes the full walk
            state["extra"] = step
    ck.before_update()
    after = _memory()
    assert after["VmHWM"] - before["VmRSS"] < 24 << 20, (before, after)
    assert after["RssAnon"] - before["RssAnon"] < 16 << 20, (before, after)
    assert same(loaded(ck, 5), state)
    ck.close()


_OTHER_TORCH = """
import sys
import torch
torch.__version__ = "0.0.0+other"  # what another torch install would say
try:
    import safepoint._torchprobe  # noqa: F401
    print("loaded")
except ImportError as e:
    print("refused:", e)
import safepoint
from safepoint import _core
print("probe", _core.set_torch_probe(True))
st = {"w": torch.arange(10.0), "b": torch.ones(3, dtype=torch.bfloat16), "n": 5}
safepoint.save(sys.argv[1], 1, st)
step, got = safepoint.load(sys.argv[1])
print("equal", step == 1 and got["n"] == 5 and all(torch.equal(got[k], st[k]) for k in "wb"))
"""


def test_a_probe_built_for_another_torch_is_refused_and_saves_take_the_python_route(
        tmp_path, tensor_reads):
    import importlib.util
    import subprocess
    import sys

    if tensor_reads != "probe":
        pytest.skip("the subprocess chooses its own route: one run is enough")
    if importlib.util.find_spec("safepoint._torchprobe") is None:
        pytest.skip("safepoint._torchprobe is not built here")
    r = subprocess.run([sys.executable, "-c", _OTHER_TORCH, str(tmp_path / "ckpt")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("refused: safepoint._torchprobe was built for torch "), lines
    assert lines[0].endswith("this is torch 0.0.0+other"), lines
    assert lines[1:] == ["probe False", "equal True"], lines
