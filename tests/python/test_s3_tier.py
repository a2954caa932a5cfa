"""safepoint.save / load, and `safepoint ls` / `verify`, on an s3:// URI against a real RADOS
Gateway ($SAFEPOINT_TEST_S3_URI and the AWS_* environment that `make test` exports with its test
Ceph cluster; skipped when unset)."""

import os
import uuid

import pytest
import torch

import safepoint
from safepoint.errors import StorageError

BASE = os.environ.get("SAFEPOINT_TEST_S3_URI")

pytestmark = pytest.mark.skipif(
    not BASE, reason="$SAFEPOINT_TEST_S3_URI is not set (make test sets it with a test Ceph cluster)")


@pytest.fixture
def uri():
    return BASE.rstrip("/") + "/py-" + uuid.uuid4().hex[:12]


def test_save_and_load_round_trip_bit_exact_through_s3(uri, cli):
    g = torch.Generator().manual_seed(5)
    state = {"w": torch.randn(5_000_000, generator=g), "b": torch.arange(10), "step": 7}
    for step in (10, 20):
        r = safepoint.save(uri, step, state)
        assert r["committed"] and r["bytes"] > 20_000_000
    assert safepoint.steps(uri) == [10, 20]
    step, back = safepoint.load(uri)
    assert step == 20
    assert torch.equal(back["w"], state["w"]) and torch.equal(back["b"], state["b"])
    assert back["step"] == 7

    ls = cli("ls", uri, check=0)
    assert "10" in ls.stdout and "20" in ls.stdout
    verify = cli("verify", uri, check=0)
    assert verify.stdout.count("OK") >= 1 and uri in verify.stdout


def test_wrong_secret_is_a_clear_error(uri, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "0" * 40)
    with pytest.raises(StorageError, match="permission denied"):
        safepoint.save(uri, 1, {"x": torch.zeros(4)})
