"""One rank of a 2-rank data-parallel run on one node whose replicated state each rank copies
only its share of (the copy plan of Checkpointer(dedupe=True)).

argv: ckpt_dir shm_dir job port rank mode
  save     saves steps 1..4 (step 4 persisted and waited for), then dies without closing
  changed  as save, but from step 3 on rank 1's state has one tensor more (a structure change
           on one rank: a rank that left tensors out under the old plan copies the step again)
  applyfail as save, but rank 0 fails to take its share of the copies after step 3's
           agreement (a failure of one rank alone: it must not change any collective)
  resume   restores into a zeroed state (hot reload) and checks every value
Prints one JSON line with what this rank saw.
"""

import json
import os
import sys
import warnings

import torch
import torch.distributed as dist

import safepoint

ckpt, shm_dir, job, port, rank, mode = sys.argv[1:7]
rank = int(rank)
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
dist.init_process_group("gloo", rank=rank, world_size=2)


def state(step, changed=False):
    """The model and optimizer state every rank holds (a function of the step), and a value of
    this rank's own."""
    g = torch.Generator().manual_seed(step)
    out = {"model": {f"layer{i}": torch.randn(128, 128 * (i + 1), generator=g) for i in range(6)},
           "optim": {f"m{i}": torch.randn(128, 128 * (i + 1), generator=g) for i in range(6)},
           f"local{rank}": torch.full((100,), float(rank * 100 + step))}
    if changed and rank == 1:
        out["extra"] = torch.arange(1000, dtype=torch.float32) + step
    return out


def zeroed(s):
    return {k: ({n: torch.zeros_like(t) for n, t in v.items()} if isinstance(v, dict)
                else torch.zeros_like(v)) for k, v in s.items()}


def equal(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    return torch.equal(a, b)


if mode == "applyfail" and rank == 0:
    from safepoint import _dedupe

    take_share = _dedupe.ReplicaPlan.apply
    calls = []

    def failing_apply(plan, client):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected: taking the share failed")
        return take_share(plan, client)

    _dedupe.ReplicaPlan.apply = failing_apply

ck = safepoint.Checkpointer(ckpt, job=job, shm_dir=shm_dir, persist_every=1000)
if mode in ("save", "changed", "applyfail"):
    out = {"rank": rank, "image_bytes": [], "copy_skip": []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in (1, 2, 3, 4):
            ck.save(step, state(step, mode == "changed" and step >= 3), persist=step == 4)
            out["image_bytes"].append(int(ck.status()["last_save"]["image_bytes"]))
            out["copy_skip"].append([list(r) for r in ck._live.last_copy_skip()])
        ck.wait()
    # e.g. "the ranks could not agree" (none is expected but where a failure is injected)
    out["warnings"] = [str(w.message) for w in caught if w.category is RuntimeWarning]
    out["full_bytes"] = sum(t.numel() * 4 for v in state(1).values()
                            for t in (v.values() if isinstance(v, dict) else [v]))
    print(json.dumps(out), flush=True)
    dist.barrier()
    os._exit(0)  # a crash: the snapshots stay with the agent

want = state(4, changed=os.environ.get("SHARE_CHANGED") == "1")
target = zeroed(want)
step = ck.restore(target)
source, ok = ck.last_load_source, equal(target, want)
# load() (no targets: the tensors left to another rank come back fresh, filled from its slot)
loaded_step, loaded = ck.load()
ok = ok and loaded_step == step and equal({k: loaded[k] for k in want}, want)
print(json.dumps({"rank": rank, "step": step, "source": source, "equal": ok}), flush=True)
ck.close()
dist.barrier()
dist.destroy_process_group()
