"""A real Prometheus server (Debian `prometheus`, installed by scripts/setup.sh) scrapes a running
job's agent (issue 13, part 3): its HTTP API sees the save count grow, and once the job's storage
fails it sees the shipped SafepointPersistFailing alert fire (deploy/prometheus/safepoint.rules.yml,
evaluated every second here). The server runs with its own configuration and data directory
under tmp_path, on a loopback port, and is always stopped. Waits only guard against hangs."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request

import pytest
import torch

import safepoint
from safepoint import Checkpointer

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "common"))
from processes import HANG, wait_until  # noqa: E402

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
RULES = os.path.join(REPO, "deploy", "prometheus", "safepoint.rules.yml")


def state(step: int) -> dict:
    return {"w": torch.full((50_000,), float(step)), "step": step}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """`prometheus` in the foreground, a child of this process, scraping `target` every second."""

    def __init__(self, tmp, target: str) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            pytest.skip("the prometheus server is not installed (Debian package prometheus; "
                        "scripts/setup.sh)")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = tmp / "prometheus.yml"
        config.write_text(json.dumps({  # YAML is a superset of JSON
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s",
                       "scrape_timeout": "1s"},
            "rule_files": [RULES],
            "scrape_configs": [{"job_name": "safepoint",
                                "static_configs": [{"targets": [target]}]}],
        }))
        self.log = tmp / "prometheus.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT, cwd=tmp)

    def get(self, path: str, **params):
        url = f"{self.url}{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.loads(r.read()) if path.startswith("/api/") else r.read()

    def ready(self) -> bool:
        assert self.proc.poll() is None, self.log.read_text()[-3000:]
        try:
            self.get("/-/ready")
            return True
        except (urllib.error.URLError, ConnectionError):
            return False

    def scalar(self, query: str):
        """The value of an instant query with one result, or None."""
        res = self.get("/api/v1/query", query=query)
        assert res["status"] == "success", res
        result = res["data"]["result"]
        assert len(result) <= 1, result
        return float(result[0]["value"][1]) if result else None

    def firing(self, name: str) -> list:
        alerts = self.get("/api/v1/alerts")["data"]["alerts"]
        return [a for a in alerts if a["labels"]["alertname"] == name and a["state"] == "firing"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=HANG)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def test_prometheus_scrapes_the_agent_and_fires_the_persist_failure_alert(tmp_path, shm):
    path = tmp_path / "ckpt"
    ck = Checkpointer(path, job="prom", shm_dir=shm, metrics="127.0.0.1:0")
    ck.save(1, state(1))
    ck.wait()
    target = urllib.parse.urlparse(ck.status()["metrics_url"]).netloc
    prom = Prometheus(tmp_path, target)
    try:
        assert wait_until(prom.ready), prom.log.read_text()[-3000:]
        saves = 'safepoint_saves_total{safepoint_job="prom",rank="0"}'
        assert wait_until(lambda: prom.scalar(saves) == 1), prom.get("/api/v1/targets")
        assert prom.scalar('up{job="safepoint"}') == 1
        # Prometheus sees the save count grow.
        for step in (2, 3, 4):
            ck.save(step, state(step))
        ck.wait()
        assert wait_until(lambda: prom.scalar(saves) == 4)
        committed = 'safepoint_newest_committed_step{safepoint_job="prom",tier="0"}'
        assert wait_until(lambda: prom.scalar(committed) == 4)
        failed = 'safepoint_persists_total{safepoint_job="prom",tier="0",result="failed"}'
        assert prom.scalar(failed) == 0  # scraped before any failure: increase() sees the first
        assert prom.firing("SafepointPersistFailing") == []

        # The job's storage fails: its directory is replaced by a file.
        shutil.move(str(path), str(tmp_path / "moved"))
        path.write_text("not a directory")
        ck.save(5, state(5))
        with pytest.raises(safepoint.Error):
            ck.wait()
        assert wait_until(lambda: prom.firing("SafepointPersistFailing") != []), \
            prom.get("/api/v1/rules")
        (alert,) = prom.firing("SafepointPersistFailing")
        assert alert["labels"]["safepoint_job"] == "prom" and alert["labels"]["tier"] == "0"
        assert alert["labels"]["severity"] == "critical"
        assert prom.scalar(failed) >= 1
        # Nothing else fires: the other rules hold for a healthy job.
        others = [a for a in prom.get("/api/v1/alerts")["data"]["alerts"]
                  if a["labels"]["alertname"] != "SafepointPersistFailing"]
        assert others == [], others

        path.unlink()
        shutil.move(str(tmp_path / "moved"), str(path))
        ck.save(6, state(6))
        ck.wait()
        assert wait_until(lambda: prom.scalar(committed) == 6)
    finally:
        prom.stop()
        ck.close()
    assert prom.proc.returncode is not None
