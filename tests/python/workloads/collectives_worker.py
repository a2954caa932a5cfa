"""One rank of a gloo job that counts the torch.distributed collectives of each save
(tests/python/test_collectives.py, and the "Collectives per save" numbers in docs/benchmarks.md).

    python collectives_worker.py CKPT SHM_DIR JOB PORT RANK WORLD MODE [STEPS [PERSIST_EVERY]]

Every collective function of torch.distributed is wrapped (after the Checkpointer is made, so
that only what the saves run is counted): each outermost call is recorded with the bytes this
rank sent and received (tensors: their bytes; objects: their pickles) and how long it took. A
call inside another (all_gather_object's own all_gathers) is part of the outer one. A barrier
(not recorded) starts each save on every rank together.

MODE: words joined by "+" (e.g. "preempt+overlap"), of
  steady   saves steps 1..STEPS (default 6) of a state whose structure never changes.
  overlap  saves with save(..., overlap=True) and before_update().
  change   as steady, but at step 3 the last rank's state changes structure (one replicated
           tensor is renamed and cut there, and a rank-local tensor is added): the ranks must plan
           the replicas again. Then every rank restores each step from storage and checks it is
           bit-exact.
  preempt  as steady, but the last rank gives the preemption notice (notify_preemption) after
           step 3 (on_preemption="return"); the loop stops at ``ckpt.preempted``.
  timeout  the job's process group has a 5 s timeout and the last rank never saves: each other
           rank saves step 1 (its collective must give up on the last rank after the job's
           timeout, not gloo's default 30 minutes), then leaves a file in CKPT.flags; the last
           rank waits up to 200 s for every other rank's file. Prints {"rank", "saved",
           "warnings"} (the other ranks) or {"rank", "saw"} (the last), and exits at once.

Prints one JSON line: {"rank", "saves": [[step, [[name, sent, received, seconds], ...]], ...],
"preempted_at", "exact"}.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

import safepoint

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..",
                                "bench"))
from collective_count import CollectiveCounter  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "common"))
from processes import wait_until  # noqa: E402

ckpt_dir, shm_dir, job, port, rank, world, mode = sys.argv[1:8]
steps = int(sys.argv[8]) if len(sys.argv) > 8 else 6
persist_every = int(sys.argv[9]) if len(sys.argv) > 9 else 1
rank, world = int(rank), int(world)
modes = set(mode.split("+"))
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
dist.init_process_group("gloo", rank=rank, world_size=world,
                        **({"timeout": timedelta(seconds=5)} if "timeout" in modes else {}))

LAST = world - 1
REPLICATED = 4  # tensors every rank holds (DDP's parameters), over dedupe's 64 KiB floor


def state(step: int) -> dict:
    """The state after `step` steps: replicated tensors (a function of the step alone) and a
    rank-local one. In mode "change", the last rank's state from step 3 on differs in structure."""
    g = torch.Generator().manual_seed(step)
    model = {f"layer{i}": torch.randn(128, 160, generator=g) for i in range(REPLICATED)}
    # named by rank: same-named tensors of the ranks are replicas (DCP's convention)
    local = {f"r{rank}": torch.full((100,), float(rank * 1000 + step))}
    if "change" in modes and rank == LAST and step >= 3:
        model["layer1_own"] = model.pop("layer1")[:64].clone()  # no longer a replica
        local["extra"] = torch.arange(step, step + 50)
    return {"model": model, "local": local, "step": step}


if "timeout" in modes:
    flags = ckpt_dir + ".flags"
    os.makedirs(flags, exist_ok=True)
    ck = safepoint.Checkpointer(ckpt_dir, job=job, shm_dir=shm_dir)
    if rank == LAST:
        others = [os.path.join(flags, str(r)) for r in range(LAST)]
        out = {"rank": rank, "saw": wait_until(lambda: all(map(os.path.exists, others)), 200,
                                               interval=0.1)}
    else:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            saved = ck.save(1, state(1))
        open(os.path.join(flags, str(rank)), "w").close()
        out = {"rank": rank, "saved": saved, "warnings": [str(w.message) for w in caught]}
    print(json.dumps(out), flush=True)
    os._exit(0)  # no close: the last rank never joins another collective

# -- the run -------------------------------------------------------------------------------------
saves: list = []
preempted_at = None
ck = safepoint.Checkpointer(ckpt_dir, job=job, shm_dir=shm_dir, persist_every=persist_every,
                            on_preemption="return")
with ck:
    counter = CollectiveCounter()
    for step in range(1, steps + 1):
        dist.barrier()  # the ranks start each save together (not recorded: cleared next)
        counter.calls.clear()
        if "overlap" in modes:
            ck.save(step, state(step), overlap=True)
            ck.before_update()
        else:
            ck.save(step, state(step))
        saves.append([step, list(counter.calls)])
        if ck.preempted:
            preempted_at = step
            break
        if "preempt" in modes and step == 3 and rank == LAST:
            ck.notify_preemption()
    ck.wait()

exact = None
if modes & {"change", "preempt"}:
    exact = True
    for step in safepoint.steps(ckpt_dir):
        got, loaded = safepoint.load(ckpt_dir, step=step, rank=rank)
        want = state(step)
        exact = exact and got == step and loaded["step"] == step and all(
            torch.equal(loaded[part][k], v) for part in ("model", "local")
            for k, v in want[part].items()) and all(
            set(loaded[part]) == set(want[part]) for part in ("model", "local"))
print(json.dumps({"rank": rank, "saves": saves, "preempted_at": preempted_at,
                  "exact": exact, "steps": safepoint.steps(ckpt_dir)}))
dist.barrier()
dist.destroy_process_group()
