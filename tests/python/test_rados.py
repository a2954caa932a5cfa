"""rados:// from Python and from the CLI, against the test Ceph cluster of scripts/with-ceph.sh
(the `ceph` fixture; skips without one): safepoint.save/load round trips bit-exact, and
`safepoint ls` / `verify` / `inspect` open rados:// URIs like directories."""

import json
import os
import uuid

import pytest
import torch

import safepoint


@pytest.fixture
def rados_uri(ceph):
    return ceph["SAFEPOINT_TEST_RADOS_URI"].rstrip("/") + "/py-" + uuid.uuid4().hex[:12]


def test_save_and_load_round_trip_bit_exact(rados_uri):
    g = torch.Generator().manual_seed(7)
    state = {"w": torch.randn(3, 1 << 18, generator=g), "b": torch.arange(10), "step": 4,
             "name": "run"}
    for step in (1, 2):
        info = safepoint.save(rados_uri, step, state)
        assert info["committed"]
    step, back = safepoint.load(rados_uri)
    assert step == 2
    assert torch.equal(back["w"], state["w"]) and torch.equal(back["b"], state["b"])
    assert back["step"] == 4 and back["name"] == "run"
    step, _ = safepoint.load(rados_uri, 1)
    assert step == 1
    # A committed step is immutable on rados:// too.
    with pytest.raises(safepoint.AlreadyExistsError):
        safepoint.save(rados_uri, 2, state)


def test_cli_ls_verify_inspect(rados_uri, cli):
    safepoint.save(rados_uri, 5, {"w": torch.ones(1000)})
    out = cli("ls", rados_uri, "--json", check=0)
    steps = json.loads(out.stdout)
    assert [s["step"] for s in steps] == [5], out.stdout
    out = cli("verify", rados_uri, check=0)
    assert "OK" in out.stdout and rados_uri in out.stdout, out.stdout
    cli("inspect", rados_uri, check=0)


def test_missing_pool_is_a_clear_error(ceph, cli):
    out = cli("ls", "rados://no-such-pool-sp/x")
    assert out.returncode != 0
    assert "no-such-pool-sp" in out.stderr and "does not exist" in out.stderr, out.stderr
    with pytest.raises(safepoint.NotFoundError):
        safepoint.load("rados://no-such-pool-sp/x")


def test_ceph_fixture_exports_the_cluster(ceph):
    assert ceph["SAFEPOINT_TEST_RADOS_URI"].startswith("rados://safepoint/")
    assert ceph["SAFEPOINT_TEST_S3_URI"].startswith("s3://safepoint-test/")
    assert os.path.exists(os.path.join(ceph["SAFEPOINT_TEST_CEPH_DIR"], "run", "osd.0.pid"))
