"""The node agent's Prometheus endpoint and JSON-lines event log, end to end (issue 13): a real
training process (this one), a real agent, scraped over HTTP and parsed with prometheus_client's
own parser of the text format. The real Prometheus server is in test_prometheus.py."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import urllib.error
import urllib.request

import pytest
import torch

import safepoint
from safepoint import Checkpointer, Tier

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "common"))
from processes import agent_log, job_dir, wait_until  # noqa: E402

parser = pytest.importorskip(
    "prometheus_client.parser", reason="prometheus_client (scripts/setup.sh installs it)")


def state(step: int, n: int = 100_000) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(n, generator=g), "step": step}


def scrape(url: str) -> dict:
    """{(sample name, frozenset of labels): value}; every sample must carry safepoint_job."""
    with urllib.request.urlopen(url, timeout=30) as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = r.read().decode()
    out = {}
    for family in parser.text_string_to_metric_families(text):
        for s in family.samples:
            assert "safepoint_job" in s.labels, s
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: dict, name: str, **labels) -> float | None:
    """The sample `name` whose labels include `labels` (None when there is none)."""
    want = {(k, str(v)) for k, v in labels.items()}
    found = [v for (n, ls), v in samples.items() if n == name and want <= ls]
    assert len(found) <= 1, (name, labels, found)
    return found[0] if found else None


def events(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_agent_serves_metrics_of_saves_persists_and_commits(ckpt, shm):
    t0 = time.time()
    ck = Checkpointer(ckpt, job="m-basic", shm_dir=shm, metrics="127.0.0.1:0")
    for step in (1, 2, 3):
        ck.save(step, state(step))
        ck.wait()
    st = ck.status()
    url = st["metrics_url"]
    assert url and url.startswith("http://127.0.0.1:") and url.endswith("/metrics"), st
    assert st["metrics_error"] is None
    m = scrape(url)
    assert value(m, "safepoint_saves_total", rank=0, safepoint_job="m-basic") == 3
    assert value(m, "safepoint_save_blocking_seconds_count", rank=0) == 3
    assert value(m, "safepoint_save_blocking_seconds_bucket", rank=0, le="+Inf") == 3
    assert value(m, "safepoint_snapshot_bytes_total", rank=0) >= 3 * 400_000
    assert value(m, "safepoint_persists_total", tier=0, result="ok") == 3
    # the failure counter exists from the start
    assert value(m, "safepoint_persists_total", tier=0, result="failed") == 0
    assert value(m, "safepoint_persist_seconds_count", tier=0) == 3
    assert value(m, "safepoint_persisted_bytes_total", tier=0) >= 3 * 400_000
    assert value(m, "safepoint_commits_total", tier=0) == 3
    assert value(m, "safepoint_newest_committed_step", tier=0) == 3
    assert t0 <= value(m, "safepoint_last_commit_timestamp_seconds", tier=0) <= time.time()
    assert value(m, "safepoint_commit_interval_seconds", tier=0) >= 0
    assert value(m, "safepoint_tier_info", tier=0, uri=str(ckpt)) == 1
    assert value(m, "safepoint_saves_skipped_total", rank=0) is None
    # Sampled state shows within about a second.
    assert wait_until(lambda: (value(scrape(url), "safepoint_shm_used_bytes") or 0) > 0)
    m = scrape(url)
    assert value(m, "safepoint_shm_size_bytes") >= value(m, "safepoint_shm_free_bytes") > 0
    assert value(m, "safepoint_pending_persists") == 0
    assert value(m, "safepoint_ranks_connected") == 1
    # No step or tensor labels: every label is one of a bounded set.
    assert {k for (_, ls) in m for k, _ in ls} <= {
        "safepoint_job", "rank", "tier", "result", "uri", "where", "le", "kind", "code",
        "reason", "source", "scheme", "op", "dir"}
    ck.close()


def test_restore_and_emergency_flush_are_counted(ckpt, shm):
    ck = Checkpointer(ckpt, job="m-restore", shm_dir=shm, metrics="127.0.0.1:0",
                      persist_every=10)
    ck.save(1, state(1))  # in memory only
    ck.abandon()          # like a crash: the agent flushes step 1
    ck = Checkpointer(ckpt, job="m-restore", shm_dir=shm, metrics="127.0.0.1:0")
    target = state(0)
    assert ck.restore(target) == 1 and ck.last_restore.source == "memory"
    url = ck.status()["metrics_url"]
    m = scrape(url)
    assert value(m, "safepoint_emergency_flushes_total", reason="emergency") == 1
    assert value(m, "safepoint_restores_total", source="memory") == 1
    assert value(m, "safepoint_restore_seconds_count", source="memory") == 1
    ck.close()


def test_metrics_address_from_the_environment(ckpt, shm, monkeypatch):
    monkeypatch.setenv("SAFEPOINT_METRICS_ADDR", "127.0.0.1:0")
    ck = Checkpointer(ckpt, job="m-env", shm_dir=shm)
    ck.save(1, state(1))
    ck.wait()
    url = ck.status()["metrics_url"]
    assert url and value(scrape(url), "safepoint_saves_total", rank=0) == 1
    ck.close()
    # The endpoint goes away with the agent once the job is done.
    assert wait_until(lambda: not job_dir(shm, "m-env").exists())
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=5)


def test_without_metrics_nothing_listens_and_status_says_so(ckpt, shm, monkeypatch):
    monkeypatch.delenv("SAFEPOINT_METRICS_ADDR", raising=False)
    ck = Checkpointer(ckpt, job="m-none", shm_dir=shm)
    ck.save(1, state(1))
    st = ck.status()
    assert st["metrics_url"] is None and st["metrics_error"] is None
    ck.close()


def test_a_port_in_use_is_reported_and_training_goes_on(ckpt, shm):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        addr = f"127.0.0.1:{busy.getsockname()[1]}"
        ck = Checkpointer(ckpt, job="m-busy", shm_dir=shm, metrics=addr)
        ck.save(1, state(1))
        ck.wait()
        st = ck.status()
        assert st["metrics_url"] is None
        assert addr in st["metrics_error"], st["metrics_error"]
        assert addr in agent_log(shm, "m-busy")
        assert safepoint.steps(str(ckpt)) == [1]
        ck.close()


def test_status_json_of_the_cli_names_the_metrics_url(ckpt, shm, cli):
    ck = Checkpointer(ckpt, job="m-cli", shm_dir=shm, metrics="127.0.0.1:0")
    ck.save(1, state(1))
    jobs = json.loads(cli("status", "--shm-dir", shm, "--json", check=0).stdout)
    (job,) = [j for j in jobs if j.get("job") == "m-cli"]
    url = ck.status()["metrics_url"]
    assert url and json.dumps(job).count(url) == 1, job
    assert f"metrics {url}" in cli("status", "--shm-dir", shm, check=0).stdout
    ck.close()


def test_event_log_has_one_line_per_save_persist_commit_flush_and_restore(ckpt, shm, tmp_path):
    log = tmp_path / "events.jsonl"
    ck = Checkpointer(ckpt, job="m-events", shm_dir=shm, event_log=log, persist_every=2)
    for step in (1, 2):
        ck.save(step, state(step))
    ck.wait()
    assert ck.status()["event_log"] == str(log)
    ck.save(3, state(3))  # not persisted: flushed when the process "dies"
    ck.status()  # a round trip: the agent has handled the save's report before the socket closes
    ck.abandon()
    ck = Checkpointer(ckpt, job="m-events", shm_dir=shm, event_log=log)
    assert ck.restore(state(0)) == 3
    ck.save(4, state(4))
    ck.close()
    ev = events(log)
    assert all(e["job"] == "m-events" and e["time"].endswith("Z") and e["ts"] > 0 for e in ev)
    kinds = [e["event"] for e in ev]
    saves = [e for e in ev if e["event"] == "save"]
    assert [e["step"] for e in saves] == [1, 2, 3, 4]
    assert all(e["rank"] == 0 and e["bytes"] > 0 and e["seconds"] >= 0 for e in saves)
    persists = [e for e in ev if e["event"] == "persist"]
    assert [e["step"] for e in persists] == [2, 3, 4]
    assert [e["reason"] for e in persists] == ["requested", "emergency", "requested"]
    assert all(e["tier"] == 0 and e["bytes"] > 0 for e in persists)
    assert [e["step"] for e in ev if e["event"] == "commit"] == [2, 3, 4]
    (flush,) = [e for e in ev if e["event"] == "flush"]
    assert flush["step"] == 3 and flush["reason"] == "emergency"
    (restore,) = [e for e in ev if e["event"] == "restore"]
    assert restore["step"] == 3 and restore["source"] == "memory"
    assert "failure" not in kinds
    # The user's log stays after the job finished; the job directory is gone.
    assert wait_until(lambda: not job_dir(shm, "m-events").exists())
    assert log.exists()


def test_default_event_log_is_in_the_job_directory_and_records_failures(tmp_path, shm):
    path = tmp_path / "ckpt"
    ck = Checkpointer(path, job="m-fail", shm_dir=shm)
    ck.save(1, state(1))
    ck.wait()
    default = job_dir(shm, "m-fail") / "events.jsonl"
    assert ck.status()["event_log"] == str(default)
    # Storage fails: the checkpoint directory becomes a file.
    shutil.move(str(path), str(tmp_path / "moved"))
    path.write_text("not a directory")
    ck.save(2, state(2))
    with pytest.raises(safepoint.Error):
        ck.wait()
    (failure,) = [e for e in events(default) if e["event"] == "failure"]
    assert failure["kind"] == "persist" and failure["step"] == 2 and failure["tier"] == 0
    assert str(path) in failure["error"] and failure["code"]
    path.unlink()
    shutil.move(str(tmp_path / "moved"), str(path))
    ck.close()
    # A finished job leaves nothing behind in shared memory, the default event log included.
    assert wait_until(lambda: not job_dir(shm, "m-fail").exists())


def test_process_view_through_prometheus_client(ckpt, shm):
    import prometheus_client

    import safepoint.metrics

    registry = prometheus_client.CollectorRegistry()
    ck = Checkpointer(ckpt, job="m-proc", shm_dir=shm, on_busy="skip")
    collector = safepoint.metrics.register(ck, registry)
    ck.save(1, state(1))
    ck.save(2, state(2))
    text = prometheus_client.generate_latest(registry).decode()
    got = {(s.name, frozenset(s.labels.items())): s.value
           for f in parser.text_string_to_metric_families(text) for s in f.samples}
    labels = {"safepoint_job": "m-proc", "rank": "0"}
    assert value(got, "safepoint_process_saves_total", **labels) == 2
    assert value(got, "safepoint_process_save_blocking_seconds_count", **labels) == 2
    assert value(got, "safepoint_process_save_blocking_seconds_sum", **labels) > 0
    assert value(got, "safepoint_process_last_save_blocking_seconds", **labels) > 0
    safepoint.metrics.unregister(collector, registry)
    assert "safepoint_process" not in prometheus_client.generate_latest(registry).decode()
    ck.close()


def test_tier_copies_show_per_tier(tmp_path, shm, monkeypatch):
    monkeypatch.setenv("SAFEPOINT_TIER_RETRY_SECONDS", "0.05")
    lower = tmp_path / "lower"
    ck = Checkpointer(tmp_path / "ckpt", job="m-tiers", shm_dir=shm, metrics="127.0.0.1:0",
                      tiers=[Tier(f"file://{lower}", every=2, keep=3)])
    for step in (1, 2, 3, 4):
        ck.save(step, state(step))
        ck.wait()
    url = ck.status()["metrics_url"]
    assert wait_until(lambda: ck.status()["tiers"][0]["newest_step"] == 4
                      and ck.status()["tiers"][0]["pending_step"] is None)
    copies = ck.status()["tiers"][0]["copies"]
    assert copies >= 2  # steps 2 and 4 at least (the tier may take the first step too)
    assert wait_until(lambda: value(scrape(url), "safepoint_persists_total", tier=1,
                                    result="ok") == copies)
    m = scrape(url)
    # Each copy wakes the agent's loop, which sees it on its own (two that finish before the
    # loop turns are counted, but observed and committed once).
    assert 1 <= value(m, "safepoint_persist_seconds_count", tier=1) <= copies
    assert 1 <= value(m, "safepoint_commits_total", tier=1) <= copies
    assert value(m, "safepoint_newest_committed_step", tier=1) == 4
    assert value(m, "safepoint_tier_up", tier=1) == 1
    assert value(m, "safepoint_tier_info", tier=1, uri=f"file://{lower}") == 1
    assert value(m, "safepoint_persists_total", tier=1, result="failed") == 0
    ck.close()
