"""`safepoint cp` and `safepoint rm`: copies between checkpoint directories (file:// URIs here;
mem:// lives in one process, and the rados/s3 tests copy to their own schemes) and safe deletes."""

import json

import torch

import safepoint


def state(step, rank=0):
    g = torch.Generator().manual_seed(step * 100 + rank)
    # Three 4 MiB checksum chunks and a bit: the copy streams more than one chunk per image.
    return {"model": {"w": torch.randn(3 << 20, generator=g), "b": torch.arange(7, dtype=torch.bfloat16)},
            "step": step, "note": f"rank {rank}"}


def make(path, steps, world_size=1):
    for step in steps:
        for rank in range(world_size):
            safepoint.save(path, step, state(step, rank), rank=rank, world_size=world_size)


def step_dir(path, step):
    return path / f"step-{step:020d}"


def files_of(path, step):
    d = step_dir(path, step)
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def steps_of(cli, uri):
    return [s["step"] for s in json.loads(cli("ls", uri, "--json", check=0).stdout)]


def assert_same_state(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            assert_same_state(a[k], b[k])
        elif isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k])
        else:
            assert a[k] == b[k]


def test_cp_between_file_uris_is_bit_exact_and_verifies(tmp_path, cli):
    src, dst = tmp_path / "src", tmp_path / "nvme" / "dst"
    make(src, [3, 8], world_size=2)
    proc = cli("cp", f"file://{src}", f"file://{dst}", check=0)  # the newest step by default
    assert "copied step 8" in proc.stdout and f"file://{dst}" in proc.stdout
    # Not a terminal: no progress bar (no carriage returns or escape codes) on stderr.
    assert "\r" not in proc.stderr and "\033" not in proc.stderr
    assert steps_of(cli, f"file://{dst}") == [8]
    assert files_of(dst, 8) == files_of(src, 8)  # every image and the COMMIT record, byte for byte
    assert cli("verify", f"file://{dst}", "--all", check=0).stdout.count("OK") == 2
    for rank in range(2):
        step, loaded = safepoint.load(dst, rank=rank)
        assert step == 8
        assert_same_state(loaded, state(8, rank))
    inspected = json.loads(cli("inspect", f"file://{dst}", "--rank", "1", "--json", check=0).stdout)
    assert inspected["step"] == 8 and inspected["world_size"] == 2


def test_cp_all_copies_only_what_is_missing_and_json_reports_it(tmp_path, cli):
    src, dst = tmp_path / "src", tmp_path / "dst"
    make(src, [1, 2, 5])
    cli("tag", src, "5", "release", check=0)
    cli("tag", src, "1", "base", check=0)
    # Tags travel with their steps: "release" not yet (step 5 is not copied), "base" not at all.
    cli("cp", src, dst, "--step", "2", check=0)
    assert json.loads(cli("tag", dst, "--json", check=0).stdout) == []
    report = json.loads(cli("cp", src, f"file://{dst}", "--all", "--json", check=0).stdout)
    assert report["ok"] is True and report["tags"] == ["base", "release"]
    assert report["source"] == f"file://{src}" and report["destination"] == f"file://{dst}"
    assert [s["step"] for s in report["steps"]] == [1, 5]
    assert all(s["ok"] and not s["already_there"] and s["bytes"] > 0 for s in report["steps"])
    assert steps_of(cli, dst) == [1, 2, 5]
    for step in (1, 2, 5):
        assert files_of(dst, step) == files_of(src, step)
    # Nothing left to copy; copying a step that is there writes nothing.
    assert "nothing to copy" in cli("cp", src, dst, "--all", check=0).stdout
    again = json.loads(cli("cp", src, dst, "--step", "5", "--json", check=0).stdout)
    assert again["tags"] == []
    assert again["steps"] == [{"step": 5, "ok": True, "bytes": 0, "seconds": again["steps"][0]["seconds"],
                               "already_there": True}]
    assert "already in" in cli("cp", src, dst, "--step", "5", check=0).stdout


def test_cp_of_a_missing_step_fails_naming_it(tmp_path, cli):
    src, dst = tmp_path / "src", tmp_path / "dst"
    make(src, [3])
    proc = cli("cp", src, dst, "--step", "4", check=1)
    assert "step 4 is not committed" in proc.stderr and str(src) in proc.stderr
    assert steps_of(cli, dst) == []
    proc = cli("cp", tmp_path / "nowhere", dst, check=1)
    assert "no such checkpoint directory" in proc.stderr
    assert "excludes" in cli("cp", src, dst, "--all", "--step", "3", check=2).stderr
    assert "DST is required" in cli("cp", src, check=2).stderr


def test_cp_whose_tags_cannot_be_written_fails_naming_them_and_keeps_the_steps(tmp_path, cli):
    src, dst = tmp_path / "src", tmp_path / "dst"
    make(src, [1, 2])
    cli("tag", src, "2", "best", check=0)
    dst.mkdir()
    (dst / "tags").write_text("")  # tags/ cannot be a directory there
    proc = cli("cp", src, dst, "--all", check=1)
    assert "copying the tags" in proc.stderr and str(dst / "tags") in proc.stderr
    assert steps_of(cli, dst) == [1, 2]  # the copied steps stay committed
    for step in (1, 2):
        assert files_of(dst, step) == files_of(src, step)


def test_cp_of_a_damaged_step_commits_nothing(tmp_path, cli):
    src, dst = tmp_path / "src", tmp_path / "dst"
    make(src, [3])
    img = step_dir(src, 3) / "rank-00000.img"
    data = bytearray(img.read_bytes())
    data[(4 << 20) + 100] ^= 0x40  # in the second checksum chunk
    img.write_bytes(data)
    proc = cli("cp", src, dst, "--json", check=1)
    report = json.loads(proc.stdout)
    assert report["ok"] is False and report["steps"][0]["ok"] is False
    assert "Corruption" in report["steps"][0]["error"] and str(img) in report["steps"][0]["error"]
    assert steps_of(cli, dst) == []
    assert not (step_dir(dst, 3) / "COMMIT").exists()


def test_cp_refuses_a_different_step_of_the_same_number(tmp_path, cli):
    src, dst = tmp_path / "src", tmp_path / "dst"
    make(src, [3])
    safepoint.save(dst, 3, state(4))
    before = files_of(dst, 3)
    proc = cli("cp", src, dst, "--step", "3", check=1)
    assert "AlreadyExists" in proc.stderr and f"file://{src}" in proc.stderr
    assert f"file://{dst}" in proc.stderr
    assert files_of(dst, 3) == before


def test_rm_deletes_steps_safely(tmp_path, cli):
    ckpt = tmp_path / "ckpt"
    make(ckpt, [3, 8, 12])
    # The newest step is what a restart loads: only with --force.
    proc = cli("rm", f"file://{ckpt}", "--step", "12", check=1)
    assert "newest committed step" in proc.stderr and "--force" in proc.stderr
    assert steps_of(cli, ckpt) == [3, 8, 12]
    assert "deleted step 8" in cli("rm", ckpt, "--step", "8", check=0).stdout
    assert steps_of(cli, ckpt) == [3, 12]
    assert not step_dir(ckpt, 8).exists()
    report = json.loads(cli("rm", ckpt, "--step", "12", "--force", "--json", check=0).stdout)
    assert report == {"uri": f"file://{ckpt}", "step": 12, "deleted": True, "damaged": False}
    assert steps_of(cli, ckpt) == [3]
    assert safepoint.load(ckpt)[0] == 3
    # A missing step: an error that names it and says what is there.
    proc = cli("rm", ckpt, "--step", "8", check=1)
    assert "step 8 is not committed" in proc.stderr and "committed steps: 3" in proc.stderr
    assert "--step is required" in cli("rm", ckpt, check=2).stderr
    assert "no such checkpoint directory" in cli("rm", tmp_path / "nowhere", "--step", "1",
                                                 check=1).stderr


def test_rm_removes_a_step_whose_commit_record_is_damaged(tmp_path, cli):
    ckpt = tmp_path / "ckpt"
    make(ckpt, [3, 8])
    commit = step_dir(ckpt, 8) / "COMMIT"
    data = bytearray(commit.read_bytes())
    data[20] ^= 1
    commit.write_bytes(data)
    assert steps_of(cli, ckpt) == [3]  # not a step for readers
    report = json.loads(cli("rm", ckpt, "--step", "8", "--json", check=0).stdout)
    assert report["deleted"] is True and report["damaged"] is True
    assert not step_dir(ckpt, 8).exists()
    assert steps_of(cli, ckpt) == [3]


def test_help_lists_cp_and_rm(cli):
    out = cli("--help", check=0).stdout
    assert "cp" in out and "rm" in out
    out = cli("cp", "--help", check=0).stdout
    assert "SRC" in out and "DST" in out and "--step N" in out and "--all" in out
    out = cli("rm", "--help", check=0).stdout
    assert "--step N" in out and "--force" in out
