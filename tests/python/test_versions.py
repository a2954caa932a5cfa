"""Versioning and interchange (issue 12, parts 3 and 4): lineage (parents across kills, resumes
and branches, the run's attempt, user metadata), `safepoint log / tag / diff`, tags and retention,
`Checkpointer.restore(from_=URI@tag)`, and export/import through the real `safetensors` package
and `torch.load`. Real agents, real processes; the s3:// and rados:// cases run against the
Ceph that `make test` starts (the `ceph` fixture), else they skip."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import uuid

import pytest
import torch

import safepoint
from safepoint import Checkpointer, Tier, _core
from safepoint._versions import lineage
from safepoint.errors import InvalidArgumentError, NotFoundError

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "common"))
from processes import wait_until  # noqa: E402

RESHARD_WORKER = os.path.join(os.path.dirname(__file__), "workloads", "reshard_worker.py")


def state(step: int, n: int = 1000) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(n, generator=g), "h": torch.randn(7, 3, generator=g)
                      .to(torch.bfloat16)}, "step": step}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, for bit-exact comparisons (NaN payloads included)."""
    return t.contiguous().view(torch.uint8)


@pytest.fixture
def location(request, tmp_path):
    """A checkpoint location on file://, or on s3:// or rados:// (the test Ceph)."""
    if request.param == "file":
        return f"file://{tmp_path}/ckpt"
    ceph = request.getfixturevalue("ceph")
    base = ceph["SAFEPOINT_TEST_S3_URI" if request.param == "s3" else "SAFEPOINT_TEST_RADOS_URI"]
    return f"{base}/versions-{uuid.uuid4().hex}"


def run_python(code: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
                          capture_output=True, text=True, timeout=300)


# --- lineage -------------------------------------------------------------------------------------

def test_a_fresh_run_records_no_parent_and_its_metadata(tmp_path, shm):
    ck = Checkpointer(tmp_path / "ckpt", job="ver-fresh", shm_dir=shm,
                      metadata={"git": "0123abc", "config_hash": "9f9f", "lr": 0.5})
    for step in (1, 2):
        ck.save(step, state(step))
    ck.wait()
    ck.close()
    path = str(tmp_path / "ckpt")
    for step in (1, 2):
        got = lineage(path, step)
        assert got["parent"] is None
        assert got["metadata"] == {"git": "0123abc", "config_hash": "9f9f", "lr": 0.5}
        assert got["attempt"] == ck.attempt != 0
    # The synchronous API records metadata and a parent too.
    safepoint.save(path, 3, state(3), metadata={"note": "by hand"}, parent="step-2")
    assert lineage(path, 3) == {"attempt": 0, "parent": {"step": 2, "location": path},
                                "metadata": {"note": "by hand"}}
    # Another spelling of the same checkpoint is "this checkpoint" (recorded empty).
    safepoint.save(path, 4, state(4), parent=f"file://{path}@3")
    assert _core.step_lineage(path, 4)[1:3] == (3, "")


WORKER = """
    import os, signal, sys
    import torch
    import safepoint
    path, shm, mode = sys.argv[1:4]
    ck = safepoint.Checkpointer(path, job="ver-kill", shm_dir=shm, metadata={"run": mode})
    s = {"w": torch.zeros(1000), "step": 0}
    start = ck.restore(s) or 0
    print("restored", start, ck.last_load_source, flush=True)
    for step in range(start + 1, start + 4):
        s["w"] += 1
        s["step"] = step
        ck.save(step, s)
    ck.wait()
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    ck.close()
"""


def test_a_resumed_run_records_the_step_it_was_restored_from_across_a_kill(tmp_path, shm):
    path = str(tmp_path / "ckpt")
    first = run_python(WORKER, path, shm, "kill")
    assert first.returncode == -signal.SIGKILL, first.stderr
    assert safepoint.steps(path) == [1, 2, 3]
    second = run_python(WORKER, path, shm, "resume")
    assert second.returncode == 0, second.stderr
    assert "restored 3 memory" in second.stdout  # hot reload from the killed run's snapshot
    assert safepoint.steps(path) == [4, 5, 6]
    killed = lineage(path, 4)
    assert killed["parent"] == {"step": 3, "location": path}
    assert killed["metadata"] == {"run": "resume"}
    for step in (5, 6):
        assert lineage(path, step)["parent"] == {"step": 3, "location": path}
        assert lineage(path, step)["attempt"] == killed["attempt"]


def test_branch_from_another_runs_tag_reshards_and_records_the_parent(tmp_path, shm, cli):
    from conftest import free_port, run_ranks

    base = tmp_path / "base"
    port = free_port()
    outs = run_ranks([[RESHARD_WORKER, base, "save", "2", port, r] for r in range(2)])
    assert all(o["ok"] for o in outs)
    cli("tag", base, "7", "pretrained", check=0)

    def full(i, shape, dtype=torch.float32):
        n = 1
        for s in shape:
            n *= s
        return (torch.arange(n, dtype=torch.float64) * (i + 1) + i).reshape(shape).to(dtype)

    shapes = [(7, 5), (5, 9), (6, 4), (3, 11)]
    dtypes = [torch.float32] * 3 + [torch.bfloat16]
    ft = tmp_path / "finetune"
    ck = Checkpointer(ft, job="ver-branch", shm_dir=shm, metadata={"task": "ft"})
    for ref in ("pretrained", "step-7", "7"):
        # One rank loads the step two ranks saved (resharding), from the tag's location.
        target = {f"w{i}": torch.zeros(s, dtype=d) for i, (s, d) in
                  enumerate(zip(shapes, dtypes))}
        target["plain"], target["meta"] = torch.zeros(4, 3), {"lr": 0.0, "name": ""}
        assert ck.restore(target, from_=f"file://{base}@{ref}") == 7
        for i, (s, d) in enumerate(zip(shapes, dtypes)):
            assert torch.equal(bits(target[f"w{i}"]), bits(full(i, s, d)))
        assert target["meta"] == {"lr": 0.5, "name": "run"}
    assert ck.last_restore.uri == f"file://{base}"
    ck.save(8, target)
    ck.wait()
    ck.close()
    assert lineage(str(ft), 8) == {"attempt": ck.attempt,
                                   "parent": {"step": 7, "location": f"file://{base}"},
                                   "metadata": {"task": "ft"}}
    # log follows the parent into the base run.
    log = json.loads(cli("log", ft, "--json", check=0).stdout)
    assert [(e["step"], e["location"].endswith(p)) for e, p in
            zip(log, ("finetune", "base"))] == [(8, True), (7, True)]
    assert log[0]["parent"] == {"step": 7, "location": f"file://{base}"}
    assert log[1]["tags"] == ["pretrained"] and log[1]["parent"] is None
    text = cli("log", ft, check=0).stdout
    assert f"7 in file://{base}" in text and "pretrained" in text

    # Bad references say what exists.
    ck = Checkpointer(ft, job="ver-branch", shm_dir=shm)
    with pytest.raises(NotFoundError, match=r"no tag 'nope' \(tags: pretrained\)"):
        ck.restore(target, from_=f"{base}@nope")
    with pytest.raises(NotFoundError, match="step 6 is not committed"):
        ck.restore(target, from_=f"{base}@6")
    with pytest.raises(InvalidArgumentError, match="neither a step"):
        ck.restore(target, from_=f"{base}@bad/name")
    with pytest.raises(InvalidArgumentError, match="not both"):
        ck.restore(target, 3, from_=f"{base}@7")
    ck.close()


def test_metadata_must_be_small_and_json(tmp_path, shm):
    p = tmp_path / "ckpt"
    for bad, what in (({"k": "x" * 3000}, "more than 2048"), ([1], "must be a dict"),
                      ({"k": {"nested": 1}}, "must be str, int"), ({1: "x"}, "keys must be str"),
                      ({"k": float("nan")}, "not JSON")):
        with pytest.raises(InvalidArgumentError, match=what):
            Checkpointer(p, job="ver-meta", shm_dir=shm, metadata=bad)
        with pytest.raises(InvalidArgumentError, match=what):
            safepoint.save(p, 1, state(1), metadata=bad)
    assert safepoint.steps(p) == []


# --- log, tag, diff on file:// and s3:// ---------------------------------------------------------

@pytest.mark.parametrize("location", ["file", "s3", "rados"], indirect=True)
def test_log_tag_and_diff(location, cli):
    s1, s2 = state(1), state(1)
    s2["model"]["w"][10] += 0.25
    s2["model"]["w"][999] -= 4.0
    s2["model"]["extra"] = torch.ones(3)
    del s2["model"]["h"]
    safepoint.save(location, 1, s1, metadata={"git": "a1"})
    safepoint.save(location, 2, s2, metadata={"git": "b2"}, parent="1")
    safepoint.save(location, 3, s2, parent="1")

    assert cli("tag", location, "1", "baseline", check=0).stdout.startswith("tagged step 1")
    cli("tag", location, "step-2", "tuned", check=0)
    tags = json.loads(cli("tag", location, "--json", check=0).stdout)
    assert [(t["name"], t["step"]) for t in tags] == [("baseline", 1), ("tuned", 2)]
    assert _core.tags(location) == [("baseline", 1), ("tuned", 2)]

    log = json.loads(cli("log", location, "--json", check=0).stdout)
    assert [e["step"] for e in log] == [3, 2, 1]
    assert log[1]["tags"] == ["tuned"] and log[1]["metadata"] == {"git": "b2"}
    assert log[1]["parent"]["step"] == 1 and log[2]["parent"] is None
    assert len(json.loads(cli("log", location, "--limit", "2", "--json", check=0).stdout)) == 2
    text = cli("log", location, check=0).stdout
    assert "baseline" in text and '{"git":"a1"}' in text

    diff = json.loads(cli("diff", location, "baseline", "tuned", "--json", check=0).stdout)
    changes = {t["name"]: t for t in diff["tensors"]}
    assert changes["model.w"]["change"] == "changed" and changes["model.w"]["changed"] == 2
    assert changes["model.w"]["max_abs"] == pytest.approx(4.0, rel=1e-6)
    assert changes["model.w"]["elements"] == 1000
    assert changes["model.h"]["change"] == "removed"
    assert changes["model.extra"]["change"] == "added"
    assert diff["summary"]["changed"] == 1 and "model.h" in changes
    same = json.loads(cli("diff", location, "2", "3", "--json", check=0).stdout)
    assert same["tensors"] == [] and same["summary"]["same"] == 2
    text = cli("diff", location, "1", "2", check=0).stdout
    assert "1 changed, 1 added, 1 removed" in text and "2/1000" in text

    # Bad input: clear errors, exit status 1.
    for args, message in ((("tag", location, "9", "x"), "step 9 is not committed"),
                          (("tag", location, "1", "bad/name"), "tag name 'bad/name' is invalid"),
                          (("tag", location, "1", "123"), "is a step, not a tag"),
                          (("tag", location, "2", "baseline"), "already names step 1"),
                          (("diff", location, "1", "nope"), "no tag 'nope'"),
                          (("tag", location, "nope", "--delete"), "no tag 'nope'")):
        r = cli(*args, check=1)
        assert message in r.stderr, (args, r.stderr)
    cli("tag", location, "2", "baseline", "--replace", check=0)
    cli("tag", location, "baseline", "--delete", check=0)
    assert _core.tags(location) == [("tuned", 2)]

    # rm: a tagged step only with --force, which removes its tags too.
    r = cli("rm", location, "--step", "2", check=1)
    assert "tagged 'tuned'" in r.stderr
    cli("rm", location, "--step", "2", "--force", check=0)
    assert safepoint.steps(location) == [1, 3] and _core.tags(location) == []


# --- retention -----------------------------------------------------------------------------------

def test_tagged_steps_survive_the_checkpointers_and_the_tiers_keep(tmp_path, shm):
    p0, p1 = tmp_path / "nvme", tmp_path / "shared"
    ck = Checkpointer(p0, job="ver-keep", shm_dir=shm, keep=1, tiers=[Tier(str(p1), keep=1)])
    ck.save(1, state(1))
    ck.wait()
    assert wait_until(lambda: safepoint.steps(p1) == [1])
    _core.set_tag(str(p0), 1, "golden")  # on the job's path: kept there and on every tier
    for step in (2, 3, 4):
        ck.save(step, state(step))
        ck.wait()
    assert wait_until(lambda: safepoint.steps(p1) == [1, 4]), safepoint.steps(p1)
    # The tag travelled with the copies: the tier keeps step 1 also without the path's tags.
    assert _core.tags(str(p1)) == [("golden", 1)]
    # Retention ran on path (a step the tier copied at that moment may still be pinned there).
    on_path = safepoint.steps(p0)
    assert on_path[0] == 1 and on_path[-1] == 4 and len(on_path) < 4, on_path
    ck.close()
    got_step, got = safepoint.load(p1, 1)
    assert torch.equal(got["model"]["w"], state(1)["model"]["w"])


def test_tags_from_python_and_loading_by_tag(tmp_path):
    p = str(tmp_path / "ckpt")
    for step in (1, 2, 3):
        safepoint.save(p, step, state(step))
    safepoint.tag(p, 2, "best")
    safepoint.tag(p, "step-1", "first")
    assert safepoint.tags(p) == {"best": 2, "first": 1}
    got_step, got = safepoint.load(p, "best")
    assert got_step == 2 and torch.equal(bits(got["model"]["h"]), bits(state(2)["model"]["h"]))
    target = state(0)
    assert safepoint.restore(p, target, step="first") == 1
    assert torch.equal(target["model"]["w"], state(1)["model"]["w"])
    assert safepoint.load(p, "step-3")[0] == 3
    with pytest.raises(NotFoundError, match=r"no tag 'nope'"):
        safepoint.load(p, "nope")
    with pytest.raises(safepoint.AlreadyExistsError, match="already names step 2"):
        safepoint.tag(p, 3, "best")
    safepoint.tag(p, 3, "best", replace=True)
    assert safepoint.load(p, "best")[0] == 3
    safepoint.untag(p, "first")
    assert safepoint.tags(p) == {"best": 3}
    with pytest.raises(InvalidArgumentError, match="step must be"):
        safepoint.load(p, -1)
    with pytest.raises(InvalidArgumentError, match="tag needs a step"):
        safepoint.tag(p, None, "x")  # type: ignore[arg-type]
    with pytest.raises(NotFoundError, match="step 9"):
        safepoint.tag(p, 9, "later")  # only committed steps
    with pytest.raises(NotFoundError, match="no tag 'gone'"):
        safepoint.untag(p, "gone")


# --- export and import ---------------------------------------------------------------------------

def test_export_round_trips_through_safetensors_and_torch(tmp_path, cli):
    from safetensors.torch import load_file

    ckpt = tmp_path / "ckpt"
    s = state(5)
    s["model"]["w"][3] = float("nan")
    s["optim"] = {"m": torch.arange(4.0)}
    safepoint.save(ckpt, 5, s)
    cli("tag", ckpt, "5", "release", check=0)
    st = tmp_path / "out.safetensors"
    r = cli("export", ckpt, "--tag", "release", "--format", "safetensors", "--select", "model",
            st, check=0)
    assert "exported step 5" in r.stdout
    got = load_file(st)
    assert sorted(got) == ["h", "w"]
    for k in ("w", "h"):
        assert got[k].dtype == s["model"][k].dtype and torch.equal(bits(got[k]),
                                                                    bits(s["model"][k]))
    pt = tmp_path / "out.pt"
    report = json.loads(cli("export", ckpt, "--step", "5", "--format", "torch", pt, "--json",
                            check=0).stdout)
    assert report["tensors"] == 3
    got = torch.load(pt, weights_only=True)
    assert sorted(got) == ["model.h", "model.w", "optim.m"]
    assert torch.equal(bits(got["model.w"]), bits(s["model"]["w"]))
    assert torch.equal(got["optim.m"], torch.arange(4.0))
    # Errors: unknown tag, empty selection.
    assert "no tag 'x'" in cli("export", ckpt, "--tag", "x", "--format", "torch", pt,
                               check=1).stderr
    assert "has no tensors under 'nothing'" in cli(
        "export", ckpt, "--format", "torch", "--select", "nothing", pt, check=1).stderr


def test_a_sharded_step_exports_as_full_tensors(tmp_path, cli):
    from conftest import free_port, run_ranks
    from safetensors.torch import load_file

    base = tmp_path / "base"
    port = free_port()
    outs = run_ranks([[RESHARD_WORKER, base, "save", "2", port, r] for r in range(2)])
    assert all(o["ok"] for o in outs)
    out = tmp_path / "full.safetensors"
    cli("export", base, "--format", "safetensors", out, check=0)
    got = load_file(out)
    shapes = [(7, 5), (5, 9), (6, 4), (3, 11)]
    for i, shape in enumerate(shapes):
        n = shape[0] * shape[1]
        dtype = torch.bfloat16 if i == 3 else torch.float32
        want = (torch.arange(n, dtype=torch.float64) * (i + 1) + i).reshape(shape).to(dtype)
        assert got[f"w{i}"].dtype == dtype and torch.equal(bits(got[f"w{i}"]), bits(want))
    pt = tmp_path / "full.pt"
    cli("export", base, "--format", "torch", pt, check=0)
    assert torch.equal(torch.load(pt, weights_only=True)["w0"], got["w0"])


def test_sharded_export_is_a_hugging_face_model_directory(tmp_path, cli):
    """--max-shard-size: files of at most that many tensor bytes (a larger tensor alone) and
    the index; transformers loads the directory, and safepoint import reads it back bit-exact,
    but refuses shards without their index when some are missing."""
    transformers = pytest.importorskip("transformers")
    GPT2Config, GPT2LMHeadModel = transformers.GPT2Config, transformers.GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    ckpt = tmp_path / "ckpt"
    safepoint.save(ckpt, 7, {"model": model.state_dict(), "optim": {"m": torch.ones(3)}})
    out = tmp_path / "hf"
    report = json.loads(cli("export", ckpt, "--format", "safetensors", "--select", "model",
                            "--max-shard-size", "4KiB", out, "--json", check=0).stdout)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert report["files"] == len(files) > 2 and sorted(set(index["weight_map"].values())) == files
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    from safetensors import safe_open

    sizes = {}
    for f in files:
        with safe_open(out / f, framework="pt") as st:
            assert st.metadata()["format"] == "pt"
            sizes[f] = [st.get_tensor(k).numel() * st.get_tensor(k).element_size()
                        for k in st.keys()]
    for f, parts in sizes.items():
        assert sum(parts) <= 4096 or len(parts) == 1, (f, parts)  # wte is 4 KiB alone
    assert index["metadata"]["total_size"] == sum(map(sum, sizes.values())) == report["bytes"]
    config.save_pretrained(out)
    loaded = GPT2LMHeadModel.from_pretrained(out)
    want = model.state_dict()
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, want[k]), k
    # Back in: the directory imports as a step with the same tensors.
    cli("import", out, tmp_path / "back", "--step", "1", check=0)
    _, got = safepoint.load(tmp_path / "back", 1)
    assert sorted(got["model"]) == sorted(index["weight_map"])
    assert all(torch.equal(got["model"][k], want[k]) for k in got["model"])
    # An export that did not finish (no index yet, a shard missing) is not imported as a model.
    partial = tmp_path / "partial"
    shutil.copytree(out, partial)
    (partial / "model.safetensors.index.json").unlink()
    (partial / files[1]).unlink()
    r = cli("import", partial, tmp_path / "nope", "--step", "1", check=1)
    assert "shard(s) 2 of them missing" in r.stderr, r.stderr
    # Errors: a non-empty directory, the torch format, a size that is not one.
    assert "new or empty directory" in cli("export", ckpt, "--format", "safetensors",
                                           "--max-shard-size", "1GB", out, check=1).stderr
    assert "safetensors only" in cli("export", ckpt, "--format", "torch", "--max-shard-size",
                                     "1GB", tmp_path / "x", check=1).stderr
    assert "not a size" in cli("export", ckpt, "--format", "safetensors", "--max-shard-size",
                               "lots", tmp_path / "y", check=1).stderr


def test_export_to_a_full_disk_is_a_clear_error_and_leaves_no_temporary(tmp_path, cli):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mnt = tmp_path / "full"
    mnt.mkdir()
    m = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if m.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {m.stderr.strip()}")
    try:
        ckpt = tmp_path / "ckpt"
        safepoint.save(ckpt, 1, {"model": {f"l{i}": torch.randn(16384) for i in range(4)}})
        r = cli("export", ckpt, "--format", "safetensors", mnt / "one.safetensors", check=1)
        assert "one.safetensors: cannot write" in r.stderr, r.stderr
        assert "No space left on device" in r.stderr and "Traceback" not in r.stderr, r.stderr
        r = cli("export", ckpt, "--format", "safetensors", "--max-shard-size", "64KiB",
                mnt / "shards", check=1)
        assert "cannot write" in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert "remove the directory before exporting again" in r.stderr, r.stderr
        left = sorted(p.name for p in mnt.rglob("*") if p.is_file())
        assert not [n for n in left if ".tmp." in n], left  # no temporary stays
        assert "model.safetensors.index.json" not in left, left
        assert safepoint.steps(ckpt) == [1]  # the source is untouched
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_import_of_a_safetensors_file_and_a_hugging_face_directory(tmp_path, cli, shm):
    from safetensors.torch import save_file

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)).to(torch.bfloat16)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    one = tmp_path / "model.safetensors"
    save_file(sd, one)
    dst = tmp_path / "imported"
    r = cli("import", one, dst, "--step", "100", check=0)
    assert "imported 4 tensors" in r.stdout
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)).to(torch.bfloat16)
    ck = Checkpointer(dst, job="ver-import", shm_dir=shm)
    assert ck.restore({"model": fresh}) == 100
    ck.close()
    for k, v in fresh.state_dict().items():
        assert torch.equal(bits(v), bits(sd[k])), k
    assert lineage(str(dst), 100)["metadata"]["format"] == "safetensors"

    # A Hugging Face directory: two shards and the index, fp32.
    hf = tmp_path / "hf"
    hf.mkdir()
    tensors = {f"layers.{i}.weight": torch.randn(5, 3) for i in range(4)}
    save_file({k: tensors[k] for k in list(tensors)[:2]}, hf / "model-00001-of-00002.safetensors")
    save_file({k: tensors[k] for k in list(tensors)[2:]}, hf / "model-00002-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {
        k: f"model-0000{1 + i // 2}-of-00002.safetensors" for i, k in enumerate(tensors)}}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    (hf / "config.json").write_text("{}")
    report = json.loads(cli("import", hf, dst, "--step", "200", "--json", check=0).stdout)
    assert report["files"] == 2 and report["tensors"] == 4
    step, got = safepoint.load(dst, 200)
    assert step == 200 and sorted(got["model"]) == sorted(tensors)
    assert all(torch.equal(got["model"][k], v) for k, v in tensors.items())
    # Round trip back out: the same bytes.
    out = tmp_path / "again.safetensors"
    cli("export", dst, "--step", "200", "--format", "safetensors", "--select", "model", out,
        check=0)
    from safetensors.torch import load_file

    assert all(torch.equal(load_file(out)[k], v) for k, v in tensors.items())
    # Errors: the step exists; not safetensors; nothing to import.
    assert "already" in cli("import", hf, dst, "--step", "200", check=1).stderr.lower()
    cli("import", hf, dst, "--step", "200", "--overwrite", check=0)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    assert "not a readable safetensors file" in cli("import", bad, dst, "--step", "1",
                                                    check=1).stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no *.safetensors files" in cli("import", empty, dst, "--step", "1", check=1).stderr
