"""Exact resume of the data position (issue 34, items 2 to 4), also with another data-parallel
size.

A gloo DDP job (tests/python/workloads/exact_resume_worker.py: examples/tiny_gpt.py's model
with dropout, augmentation from the torch, numpy and ``random`` generators,
``safepoint.data.GlobalBatchSampler`` with a global batch of 12 samples) trains N steps
uninterrupted, recording the sample ids each rank trained on at each global step and the final
weights. Then the same job is killed (a real SIGKILL of every rank, at a step drawn from a seeded
generator, after the step trained and before it was saved) and restarted with
``Checkpointer.restore``:

- at the same data-parallel size, from memory (the node agent's hot reload; the data position
  in a torchdata ``StatefulDataLoader``, the randomness from ``safepoint.data.seed_for_step``)
  and from storage (the agent stopped and the node's shared memory wiped; the data position in
  the sampler, the generators' states saved with ``include_rng``): the sample ids of every
  global step and the final weights equal the uninterrupted run's, bit for bit;
- with data-parallel size 2, then 4 (killed again), then 3: the sample ids of every global step
  equal the uninterrupted run's (the weights cannot be bit-identical: the gradients are reduced
  over other groupings of the samples).

A run that did not restore the cursor would train its first resumed step on the first batch of
epoch 0 instead of the next batch of the killed run's position, and fail the comparison of that
step's ids. Processes are forked from a multiprocessing forkserver that has torch imported once;
each is a real process, killed with SIGKILL. Waits only guard against hangs.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

import pytest

import safepoint
from safepoint.data import GlobalBatchSampler, seed_for_step, step_seeds
from safepoint.errors import InvalidArgumentError

WORKLOADS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workloads")
sys.path.insert(0, WORKLOADS)
import exact_resume_worker as worker  # noqa: E402
from conftest import cli_path, free_port  # noqa: E402
from processes import PipedProcess, agents_of, job_dir, kill_agents, wait_until  # noqa: E402

N = 16                 # global steps: 3 epochs and a step (5 global steps per epoch)
PERSIST_EVERY = 3
HANG = 120.0           # seconds: a guard against a hung process, never a performance limit


# --- processes -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ctx():
    """A forkserver context whose server has imported torch, torchdata and the worker."""
    c = multiprocessing.get_context("forkserver")
    c.set_forkserver_preload(["torch.distributed", "torchdata.stateful_dataloader",
                              "exact_resume_worker"])
    return c


class Rank(PipedProcess):
    """One rank's process (worker.run) and the events it sent."""

    def __init__(self, ctx, cfg: dict):
        super().__init__(ctx, worker.run, cfg, HANG)

    def kill(self) -> None:
        code = super().kill()
        assert code == -signal.SIGKILL, code

    def finish(self) -> None:
        code = super().finish()
        assert code == 0, (code, self.events[-3:])

    def batches(self) -> dict[int, list[int]]:
        return {ev[1]: ev[2] for ev in self.events if ev[0] == "batch"}


class Job:
    """A job's checkpoint path, job name and private shm directory, and its runs."""

    def __init__(self, tmp: Path, name: str, rng: str, loader: str):
        self.own = tempfile.mkdtemp(prefix="spx-")  # short: the agent's socket path is limited
        self.shm = Path(self.own) / "shm"
        self.shm.mkdir()
        self.path, self.name, self.rng, self.loader = tmp / "ckpt", name, rng, loader
        self.ranks: list[Rank] = []

    def launch(self, ctx, world: int, pause_at: Optional[int] = None,
               resume: bool = False) -> list[Rank]:
        port = free_port()
        cfg = {"path": str(self.path), "job": self.name, "shm_dir": str(self.shm),
               "steps": N, "persist_every": PERSIST_EVERY, "world": world, "port": port,
               "rng": self.rng, "loader": self.loader, "pause_at": pause_at, "resume": resume}
        ranks = [Rank(ctx, {**cfg, "rank": r}) for r in range(world)]
        self.ranks += ranks
        return ranks

    def killed_at(self, ctx, world: int, step: int, resume: bool = False,
                  source: Optional[str] = None) -> list[Rank]:
        """A run that every rank trains to `step` in, then SIGKILLed before it saves `step`."""
        ranks = self.launch(ctx, world, pause_at=step, resume=resume)
        started = [r.expect("fresh", "resumed") for r in ranks]
        if source is not None:
            assert {ev[2] for ev in started} == {source}, started
        for r in ranks:
            assert r.expect("paused") == ("paused", step)
        for r in ranks:
            r.kill()
        return ranks

    def resumed(self, ctx, world: int, step: int, source: str) -> list[Rank]:
        """A restarted run that resumes from `step` (read from `source`) and trains to N."""
        ranks = self.launch(ctx, world, resume=True)
        for r in ranks:
            assert r.expect("fresh", "resumed") == ("resumed", step, source)
        for r in ranks:
            r.finish()
        return ranks

    def stop_agent_and_wipe_memory(self) -> None:
        """SIGTERM the agent (it persists the newest snapshots and exits), then `safepoint gc`
        removes the job's shared memory: the next restore reads storage."""
        agents = agents_of(self.shm)
        assert len(agents) == 1, agents
        os.kill(agents[0], signal.SIGTERM)
        assert wait_until(lambda: not agents_of(self.shm), HANG), f"agent {agents[0]} stayed"
        gc = subprocess.run([cli_path(), "gc", "--shm-dir", str(self.shm)],
                            capture_output=True, text=True, timeout=HANG)
        assert gc.returncode == 0, (gc.stdout, gc.stderr)
        assert not job_dir(self.shm, self.name).exists()

    def cleanup(self) -> None:
        for r in self.ranks:
            if r.proc.is_alive():
                r.proc.kill()
            r.proc.join(30)
        kill_agents(str(self.shm), deadline=30)
        shutil.rmtree(self.own, ignore_errors=True)


_counter = iter(range(1 << 30))


@pytest.fixture
def new_job(tmp_path):
    made: list[Job] = []

    def make(rng: str, loader: str) -> Job:
        n = next(_counter)
        job = Job(tmp_path / f"j{n}", f"exact{os.getpid() % 10000}-{n}", rng, loader)
        made.append(job)
        return job

    yield make
    for job in made:
        job.cleanup()


def global_batches(runs: list[list[Rank]], last: list[int]) -> dict[int, list[int]]:
    """step -> the global batch (every rank's ids, in rank order) of a job's runs: run i's
    steps up to last[i] (the steps it saved before it was killed; N for the last run)."""
    out: dict[int, list[int]] = {}
    first = 1
    for ranks, upto in zip(runs, last):
        per_rank = [r.batches() for r in ranks]
        for step in range(first, upto + 1):
            assert all(step in b for b in per_rank), (step, [sorted(b) for b in per_rank])
            out[step] = [i for b in per_rank for i in b[step]]
        first = upto + 1
    assert sorted(out) == list(range(1, N + 1)), sorted(out)
    return out


@pytest.fixture(scope="module")
def reference(ctx, tmp_path_factory):
    """Per rng mode: the uninterrupted 2-rank run's global batches and final weights (the
    sampler in a plain DataLoader: what a step trains on does not depend on the loader)."""
    cache: dict[str, tuple[dict[int, list[int]], str]] = {}

    def get(rng: str) -> tuple[dict[int, list[int]], str]:
        if rng not in cache:
            job = Job(tmp_path_factory.mktemp(f"ref-{rng}"), f"exactref{os.getpid() % 10000}-"
                      f"{rng}", rng, "sampler")
            try:
                ranks = job.launch(ctx, 2)
                for r in ranks:
                    assert r.expect("fresh", "resumed") == ("fresh",)
                for r in ranks:
                    r.finish()
                weights = {r.events[-1][1] for r in ranks}
                assert len(weights) == 1, weights  # DDP's replicas hold the same weights
                cache[rng] = (global_batches([ranks], [N]), weights.pop())
            finally:
                job.cleanup()
            check_epochs(cache[rng][0])
        return cache[rng]

    return get


def check_epochs(batches: dict[int, list[int]]) -> None:
    """Every step a full global batch; within an epoch no sample twice; a new order each
    epoch."""
    per_epoch = worker.SAMPLES // worker.GLOBAL_BATCH
    for first in range(1, N + 1, per_epoch):
        ids = [i for s in range(first, min(first + per_epoch, N + 1)) for i in batches[s]]
        assert len(ids) == len(set(ids)), f"a sample repeated within the epoch from step {first}"
        assert all(len(batches[s]) == worker.GLOBAL_BATCH for s in batches)
    assert batches[1] != batches[1 + per_epoch]  # a new order every epoch


def check_same(ref: dict[int, list[int]], got: dict[int, list[int]], seed: int) -> None:
    differ = [(s, ref[s], got[s]) for s in range(1, N + 1) if ref[s] != got[s]]
    assert not differ, f"kill seed {seed}: global batches differ from the uninterrupted run " \
                       f"(step, want, got): {differ[:3]}"


def saved_before_kill(ranks: list[Rank]) -> int:
    steps = {max([ev[1] for ev in r.events if ev[0] == "saved"], default=0) for r in ranks}
    assert len(steps) == 1, steps
    return steps.pop()


# --- the tests -----------------------------------------------------------------------------------

@pytest.mark.parametrize("source,rng,loader,seed", [
    ("memory", "derived", "stateful", 3401),
    ("storage", "saved", "sampler", 3402),
])
def test_same_dp_size_resume_trains_the_same_samples_to_bit_identical_weights(
        ctx, reference, new_job, source, rng, loader, seed):
    if loader == "stateful":
        pytest.importorskip("torchdata")  # `make test` has it (torchtitan's dependency)
    ref_batches, ref_weights = reference(rng)
    kill_at = random.Random(seed).randint(2, N - 1)
    job = new_job(rng, loader)
    first = job.killed_at(ctx, 2, kill_at)
    assert saved_before_kill(first) == kill_at - 1
    if source == "storage":
        job.stop_agent_and_wipe_memory()
        assert safepoint.steps(job.path)[-1] == kill_at - 1
    again = job.resumed(ctx, 2, kill_at - 1, source)

    check_same(ref_batches, global_batches([first, again], [kill_at - 1, N]), seed)
    weights = {r.events[-1][1] for r in again}
    assert weights == {ref_weights}, f"kill seed {seed} (step {kill_at}): final weights differ"


def test_dp_size_2_then_4_then_3_trains_the_same_samples(ctx, reference, new_job):
    seed = 3417  # kills at steps 4 (mid-epoch) and 11 (resumes at an epoch's end, step 10)
    ref_batches, _ = reference("derived")
    gen = random.Random(seed)
    kill1 = gen.randint(2, N // 2)
    kill2 = gen.randint(kill1 + 1, N - 1)
    job = new_job("derived", "sampler")
    dp2 = job.killed_at(ctx, 2, kill1)
    # Another world size: the agent persists the 2 ranks' snapshots and drops them; the 4 ranks
    # read the step from storage (ranks 2 and 3 get rank 0's data position: the same cursor).
    dp4 = job.killed_at(ctx, 4, kill2, resume=True, source="storage")
    assert saved_before_kill(dp4) == kill2 - 1
    dp3 = job.resumed(ctx, 3, kill2 - 1, "storage")

    got = global_batches([dp2, dp4, dp3], [kill1 - 1, kill2 - 1, N])
    check_same(ref_batches, got, seed)
    # Each rank took its contiguous share: rank r of 3 the ids [4r, 4r + 4) of the global batch.
    for r, rank in enumerate(dp3):
        for step, ids in rank.batches().items():
            assert ids == ref_batches[step][4 * r:4 * r + 4], (r, step)


# --- the sampler on its own (no processes) -------------------------------------------------------

def consume(samplers: list[GlobalBatchSampler], steps: int) -> list[list[int]]:
    """`steps` global batches, each the samplers' (ranks') batches in rank order, iterated as
    a DataLoader does (a new iterator after each epoch)."""
    its = [iter(s) for s in samplers]
    out = []
    for _ in range(steps):
        parts = []
        for i, s in enumerate(samplers):
            try:
                parts += next(its[i])
            except StopIteration:
                its[i] = iter(s)
                parts += next(its[i])
        out.append(parts)
    return out


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("before,after", [(2, 4), (4, 3), (3, 1), (1, 6)])
def test_sampler_reshards_the_global_cursor(before, after, drop_last):
    ref = consume([GlobalBatchSampler(50, 12, rank=0, world_size=1, seed=9,
                                      drop_last=drop_last)], 20)
    for cut in (1, 4, 5, 9):
        old = [GlobalBatchSampler(50, 12, rank=r, world_size=before, seed=9, drop_last=drop_last)
               for r in range(before)]
        got = consume(old, cut)
        states = [s.state_dict() for s in old]
        assert all(st == states[0] for st in states)  # no rank-specific value
        new = [GlobalBatchSampler(50, 12, rank=r, world_size=after, seed=9, drop_last=drop_last)
               for r in range(after)]
        for s in new:
            s.load_state_dict(states[0])
        got += consume(new, 20 - cut)
        assert got == ref, (before, after, cut)
    per_epoch = 50 // 12 if drop_last else 5
    assert len(GlobalBatchSampler(50, 12, rank=0, world_size=1, drop_last=drop_last)) == per_epoch
    # without drop_last the epoch's last batch wraps to its first samples
    if not drop_last:
        assert ref[4][2:] == ref[0][:10] and len(set(sum(ref[:5], []))) == 50


def test_sampler_refuses_what_cannot_be_exact():
    with pytest.raises(InvalidArgumentError, match="cannot be split evenly over 5"):
        GlobalBatchSampler(50, 12, rank=0, world_size=5)
    with pytest.raises(InvalidArgumentError, match="larger than the data set"):
        GlobalBatchSampler(10, 12, rank=0, world_size=1)
    saved = GlobalBatchSampler(50, 12, rank=0, world_size=1, seed=1).state_dict()
    with pytest.raises(InvalidArgumentError, match="seed 1"):
        GlobalBatchSampler(50, 12, rank=0, world_size=1, seed=2).load_state_dict(saved)
    with pytest.raises(InvalidArgumentError, match="num_samples 50"):
        GlobalBatchSampler(51, 12, rank=0, world_size=1, seed=1).load_state_dict(saved)


def test_sampler_set_epoch_keeps_a_restored_position():
    s = GlobalBatchSampler(50, 12, rank=0, world_size=1, seed=4)
    consume([s], 6)  # 4 steps per epoch: epoch 1, two steps in
    assert (s.epoch, s.offset, s.step, s.consumed) == (1, 24, 6, 72)
    s.set_epoch(1)
    assert s.offset == 24
    # A loop (or framework) one epoch behind never moves it back over trained samples.
    with pytest.warns(RuntimeWarning, match="stays there"):
        s.set_epoch(0)
    assert (s.epoch, s.offset) == (1, 24)
    s.set_epoch(2)
    assert (s.epoch, s.offset) == (2, 0)


@pytest.mark.parametrize("drop_last", [True, False])
def test_sampler_resumed_with_another_global_batch_trains_each_sample_once_an_epoch(drop_last):
    # Saved after one global batch of 4 of a 10-sample epoch, resumed with batches of 8: the
    # rest of the epoch's order (6 samples) is consumed once, then the next epoch starts (the
    # cursor used to wrap a second time without drop_last: every sample of that extra batch
    # had been trained in the epoch already).
    old = GlobalBatchSampler(10, 4, rank=0, world_size=1, seed=3, drop_last=drop_last)
    first = consume([old], 1)[0]
    new = GlobalBatchSampler(10, 8, rank=0, world_size=1, seed=3, drop_last=drop_last)
    new.load_state_dict(old.state_dict())
    order = list(new.epoch_order(0))
    if drop_last:  # 6 left, fewer than a batch of 8: epoch 0 is over
        assert (new.epoch, new.offset) == (1, 0)
        return
    rest = [b for b in new]  # the rest of epoch 0: one batch, then epoch 1
    # the 6 samples left, completed by the epoch's first 2 (what drop_last=False does)
    assert rest == [order[4:] + order[:2]]
    assert first == order[:4]
    assert (new.epoch, new.offset) == (1, 0)


def test_step_seeds_make_a_step_draw_the_same_numbers():
    import random as pyrandom

    import numpy as np
    import torch

    def draws():
        return (torch.rand(3).tolist(), np.random.rand(3).tolist(), pyrandom.random())

    seed_for_step(7, 12, 1)
    first = draws()
    torch.rand(5)  # generator states moved on, as a restart would leave them elsewhere
    seed_for_step(7, 12, 1)
    assert draws() == first
    assert step_seeds(7, 12, 1) != step_seeds(7, 12, 0) != step_seeds(7, 13, 0)


# --- the data position of torchdata's StatefulDataLoader and torch's DistributedSampler ----------

def test_stateful_dataloader_position_restores_from_memory_and_storage(tmp_path, shm):
    """A StatefulDataLoader is a Stateful value of the state: saved with each snapshot,
    restored from memory and from storage, with worker processes too, and goes on into the next
    epochs as the uninterrupted loader did. Its shuffling sampler's generator state is a tensor,
    which restore copies into the loader's own (a torch Generator cannot read a state from a
    view into a larger buffer, as a load from storage returns). The sampler has a generator of
    its own: one shared with the loader's generator= puts the next epoch a draw behind after a
    restore (torchdata 0.11's StatefulDataLoader, safepoint or not)."""
    pytest.importorskip("torchdata")
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchdata.stateful_dataloader.sampler import RandomSampler

    data = list(range(40))

    def loader(workers: int) -> StatefulDataLoader:
        shuffled = RandomSampler(data, generator=torch_generator(5))
        return StatefulDataLoader(data, batch_size=3, sampler=shuffled, num_workers=workers,
                                  generator=torch_generator(6))

    def epochs(dl: StatefulDataLoader, n: int) -> list[list[int]]:
        return [b.tolist() for _ in range(n) for b in dl]

    for workers in (0, 2):
        whole = epochs(loader(workers), 2)
        first = loader(workers)
        it = iter(first)
        seen = [next(it).tolist() for _ in range(4)]
        assert seen == whole[:4]
        ck_dir = tmp_path / f"w{workers}"
        with safepoint.Checkpointer(ck_dir, job=f"sdl{workers}-{os.getpid()}", shm_dir=shm) as ck:
            ck.save(4, {"loader": first})
            ck.wait()
            hot = loader(workers)
            assert ck.restore({"loader": hot}) == 4 and ck.last_load_source == "memory"
            assert epochs(hot, 2) == whole[4:]
        cold = loader(workers)  # a new job name: nothing in memory, the step from storage
        with safepoint.Checkpointer(ck_dir, job=f"sdl{workers}b-{os.getpid()}",
                                    shm_dir=shm) as ck:
            assert ck.restore({"loader": cold}) == 4 and ck.last_load_source == "storage"
            assert epochs(cold, 2) == whole[4:]


def test_distributed_sampler_epoch_goes_in_the_state_beside_the_loader(tmp_path, shm):
    """torch's DistributedSampler has no state_dict: a StatefulDataLoader over it saves how many
    batches it handed out (and fast-forwards by that many), not the sampler's epoch. The epoch
    goes in the state as a plain value and set_epoch takes it back before the next iter()."""
    from torch.utils.data import DistributedSampler
    pytest.importorskip("torchdata")
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = list(range(40))

    def make():
        sampler = DistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=3)
        return sampler, StatefulDataLoader(data, batch_size=3, sampler=sampler)

    sampler, loader = make()
    epochs = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        epochs.append([b.tolist() for b in loader])
    sampler, loader = make()
    sampler.set_epoch(1)
    it = iter(loader)
    [next(it) for _ in range(2)]
    with safepoint.Checkpointer(tmp_path / "ckpt", job=f"ds-{os.getpid()}", shm_dir=shm) as ck:
        ck.save(9, {"loader": loader, "epoch": 1})
        ck.wait()
    sampler, loader = make()
    state = {"loader": loader, "epoch": 0}
    with safepoint.Checkpointer(tmp_path / "ckpt", job=f"ds2-{os.getpid()}", shm_dir=shm) as ck:
        assert ck.restore(state) == 9
    sampler.set_epoch(state["epoch"])
    assert [b.tolist() for b in loader] == epochs[1][2:]
    sampler.set_epoch(2)
    assert [b.tolist() for b in loader] == epochs[2]


def torch_generator(seed: int):
    import torch

    return torch.Generator().manual_seed(seed)


def test_stateful_dataloader_with_workers_saves_the_cursor_of_what_it_handed_out(tmp_path, shm):
    """A loader with worker processes draws batches ahead of the loop, so the sampler's own
    cursor runs ahead of the batches handed out; a StatefulDataLoader over a GlobalBatchSampler
    saves the sampler's state as of the batches it handed out, and the restored loader goes on
    with the next one, also into the next epoch."""
    pytest.importorskip("torchdata")
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = list(range(50))

    def make() -> tuple[GlobalBatchSampler, StatefulDataLoader]:
        sampler = GlobalBatchSampler(data, 6, rank=0, world_size=1, seed=8)
        return sampler, StatefulDataLoader(data, batch_sampler=sampler, num_workers=2,
                                           generator=torch_generator(1))

    sampler, loader = make()
    whole = [b.tolist() for b in loader] + [b.tolist() for b in loader]  # two epochs of 8
    sampler, loader = make()
    it = iter(loader)
    seen = [next(it).tolist() for _ in range(3)]
    assert seen == whole[:3]
    assert sampler.step > 3  # the workers' prefetch: the sampler alone would resume too late
    with safepoint.Checkpointer(tmp_path / "ckpt", job=f"wk-{os.getpid()}", shm_dir=shm) as ck:
        ck.save(3, {"data": loader})
        ck.wait()
        del it
        sampler, loader = make()
        assert ck.restore({"data": loader}) == 3
    rest = [b.tolist() for b in loader] + [b.tolist() for b in loader]
    assert rest == whole[3:]
