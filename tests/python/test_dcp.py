"""safepoint.dcp: torch.distributed.checkpoint's save/load/async_save in safepoint's format, with
real DCP (torch 2.x, CPU, gloo ranks as processes)."""

import importlib.util
import inspect
import json
import os
import stat
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import flip_byte
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import safepoint
import safepoint.dcp as sdcp
from safepoint import _core

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP's "no process group" note

WORKER = os.path.join(os.path.dirname(__file__), "workloads", "dcp_worker.py")
_spec = importlib.util.spec_from_file_location("dcp_worker", WORKER)
dcp_worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dcp_worker)


def failures(e: CheckpointException) -> list:
    return [exc for exc, _ in e.failures.values()]


def model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3 * (seed + 1), weight_decay=0.1 * seed)
    for _ in range(2):
        model(torch.randn(5, 8)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_model_and_optimizer_round_trip_bit_exact(ckpt, cli):
    model, opt = model_and_optimizer(0)
    msd, osd = get_state_dict(model, opt)
    extra = {"epoch": 3, "note": "dcp", "z": torch.randn(3, dtype=torch.complex64),
             "half": torch.randn(4, 2).to(torch.bfloat16)}
    dcp.save({"model": msd, "optim": osd, "extra": extra},
             checkpoint_id=f"{ckpt}/step-5", storage_writer=sdcp.Writer(ckpt))
    assert safepoint.steps(ckpt) == [5]

    model2, opt2 = model_and_optimizer(1)
    msd2, osd2 = get_state_dict(model2, opt2)
    extra2 = {"epoch": 0, "note": "", "z": torch.zeros(3, dtype=torch.complex64),
              "half": torch.zeros(4, 2, dtype=torch.bfloat16)}
    target = {"model": msd2, "optim": osd2, "extra": extra2}
    reader = sdcp.Reader(ckpt)
    dcp.load(target, storage_reader=reader)
    assert reader.checkpoint_id == _core.step_path(str(ckpt), 5)
    set_state_dict(model2, opt2, model_state_dict=target["model"], optim_state_dict=target["optim"])

    for (k, a), (k2, b) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    for i in s1["state"]:
        for name, v in s1["state"][i].items():
            assert torch.equal(v, s2["state"][i][name]), (i, name)
    assert target["extra"]["epoch"] == 3 and target["extra"]["note"] == "dcp"
    assert torch.equal(target["extra"]["z"], extra["z"])
    assert torch.equal(target["extra"]["half"], extra["half"])

    # A plain safepoint checkpoint: the CLI lists and verifies it.
    assert "5" in cli("ls", ckpt, check=0).stdout
    cli("verify", ckpt, "--all", check=0)
    listing = json.loads(cli("inspect", ckpt, "--json", check=0).stdout)
    assert "tensors.model.0.weight@0,0" in json.dumps(listing)


def _stored_dtypes(ckpt, step: int) -> dict:
    """{tensor name in the image: the dtype its index records} of rank 0's image."""
    return {e.name: e.dtype for e in _core.read_metadata(str(ckpt), step, 0).tensors}


def test_complex64_and_uint16_round_trip_bit_exact_and_are_stored_as_themselves(ckpt):
    # freqs_cis-like complex buffer; uint16 values above 2**15 (a signed reading would change them)
    angles = torch.arange(24, dtype=torch.float32).reshape(4, 6) / 7
    z = torch.polar(torch.ones(4, 6), angles)
    u = torch.tensor([[0, 1, 32767, 32768, 40000, 65535]] * 3, dtype=torch.uint16)
    dcp.save({"z": z, "u": u}, storage_writer=sdcp.Writer(ckpt, step=1))
    # Native dtypes of the image format (from _core.DTYPES), not raw bytes: safepoint inspect
    # and safepoint.load see them as what they are.
    assert _stored_dtypes(ckpt, 1) == {"tensors.z@0,0": "complex64", "tensors.u@0,0": "uint16"}

    target = {"z": torch.zeros(4, 6, dtype=torch.complex64),
              "u": torch.zeros(3, 6, dtype=torch.uint16)}
    dcp.load(target, storage_reader=sdcp.Reader(ckpt, step=1))
    assert torch.equal(target["z"], z) and torch.equal(target["u"], u)


@pytest.mark.parametrize("name", [n for n in _core.DTYPES
                                  if isinstance(getattr(torch, n, None), torch.dtype)])
def test_every_dtype_the_format_stores_round_trips_natively(ckpt, name):
    dtype = getattr(torch, name)
    g = torch.Generator().manual_seed(3)
    if dtype == torch.bool:
        t = torch.randint(0, 2, (5, 8), generator=g).bool()
    else:  # arbitrary bit patterns (NaNs included): compared as bytes
        t = torch.randint(0, 256, (5, 8 * dtype.itemsize), generator=g,
                          dtype=torch.uint8).view(dtype)
    dcp.save({"t": t}, storage_writer=sdcp.Writer(ckpt, step=2))
    assert _stored_dtypes(ckpt, 2) == {"tensors.t@0,0": name}
    target = {"t": torch.zeros(t.shape, dtype=dtype)}
    dcp.load(target, storage_reader=sdcp.Reader(ckpt, step=2))
    assert torch.equal(target["t"].view(torch.uint8), t.view(torch.uint8))


def test_a_dtype_the_format_lacks_round_trips_as_its_bytes(ckpt):
    assert "complex32" not in _core.DTYPES
    t = torch.randn(3, 4, dtype=torch.complex64).to(torch.complex32)
    dcp.save({"c": t}, storage_writer=sdcp.Writer(ckpt, step=1))
    assert _stored_dtypes(ckpt, 1) == {"tensors.c@0,0": "uint8"}
    target = {"c": torch.zeros(3, 4, dtype=torch.complex32)}
    dcp.load(target, storage_reader=sdcp.Reader(ckpt, step=1))
    assert torch.equal(target["c"].view(torch.uint8), t.view(torch.uint8))


def test_sharded_save_reshards_to_one_two_and_three_ranks(tmp_path, ckpt, cli):
    def run(world, phase):
        store = tmp_path / f"store-{phase}-{world}"
        env = dict(os.environ, OMP_NUM_THREADS="1")
        procs = [subprocess.Popen([sys.executable, WORKER, str(store), str(ckpt), str(world),
                                   str(r), phase], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=env) for r in range(world)]
        outs = [p.communicate(timeout=240) for p in procs]
        for p, (out, err) in zip(procs, outs):
            assert p.returncode == 0, err[-3000:]
        return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]

    full = dcp_worker.global_state()
    expect_ok = {k: True for k in full}

    # World size 2: Shard(0) and Shard(1) DTensors, saved and loaded back.
    saved = run(2, "save")
    for rep in saved:
        assert rep["steps_after_save"] == [1]
        got = rep["load"]
        assert got["ok"] == expect_ok and got["meta"] == {"step": 1, "name": "run"}
        assert got["step"] == 1
        assert got["bytes_read"] == got["needed"]  # the same shards: exactly its own bytes
        # A save in which rank 1 fails leaves step 2 invisible and unloadable ...
        assert rep["failed_save"] == "CheckpointException"
        assert rep["steps_after_failure"] == [1] and rep["newest_loaded"] == 1
        # ... and cannot be re-saved over rank 0's leftover image.
        assert "unfinished save of step 2" in rep["resave"]
        # async_save of the sharded state through the shared-memory stager.
        got = rep["async"]
        assert rep["stager_files"] == 1 and got["step"] == 3
        assert got["ok"] == expect_ok and got["meta"] == {"step": 3, "name": "run"}
    # Step 3's commit leaves step 2's leftover image alone: younger than the clean-up's grace
    # (10 minutes: another writer may be about to commit an older step; CleanUp removes it
    # once older, src/checkpoint/checkpoint_store_test.cc). Step 2 stays invisible.
    assert _core.image_ranks(str(ckpt), 2) == [0]
    with pytest.raises(CheckpointException, match="step 2 is not committed"):
        dcp.load({"meta": {"step": 0}}, storage_reader=sdcp.Reader(ckpt, step=2))

    # World size 3: DCP's planner reshards (13 rows, 11 and 257 columns: uneven splits).
    stored = sum(e.nbytes for r in range(2) for e in _core.read_metadata(str(ckpt), 1, r).tensors)
    for rep in run(3, "load"):
        got = rep["load"]
        assert got["ok"] == expect_ok and got["step"] == 1
        assert got["needed"] <= got["bytes_read"] < stored

    # World size 1 (no process group): plain full tensors.
    target = {"model": {k: torch.zeros_like(v) for k, v in full.items()},
              "meta": {"step": 0, "name": ""}}
    dcp.load(target, storage_reader=sdcp.Reader(ckpt, step=1))
    for k, v in full.items():
        assert torch.equal(target["model"][k], v), k
    assert target["meta"] == {"step": 1, "name": "run"}

    out = cli("verify", ckpt, "--all", check=0).stdout
    assert "rank 0" in out and "rank 1" in out


def _async_save_through(stager, how, state, ckpt, step):
    if how == "writer":  # every torch: the storage writer is the stager
        return dcp.async_save(state, storage_writer=stager.writer(ckpt, step=step))
    if "async_stager" not in inspect.signature(dcp.async_save).parameters:
        pytest.skip(f"torch {torch.__version__}: dcp.async_save has no async_stager")
    return dcp.async_save(state, storage_writer=sdcp.Writer(ckpt, step=step),
                          async_stager=stager)


@pytest.mark.parametrize("how", ["writer", "async_stager"])
def test_async_save_with_shm_stager(ckpt, how):
    model, opt = model_and_optimizer(2)
    state = {"model": model.state_dict(), "step": 1}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with sdcp.ShmStager() as stager:
        fut = _async_save_through(stager, how, state, ckpt, 1)
        # async_save returned once the state was copied into shared memory: training may go on.
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        fut.result()
        files = stager.files
        assert len(files) == 1 and files[0].startswith(stager.shm_dir)
        assert stat.S_IMODE(os.stat(files[0]).st_mode) == 0o600
        state["step"] = 2
        _async_save_through(stager, how, state, ckpt, 2).result()
        # The same shapes reuse the buffer (a second one only if the first save's thread had
        # not let go of its state dict within 50 ms: exact reuse is tested below).
        assert stager.allocations in (1, 2)
    assert not any(os.path.exists(f) for f in files)
    assert safepoint.steps(ckpt) == [1, 2]

    got = {"model": {k: torch.zeros_like(v) for k, v in before.items()}, "step": 0}
    dcp.load(got, storage_reader=sdcp.Reader(ckpt, step=1))
    assert got["step"] == 1
    for k, v in before.items():
        assert torch.equal(got["model"][k], v), k  # the values at staging time
    dcp.load(got, storage_reader=sdcp.Reader(ckpt))
    assert got["step"] == 2
    for k, v in model.state_dict().items():
        assert torch.equal(got["model"][k], v), k


def test_a_stager_never_overwrites_a_staged_state_still_in_use(tmp_path):
    t = {"w": torch.arange(6.0)}
    with sdcp.ShmStager(shm_dir=str(tmp_path)) as stager:
        first = stager.stage(t)
        t["w"] += 10
        second = stager.stage(t)  # `first` is still referenced: a second buffer
        assert stager.allocations == 2
        assert torch.equal(first["w"], torch.arange(6.0))
        assert torch.equal(second["w"], torch.arange(6.0) + 10)
        del first, second
        third = stager.stage(t)  # both buffers are free again: one is reused
        assert stager.allocations == 2 and torch.equal(third["w"], t["w"])
        del third
        stager.stage({"w": torch.zeros(3)})  # another layout: a new buffer, the idle ones go
        assert len(stager.files) <= 2
        stager_files = stager.files
    assert os.listdir(tmp_path) == [os.path.basename(os.path.dirname(stager_files[0]))]
    assert os.listdir(os.path.dirname(stager_files[0])) == []


def test_corruption_is_detected_and_only_needed_chunks_are_read(ckpt):
    # Two 5 MiB tensors: each lies in checksum chunks of its own (chunks are 4 MiB).
    g = torch.Generator().manual_seed(7)
    state = {"a": torch.randn(5 << 18, generator=g), "b": torch.randn(5 << 18, generator=g)}
    dcp.save(state, storage_writer=sdcp.Writer(ckpt, step=3))
    last = _core.read_metadata(str(ckpt), 3, 0).tensors[-1].name
    bad, good = ("b", "a") if last.startswith("tensors.b@") else ("a", "b")
    img, offset, nbytes = _core.tensor_extent(str(ckpt), 3, 0, last)
    flip_byte(img, offset + nbytes - 1, 0xFF)  # the last byte of the last tensor

    # The other tensor's chunks are intact: it loads bit-exact without reading the damaged one.
    ok = {good: torch.zeros_like(state[good])}
    dcp.load(ok, storage_reader=sdcp.Reader(ckpt))
    assert torch.equal(ok[good], state[good])

    with pytest.raises(CheckpointException) as info:
        dcp.load({bad: torch.zeros_like(state[bad])}, storage_reader=sdcp.Reader(ckpt))
    errs = failures(info.value)
    assert any(isinstance(e, safepoint.CorruptionError) for e in errs), errs
    assert str(img) in str(info.value)


def test_clear_errors(ckpt, tmp_path):
    state = {"w": torch.ones(2)}
    with pytest.raises(CheckpointException, match="no step to save"):
        dcp.save(state, storage_writer=sdcp.Writer(ckpt))
    dcp.save(state, storage_writer=sdcp.Writer(ckpt, step=1))
    with pytest.raises(CheckpointException, match="step 1 is already committed"):
        dcp.save(state, storage_writer=sdcp.Writer(ckpt, step=1))
    with pytest.raises(safepoint.InvalidArgumentError, match="non-negative int"):
        sdcp.Writer(ckpt, step=-1)

    plain = tmp_path / "plain"
    safepoint.save(plain, 4, {"w": torch.ones(2)})
    with pytest.raises(CheckpointException, match="not written by safepoint.dcp.Writer"):
        dcp.load({"w": torch.zeros(2)}, storage_reader=sdcp.Reader(plain))
    with pytest.raises(CheckpointException, match="no committed step"):
        dcp.load({"w": torch.zeros(2)}, storage_reader=sdcp.Reader(tmp_path / "empty"))
    with pytest.raises(CheckpointException, match="w"):
        dcp.load({"w": torch.zeros(3)}, storage_reader=sdcp.Reader(ckpt))  # wrong shape

    assert sdcp.Writer.validate_checkpoint_id("/x/step-12")
    assert not sdcp.Writer.validate_checkpoint_id("/x/y")


def _save_step(ckpt, step, keep):
    dcp.save({"w": torch.full((2,), float(step))},
             storage_writer=sdcp.Writer(ckpt, step=step, keep=keep))


def test_keep_prunes_older_steps_but_never_tagged_read_or_just_written_ones(ckpt):
    for step in range(1, 6):
        _save_step(ckpt, step, keep=2)
    assert safepoint.steps(ckpt) == [4, 5]
    safepoint.tag(ckpt, 4, "best")
    # A Reader of this process has resolved step 5 (its metadata is read, its data not yet).
    reader = sdcp.Reader(ckpt, step=5)
    reader.read_metadata()
    for step in (6, 7, 8):
        _save_step(ckpt, step, keep=1)
    assert safepoint.steps(ckpt) == [4, 5, 8]  # tagged, being read, the newest
    got = {"w": torch.zeros(2)}
    dcp.load(got, storage_reader=reader)  # the read ends: step 5 may go now
    assert torch.equal(got["w"], torch.full((2,), 5.0))
    _save_step(ckpt, 9, keep=1)
    assert safepoint.steps(ckpt) == [4, 9]
    # A save of an older step than the kept ones keeps what it wrote (until the next save).
    _save_step(ckpt, 2, keep=1)
    assert safepoint.steps(ckpt) == [2, 4, 9]
    safepoint.untag(ckpt, "best")
    _save_step(ckpt, 10, keep=2)
    assert safepoint.steps(ckpt) == [9, 10]
    # Without keep nothing is pruned.
    for step in (11, 12, 13):
        _save_step(ckpt, step, keep=None)
    assert safepoint.steps(ckpt) == [9, 10, 11, 12, 13]


def test_keep_through_the_shm_stager_and_bad_values(ckpt):
    with sdcp.ShmStager() as stager:
        for step in (1, 2, 3):
            dcp.async_save({"w": torch.full((2,), float(step))},
                           storage_writer=stager.writer(ckpt, step=step, keep=1)).result()
    assert safepoint.steps(ckpt) == [3]
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(safepoint.InvalidArgumentError, match="keep must be a positive int"):
            sdcp.Writer(ckpt, step=4, keep=bad)


def test_strided_reads_are_split_where_gaps_span_checksum_chunks():
    from safepoint._shards import box_span, row_major_strides, split_box

    mib = 1 << 20
    assert _core.CHUNK_SIZE == 4 * mib
    # Rows of 8 MiB, 10 columns wanted: one 40-byte range per row, not the whole chunk.
    pieces = list(split_box((0, 5), (64, 10), (64, 2 * mib), 4))
    assert len(pieces) == 64
    assert all(box_span(o, n, row_major_strides((64, 2 * mib)), 4)[1] == 40 for o, n in pieces)
    # Rows of 4000 bytes: every 4 MiB chunk holds wanted bytes, so ranges stay whole but are cut
    # into buffers of at most 64 MiB.
    pieces = list(split_box((0, 0), (1 << 20, 10), (1 << 20, 1000), 4))
    spans = [box_span(o, n, row_major_strides((1 << 20, 1000)), 4)[1] for o, n in pieces]
    assert len(pieces) < 100 and max(spans) <= 64 * mib
    assert sum(n[0] for _, n in pieces) == 1 << 20
    # A contiguous box is one range.
    assert list(split_box((3, 0), (5, 1000), (1 << 20, 1000), 4)) == [((3, 0), (5, 1000))]


# -- a step never mixes two saves -----------------------------------------------------------------

def _url(kind: str, ckpt) -> str:
    # A mem:// store lives as long as the process: its name comes from the test's own directory
    # (unique within a pytest run) and the worker's pid, never from id(), which a later test's
    # object may reuse and so find an earlier test's leftover images.
    return {"path": str(ckpt), "file": f"file://{ckpt}", "mem": f"mem://dcp-{ckpt.parent.name}-"
            f"{os.getpid()}"}[kind]


class _Ranks:
    """Drives safepoint.dcp.Writer through DCP's save protocol for several ranks in one process
    (rank r's planner and writer, plans gathered by hand), so that a test can stop any rank
    between any two steps of it, as a crash would."""

    def __init__(self, url: str, step: int, states: list) -> None:
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

        self.world = len(states)
        self.planners = [DefaultSavePlanner() for _ in states]
        self.writers = [sdcp.Writer(url, step=step) for _ in states]
        for r, (planner, writer) in enumerate(zip(self.planners, self.writers)):
            planner.set_up_planner(states[r], is_coordinator=r == 0)
            writer.set_up_storage_writer(r == 0, rank=r, use_collectives=True)

    def plan(self) -> None:
        """prepare_local_plan on every rank (where the guard runs), then the global plan."""
        local = [w.prepare_local_plan(p.create_local_plan())
                 for p, w in zip(self.planners, self.writers)]
        plans, self.metadata = self.planners[0].create_global_plan(local)
        self.plans = [p.finish_plan(g) for p, g in
                      zip(self.planners, self.writers[0].prepare_global_plan(plans))]

    def write(self, rank: int) -> None:
        self.writers[rank].write_data(self.plans[rank], self.planners[rank]).wait()


@pytest.mark.parametrize("kind", ["path", "file", "mem"])
def test_a_leftover_image_of_an_unfinished_save_is_refused_for_every_uri(ckpt, kind):
    url = _url(kind, ckpt)
    crashed = _Ranks(url, 7, [{"a": torch.zeros(4)}, {"b": torch.zeros(4)}])
    crashed.plan()
    crashed.write(1)  # rank 0 died before writing: rank 1's image stays, step 7 uncommitted
    assert safepoint.steps(url) == []

    again = _Ranks(url, 7, [{"a": torch.ones(4)}, {"b": torch.ones(4)}])
    with pytest.raises(safepoint.AlreadyExistsError, match="unfinished save of step 7"):
        again.plan()


@pytest.mark.parametrize("kind", ["path", "file", "mem"])
def test_an_image_of_another_save_is_never_committed_beside_this_saves(ckpt, kind):
    url = _url(kind, ckpt)
    old = _Ranks(url, 7, [{"a": torch.zeros(4)}, {"b": torch.zeros(4)}])
    new = _Ranks(url, 7, [{"a": torch.ones(4)}, {"b": torch.ones(4)}])
    old.plan()
    new.plan()  # both pass the guard: neither has written yet
    old.write(1)  # the old save's rank 1 lands late; its rank 0 never writes
    new.write(0)
    # Rank 1's image is the old save's: committing now would mix two saves.
    assert safepoint.steps(url) == []
    new.write(1)  # replaces the old image: now every image is of this save
    assert safepoint.steps(url) == [7]
    got = {"a": torch.zeros(4), "b": torch.zeros(4)}
    dcp.load(got, storage_reader=sdcp.Reader(url, step=7))
    assert torch.equal(got["a"], torch.ones(4)) and torch.equal(got["b"], torch.ones(4))


# -- staging files outlive a killed process only until gc -------------------------------------------

_STAGER_HOLDER = """
import sys, torch, safepoint.dcp as sdcp
stager = sdcp.ShmStager(shm_dir=sys.argv[1])
staged = stager.stage({"w": torch.ones(1 << 16)})
print(stager.files[0], flush=True)
sys.stdin.read()  # holds the stager until the test closes stdin
"""


def test_gc_removes_staging_files_of_a_killed_process_and_keeps_a_live_ones(shm, cli):
    procs = [subprocess.Popen([sys.executable, "-c", _STAGER_HOLDER, shm], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        killed, live = [p.stdout.readline().strip() for p in procs]
        assert os.path.isfile(killed) and os.path.isfile(live)
        procs[0].kill()
        procs[0].wait()
        assert os.path.isfile(killed)  # SIGKILL: nothing in the process could remove it

        assert "would remove 1 staging file" in cli("gc", "--shm-dir", shm, "--dry-run",
                                                     check=0).stdout
        assert os.path.isfile(killed)
        out = cli("gc", "--shm-dir", shm, check=0).stdout
        assert "removed 1 staging file" in out, out
        assert not os.path.exists(killed)
        assert os.path.isfile(live)
    finally:
        for p in procs:
            p.stdin.close()
            p.wait()
    assert not os.path.exists(live)  # its owner removed it when it exited
