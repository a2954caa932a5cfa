"""Data-parallel replicas are written to storage once in total, the work split across ranks
(2 ranks, gloo, real processes and agents)."""

import os

import safepoint
from safepoint import _core
from conftest import free_port, run_ranks

WORKER = os.path.join(os.path.dirname(__file__), "workloads", "dedupe_worker.py")


def test_replicas_are_written_once_and_every_rank_loads_them(tmp_path, cli):
    ckpt, shm = tmp_path / "ckpt", tmp_path / "shm"
    shm.mkdir()
    job, port = f"dedupe-{os.getpid()}", free_port()
    outs = run_ranks([[WORKER, ckpt, shm, job, port, r] for r in range(2)])
    assert outs == [{"rank": r, "memory_ok": True, "load_ok": True, "restore_ok": True}
                    for r in range(2)]
    assert safepoint.steps(ckpt) == [1, 2]
    for step in (1, 2):
        held = {}  # replicated tensor -> ranks whose image holds its bytes
        written = [0, 0]
        for r in range(2):
            for e in _core.read_metadata(str(ckpt), step, r).tensors:
                if e.name.startswith("model."):
                    if not e.elsewhere:
                        held.setdefault(e.name, []).append(r)
                        written[r] += e.nbytes
                else:
                    assert not e.elsewhere, e.name  # rank-local: the step, generator states
        # Each of the 4 replicated tensors is written exactly once, and both ranks write some.
        assert sorted(held) == [f"model.layer{i}" for i in range(4)]
        assert all(len(rs) == 1 for rs in held.values()), held
        assert min(written) > 0, written
    cli("verify", ckpt, "--all", check=0)


def test_a_skip_list_outside_the_snapshot_fails_the_persist_clearly(tmp_path):
    # The agent checks the ranges it is told to leave to other ranks: a bad one fails that
    # persist (reported through wait()) and writes nothing; the next save persists normally.
    import pytest
    import torch

    ck = safepoint.Checkpointer(tmp_path / "ckpt", job=f"skip-{os.getpid()}",
                                shm_dir=str(tmp_path))
    try:
        ck._live.save(1, {"w": torch.ones(8)}, True, None, notify=False)
        ck._live.notify([(0, 5)])  # the snapshot has one tensor
        with pytest.raises(safepoint.Error, match="skip range"):
            ck.wait()
        assert safepoint.steps(tmp_path / "ckpt") == []
        ck.save(2, {"w": torch.ones(8)})
        ck.wait()
        assert safepoint.steps(tmp_path / "ckpt") == [2]
    finally:
        ck.close()


def test_the_copy_plan_holds_each_tensor_once_per_node_and_writers_hold_what_they_write():
    from safepoint._dedupe import MIN_SHARED_BYTES, _indexes, plan_copies, plan_replicas

    # 4 data-parallel ranks on 2 nodes: 5 replicated tensors of different sizes, a replicated
    # scalar (an optimizer's step count) and one local tensor.
    def entries(r):
        n = MIN_SHARED_BYTES // 4
        out = [(f"w{i}", "float32", [n * (i + 1)], [], [], 4 * n * (i + 1)) for i in range(5)]
        return out + [("step", "float32", [], [], [], 4), (f"rng.{r}", "uint8", [8], [], [], 8)]
    everyone = [entries(r) for r in range(4)]
    nodes = ["a", "a", "b", "b"]
    copies = [_indexes(c) for c in plan_copies(everyone, nodes, "rng.")]
    for ranks in ([0, 1], [2, 3]):
        held = [set(range(7)) - copies[r] for r in ranks]
        # Each replicated tensor once per node; a rank's own generator state (6) always, and
        # the scalar too (too small to leave to another rank: a reload would verify a whole
        # checksum chunk of that rank's slot for it).
        assert held[0] & held[1] == {5, 6} and held[0] | held[1] == set(range(7))
        assert all(len(h) > 2 for h in held)  # both ranks copy a share
    # Storage: each replicated tensor written once, by a rank whose snapshot holds it.
    skips = [_indexes(plan_replicas(everyone, r, "rng.", copies)) for r in range(4)]
    for i in range(6):
        writers = [r for r in range(4) if i not in skips[r]]
        assert len(writers) == 1 and i not in copies[writers[0]]
    # A rank alone on its node copies everything.
    assert plan_copies(everyone, ["a", "b", "c", "d"], "rng.")[0] == []
