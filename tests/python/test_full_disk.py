"""A job of 4 ranks whose checkpoint file system fills while it persists (issue 35 item 3).

The checkpoint path is a real small file system (a size-limited tmpfs), filled by another writer
after two steps committed. Expected of safepoint, as a user on a full disk needs it:
- training goes on: every save returns (into shared memory); the waits fail with
  ResourceExhaustedError naming the path, each rank's own;
- nothing committed is lost or hidden: the steps committed before stay listed and load
  bit-exact, retention removes none of them for a step that did not commit, and no part of
  the failed step is visible;
- a rank restarted meanwhile reloads the newest snapshot from memory (hot reload), not the
  older committed step from storage;
- once space is freed the job persists and commits again without a restart.

The file doubles as its worker: ``python test_full_disk.py worker PATH SHM JOB RANK WORLD`` reads
commands from stdin and answers one line each.
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
from processes import (CommandedWorker, kill_agents, serve_commands,  # noqa: E402
                       sigkill, small_tmpfs)

WORLD = 4
NUMEL = 1 << 18  # 1 MiB of float32 a rank


def _state(step: int, rank: int):
    import torch

    return {"w": torch.arange(NUMEL, dtype=torch.float32) + step * 10 + rank * 1000,
            "step": step}


def worker(path: str, shm: str, job: str, rank: str, world: str) -> None:
    import torch

    import safepoint

    r = int(rank)
    ckpt = None

    def handle(cmd: str, args: list[str]) -> list:
        nonlocal ckpt
        if cmd == "open":
            ckpt = safepoint.Checkpointer(path, job=job, shm_dir=shm, rank=r,
                                          world_size=int(world), persist_every=1, keep=2)
            return []
        if cmd == "save":
            step = int(args[0])
            return [ckpt.save(step, _state(step, r))]
        if cmd == "wait":
            ckpt.wait(timeout=120)
            return []
        if cmd == "load":  # the newest step wherever it is, checked against its state
            step, got = ckpt.load()
            exact = torch.equal(got["w"], _state(step, r)["w"]) and got["step"] == step
            return [step, ckpt.last_load_source, exact]
        if cmd == "load_storage":  # a committed step read back from the file system
            step = int(args[0])
            _, got = safepoint.load(path, step, rank=r)
            return [torch.equal(got["w"], _state(step, r)["w"])]
        if cmd == "exit":
            os._exit(0)
        raise ValueError(f"unknown command {cmd}")

    serve_commands(handle, errors=(safepoint.Error,))


def Rank(path, shm, job, rank) -> CommandedWorker:
    return CommandedWorker(__file__, path, shm, job, rank, WORLD, what=f"rank {rank}",
                           timeout=180)


def ask_all(ranks: list, cmd: str) -> list[list[str]]:
    """Sends `cmd` to every rank first (a save or wait of one rank may wait for the others),
    then collects the answers."""
    for r in ranks:
        r.send(cmd)
    return [r.answer(cmd) for r in ranks]


def ok_all(ranks: list, cmd: str) -> list[list[str]]:
    answers = ask_all(ranks, cmd)
    for i, a in enumerate(answers):
        assert a[0] == "OK", f"rank {i}: {cmd!r}: {' '.join(a)}"
    return [a[1:] for a in answers]


def fill(path: str) -> str:
    """Writes a file into `path`'s file system until it is full; returns its name."""
    filler = os.path.join(path, "filler")
    block = b"f" * (64 << 10)
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(block)
        except OSError as e:
            assert e.errno == 28, e  # ENOSPC
    return filler


@pytest.fixture
def small_fs(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    with small_tmpfs(mnt, "48m"):
        yield mnt


def test_a_full_checkpoint_file_system_loses_nothing_and_the_job_goes_on(small_fs, shm):
    import safepoint

    path, job = str(small_fs / "ckpt"), "full-disk"
    ranks = []
    try:
        ranks = [Rank(path, shm, job, r) for r in range(WORLD)]
        ok_all(ranks, "open")
        for step in (1, 2):
            assert ok_all(ranks, f"save {step}") == [["True"]] * WORLD
            ok_all(ranks, "wait")
        assert safepoint.steps(path) == [1, 2]

        filler = fill(str(small_fs))
        # Training goes on: the save lands in shared memory; each rank's wait names the full disk.
        assert ok_all(ranks, "save 3") == [["True"]] * WORLD
        waits = ask_all(ranks, "wait")
        for i, w in enumerate(waits):
            assert w[:2] == ["ERROR", "ResourceExhaustedError"], (i, w)
            assert path in " ".join(w) and "No space left on device" in " ".join(w), (i, w)
        # Nothing committed is lost, nothing of step 3 is visible, no temporary is left behind.
        assert safepoint.steps(path) == [1, 2]
        assert ok_all(ranks, "load_storage 2") == [["True"]] * WORLD
        leftovers = [os.path.join(d, f) for d, _, files in os.walk(path) for f in files
                     if ".tmp" in f]
        assert leftovers == [], leftovers

        # A rank restarted on the full disk reloads step 3 from memory, bit-exact.
        ranks[1].send("exit")
        ranks[1].proc.wait(timeout=60)
        ranks[1] = Rank(path, shm, job, 1)
        ok_all(ranks[1:2], "open")
        assert ok_all(ranks[1:2], "load") == [["3", "memory", "True"]]

        # Space comes back: the job persists and commits again, without a restart.
        os.unlink(filler)
        assert ok_all(ranks, "save 4") == [["True"]] * WORLD
        ok_all(ranks, "wait")
        assert safepoint.steps(path)[-1] == 4
        assert ok_all(ranks, "load_storage 4") == [["True"]] * WORLD
        assert ok_all(ranks, "load") == [["4", "memory", "True"]] * WORLD
    finally:
        for r in ranks:
            sigkill(r.proc)
        kill_agents(shm, deadline=30)


if __name__ == "__main__":
    if len(sys.argv) == 7 and sys.argv[1] == "worker":
        worker(*sys.argv[2:])
    else:
        pytest.main([__file__, "-q"])
