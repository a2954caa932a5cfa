"""The staged-copy path of flash snapshots: GPU tensors are copied by safepoint._staging straight
into the (pinned) slot before the image is checksummed. On machines without CUDA the same path
is driven with CPU tensors (stage=2); the CUDA test runs where a GPU exists."""

import os

import pytest
import torch

import safepoint
from safepoint import _staging


def state():
    g = torch.Generator().manual_seed(3)
    return {"big": torch.randn(300_000, generator=g), "small": torch.arange(7, dtype=torch.int16),
            "t": torch.randn(64, 64, generator=g).t(),  # not contiguous
            "bf": torch.randn(1000, generator=g).to(torch.bfloat16), "empty": torch.zeros(0),
            "n": 3}


def equal(a, b):
    return all(torch.equal(a[k], b[k]) for k in ("big", "small", "t", "bf", "empty")) and a["n"] == b["n"]


@pytest.fixture
def ck(tmp_path):
    c = safepoint.Checkpointer(tmp_path / "ckpt", job=f"stage-{os.getpid()}-{id(tmp_path) % 10**6}",
                               shm_dir=str(tmp_path))
    yield c
    c.close()


def test_staged_tensors_land_in_the_snapshot_and_on_storage(ck, cli):
    ck._live.save(1, state(), True, None, True, 2)  # every tensor through the staged path
    ck.wait()
    step, snap = ck.load()
    assert step == 1 and ck.last_load_source == "memory" and equal(snap, state())
    assert equal(safepoint.load(ck.path, 1)[1], state())
    cli("verify", ck.path, "--all", check=0)


def test_a_failing_copy_fails_the_save_and_frees_the_slot(ck, monkeypatch):
    def broken(address, size, copies):
        raise RuntimeError("device lost")

    monkeypatch.setattr(_staging, "stage", broken)
    with pytest.raises(safepoint.StorageError, match="device lost"):
        ck._live.save(1, state(), True, None, True, 2)
    monkeypatch.undo()
    assert all(s.state != "WRITING" for s in ck._live.slots())
    ck.save(2, state())  # the next save works, and nothing half-copied is ever loaded
    ck.wait()
    assert ck.load()[0] == 2 and safepoint.steps(ck.path) == [2]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_tensors_are_copied_asynchronously_into_pinned_slots(ck):
    gpu = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in state().items()}
    ck.save(1, gpu)
    ck.wait()
    step, snap = ck.load()
    assert step == 1 and equal(snap, state())
    target = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else v) for k, v in gpu.items()}
    assert ck.restore(target) == 1
    assert all(torch.equal(target[k].cpu(), state()[k]) for k in ("big", "small", "t", "bf"))


def test_small_tensors_go_to_the_slot_in_runs_of_neighbours(monkeypatch):
    """The path GPU saves take for many small tensors (issue 14), run on the CPU: neighbours in
    the slot are gathered into one buffer laid out like the slot and copied in one piece; a run
    never covers another staged tensor (whose own copy could land first), is cut at _RUN_BYTES
    and at gaps of _GAP, may cover what is not staged (the client fills that afterwards), and a
    run of one tensor is copied straight."""
    from safepoint import _staging

    monkeypatch.setattr(_staging, "_RUN_BYTES", 4000)
    monkeypatch.setattr(_staging, "_GAP", 1000)
    g = torch.Generator().manual_seed(3)
    sizes = [(5, torch.float32), (100, torch.bfloat16), (1, torch.int64), (60, torch.float32),
             (20, torch.float16), (7, torch.float64), (9, torch.float32), (3, torch.int32)]
    tensors = [torch.randn(n, generator=g).to(dt) for n, dt in sizes]
    slot = torch.full((8192,), 0xAB, dtype=torch.uint8)
    items, others, off = [], [], 0
    for k, t in enumerate(tensors):
        if k == 2:  # a tensor that is not staged lies here: inside the run
            off += 128
        if k == 4:  # another staged tensor (of another device, or a large one): ends the run
            others.append(off)
            off += 256
        if k == 7:  # further than _GAP: a run of its own
            off += 2048
        n = t.numel() * t.element_size()
        items.append((t, off, n))
        off = (off + n + 63) // 64 * 64
    runs = _staging._runs(items[::-1], others)  # in slot order whatever the order given
    sizes_of = [[t.numel() for t, _, _ in r] for _, _, r in runs]
    assert sizes_of == [[5, 100, 1, 60], [20, 7, 9], [3]]
    monkeypatch.setattr(_staging, "_RUN_BYTES", 300)  # a run's span: at most this
    assert [[t.numel() for t, _, _ in r] for _, _, r in _staging._runs(items, others)][:3] == \
        [[5, 100], [1], [60]]
    _staging.copy_runs(runs, slot, torch.full((4000,), 0xCD, dtype=torch.uint8), False)
    for t, o, n in items:
        assert torch.equal(slot[o:o + n], t.reshape(-1).view(torch.uint8)), (o, n)
    covered = torch.zeros(8192, dtype=torch.bool)
    for _, o, n in items:
        covered[o:o + n] = True
    inside = torch.zeros(8192, dtype=torch.bool)
    for start, end, run in runs:
        if len(run) > 1:
            inside[start:end] = True
    assert bool((slot[inside & ~covered] == 0).all())  # zeros, never the buffer's bytes
    assert bool((slot[~inside & ~covered] == 0xAB).all())  # the other staged tensor's place too
