"""Determinism across a kill and a resume (issue 4, part 7).

A small GPT-style model (tests/python/workloads/det_train.py: model, AdamW, an LR schedule, a
shuffled data order with an epoch/position cursor, random augmentation from the torch, numpy and
``random`` generators, ``include_rng=True``) is trained for N steps without interruption, every
step's loss recorded as its exact float bits; then again with a real SIGKILL in the middle of step
K+1 (after save(K) returned) and a restart that resumes with ``Checkpointer.restore``:

- from memory: the node agent still holds the snapshots;
- from storage: the agent is stopped (SIGTERM: it persists the newest snapshots and exits) and its
  shared memory is removed with ``safepoint gc``.

Every loss after K, and the final weights, optimizer, scheduler, data position and generator
states, must be bit-identical to the uninterrupted run. In one process and in a 2-rank gloo DDP
group (one rank killed while the other runs ahead, or the whole group killed).

The workload is made bit-reproducible first (one thread, deterministic algorithms, fixed data;
see det_train.make_deterministic): with several threads the CPU loss varied in its last bits from
run to run even without any interruption.

Processes are forked from a multiprocessing forkserver that has torch imported once (a fresh
interpreter per process would spend most of this file's time importing torch); each is a real
process, killed with SIGKILL. Waits only guard against hangs; no assertion depends on timing.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import safepoint

WORKLOADS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workloads")
sys.path.insert(0, WORKLOADS)
import det_train  # noqa: E402
from conftest import cli_path, free_port  # noqa: E402
from processes import PipedProcess, agents_of, job_dir, kill_agents, wait_until  # noqa: E402

N, K = 12, 6           # train N steps; killed during step K + 1, after save(K) returned
PERSIST_EVERY = 4      # storage holds step 4; step K reaches it by the agent's flush
HANG = 120.0           # seconds: a guard against a hung process, never a performance limit


# --- processes -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ctx():
    """A forkserver context whose server has imported torch, safepoint and the workload."""
    c = multiprocessing.get_context("forkserver")
    # torch.use_deterministic_algorithms imports torch._inductor (seconds): once, in the server.
    c.set_forkserver_preload(["torch._inductor", "torch.distributed", "det_train"])
    return c


class Proc(PipedProcess):
    """One training process (det_train.run) and the events it sent."""

    def __init__(self, ctx, cfg: dict):
        super().__init__(ctx, det_train.run, cfg, HANG)

    def kill(self) -> None:
        code = super().kill()
        assert code is not None, f"pid {self.proc.pid} survived SIGKILL"

    def losses(self) -> dict[int, str]:
        return {ev[1]: ev[2] for ev in self.events if ev[0] == "loss"}

    def digests(self) -> dict:
        return next(ev[1] for ev in self.events if ev[0] == "done")



# --- the node agent ------------------------------------------------------------------------------

class Job:
    def __init__(self, tmp: Path, shm: Path, name: str):
        self.path, self.shm, self.name = tmp / "ckpt", shm, name
        self.procs: list[Proc] = []

    def cfg(self, **kw) -> dict:
        return {"path": str(self.path), "job": self.name, "shm_dir": str(self.shm), "steps": N,
                "persist_every": PERSIST_EVERY, **kw}

    def launch(self, ctx, world: int, **kw) -> list[Proc]:
        """`world` processes (a gloo group when world > 1); kw["pause_at"] may be per rank."""
        port = free_port() if world > 1 else 0
        pause = kw.pop("pause_at", None)
        procs = []
        for rank in range(world):
            p = pause[rank] if isinstance(pause, (list, tuple)) else pause
            procs.append(Proc(ctx, self.cfg(rank=rank, world=world, port=port, pause_at=p, **kw)))
        self.procs += procs
        return procs

    def job_dir(self) -> Path:
        return job_dir(self.shm, self.name)

    def stop_agent_and_wipe_memory(self, cli: str) -> None:
        """SIGTERM the agent (it persists the newest snapshots and exits), then `safepoint gc`
        removes the job's shared memory, as an operator would after the node's agent is gone."""
        agents = agents_of(self.shm)
        assert len(agents) == 1, agents
        os.kill(agents[0], signal.SIGTERM)
        assert wait_until(lambda: not agents_of(self.shm)), f"agent {agents[0]} did not exit"
        gc = subprocess.run([cli, "gc", "--shm-dir", str(self.shm)], capture_output=True,
                            text=True, timeout=HANG)
        assert gc.returncode == 0, (gc.stdout, gc.stderr)
        assert not self.job_dir().exists(), (gc.stdout, list(self.job_dir().iterdir()))

    def cleanup(self) -> None:
        for p in self.procs:
            if p.proc.is_alive():
                p.proc.kill()
            p.proc.join(30)
        kill_agents(self.shm, deadline=30)


_counter = iter(range(1 << 30))


@pytest.fixture
def new_job(tmp_path):
    """Makes jobs with private shm directories (short: the agent's socket path is limited)."""
    made: list[tuple[Job, str]] = []

    def make() -> Job:
        own = tempfile.mkdtemp(prefix="spd-")
        shm = Path(own) / "shm"
        shm.mkdir()
        n = next(_counter)
        job = Job(tmp_path / f"j{n}", shm, f"det{os.getpid() % 10000}-{n}")
        made.append((job, own))
        return job

    yield make
    for job, own in made:
        job.cleanup()
        shutil.rmtree(own, ignore_errors=True)


# --- the uninterrupted runs ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference(ctx, tmp_path_factory):
    """Per world size: each rank's losses of steps 1..N and final digests, uninterrupted."""
    cache: dict[int, list[tuple[dict, dict]]] = {}

    def get(world: int):
        if world not in cache:
            own = tempfile.mkdtemp(prefix="spd-")
            shm = Path(own) / "shm"
            shm.mkdir()
            job = Job(tmp_path_factory.mktemp(f"ref{world}"), shm, f"detref{os.getpid() % 10000}-{world}")
            try:
                procs = job.launch(ctx, world)
                assert [p.expect("fresh", "resumed") for p in procs] == [("fresh",)] * world
                for p in procs:
                    assert p.finish() == 0, p.events[-3:]
                cache[world] = [(p.losses(), p.digests()) for p in procs]
            finally:
                job.cleanup()
                shutil.rmtree(own, ignore_errors=True)
            assert all(sorted(losses) == list(range(1, N + 1)) for losses, _ in cache[world])
            # The replicas of a DDP group hold the same weights.
            assert len({d["weights"] for _, d in cache[world]}) == 1
        return cache[world]

    return get


def check_identical(ref: tuple[dict, dict], before: Proc, after: Proc, rank: int) -> None:
    """Losses of the killed run (steps <= K) and of the resumed one (K+1..N) and the final
    digests equal the uninterrupted run's, bit for bit."""
    ref_losses, ref_digests = ref
    got = {s: l for s, l in before.losses().items() if s <= K}
    assert sorted(got) == list(range(1, K + 1)), sorted(got)
    resumed = after.losses()
    assert sorted(resumed) == list(range(K + 1, N + 1)), sorted(resumed)
    got.update(resumed)
    differ = [(s, ref_losses[s], got[s]) for s in range(1, N + 1) if got[s] != ref_losses[s]]
    assert not differ, f"rank {rank}: losses differ from the uninterrupted run (step, want, " \
                       f"got): {differ}"
    diff = {k: (ref_digests[k], v) for k, v in after.digests().items() if ref_digests[k] != v}
    assert not diff, f"rank {rank}: final state differs from the uninterrupted run: {sorted(diff)}"


def resume_and_check(ctx, job, ref: list, killed: list, source: str) -> None:
    """Restarts the killed ranks: each resumes from step K (from `source`), runs to N, and
    matches the uninterrupted run bit for bit."""
    procs = job.launch(ctx, len(killed), resume=True)
    for p in procs:
        assert p.expect("fresh", "resumed") == ("resumed", K, source)
    for p in procs:
        assert p.finish() == 0, p.events[-3:]
    for rank, (before, after) in enumerate(zip(killed, procs)):
        check_identical(ref[rank], before, after, rank)


# --- tests ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("source", ["memory", "storage"])
def test_single_process_resume_is_bit_identical(ctx, reference, new_job, source):
    ref = reference(1)
    job = new_job()
    [first] = job.launch(ctx, 1, pause_at=K + 1)
    assert first.expect("fresh", "resumed") == ("fresh",)
    assert first.expect("paused") == ("paused", K + 1)
    first.kill()
    assert first.proc.exitcode == -signal.SIGKILL
    assert [ev[1] for ev in first.events if ev[0] == "saved"][-1] == K

    if source == "storage":
        job.stop_agent_and_wipe_memory(cli_path())
        assert safepoint.steps(job.path)[-1] == K  # persisted by the agent when it stopped

    resume_and_check(ctx, job, ref, [first], source)


def test_ddp_one_rank_killed_resumes_from_memory_bit_identical(ctx, reference, new_job):
    """Rank 1 is killed during step K+1; rank 0 runs ahead into save(K+1), which waits for its
    peer to agree on who writes the replicas. When rank 1 dies, rank 0's save still completes
    (it writes all of its tensors) and rank 0 is killed next, as torchrun kills a failed group.
    Both ranks must resume from step K (rank 0's newer snapshot is not one every rank has),
    from memory."""
    ref = reference(2)
    job = new_job()
    r0, r1 = job.launch(ctx, 2, pause_at=[None, K + 1])
    assert r1.expect("paused") == ("paused", K + 1)
    r1.kill()
    assert r1.proc.exitcode == -signal.SIGKILL
    while ("saved", K + 1) not in r0.events:
        r0.expect("saved")
    r0.kill()

    resume_and_check(ctx, job, ref, [r0, r1], "memory")


def test_ddp_group_killed_resumes_from_storage_bit_identical(ctx, reference, new_job):
    """Both ranks are killed during step K+1; the agent is stopped and the node's shared memory
    wiped: both ranks resume from step K on storage."""
    ref = reference(2)
    job = new_job()
    first = job.launch(ctx, 2, pause_at=K + 1)
    for p in first:
        assert p.expect("paused") == ("paused", K + 1)
    for p in first:
        p.kill()
        assert p.proc.exitcode == -signal.SIGKILL
    job.stop_agent_and_wipe_memory(cli_path())
    assert safepoint.steps(job.path)[-1] == K

    resume_and_check(ctx, job, ref, first, "storage")
