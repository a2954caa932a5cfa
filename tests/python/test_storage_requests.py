"""Storage requests counted per scheme (issue 32 item 2): what a save, a commit and a restore ask
of storage, seen from inside the process (``_core.storage_requests()``), in a Checkpointer's
``status()`` and on the agent's Prometheus endpoint. The counts are exact for one process: they
state the cost of each operation, so a change that adds requests shows here."""

from __future__ import annotations

import os
import sys

import torch

import safepoint
from safepoint import Checkpointer, _core

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "common"))
from processes import wait_until  # noqa: E402
from test_metrics import scrape, value  # noqa: E402

OPS = ("list", "head", "get", "create", "write", "put", "delete", "cleanup")


def delta(before: dict, after: dict, scheme: str = "file") -> dict:
    b, a = before.get(scheme, {}), after.get(scheme, {})
    return {k: a.get(k, 0) - b.get(k, 0) for k in a}


def test_a_sync_save_publishes_its_image_and_one_commit(tmp_path):
    state = {"w": torch.arange(1000, dtype=torch.float32), "step": 1}
    before = _core.storage_requests()
    safepoint.save(tmp_path / "ck", 1, state)
    d = delta(before, _core.storage_requests())
    assert d["put"] == 2, d      # the rank's image, then the COMMIT record
    assert d["create"] == 2, d
    assert d["delete"] == 0, d
    assert d["data_bytes_written"] >= 4000, d
    assert 0 < d["metadata_bytes"] < 64 << 10, d
    assert d["requests"] == sum(d[k] for k in OPS), d


def test_a_restore_counts_its_reads(tmp_path):
    safepoint.save(tmp_path / "ck", 1, {"w": torch.ones(1 << 16)})
    before = _core.storage_requests()
    step, got = safepoint.load(tmp_path / "ck")
    assert step == 1 and torch.equal(got["w"], torch.ones(1 << 16))
    d = delta(before, _core.storage_requests())
    assert d["list"] >= 1 and d["get"] >= 1 and d["put"] == 0 and d["create"] == 0, d
    assert d["data_bytes_read"] >= 4 << 16, d


def test_a_restore_into_the_world_that_saved_opens_its_own_image_alone(tmp_path):
    # Each rank restores from its own image's header and index, not every image's (W x W opens
    # across a job): one rank's restore asks storage the same of a step of 2 ranks and of 8.
    counts = {}
    for world in (2, 8):
        ck = tmp_path / f"w{world}"
        for r in range(world):
            safepoint.save(ck, 1, {"mine": torch.full((1000,), float(r)), "step": 1}, rank=r,
                           world_size=world, attempt=7)
        target = {"mine": torch.zeros(1000), "step": 0}
        before = _core.storage_requests()
        assert safepoint.restore(ck, target, 1, rank=1) == 1
        counts[world] = delta(before, _core.storage_requests())
        assert torch.equal(target["mine"], torch.full((1000,), 1.0)) and target["step"] == 1
    # The COMMIT record read grows by 12 bytes a rank (its image sizes and CRCs); nothing else.
    assert counts[8].pop("metadata_bytes") - counts[2].pop("metadata_bytes") == 6 * 12, counts
    assert counts[2] == counts[8], counts
    # A rank the saving world did not have (8 -> 9 ranks) restores what rank 0 saved.
    target = {"mine": torch.zeros(1000), "step": 0}
    assert safepoint.restore(tmp_path / "w8", target, 1, rank=8) == 1
    assert torch.equal(target["mine"], torch.zeros(1000)) and target["step"] == 1


def test_ranks_restoring_the_newest_step_on_their_own_skip_a_missing_image_alike(tmp_path):
    # Without an agreement among them, every rank must see that one image of the newest step is
    # gone and fall back to the same older step, not only the rank whose image it was.
    import pytest

    ck = tmp_path / "ck"
    for step in (1, 2):
        for r in range(3):
            safepoint.save(ck, step, {"mine": torch.full((10,), float(step * 10 + r))}, rank=r,
                           world_size=3, attempt=step)
    lost = list((ck / f"step-{2:020d}").glob("rank-00002*"))
    assert lost
    for f in lost:
        f.unlink()
    for r in range(3):
        target = {"mine": torch.zeros(10)}
        with pytest.warns(RuntimeWarning, match="skipped a damaged checkpoint: step 2"):
            assert safepoint.restore(ck, target, rank=r) == 1
        assert torch.equal(target["mine"], torch.full((10,), float(10 + r)))


def test_status_and_metrics_show_the_agents_requests(ckpt, shm):
    ck = Checkpointer(ckpt, job="req-count", shm_dir=shm, metrics="127.0.0.1:0")
    try:
        for step in (1, 2):
            ck.save(step, {"w": torch.full((1000,), float(step))})
            ck.wait()
        st = ck.status()
        agent = st["storage_requests"]["agent"]["file"]
        # Two persists: at least an image and a COMMIT each, by the agent, not this process.
        assert agent["put"] >= 4 and agent["data_bytes_written"] >= 8000, agent
        assert "process" in st["storage_requests"]
        url = st["metrics_url"]
        assert wait_until(lambda: (value(scrape(url), "safepoint_storage_requests_total",
                                         scheme="file", op="put") or 0) >= 4)
        m = scrape(url)
        assert value(m, "safepoint_storage_metadata_bytes_total", scheme="file") > 0
        assert value(m, "safepoint_storage_data_bytes_total", scheme="file",
                     dir="written") >= 8000
    finally:
        ck.close()


def test_a_process_alone_lists_once_and_reads_the_newest_commit_record_once(ckpt, shm):
    # A Checkpointer alone in its job lists the storage (its one List reads the newest COMMIT
    # record) and then reads the newest step's image against that record: one List and one
    # COMMIT read. Before, the load of the newest step listed and read the record again (2 lists,
    # 3 opens, 980 metadata bytes), and a restore with targets listed again and read every step's
    # record (2 lists, 7 opens, 1,352 bytes).
    with Checkpointer(ckpt, job="alone", shm_dir=shm, keep=3) as ck:
        for step in (1, 2, 3, 4):
            ck.save(step, {"w": torch.full((1000,), float(step))})
        ck.wait()
    metadata = []
    for how in ("load", "restore"):
        with Checkpointer(ckpt, job="alone", shm_dir=shm) as ck:
            target = {"w": torch.zeros(1000)}
            before = _core.storage_requests()
            if how == "load":
                got = ck.load()
                assert got is not None
                step, w = got[0], got[1]["w"]
            else:
                step, w = ck.restore(target), target["w"]
            d = delta(before, _core.storage_requests())
            assert ck.last_load_source == "storage", how
        assert step == 4 and torch.equal(w, torch.full((1000,), 4.0)), how
        assert d["list"] == 1, (how, d)
        # The newest COMMIT record, then the image (a restore opens it for its index, then for
        # its ranges); the metadata read is the listing and that one record, for both.
        assert d["head"] == {"load": 2, "restore": 3}[how], (how, d)
        metadata.append(d["metadata_bytes"])
    assert metadata[0] == metadata[1], metadata


def test_a_process_alone_falls_back_past_a_damaged_newest_image(ckpt, shm):
    # The newest step's image read against the record the listing read fails its checksums:
    # the load falls back to the step before, as before.
    import pytest

    with Checkpointer(ckpt, job="alone-damaged", shm_dir=shm, keep=3) as ck:
        for step in (1, 2):
            ck.save(step, {"w": torch.full((1 << 14,), float(step))})
        ck.wait()
    flip_tensor_byte(ckpt, 2, 0, "w")
    with Checkpointer(ckpt, job="alone-damaged", shm_dir=shm) as ck:
        target = {"w": torch.zeros(1 << 14)}
        with pytest.warns(RuntimeWarning, match="step 2"):
            assert ck.restore(target) == 1
        assert torch.equal(target["w"], torch.full((1 << 14,), 1.0))


def test_save_and_load_cost_the_same_whatever_the_steps_kept(tmp_path):
    # A save's clean-up and a load of the newest step read the newest COMMIT record first, not
    # every one kept: their requests do not grow with the history (they did: one head and one
    # get more per step kept).
    def requests_of(fn) -> int:
        before = _core.storage_requests()
        fn()
        return delta(before, _core.storage_requests())["requests"]

    path = tmp_path / "ck"
    saves = [requests_of(lambda s=s: safepoint.save(path, s, {"w": torch.ones(100)}))
             for s in range(1, 9)]
    assert len(set(saves[1:])) == 1, saves  # the first one finds no step to clean up after
    load_of_8 = requests_of(lambda: safepoint.load(path))
    other = tmp_path / "other"
    for s in (1, 2):
        safepoint.save(other, s, {"w": torch.ones(100)})
    assert requests_of(lambda: safepoint.load(other)) == load_of_8


def test_a_damaged_newest_commit_falls_back_to_the_step_before(tmp_path):
    path = tmp_path / "ck"
    for s in (1, 2, 3):
        safepoint.save(path, s, {"w": torch.full((10,), float(s))})
    commit = path / "step-00000000000000000003" / "COMMIT"
    raw = bytearray(commit.read_bytes())
    raw[-1] ^= 0xFF
    commit.write_bytes(bytes(raw))
    step, got = safepoint.load(path)
    assert step == 2 and torch.equal(got["w"], torch.full((10,), 2.0))


# --- a restore of a whole job (issue 32 item 4) ---------------------------------------------------
# 4 real processes (gloo), each counting its own storage requests around the restore
# (tests/python/workloads/restore_requests_worker.py). One rank (rank 0, the agreement's lister)
# lists the storage and reads the newest COMMIT record, for the job; every rank then reads only the
# step it restores. Before, every rank listed the storage and read every COMMIT record there.

RANKS = 4
WORKER = os.path.join(os.path.dirname(__file__), "workloads", "restore_requests_worker.py")


def job_run(tmp_path, shm, phase: str, tag: str, ranks: int = RANKS) -> list:
    from conftest import free_port, run_ranks

    port = free_port()
    return run_ranks([[WORKER, tmp_path / "ckpt", shm, f"rq-{tag}-{os.getpid()}", port, r,
                       ranks, phase] for r in range(ranks)])


def flip_tensor_byte(ckpt, step: int, rank: int, name: str) -> None:
    """Flips a byte in the middle of tensor `name` of rank `rank`'s image of `step`."""
    img, offset, nbytes = _core.tensor_extent(str(ckpt), step, rank, name)
    with open(img, "r+b") as f:
        f.seek(offset + nbytes // 2)
        byte = f.read(1)
        f.seek(offset + nbytes // 2)
        f.write(bytes([byte[0] ^ 0xFF]))


def flip_last_byte(path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))


def test_a_restore_of_the_job_lists_storage_once(tmp_path, shm):
    job_run(tmp_path, shm, "save", "a")
    assert safepoint.steps(tmp_path / "ckpt") == [2, 3, 4]  # keep=3
    for phase in ("load", "restore"):
        outs = job_run(tmp_path, shm, phase, phase)
        assert [(o["step"], o["ok"], o["source"]) for o in outs] == [(4, True, "storage")] * 4
        req = [o["requests"]["file"] for o in outs]
        # The one List of the job, by rank 0; no other rank lists.
        assert [r.get("list", 0) for r in req] == [1, 0, 0, 0], (phase, req)
        # Rank 0 reads the newest COMMIT record, for the job, and hands it to the others in the
        # agreement's rows: they read their images against it and no record (a COMMIT record
        # is the only metadata a restore reads besides the listing; images are data). Before,
        # every rank read it: 168 bytes, an open and a read more a rank.
        assert [r.get("metadata_bytes", 0) for r in req[1:]] == [0] * (RANKS - 1), (phase, req)
        assert req[0]["metadata_bytes"] > 0, (phase, req)
        # The record rides in the agreement's one all-gather: no collective more.
        assert all(o["calls"].count("all_gather") == 1 for o in outs), (phase, outs)
        assert all("broadcast" not in c for o in outs for c in o["calls"]), (phase, outs)


def test_a_record_the_rows_cannot_hold_is_broadcast_not_read_by_every_rank(tmp_path, shm,
                                                                            monkeypatch):
    # A world over 249 ranks: the agreement's rows carry the COMMIT record's header alone and
    # rank 0 broadcasts its bytes; the other ranks still read no record (before, each read it:
    # W COMMIT reads a restore, (100 + 12 W) W bytes). The slot's limit is lowered here so that
    # 4 ranks' record does not fit.
    job_run(tmp_path, shm, "save", "a")
    monkeypatch.setenv("SAFEPOINT_TEST_RECORD_LIMIT", "0")
    for phase in ("load", "restore"):
        outs = job_run(tmp_path, shm, phase, phase + "-big")
        assert [(o["step"], o["ok"], o["source"]) for o in outs] == [(4, True, "storage")] * 4
        req = [o["requests"]["file"] for o in outs]
        assert [r.get("list", 0) for r in req] == [1, 0, 0, 0], (phase, req)
        assert [r.get("metadata_bytes", 0) for r in req[1:]] == [0] * (RANKS - 1), (phase, req)
        assert all(o["calls"].count("broadcast") == 1 for o in outs), (phase, outs)


def test_requests_of_a_rank_that_does_not_list_do_not_grow_with_the_steps_kept(tmp_path, shm):
    # The steps kept are 2, 3 and 4; the ranks that do not list read the step they restore alone,
    # whatever the number of steps kept: the same requests as after a first save alone.
    job_run(tmp_path, shm, "save", "a")
    many = job_run(tmp_path, shm, "load", "b")
    for step in (2, 3):
        (tmp_path / "ckpt" / f"step-{step:020d}" / "COMMIT").unlink()  # steps 2, 3: gone
    assert safepoint.steps(tmp_path / "ckpt") == [4]
    one = job_run(tmp_path, shm, "load", "c")
    assert [o["step"] for o in many + one] == [4] * 8
    for a, b in zip(many[1:], one[1:]):
        assert a["requests"] == b["requests"], (a["requests"], b["requests"])


def test_a_damaged_newest_commit_is_skipped_by_every_rank_together(tmp_path, shm):
    job_run(tmp_path, shm, "save", "a")
    flip_last_byte(tmp_path / "ckpt" / f"step-{4:020d}" / "COMMIT")
    outs = job_run(tmp_path, shm, "restore", "b")
    assert [(o["step"], o["ok"]) for o in outs] == [(3, True)] * RANKS
    # Rank 0 read it and says so, once for the job.
    assert any("damaged" in w and "COMMIT" in w for w in outs[0]["warnings"]), outs[0]
    assert not any("damaged" in w for o in outs[1:] for w in o["warnings"])


def test_an_unread_older_commit_that_is_damaged_makes_every_rank_fall_back(tmp_path, shm):
    # Step 4's image of rank 1 is damaged: every rank falls back to step 3, whose COMMIT record
    # (not read by the lister, which stopped at step 4's intact one) is damaged too: the ranks
    # fall back together once more, to step 2.
    job_run(tmp_path, shm, "save", "a")
    ckpt = tmp_path / "ckpt"
    flip_tensor_byte(ckpt, 4, 1, "r1")
    flip_last_byte(ckpt / f"step-{3:020d}" / "COMMIT")
    outs = job_run(tmp_path, shm, "load", "b")
    assert [(o["step"], o["ok"]) for o in outs] == [(2, True)] * RANKS
    assert sum("fall back" in w for w in outs[0]["warnings"]) == 2, outs[0]["warnings"]


def test_a_restore_opens_a_constant_number_of_images_a_rank_whatever_the_world(tmp_path, shm):
    # The model's two tensors are replicas written once (dedupe): rank 0's image holds one, rank
    # 1's the other, and every other image leaves both "elsewhere". A rank opens its own image
    # and the images it reads a range of (the shared read's plan gives one rank the model's
    # ranges to read and send), never every image of the step to find where the replicas are:
    # the job opens about W images, not W x W (8 x 8 = 64 before), and no rank more than 3.
    world = 8
    job_run(tmp_path, shm, "save", "a", world)
    outs = job_run(tmp_path, shm, "restore", "b", world)
    assert [(o["step"], o["ok"], o["source"]) for o in outs] == [(4, True, "storage")] * world
    images = [o["images"] for o in outs]
    for r, opened in enumerate(images):
        assert r in opened and len(opened) == len(set(opened)) <= 3, images
    assert sum(map(len, images)) <= world + 4, images
    # What each rank asks of storage does not depend on W either: the ranks that open their
    # own image alone (all but the lister and the reader of the model) ask the same.
    gets = sorted(o["requests"]["file"].get("get", 0) for o, i in zip(outs[1:], images[1:])
                  if len(i) == 1)
    assert len(gets) >= world - 3 and gets[0] == gets[-1], (gets, images)


def test_a_shared_read_finds_the_replicas_of_a_rank_that_restores_from_memory(tmp_path, shm):
    # Rank 0 holds the step already (as in memory) and opens nothing for itself, but its image
    # holds a replica the others need: they learn its index from rank 0 in a second all-gather
    # (rank 0 opens its image for them), not by each opening every image.
    job_run(tmp_path, shm, "save", "a")
    outs = job_run(tmp_path, shm, "partial", "b")
    assert [(o["step"], o["ok"], o["everyone"]) for o in outs] == [(4, True, True)] * RANKS
    images = [o["images"] for o in outs]
    assert images[0] == [0], images
    for r, opened in enumerate(images[1:], 1):
        assert r in opened and len(opened) == len(set(opened)) <= 3, images
    assert all(o["calls"].count("all_gather_object") == 2 for o in outs), outs

