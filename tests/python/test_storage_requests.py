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
