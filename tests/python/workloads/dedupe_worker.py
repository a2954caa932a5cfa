"""One rank of a 2-rank data-parallel run whose replicated state is written to storage once.

argv: ckpt_dir shm_dir job port rank
Prints one JSON line with what this rank checked.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

import safepoint

ckpt, shm_dir, job, port, rank = sys.argv[1:6]
rank = int(rank)
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
dist.init_process_group("gloo", rank=rank, world_size=2)


def replicated(step):
    """What every rank holds (model and optimizer state under DDP): a function of the step."""
    g = torch.Generator().manual_seed(step)
    return {f"layer{i}": torch.randn(256, 256 * (i + 1), generator=g) for i in range(4)}


def state(step):
    return {"model": replicated(step), "step": step,
            f"local{rank}": torch.full((1000,), float(rank * 100 + step))}


with safepoint.Checkpointer(ckpt, job=job, shm_dir=shm_dir, persist_every=1) as ck:
    for step in (1, 2):
        ck.save(step, state(step), include_rng=True)
    ck.wait()
    # From memory: every rank's snapshot holds its full state.
    target = {k: (v if not isinstance(v, dict) else {n: torch.zeros_like(t) for n, t in v.items()})
              for k, v in state(0).items()}
    got = ck.restore(target)
    memory_ok = got == 2 and ck.last_load_source == "memory" and all(
        torch.equal(target["model"][k], v) for k, v in replicated(2).items())

# From storage: the whole-image load fills the replicas this rank's image left to the other.
step, loaded = safepoint.load(ckpt, rank=rank)
want = state(2)
load_ok = step == 2 and loaded["step"] == 2 and all(
    torch.equal(loaded["model"][k], v) for k, v in want["model"].items()) and torch.equal(
    loaded[f"local{rank}"], want[f"local{rank}"])
# And the in-place restore, reading only what it needs.
target = {"model": {k: torch.zeros_like(v) for k, v in want["model"].items()}}
restore_ok = safepoint.restore(ckpt, target, rank=rank) == 2 and all(
    torch.equal(target["model"][k], v) for k, v in want["model"].items())
print(json.dumps({"rank": rank, "memory_ok": bool(memory_ok), "load_ok": bool(load_ok),
                  "restore_ok": bool(restore_ok)}))
dist.barrier()
dist.destroy_process_group()
