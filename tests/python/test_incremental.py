"""Packed steps (issue 12): compression on the way to storage and incremental, content-addressed
chunks shared between steps, through safepoint.save, Checkpointer (its `path`, persisted by the
agent) and storage tiers; chunk garbage collection with retention and by hand; damaged and
missing chunks. s3:// cases run against the real Ceph that `make test` starts, else skip."""

from __future__ import annotations

import os
import sys
import uuid

import pytest
import torch

import safepoint
from safepoint import Checkpointer, Tier
from safepoint.errors import CorruptionError, InvalidArgumentError

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "common"))
from processes import wait_until  # noqa: E402

MODES = ["none", "auto", "zstd", "planes"]


def state(step: int, base_seed: int = 0) -> dict:
    """A frozen base (fixed by base_seed, 8 MB in bf16/fp32) and small parts that change."""
    g = torch.Generator().manual_seed(base_seed)
    base = torch.randn(2_000_000, generator=g)
    h = torch.Generator().manual_seed(1000 + step)
    return {
        "base": {"w32": base, "w16": base[:1_000_000].to(torch.bfloat16),
                 "h16": base[1_000_000:1_500_000].to(torch.float16)},
        "lora": {"a": torch.randn(4096, generator=h), "b": torch.randn(4096, generator=h)},
        "ids": torch.arange(step, step + 1000, dtype=torch.int64),
        "mask": torch.arange(100) % 3 == 0,
        "zeros": torch.zeros(300_000),
        "special": torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40]),
        "step": step,
    }


def same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return (a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.view(torch.uint8) if a.dtype != torch.bool else a,
                                b.view(torch.uint8) if b.dtype != torch.bool else b))
    return a == b


def chunk_files(path) -> set:
    root = path / "chunks"
    if not root.exists():
        return set()
    return {p.name for p in root.glob("??/*") if len(p.name) == 64}


def referenced_chunks(path) -> set:
    """The chunk names every manifest under `path` references (from their chunk tables)."""
    out = set()
    for m in path.glob("step-*/*.pack"):
        data = m.read_bytes()
        count = int.from_bytes(data[32:40], "little")
        table = data[len(data) - 4 - 48 * count:len(data) - 4]
        out |= {table[i * 48:i * 48 + 32].hex() for i in range(count)}
    return out


@pytest.mark.parametrize("incremental", [False, True])
@pytest.mark.parametrize("compression", MODES)
def test_every_mode_round_trips_bit_exact(tmp_path, compression, incremental):
    path = tmp_path / "ckpt"
    for step in (1, 2):
        r = safepoint.save(path, step, state(step), compression=compression,
                           incremental=incremental)
        assert r["committed"]
    for step in (1, 2):
        got_step, got = safepoint.load(path, step)
        assert got_step == step and same(got, state(step))
    step_dir = path / "step-00000000000000000002"
    packed = compression not in ("none", "auto") or incremental
    if packed:
        assert [p.name for p in step_dir.glob("rank-*")] == ["rank-00000.pack"]
        assert referenced_chunks(path) <= chunk_files(path)
    elif compression == "none":
        assert [p.name for p in step_dir.glob("rank-*")] == ["rank-00000.img"]
        assert not (path / "chunks").exists() and r["stored_bytes"] == 0


def test_an_incremental_step_writes_only_what_changed(tmp_path):
    path = tmp_path / "ckpt"
    first = safepoint.save(path, 1, state(1), incremental=True)
    second = safepoint.save(path, 2, state(2), incremental=True)
    assert first["stored_bytes"] >= first["bytes"] * 0.9
    # The frozen base is stored once; step 2 writes the chunks that hold what changed.
    assert second["stored_bytes"] < second["bytes"] * 0.5, second
    assert same(safepoint.load(path, 2)[1], state(2))


def test_bad_layout_options_are_invalid_argument(tmp_path):
    with pytest.raises(InvalidArgumentError, match="compression must be one of"):
        safepoint.save(tmp_path / "c", 1, state(1), compression="gzip")
    with pytest.raises(InvalidArgumentError, match="incremental must be a bool"):
        safepoint.save(tmp_path / "c", 1, state(1), incremental="yes")
    with pytest.raises(InvalidArgumentError, match="compression"):
        Checkpointer(tmp_path / "c", tiers=[Tier(str(tmp_path / "t"), compression="lz4")])


def test_a_chunk_removed_behind_safepoints_back_names_the_step_and_the_chunk(tmp_path):
    path = tmp_path / "ckpt"
    safepoint.save(path, 1, state(1, base_seed=1), incremental=True)
    safepoint.save(path, 2, state(2, base_seed=2), incremental=True)
    only_2 = sorted(referenced_chunks(path) - {c for c in _chunks_of(path, 1)})
    victim = next((path / "chunks").glob(f"??/{only_2[0]}"))
    victim.unlink()
    with pytest.raises(CorruptionError) as e:
        safepoint.load(path, 2)
    msg = str(e.value)
    assert "step 2" in msg and "chunk" in msg and only_2[0] in msg
    assert "behind safepoint's back" in msg
    # Without a step, the newest step that reads back intact is loaded, with a warning.
    with pytest.warns(RuntimeWarning):
        got_step, got = safepoint.load(path)
    assert got_step == 1 and same(got, state(1, base_seed=1))


def _chunks_of(path, step: int) -> set:
    (m,) = (path / f"step-{step:020d}").glob("rank-00000*.pack")  # the agent's: .g<attempt>.pack
    data = m.read_bytes()
    count = int.from_bytes(data[32:40], "little")
    table = data[len(data) - 4 - 48 * count:len(data) - 4]
    return {table[i * 48:i * 48 + 32].hex() for i in range(count)}


def test_two_runs_sharing_a_directory_never_remove_each_others_chunks(tmp_path, cli):
    path = tmp_path / "shared"
    for step in (1, 2, 3):
        safepoint.save(path, step, state(step, base_seed=1), job="run-a", incremental=True)
    for step in (101, 102):
        safepoint.save(path, step, state(step, base_seed=2), job="run-b", incremental=True)
    # Run a prunes its steps; the chunk GC then removes only what nothing references.
    for step in (1, 2):
        cli("rm", path, "--step", step, check=0)
    before = chunk_files(path)
    out = cli("chunk-gc", path, "--json", check=0)
    assert '"deferred": false' in out.stdout, out.stdout
    after = chunk_files(path)
    assert after == referenced_chunks(path) and after < before
    for step, seed in ((3, 1), (101, 2), (102, 2)):
        assert same(safepoint.load(path, step)[1], state(step, base_seed=seed))
    assert cli("verify", path, "--all", check=0).returncode == 0


def test_retention_prunes_only_unreferenced_chunks(dirs):
    tmp, shm = dirs
    path = tmp / "nvme"
    ck = Checkpointer(path, job="pack-keep", shm_dir=shm, keep=2, incremental=True)
    for step in range(1, 6):
        ck.save(step, state(step, base_seed=step // 3))  # the base changes at steps 3 and 6
        ck.wait()
    assert safepoint.steps(path) == [4, 5]
    status = ck.status()["storage_layout"]
    assert status["incremental"] is True and status["compression"] == "none"
    # What the agent's persists used and achieved (raw frames: a ratio just under 1).
    assert status["compression_in_use"] == "none" and 0.99 < status["compression_ratio"] <= 1.0
    ck.close()
    # The agent collected after pruning: only chunks steps 4 and 5 reference are left.
    assert wait_until(lambda: chunk_files(path) == referenced_chunks(path))
    for step in (4, 5):
        assert same(safepoint.load(path, step)[1], state(step, base_seed=step // 3))


def test_a_corrupt_chunk_falls_back_to_another_tier(dirs, cli):
    tmp, shm = dirs
    p0, p1 = tmp / "nvme", tmp / "shared"
    tiers = [Tier(str(p1), keep=3, compression="zstd", incremental=True)]
    ck = Checkpointer(p0, job="pack-tier", shm_dir=shm, incremental=True, tiers=tiers)
    for step in (1, 2):
        ck.save(step, state(step))
    ck.wait()
    assert wait_until(lambda: safepoint.steps(p1) == [1, 2])
    t1 = ck.status()["tiers"][0]
    assert t1["compression"] == "zstd" and t1["incremental"] is True
    assert t1["compression_in_use"] == "zstd" and t1["compression_ratio"] > 0
    text = cli("status", "--shm-dir", shm, check=0).stdout
    assert "compression zstd (in use: zstd, ratio" in text and ", incremental" in text, text
    ck.close()
    # The agent names its images by the run's save attempt (rank-00000.g<attempt>.pack).
    assert len(list((p1 / "step-00000000000000000002").glob("rank-00000*.pack"))) == 1
    # Damage every chunk of step 2 on `path`: restore says so and reads the tier's copy.
    for name in _chunks_of(p0, 2):
        f = next((p0 / "chunks").glob(f"??/{name}"))
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0x10
        f.write_bytes(bytes(data))
    ck = Checkpointer(p0, job="pack-tier", shm_dir=shm, incremental=True, tiers=tiers)
    target = state(0)
    with pytest.warns(RuntimeWarning, match="cannot be read from"):
        assert ck.restore(target) == 2
    assert same(target, state(2)) and ck.last_restore.uri == str(p1)
    ck.close()


@pytest.mark.parametrize("backend", ["s3", "rados"])
@pytest.mark.parametrize("compression,incremental",
                         [("none", True), ("auto", False), ("zstd", True), ("planes", False)])
def test_packed_round_trips_through_ceph(ceph, backend, compression, incremental, cli):
    base = ceph["SAFEPOINT_TEST_S3_URI" if backend == "s3" else "SAFEPOINT_TEST_RADOS_URI"]
    uri = base.rstrip("/") + "/pack-" + uuid.uuid4().hex[:12]
    for step in (1, 2, 3):
        safepoint.save(uri, step, state(step), compression=compression, incremental=incremental)
    for step in (1, 2, 3):
        assert same(safepoint.load(uri, step)[1], state(step))
    cli("rm", uri, "--step", 1, check=0)
    cli("chunk-gc", uri, check=0)
    for step in (2, 3):
        assert same(safepoint.load(uri, step)[1], state(step))
    assert cli("verify", uri, "--all", check=0).returncode == 0
    assert safepoint.steps(uri) == [2, 3]


def test_safepoint_cp_stores_steps_in_the_destinations_layout(tmp_path, cli):
    src, dst = tmp_path / "plain", tmp_path / "packed"
    for step in (1, 2):
        safepoint.save(src, step, state(step))
    cli("cp", src, dst, "--all", "--incremental", "--compression", "zstd", check=0)
    assert (dst / "step-00000000000000000002" / "rank-00000.pack").exists()
    assert referenced_chunks(dst) == chunk_files(dst)
    for step in (1, 2):
        assert same(safepoint.load(dst, step)[1], state(step))
    # Back to the plain layout, and the same step is recognised whatever its layout.
    back = tmp_path / "back"
    cli("cp", dst, back, "--all", check=0)
    assert (back / "step-00000000000000000002" / "rank-00000.img").exists()
    assert "nothing to copy" in cli("cp", dst, back, "--all", check=0).stdout
    assert cli("cp", src, dst, "--step", 2, check=0).returncode == 0
