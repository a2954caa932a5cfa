"""Resharding: DTensor states saved by N ranks restore into M ranks from storage (1-D and 2-D
meshes, Shard(0)/Shard(1)/Replicate, uneven splits), bit-exact; real processes, gloo."""

import os

import pytest

import safepoint
from conftest import free_port, run_ranks
from safepoint import _core

WORKER = os.path.join(os.path.dirname(__file__), "workloads", "reshard_worker.py")


def run(ckpt, mode, mesh, *extra):
    world = 1
    for d in mesh.split("x"):
        world *= int(d)
    port = free_port()
    return run_ranks([[WORKER, ckpt, mode, mesh, port, r, *extra] for r in range(world)])


@pytest.mark.parametrize("save_mesh,load_meshes", [("2", ["1", "3"]), ("2x2", ["3"])])
def test_save_n_ranks_restore_m_ranks(tmp_path, save_mesh, load_meshes):
    ckpt = tmp_path / "ckpt"
    assert all(o["ok"] for o in run(ckpt, "save", save_mesh))
    assert safepoint.steps(ckpt) == [7]
    if save_mesh == "2":
        # Each shard records its box: w0 is (7, 5) split on dim 0 over 2 ranks, rows [0, 4)
        # and [4, 7).
        boxes = []
        for r in range(2):
            e = next(t for t in _core.read_metadata(str(ckpt), 7, r).tensors if t.name == "w0")
            boxes.append((e.shape, e.global_shape, e.global_offset))
        assert boxes == [([4, 5], [7, 5], [0, 0]), ([3, 5], [7, 5], [4, 0])]
    for mesh in load_meshes:
        outs = run(ckpt, "load", mesh)
        assert all(o["ok"] for o in outs), outs
        # The same through the shared read of the whole job (Checkpointer.restore's from
        # storage), where a rank learns the boxes of the images it did not open from the ranks
        # that did (a world that shrank: the images of the ranks it lacks are opened too).
        outs = run(ckpt, "shared", mesh)
        assert all(o["ok"] for o in outs), outs


def test_flash_checkpoint_of_dtensors_restores_from_memory_then_reshards(tmp_path):
    ckpt = tmp_path / "ckpt"
    shm = tmp_path / "shm"
    shm.mkdir()
    job = f"reshard-{os.getpid()}"
    outs = run(ckpt, "flash", "2", shm, job)
    assert all(o["ok"] for o in outs), outs
    assert safepoint.steps(ckpt) == [7]
    outs = run(ckpt, "load", "3")
    assert all(o["ok"] for o in outs), outs


def test_hot_reload_of_dtensors_reuses_the_save_and_restore_plans(tmp_path):
    # Issue 21: DTensor shards (FSDP2's parameters) take the plans plain tensors take: the second
    # save, and each restore after the first (into the same DTensors, then into new ones of the
    # same structure), reuse them; every restore is bit-exact.
    shm = tmp_path / "shm"
    shm.mkdir()
    outs = run(tmp_path / "ckpt", "hot", "2", shm, f"hot-{os.getpid()}")
    assert all(o["ok"] for o in outs), outs
    assert [o["plans"] for o in outs] == [[False, True, False, True, True]] * 2, outs
    # Once a restore plan exists, each restore is whole (the targets' own DTensors were filled:
    # no extras decoded, no tree built), also through a module's load_state_dict, whose
    # state_dict() gives new DTensor objects over the same shards each time.
    assert [o["whole"] for o in outs] == [[False, True, True, False, True, True]] * 2, outs
