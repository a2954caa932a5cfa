"""A newer run of the job takes a rank from a stale process that still runs (issue 35's defect;
docs/reliability.md, "Superseded processes").

Two training processes of one job and rank on one node, as a network partition leaves them: the
stale one (hung in a collective while the job restarted elsewhere) still runs when the job's next
run puts the rank on this node again. The newer process must take the rank (it was refused with
"rank 0 is already connected"), and whatever the stale one does afterwards (save, wait, a new
Checkpointer) fails with SupersededError and never becomes the job's newest snapshot.

The file doubles as its worker: ``python test_superseded.py worker PATH SHM JOB`` reads commands
from stdin and answers one line each.
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
from processes import CommandedWorker, serve_commands, sigkill  # noqa: E402


def _state(step: int, tag: str):
    import torch

    return {"w": torch.arange(4096, dtype=torch.float32) + step, "tag": tag, "step": step}


def worker(path: str, shm: str, job: str) -> None:
    import safepoint

    ckpt = None

    def handle(cmd: str, args: list[str]) -> list:
        nonlocal ckpt
        if cmd == "open":
            ckpt = safepoint.Checkpointer(path, job=job, shm_dir=shm, persist_every=1)
            return [ckpt.attempt]
        if cmd == "load":
            got = ckpt.load()
            return ["fresh" if got is None else f"{got[0]}:{got[1]['tag']}:"
                    f"{int(got[1]['w'][0].item())}:{ckpt.last_load_source}"]
        if cmd == "save":
            step, tag = int(args[0]), args[1]
            return [ckpt.save(step, _state(step, tag))]
        if cmd == "wait":
            ckpt.wait(timeout=60)
            return []
        if cmd == "exit":
            os._exit(0)
        raise ValueError(f"unknown command {cmd}")

    serve_commands(handle, errors=(safepoint.Error,))


def Worker(path, shm, job) -> CommandedWorker:
    return CommandedWorker(__file__, path, shm, job, timeout=120)


def test_a_newer_run_takes_the_rank_from_a_stale_process_that_still_runs(tmp_path, shm):
    path, job = str(tmp_path / "ckpt"), "stale-rank"
    workers = []
    try:
        stale = Worker(path, shm, job)
        workers.append(stale)
        stale.ok("open")
        stale.ok("save 1 stale")
        stale.ok("wait")
        newer = Worker(path, shm, job)  # started after the stale one: the job's next run
        workers.append(newer)
        newer.ok("open")  # was: InvalidArgumentError ... rank 0 is already connected (pid ...)
        assert newer.ok("load") == ["1:stale:1:memory"]
        newer.ok("save 2 newer")
        newer.ok("wait")
        # The stale process wakes: nothing it does succeeds, each failure names why.
        for cmd in ("save 3 stale", "wait", "open"):
            fields = stale.ask(cmd)
            assert fields[:2] == ["ERROR", "SupersededError"], (cmd, fields)
            assert "newer run of the job" in " ".join(fields) or \
                "earlier run" in " ".join(fields), fields
        newer.proc.stdin.write("exit\n")  # dies unclosed, as a crashed rank would
        newer.proc.stdin.flush()
        newer.proc.wait(timeout=60)
        # The job's next run resumes from the newer run's step 2, never the stale process's.
        last = Worker(path, shm, job)
        workers.append(last)
        last.ok("open")
        assert last.ok("load") == ["2:newer:2:memory"]
    finally:
        for w in workers:
            sigkill(w.proc)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "worker":
        worker(*sys.argv[2:])
    else:
        pytest.main([__file__, "-q"])
