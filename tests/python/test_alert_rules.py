"""The shipped Prometheus alerting rules (deploy/prometheus/safepoint.rules.yml) are valid and do
what their unit tests say (safepoint.rules.test.yml), checked by promtool (Debian `prometheus`,
installed by scripts/setup.sh); the Grafana dashboard is valid JSON that queries only metrics
the agent exports."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
RULES = os.path.join(REPO, "deploy", "prometheus", "safepoint.rules.yml")
RULES_TEST = os.path.join(REPO, "deploy", "prometheus", "safepoint.rules.test.yml")
DASHBOARD = os.path.join(REPO, "deploy", "grafana", "safepoint-dashboard.json")
DOCS = os.path.join(REPO, "docs", "operations.md")


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed (Debian package prometheus; scripts/setup.sh)")
    return path


def test_rules_pass_promtool_check():
    proc = subprocess.run([promtool(), "check", "rules", RULES], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_rules_pass_their_unit_tests():
    proc = subprocess.run([promtool(), "test", "rules", RULES_TEST], capture_output=True,
                          text=True, timeout=120, cwd=os.path.dirname(RULES_TEST))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def documented_metrics() -> set[str]:
    """The metric names the operations guide lists in its metrics table."""
    with open(DOCS) as f:
        return set(re.findall(r"^\| `(safepoint_[a-z_]+)`", f.read(), re.M))


def test_rules_and_dashboard_use_only_documented_metrics():
    known = documented_metrics()
    assert len(known) > 20, "docs/operations.md lists the agent's metrics in a table"
    with open(RULES) as f:
        rules_text = f.read()
    with open(DASHBOARD) as f:
        dashboard = json.load(f)
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert exprs, "the dashboard has panels with queries"
    used = set(re.findall(r"safepoint_[a-z_]+", rules_text + "\n".join(exprs)))
    # histogram series names come from their family
    used = {re.sub(r"_(bucket|sum|count)$", "", n) for n in used} - {"safepoint_job"}  # a label
    assert used - known == set(), f"not exported (or not documented): {sorted(used - known)}"
