"""The safepoint CLI: outputs, --json, and exit codes."""

import json
import os

import pytest
import torch

import safepoint


def make(ckpt):
    safepoint.save(ckpt, 3, {"model": {"w": torch.zeros(4, 5), "b": torch.ones(5, dtype=torch.bfloat16)}, "lr": 0.5})
    safepoint.save(ckpt, 8, {"model": {"w": torch.zeros(4, 5), "b": torch.ones(5, dtype=torch.bfloat16)}, "lr": 0.25})


def test_version(cli):
    out = cli("--version", check=0).stdout
    assert "safepoint" in out and "image format: 1" in out and "zstd:" in out and "io_uring:" in out
    # Kill points exist only in the crash campaign's build (build/crash), never in this one.
    assert "kill points" not in out
    assert not safepoint._core.KILL_POINTS


def test_ls(ckpt, cli):
    make(ckpt)
    out = cli("ls", ckpt, check=0).stdout
    lines = out.strip().splitlines()
    assert lines[0].split()[:3] == ["STEP", "WORLD", "BYTES"]
    assert [l.split()[0] for l in lines[1:]] == ["3", "8"]
    data = json.loads(cli("ls", ckpt, "--json", check=0).stdout)
    assert [d["step"] for d in data] == [3, 8]
    assert all(d["world_size"] == 1 and d["bytes"] % 4096 == 0 for d in data)


def test_inspect(ckpt, cli):
    make(ckpt)
    out = cli("inspect", ckpt, check=0).stdout
    assert "step 8" in out and "model.w" in out and "bfloat16" in out and "[4, 5]" in out
    assert "'lr': 0.25" in out
    data = json.loads(cli("inspect", ckpt, "--step", "3", "--json", check=0).stdout)
    assert data["step"] == 3
    assert {t["name"]: (t["dtype"], t["shape"], t["bytes"]) for t in data["tensors"]} == {
        "model.w": ("float32", [4, 5], 80), "model.b": ("bfloat16", [5], 10)}
    assert "'lr': 0.5" in data["state"]


def test_verify_ok_and_damaged(ckpt, cli):
    make(ckpt)
    out = cli("verify", ckpt, "--all", check=0).stdout
    assert out.count("OK") == 2
    img = ckpt / "step-00000000000000000008" / "rank-00000.img"
    data = bytearray(img.read_bytes())
    data[4096 + 10] ^= 1
    img.write_bytes(data)
    proc = cli("verify", ckpt, check=1)
    assert "DAMAGED" in proc.stdout and str(img) in proc.stdout
    proc = cli("verify", ckpt, "--all", "--json", check=1)
    res = json.loads(proc.stdout)
    assert res["ok"] is False
    bad = [r for r in res["results"] if not r["ok"]]
    assert len(bad) == 1 and bad[0]["step"] == 8 and bad[0]["file"] == str(img)
    assert "checksum mismatch in chunk 0" in bad[0]["error"] or "index" in bad[0]["error"]
    cli("verify", ckpt, "--step", "3", check=0)


def test_errors_and_usage(ckpt, tmp_path, cli):
    assert cli(check=2).stderr.startswith("usage")
    assert "unknown command" in cli("frobnicate", check=2).stderr
    assert "needs a checkpoint PATH" in cli("ls", check=2).stderr
    assert "--step needs" in cli("inspect", ckpt, "--step", "x", check=2).stderr
    assert "unknown option" in cli("ls", ckpt, "--bogus", check=2).stderr
    make(ckpt)
    proc = cli("inspect", ckpt, "--step", "4", check=1)
    assert "not committed" in proc.stderr and proc.stdout == ""
    proc = cli("inspect", tmp_path / "missing", check=1)
    assert "error" in proc.stderr


COMMANDS = [["ls"], ["ls", "--json"], ["inspect"], ["inspect", "--json"], ["verify"],
            ["verify", "--all", "--json"]]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_a_missing_path_is_an_error(tmp_path, cli, command):
    # It used to read as an empty checkpoint (and was created): `ls` printed "no committed steps"
    # and exited 0.
    missing = tmp_path / "no" / "such" / "dir"
    for path in (missing, f"file://{missing}", f"file://localhost{missing}"):
        proc = cli(command[0], path, *command[1:], check=1)
        assert f"{missing}: no such checkpoint directory" in proc.stderr and proc.stdout == ""
        assert not (tmp_path / "no").exists()


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_a_path_that_is_not_a_directory_is_an_error(tmp_path, cli, command):
    file = tmp_path / "a-file"
    file.write_text("not a checkpoint")
    proc = cli(command[0], file, *command[1:], check=1)
    assert str(file) in proc.stderr and "not a directory" in proc.stderr and proc.stdout == ""


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads every directory")
@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_an_unreadable_path_is_an_error(tmp_path, cli, command):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o000)
    try:
        proc = cli(command[0], locked, *command[1:], check=1)
        assert str(locked) in proc.stderr and "Permission denied" in proc.stderr
    finally:
        locked.chmod(0o700)


def test_an_empty_directory_has_no_steps(tmp_path, cli):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no committed steps" in cli("ls", empty, check=0).stdout
    assert json.loads(cli("ls", empty, "--json", check=0).stdout) == []
    for command in (["inspect"], ["verify"]):
        assert "no committed checkpoint" in cli(command[0], empty, check=1).stderr
