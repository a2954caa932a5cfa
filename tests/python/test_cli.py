"""The safepoint CLI: outputs, --json, and exit codes."""

import json
import os
import subprocess

import pytest
import torch

import safepoint


def make(ckpt):
    safepoint.save(ckpt, 3, {"model": {"w": torch.zeros(4, 5), "b": torch.ones(5, dtype=torch.bfloat16)}, "lr": 0.5})
    safepoint.save(ckpt, 8, {"model": {"w": torch.zeros(4, 5), "b": torch.ones(5, dtype=torch.bfloat16)}, "lr": 0.25})


def test_version(cli):
    out = cli("--version", check=0).stdout
    assert "safepoint" in out and "image format: 1" in out and "zstd:" in out and "io_uring:" in out


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
    assert "\n  lr: 0.25\n" in out
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
    proc = cli(check=2)  # no command: the help, on stderr
    assert proc.stderr.startswith("safepoint:") and "usage: safepoint" in proc.stderr
    assert all(c in proc.stderr for c in ("ls", "inspect", "verify", "agent", "status", "gc"))
    assert "unknown command 'frobnicate'" in cli("frobnicate", check=2).stderr
    assert "PATH is required" in cli("ls", check=2).stderr
    for bad in ("x", "-1", "1.5", "", "18446744073709551616"):
        stderr = cli("inspect", ckpt, "--step", bad, check=2).stderr
        assert "--step" in stderr and "safepoint inspect --help" in stderr, (bad, stderr)
    assert "--step" in cli("verify", ckpt, "--step", check=2).stderr
    assert "16777215" in cli("inspect", ckpt, "--rank", "16777216", check=2).stderr
    assert "--bogus" in cli("ls", ckpt, "--bogus", check=2).stderr
    assert "--step" in cli("ls", ckpt, "--step", "3", check=2).stderr  # ls has no --step
    assert "excludes" in cli("verify", ckpt, "--all", "--step", "3", check=2).stderr
    assert "--job is required" in cli("agent", check=2).stderr
    assert "--json" in cli("agent", "--job", "j", "--json", check=2).stderr
    assert "--shm-dir" in cli("status", "--shm-dir", "", check=2).stderr
    make(ckpt)
    proc = cli("inspect", ckpt, "--step", "4", check=1)
    assert "not committed" in proc.stderr and proc.stdout == ""
    proc = cli("inspect", tmp_path / "missing", check=1)
    assert "error" in proc.stderr
    # The old spellings still work: --flag=value, a path after the options, `version`, `help`.
    assert json.loads(cli("inspect", "--step=3", "--json", ckpt, check=0).stdout)["step"] == 3
    assert cli("version", check=0).stdout.startswith("safepoint ")
    assert "usage: safepoint" in cli("help", check=0).stdout


def test_help(cli):
    out = cli("--help", check=0).stdout
    assert "usage: safepoint" in out and "Exit status" in out
    for command in ("ls", "inspect", "verify", "agent", "status", "gc"):
        out = cli(command, "--help", check=0).stdout
        assert f"usage: safepoint {command}" in out and "--help" in out
    out = cli("inspect", "--help", check=0).stdout
    assert "PATH" in out and "--step N" in out and "--rank R" in out and "--json" in out
    assert "--shm-dir DIR=/dev/shm" in cli("gc", "--help", check=0).stdout


EVERY_COMMAND = ("ls", "inspect", "verify", "cp", "rm", "agent", "status", "gc", "chunk-gc", "log",
            "tag", "diff", "export", "import", "advise", "simulate")


def test_help_lists_every_command_in_one_line_and_each_has_an_example(cli):
    out = cli("--help", check=0).stdout
    commands = out[out.index("Commands:"):].splitlines()[1:]
    listed = {}
    for line in commands:
        words = line.split()
        if not line.startswith("  ") or not words:
            break
        listed[words[0]] = " ".join(words[1:])
    assert set(listed) == set(EVERY_COMMAND), listed
    assert all(listed.values()), listed  # a line that says what the command does
    for command in EVERY_COMMAND:
        out = cli(command, "--help", check=0).stdout
        assert "Example" in out, (command, out)
        example = out[out.index("Example"):].splitlines()[1].split()
        assert example[:2] == ["safepoint", command], (command, out)
        assert "Exit status" in out, (command, out)


def safepointd(*args):
    binary = os.path.join(os.path.dirname(safepoint.__file__), "safepointd")
    return subprocess.run([binary, *map(str, args)], capture_output=True, text=True, timeout=120)


def test_safepointd_rejects_a_malformed_number(tmp_path):
    # --idle-exit went through an unchecked atof: "abc" meant 0 (never exit when idle). The shm
    # directory does not exist, so an agent that got past the arguments would fail with 1.
    shm = tmp_path / "no-shm"
    for bad in ("abc", "10s", "nan", "inf", "-1", "", "1e999"):
        proc = safepointd("--job", "j", "--shm-dir", shm, "--idle-exit", bad)
        assert proc.returncode == 2, (bad, proc.returncode, proc.stderr)
        assert "--idle-exit" in proc.stderr and "safepointd --help" in proc.stderr, proc.stderr
    proc = safepointd("--job", "j", "--shm-dir", shm, "--idle-exit", "0.5")
    assert proc.returncode == 1 and str(shm) in proc.stderr  # parsed; the directory is missing
    proc = safepointd("--shm-dir", shm)
    assert proc.returncode == 2 and "--job is required" in proc.stderr
    proc = safepointd("--job", "j", "--bogus")
    assert proc.returncode == 2 and "--bogus" in proc.stderr
    proc = safepointd("--help")
    assert proc.returncode == 0 and "--idle-exit SECONDS" in proc.stdout


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


def test_log_level_and_the_log_format(tmp_path, cli):
    # Errors are log lines in the agent's format ("<time> error safepoint[<pid>]: <message>").
    missing = tmp_path / "missing"
    proc = cli("ls", missing, check=1)
    line = proc.stderr.strip().splitlines()[-1]
    assert " error safepoint[" in line and f"{missing}: no such checkpoint directory" in line
    # --log-level off silences them; the exit status still says what happened.
    proc = cli("--log-level", "off", "ls", missing, check=1)
    assert proc.stderr == ""
    proc = cli("--log-level", "loud", "ls", missing, check=2)
    assert "--log-level" in proc.stderr
    proc = safepointd("--job", "j", "--shm-dir", tmp_path / "no-shm", "--log-level", "loud")
    assert proc.returncode == 2 and "--log-level" in proc.stderr


def test_inspect_lists_the_committed_steps_and_prints_the_state_readably(ckpt, cli):
    """Issue 36: `inspect` of a missing step named none of the committed ones, and printed the
    non-tensor state as one line cut off at 4096 characters."""
    state = {"model": {"w": torch.zeros(4, 5)}, "lr": 0.25, "note": "x" * 5000,
             "sched": {"milestones": list(range(200)), "gamma": 0.1},
             "groups": [{"lr": 0.1, "betas": (0.9, 0.999)}, {"lr": 0.01}], "empty": {}}
    safepoint.save(ckpt, 3, state)
    safepoint.save(ckpt, 8, state)
    r = cli("inspect", ckpt, "--step", "5", check=1)
    assert "step 5 is not committed (committed steps: 3 8)" in r.stderr, r.stderr
    out = cli("inspect", ckpt, check=0).stdout
    text = out[out.index("\nstate ("):]
    assert "\n  lr: 0.25\n" in text
    assert "\n  note: '" + "x" * 5000 + "'\n" in text  # whole
    assert "\n  model:\n    w: <tensor #0: float32 [4, 5]>\n" in text
    assert "\n  sched:\n    milestones: [0, 1, 2," in text and " 199]\n    gamma: 0.1\n" in text
    assert "\n  groups:\n    - lr: 0.1\n      betas: (0.9, 0.999)\n    - lr: 0.01\n" in text
    assert "\n  empty: {}\n" in text
    assert all(len(line) <= 100 for line in text.splitlines() if "xxxx" not in line), text
    assert "..." not in text


def test_messages_name_the_flags_and_the_attempt_has_one_form(tmp_path, ckpt, cli, shm):
    """Issue 36: `tag` did not name --replace; `import` said overwrite=True where the flag is
    --overwrite; `log` printed the attempt in hex and --json in decimal."""
    make(ckpt)
    cli("tag", ckpt, "3", "best", check=0)
    r = cli("tag", ckpt, "8", "best", check=1)
    assert "already names step 3" in r.stderr and "pass --replace" in r.stderr, r.stderr
    cli("tag", ckpt, "8", "best", "--replace", check=0)
    save_file = pytest.importorskip("safetensors.torch").save_file
    st = tmp_path / "m.safetensors"
    save_file({"w": torch.ones(3)}, st)
    r = cli("import", st, ckpt, "--step", "8", check=1)
    assert "already committed" in r.stderr and "pass --overwrite" in r.stderr, r.stderr
    assert "overwrite=True" not in r.stderr
    run = tmp_path / "run"
    with safepoint.Checkpointer(run, shm_dir=shm, job="attempt") as c:
        c.save(1, {"w": torch.ones(2)})
        c.wait()
    attempt = json.loads(cli("log", run, "--json", check=0).stdout)[0]["attempt"]
    assert attempt != 0
    text = cli("log", run, check=0).stdout
    assert str(attempt) in text and f"{attempt:016x}" not in text, text
