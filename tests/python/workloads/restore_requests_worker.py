"""One rank of a gloo job that counts what a restore asks of storage and of torch.distributed
(tests/python/test_storage_requests.py, issue 32 items 4 and 5).

    python restore_requests_worker.py CKPT SHM_DIR JOB PORT RANK WORLD PHASE [TIERS]

PHASE:
  save             saves steps 1..4 of a small state (replicated model + a rank-local tensor)
                   and closes: the snapshots leave memory, a restore reads storage.
  restore          a fresh Checkpointer restores into zeroed targets (reshards: partial reads).
  load             a fresh Checkpointer loads (whole images, no targets).
  partial          the shared read of the newest step alone (no Checkpointer), where rank 0
                   holds its copy already (as from memory) and the others read storage.
TIERS: a comma-separated list of tier URIs (the same in both phases), or nothing.

Counts, around the restore alone: this process's storage requests (``_core.storage_requests()``,
by scheme and operation), every outermost torch.distributed collective (name) and the images of
the step it opened (``_core.ShardReader``, by the saving rank of each). Prints one JSON line:
{"rank", "step", "ok", "source", "uri", "requests": {scheme: {op: n}}, "calls", "images",
"warnings"}.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch
import torch.distributed as dist

import safepoint
from safepoint import _core

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..",
                                "bench"))
from collective_count import CollectiveCounter  # noqa: E402

ckpt_dir, shm_dir, job, port, rank, world, phase = sys.argv[1:8]
tiers = [t for t in (sys.argv[8] if len(sys.argv) > 8 else "").split(",") if t]
rank, world = int(rank), int(world)
if "SAFEPOINT_TEST_RECORD_LIMIT" in os.environ:  # a world whose COMMIT record the rows cannot hold
    from safepoint import _agreement

    _agreement.RECORD_LIMIT = int(os.environ["SAFEPOINT_TEST_RECORD_LIMIT"])
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
dist.init_process_group("gloo", rank=rank, world_size=world)


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    model = {f"layer{i}": torch.randn(128, 160, generator=g) for i in range(2)}
    return {"model": model, f"r{rank}": torch.full((100,), float(rank * 1000 + step)),
            "step": step}


def zeros(tree):
    if isinstance(tree, dict):
        return {k: zeros(v) for k, v in tree.items()}
    return torch.zeros_like(tree) if isinstance(tree, torch.Tensor) else tree


def equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def delta(before: dict, after: dict) -> dict:
    return {scheme: {op: n - before.get(scheme, {}).get(op, 0) for op, n in ops.items()
                     if n - before.get(scheme, {}).get(op, 0)}
            for scheme, ops in after.items()}


# Every image a restore opens (its header and index; a read of its ranges opens nothing more).
opened: list = []
_shard_reader = _core.ShardReader


def counted_shard_reader(path, step, image, commit=None):
    opened.append(image)
    return _shard_reader(path, step, image, commit)


_core.ShardReader = counted_shard_reader

out: dict = {"rank": rank}
if phase == "save":
    with safepoint.Checkpointer(ckpt_dir, job=job, shm_dir=shm_dir, tiers=tiers or None) as ck:
        for step in (1, 2, 3, 4):
            ck.save(step, state(step))
        ck.wait()
elif phase == "partial":
    from safepoint._shared_reads import read_shared_into

    step = max(safepoint.steps(ckpt_dir))
    target = zeros(state(0))
    need = rank != 0
    counter = CollectiveCounter()
    tree, everyone = read_shared_into(ckpt_dir, step, rank, target, None, dist.group.WORLD,
                                      need, has_copy=not need)
    out.update(step=step, images=sorted(opened), calls=counter.names(), everyone=everyone,
               ok=(tree is None) if not need else equal(tree, state(step)))
    counter.on = False
else:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with safepoint.Checkpointer(ckpt_dir, job=job, shm_dir=shm_dir,
                                    tiers=tiers or None) as ck:
            dist.barrier()
            counter = CollectiveCounter()
            before = _core.storage_requests()
            del opened[:]
            if phase == "restore":
                target = zeros(state(0))
                step = ck.restore(target)
                ok = step is not None and equal(target, state(step))
            else:
                got = ck.load()
                step = got[0] if got else None
                ok = got is not None and equal(got[1], state(step))
            out["requests"] = delta(before, _core.storage_requests())
            out["calls"] = counter.names()
            out["images"] = sorted(opened)
            out.update(step=step, ok=ok, source=ck.last_load_source,
                       uri=ck.last_restore.uri if ck.last_restore else None)
            # the counting ends here: close() and the barriers below are not the restore's
            counter.on = False
    out["warnings"] = [str(w.message) for w in caught]
print(json.dumps(out), flush=True)
dist.barrier()
dist.destroy_process_group()
