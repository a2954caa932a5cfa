"""Stateful objects (modules, optimizers, schedulers, GradScaler), in-place restore, RNG state."""

import random

import numpy as np
import pytest
import torch

import safepoint


def make():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    return model, opt, sched, scaler


def train(model, opt, sched, n, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        loss = model(torch.randn(4, 8, generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()


def test_sync_save_and_restore_in_place(tmp_path):
    model, opt, sched, scaler = make()
    train(model, opt, sched, 3)
    safepoint.save(tmp_path, 3, {"model": model, "optim": opt, "sched": sched, "scaler": scaler,
                                 "epoch": 7})
    m2, o2, s2, sc2 = make()
    ptrs = [p.data_ptr() for p in m2.parameters()]
    state = {"model": m2, "optim": o2, "sched": s2, "scaler": sc2, "epoch": 0}
    assert safepoint.restore(tmp_path, state) == 3
    assert state["epoch"] == 7
    assert [p.data_ptr() for p in m2.parameters()] == ptrs  # restored in place
    for a, b in zip(model.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    assert s2.state_dict() == sched.state_dict()
    assert sc2.get_scale() == scaler.get_scale()
    # Training continues identically.
    train(model, opt, sched, 2, seed=5)
    train(m2, o2, s2, 2, seed=5)
    for a, b in zip(model.parameters(), m2.parameters()):
        assert torch.equal(a, b)


def test_restore_copies_into_existing_tensors_and_checks_shapes(tmp_path):
    t = torch.arange(6.0)
    safepoint.save(tmp_path, 1, {"t": t, "nested": {"u": torch.ones(2)}, "n": 3})
    target = {"t": torch.zeros(6), "nested": {"u": torch.zeros(2)}, "n": 0}
    keep = target["t"]
    safepoint.restore(tmp_path, target)
    assert target["t"] is keep and torch.equal(keep, t)
    assert torch.equal(target["nested"]["u"], torch.ones(2)) and target["n"] == 3
    with pytest.raises(safepoint.InvalidArgumentError, match=r"t: shape \(6,\) in the checkpoint"):
        safepoint.restore(tmp_path, {"t": torch.zeros(5)})
    with pytest.raises(safepoint.InvalidArgumentError, match="'missing' is not in the checkpoint"):
        safepoint.restore(tmp_path, {"missing": torch.zeros(5)})


def test_rng_round_trip(tmp_path):
    torch.manual_seed(123)
    np.random.seed(123)
    random.seed(123)
    torch.rand(3), np.random.rand(3), random.random()
    safepoint.save(tmp_path, 1, {"x": 1, "rng": safepoint.capture_rng()})
    expected = (torch.rand(5), np.random.rand(5), [random.random() for _ in range(5)])
    torch.manual_seed(999)
    np.random.seed(999)
    random.seed(999)
    _, state = safepoint.load(tmp_path)
    safepoint.restore_rng(state["rng"])
    got = (torch.rand(5), np.random.rand(5), [random.random() for _ in range(5)])
    assert torch.equal(expected[0], got[0])
    assert np.array_equal(expected[1], got[1])
    assert expected[2] == got[2]


def test_checkpointer_include_rng_and_restore(tmp_path):
    model, opt, sched, _ = make()
    with safepoint.Checkpointer(tmp_path / "ckpt", job=f"stateful-{id(tmp_path) % 10**8}",
                                shm_dir=str(tmp_path)) as ckpt:
        assert ckpt.restore({"model": model}) is None  # nothing yet
        train(model, opt, sched, 2)
        torch.manual_seed(7)
        ckpt.save(2, {"model": model, "optim": opt, "sched": sched}, include_rng=True)
        after = torch.rand(4)
        m2, o2, s2, _ = make()
        torch.manual_seed(0)
        assert ckpt.restore({"model": m2, "optim": o2, "sched": s2}) == 2
        assert ckpt.last_load_source == "memory"
        assert torch.equal(torch.rand(4), after)  # the generator was restored
        for a, b in zip(model.parameters(), m2.parameters()):
            assert torch.equal(a, b)


def test_leaving_with_by_an_exception_keeps_snapshots_for_hot_reload(tmp_path):
    # Regression: __exit__ closed the checkpointer even when an exception was propagating, which
    # persisted and then deleted the memory snapshots, so a restart loaded from storage.
    job = f"exit-{id(tmp_path) % 10**8}"
    with pytest.raises(RuntimeError, match="boom"):
        with safepoint.Checkpointer(tmp_path / "ckpt", job=job, shm_dir=str(tmp_path),
                                    persist_every=100) as ckpt:
            for step in (1, 2, 3):
                ckpt.save(step, {"w": torch.full((4,), float(step))})
            raise RuntimeError("boom")
    with safepoint.Checkpointer(tmp_path / "ckpt", job=job, shm_dir=str(tmp_path)) as again:
        step, state = again.load()
        assert step == 3 and again.last_load_source == "memory"
        assert torch.equal(state["w"], torch.full((4,), 3.0))


def test_restore_from_memory_never_aliases_the_snapshot_slot(tmp_path):
    # restore() reads the slot in place; whatever it hands over (optimizer state the target did
    # not have yet, values replacing non-tensors) must be copies: the slot is reused by the
    # next saves.
    model, opt, sched, _ = make()
    train(model, opt, sched, 2)
    saved = {k: {n: t.clone() for n, t in v.items()} for k, v in opt.state_dict()["state"].items()}
    with safepoint.Checkpointer(tmp_path / "ckpt", job=f"alias-{id(tmp_path) % 10**8}",
                                shm_dir=str(tmp_path), persist_every=100) as ckpt:
        ckpt.save(2, {"model": model, "optim": opt, "extra": torch.full((3,), 7.0)})
        m2, o2, s2, _ = make()  # o2 has no state yet: it comes from the slot
        target = {"model": m2, "optim": o2, "extra": None}  # so does "extra"
        assert ckpt.restore(target) == 2 and ckpt.last_load_source == "memory"
        for step in (3, 4, 5):  # overwrite both slots with other values
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
            train(model, opt, sched, 1)
            ckpt.save(step, {"model": model, "optim": opt, "extra": torch.full((3,), float(step))})
    assert torch.equal(target["extra"], torch.full((3,), 7.0))
    for k, v in o2.state_dict()["state"].items():
        for n, t in v.items():
            assert torch.equal(t, saved[k][n]), (k, n)


def test_filled_in_place_only_for_views_of_the_same_bytes():
    # A restore that filled a state_dict()'s tensors in place skips copying them into the
    # tensors a second state_dict() call gives (new objects over the same memory), and only
    # those: another layout over the same storage, a conjugate view, or other memory is copied.
    from safepoint._stateful import filled_in_place

    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert filled_in_place(w, w)
    assert filled_in_place(w.detach(), w.detach())  # two objects, the same bytes
    assert not filled_in_place(w, w.clone())
    assert not filled_in_place(w, w.t().contiguous().t())  # same values, other memory
    assert not filled_in_place(w.reshape(4, 3), w)  # other shape
    assert not filled_in_place(w[:, :2], w[:, 1:3])  # other offset
    assert not filled_in_place(w.view(torch.int32), w)  # other dtype
    c = torch.ones(3, dtype=torch.complex64)
    assert not filled_in_place(c, c.conj())
    assert not filled_in_place(torch.empty(0), torch.empty(0))
    m = torch.empty(3, device="meta")
    assert not filled_in_place(m, torch.empty(3, device="meta"))
    s = torch.eye(3).to_sparse()
    assert not filled_in_place(s, s.coalesce().clone()) and filled_in_place(s, s)
