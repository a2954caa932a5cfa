"""Real processes: a 4-rank commit, and writers killed with SIGKILL in the middle of a save."""

import os
import random
import subprocess
import time

import pytest
import torch

import safepoint
from processes import run_python, sigkill

RANK_SCRIPT = r"""
import sys, torch, safepoint
path, step, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
g = torch.Generator().manual_seed(step * 100 + rank)
safepoint.save(path, step, {"w": torch.randn(1000, 100, generator=g), "rank": rank},
               rank=rank, world_size=world)
"""


def expected(step, rank):
    g = torch.Generator().manual_seed(step * 100 + rank)
    return torch.randn(1000, 100, generator=g)


def test_four_ranks_commit_only_when_all_have_saved(ckpt):
    world = 4
    # Ranks 0..2 save step 1 as separate processes; the step must stay invisible.
    for rank in range(world - 1):
        assert run_python(RANK_SCRIPT, ckpt, 1, rank, world).wait() == 0
        assert safepoint.steps(ckpt) == []
    assert run_python(RANK_SCRIPT, ckpt, 1, world - 1, world).wait() == 0
    assert safepoint.steps(ckpt) == [1]
    # Step 2 with all ranks at once.
    procs = [run_python(RANK_SCRIPT, ckpt, 2, r, world) for r in range(world)]
    assert [p.wait() for p in procs] == [0] * world
    assert safepoint.steps(ckpt) == [1, 2]
    for rank in range(world):
        step, state = safepoint.load(ckpt, rank=rank)
        assert step == 2 and state["rank"] == rank
        assert torch.equal(state["w"], expected(2, rank))
    with pytest.raises(safepoint.InvalidArgumentError):
        safepoint.load(ckpt, rank=world)


WRITER_SCRIPT = r"""
import sys, torch, safepoint
path = sys.argv[1]
state = {"w": torch.full((48 << 20,), 0.0)}   # 192 MiB
step = 1
while True:
    state["w"].fill_(float(step))
    state["step"] = step
    safepoint.save(path, step, state)
    print(step, flush=True)
    step += 1
"""


def test_writer_killed_mid_save_never_exposes_a_partial_step(ckpt):
    rng = random.Random(int(os.environ.get("SAFEPOINT_TEST_SEED", "1234")))
    for attempt in range(4):
        proc = run_python(WRITER_SCRIPT, ckpt, stdout=subprocess.PIPE, text=True)
        reported = 0
        # Wait until at least one more step was reported durable, then kill at a random moment.
        line = proc.stdout.readline()
        assert line, "writer died"
        reported = int(line)
        time.sleep(rng.uniform(0.0, 0.6))
        sigkill(proc)
        rest = proc.stdout.read()
        for line in rest.split():
            reported = max(reported, int(line))
        steps = safepoint.steps(ckpt)
        # Every step whose save() returned is committed (single rank: durable when it returns).
        assert reported in steps
        step, state = safepoint.load(ckpt)
        assert step == steps[-1] >= reported
        assert state["step"] == step
        assert bool((state["w"] == float(step)).all())
        for s in steps:
            _, st = safepoint.load(ckpt, s)
            assert st["step"] == s
        # Keep the directory small across attempts.
        for s in steps[:-1]:
            import shutil
            shutil.rmtree(ckpt / f"step-{s:020d}")
