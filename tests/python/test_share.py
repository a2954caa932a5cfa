"""Replicated state copied once per node (issue 21): with Checkpointer(dedupe=True), each rank of
a node copies only its share of the tensors every rank holds, and a restart reloads the others'
shares from their slots (2 ranks, gloo, real processes and agents)."""

import glob
import os

from conftest import free_port, run_ranks

WORKER = os.path.join(os.path.dirname(__file__), "workloads", "share_worker.py")


def _run(tmp_path, mode):
    """Both ranks in `mode`; the job is named after the test's directory (unique in a run)."""
    ckpt, shm = tmp_path / "ckpt", tmp_path / "shm"
    shm.mkdir(exist_ok=True)
    job = f"share-{os.getpid()}-{abs(hash(tmp_path.name)) % 10**8}"
    port = free_port()
    return run_ranks([[WORKER, ckpt, shm, job, port, r, mode] for r in range(2)])


def _resume(tmp_path):
    return _run(tmp_path, "resume")


def test_each_rank_copies_its_share_and_a_restart_reloads_every_tensor_from_memory(tmp_path):
    saved = _run(tmp_path, "save")
    assert saved[0]["warnings"] == saved[1]["warnings"] == []
    for out in saved:
        # The first save copies everything (no plan yet); the next ones only this rank's share.
        assert out["image_bytes"][0] > out["full_bytes"]
        assert out["image_bytes"][1] == out["image_bytes"][3] < 0.55 * out["full_bytes"]
    # The shares are disjoint and cover the 12 replicated tensors (indexes 0..11; 12 is local).
    skips = [{i for a, b in out["copy_skip"][-1] for i in range(a, b)} for out in saved]
    assert not skips[0] & skips[1] and skips[0] | skips[1] == set(range(12))
    resumed = _resume(tmp_path)
    assert resumed == [{"rank": r, "step": 4, "source": "memory", "equal": True} for r in (0, 1)]


def test_a_failure_of_one_rank_after_the_agreement_only_makes_it_copy_everything(tmp_path):
    saved = _run(tmp_path, "applyfail")  # would hang if the ranks' collectives went apart
    assert len(saved[0]["warnings"]) == 1, saved[0]["warnings"]
    assert "copies every tensor from the next save on" in saved[0]["warnings"][0]
    assert saved[1]["warnings"] == []
    # Rank 0 copies its whole state from step 4 on; rank 1 still only its share (rank 0's
    # snapshot holds everything rank 1 leaves to it).
    assert saved[0]["image_bytes"][3] > saved[0]["full_bytes"]
    assert saved[1]["image_bytes"][3] < 0.55 * saved[1]["full_bytes"]
    resumed = _resume(tmp_path)
    assert resumed == [{"rank": r, "step": 4, "source": "memory", "equal": True} for r in (0, 1)]


def test_a_structure_change_on_one_rank_copies_the_step_again_in_full(tmp_path, monkeypatch):
    saved = _run(tmp_path, "changed")
    assert saved[0]["warnings"] == saved[1]["warnings"] == []
    # Rank 1's state gained a tensor at step 3; rank 0 had left its share out under the old
    # plan and copied the step again, whole (its first copy's slot freed: step 4 finds one).
    # From step 4 on, the new plan: shares again.
    assert saved[0]["image_bytes"][2] > saved[0]["full_bytes"]
    assert saved[1]["image_bytes"][2] > saved[1]["full_bytes"]
    assert all(out["image_bytes"][3] < 0.55 * out["full_bytes"] for out in saved)
    monkeypatch.setenv("SHARE_CHANGED", "1")
    resumed = _resume(tmp_path)
    assert resumed == [{"rank": r, "step": 4, "source": "memory", "equal": True} for r in (0, 1)]


def test_a_damaged_share_is_detected_and_both_ranks_load_storage(tmp_path):
    _run(tmp_path, "save")
    # One byte of the tensor data in every snapshot slot of rank 1: rank 1's own load and rank
    # 0's fill of the tensors rank 1 copied both fail their checksums.
    slots = glob.glob(str(tmp_path / "shm" / "*" / "rank-00001.slot-*"))
    assert slots
    for path in slots:
        with open(path, "r+b") as f:
            f.seek(4096)  # the slot's control block, then the image (docs/format.md)
            header = f.read(96)
            assert header[:8] == b"SPIMAGE\0"
            data_offset = int.from_bytes(header[80:88], "little")
            data_size = int.from_bytes(header[88:96], "little")
            f.seek(4096 + data_offset + data_size // 2)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0xFF]))
    resumed = _resume(tmp_path)
    assert resumed == [{"rank": r, "step": 4, "source": "storage", "equal": True} for r in (0, 1)]


def test_a_missing_share_falls_back_to_storage(tmp_path):
    _run(tmp_path, "save")
    for path in glob.glob(str(tmp_path / "shm" / "*" / "rank-00001.slot-*")):
        os.remove(path)  # rank 1's snapshots are gone (e.g. removed by hand)
    resumed = _resume(tmp_path)
    assert resumed == [{"rank": r, "step": 4, "source": "storage", "equal": True} for r in (0, 1)]
