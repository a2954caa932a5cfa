"""Exact resume mid-epoch through the Lightning and Hugging Face Trainer integrations (issue 34,
item 4 of the exact-resume work), at the same data-parallel size.

Each framework trains a small model with dropout on a shuffled data set whose items carry their
index (tests/python/workloads/exact_resume_frameworks.py): once uninterrupted, once SIGKILLed
right after the integration saved a step drawn from a seeded generator (mid-epoch), and once
resumed through the integration (``trainer.fit(ckpt_path="last")`` with
``SafepointCheckpointIO``; ``trainer.train(resume_from_checkpoint=cb.prepare_resume(trainer))``
with ``SafepointCallback``). The sample ids of every step and the final weights must equal the
uninterrupted run's, bit for bit, the resume coming from memory.

Lightning's data position is a torchdata ``StatefulDataLoader``, over
``safepoint.data.GlobalBatchSampler`` or with its own shuffle: Lightning saves a stateful
loader's state in its checkpoint dict, which the plugin stores like the rest (a plain DataLoader
makes Lightning start the epoch over on a mid-epoch resume, with a warning). The shuffling
loader's state holds its generator's state, a tensor that the plugin's load hands Lightning as
a copy of its own (torch's ``Generator.set_state`` misreads a view into a larger buffer: the
resume failed with "Invalid mt19937 state" before). The Trainer keeps its own shuffled
sampler and skips the batches of the epoch already trained on.
"""

from __future__ import annotations

import json
import os
import random
import signal

import pytest
from conftest import communicate, run_script, start_script

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workloads",
                      "exact_resume_frameworks.py")
STEPS, EVERY, PER_EPOCH = 24, 3, 10  # the worker's: a save every 3 steps, 10 steps an epoch
HANG = 300  # seconds: only a guard against a hung process

NEEDS = {"lightning": ("pytorch_lightning", "torchdata"), "hf": ("transformers", "accelerate")}


def steps_logged(path) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    with open(path) as f:
        for line in f:
            e = json.loads(line)
            assert e["step"] not in out, f"step {e['step']} trained twice in one run"
            out[e["step"]] = e["ids"]
    return out


def done(proc) -> tuple[str, str]:
    """(weights digest, resume source) from the worker's last line."""
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("DONE ")]
    assert proc.returncode == 0 and lines, (proc.returncode, proc.stderr[-3000:])
    _, weights, source = lines[-1].split()
    return weights, source


@pytest.mark.parametrize("framework,loader,seed", [("lightning", "global", 3503),
                                                   ("lightning", "shuffle", 3504),
                                                   ("hf", "global", 3509)])
def test_mid_epoch_kill_then_resume_trains_the_same_samples_to_the_same_weights(
        tmp_path, shm, framework, loader, seed):
    for module in NEEDS[framework]:
        pytest.importorskip(module)
    kill_at = random.Random(seed).choice([s for s in range(EVERY, STEPS, EVERY)
                                          if s % PER_EPOCH])
    job = f"xf{framework[0]}{loader[0]}{os.getpid()}"

    def args(name: str, root: str, *more) -> list:
        return [framework, "--root", tmp_path / root, "--shm", shm, "--job", job + root,
                "--work", tmp_path / f"work-{root}", "--ids", tmp_path / f"{name}.jsonl",
                "--loader", loader, *more]

    # The uninterrupted reference runs beside the run that is killed.
    ref = start_script(WORKER, *args("ref", "r"))
    killed = run_script(WORKER, *args("killed", "k", "--kill-at", kill_at), timeout=HANG)
    ref_weights, _ = done(communicate(ref, HANG))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = run_script(WORKER, *args("resumed", "k", "--resume"), timeout=HANG)
    weights, source = done(resumed)

    want = steps_logged(tmp_path / "ref.jsonl")
    before = steps_logged(tmp_path / "killed.jsonl")
    after = steps_logged(tmp_path / "resumed.jsonl")
    assert sorted(want) == list(range(1, STEPS + 1))
    assert sorted(before) == list(range(1, kill_at + 1)), (kill_at, sorted(before))
    assert sorted(after) == list(range(kill_at + 1, STEPS + 1)), (kill_at, sorted(after))
    got = {**before, **after}
    differ = [(s, want[s], got[s]) for s in want if want[s] != got[s]]
    assert not differ, f"{framework}, killed after step {kill_at}: the samples of these steps " \
                       f"differ from the uninterrupted run's (step, want, got): {differ[:3]}"
    assert source == "memory", resumed.stdout[-2000:]
    assert weights == ref_weights, f"{framework}, killed after step {kill_at}: final weights " \
                                   "differ from the uninterrupted run's"
