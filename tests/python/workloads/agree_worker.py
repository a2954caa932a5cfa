"""One rank of a 2-rank gloo job for the restore-agreement test (tests/python/test_agreement.py).

    python agree_worker.py STORE_FILE CKPT SHM_DIR JOB RANK PHASE

PHASE: save (steps 1-3 committed, step 4 in rank 0's memory only), save-both (step 4 in both
ranks' memory), hot, load or load:STEP (prints the step loaded, or the error's class and text).
"""

import json
import sys
import warnings

import torch
import torch.distributed as dist

import safepoint
from safepoint import _collectives

store_file, ckpt_dir, shm_dir, job, rank, phase = sys.argv[1:7]
rank = int(rank)
dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=2)


def state(step):
    return {"w": torch.full((1000,), float(step * 10 + rank)), "step": step}


# dedupe=False: only rank 0 saves step 4 below, and a save with dedupe is a collective.
ck = safepoint.Checkpointer(ckpt_dir, job=job, shm_dir=shm_dir, dedupe=False)
assert (ck.rank, ck.world_size) == (rank, 2)
if phase in ("save", "save-both"):  # save-both: both ranks reach step 4
    for step in (1, 2, 3):
        ck.save(step, state(step), persist=True)
    ck.wait()
    if rank == 0 or phase == "save-both":
        ck.save(4, state(4), persist=False)  # only rank 0 reaches step 4 (in memory)
    ck._client.abandon()  # die without a clean close: snapshots stay in memory
    print(json.dumps({"rank": rank}), flush=True)
elif phase == "hot":
    # A hot reload in the process that saved: every rank holds step 3 in memory, newer than
    # the committed step 2. Counts the collectives the restore runs.
    ck.save(2, state(2), persist=True)
    ck.wait()
    ck.save(3, state(3), persist=False)
    calls = {"all_gather_object": 0, "all_reduce": 0, "all_gather": 0}

    def counted(name):
        real = getattr(dist, name)

        def wrapper(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return wrapper
    for name in calls:
        setattr(dist, name, counted(name))
    # The agreement's all-gather is safepoint's own (recursive doubling over point-to-point
    # messages, which this count leaves out), counted as the all-gather it is.
    real_gather = _collectives.all_gather

    def gather(*args, **kwargs):
        calls["all_gather"] += 1
        return real_gather(*args, **kwargs)
    _collectives.all_gather = gather
    target = {"w": torch.zeros(1000), "step": 0}
    step = ck.restore(target)
    ok = bool(torch.equal(target["w"], state(3)["w"])) and target["step"] == 3
    print(json.dumps({"rank": rank, "step": step, "source": ck.last_load_source, "ok": ok,
                      "calls": calls}), flush=True)
    ck.close()
else:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            got = ck.load(int(phase.split(":")[1]) if ":" in phase else None)  # load[:STEP]
        except safepoint.Error as e:  # the test made the path unlistable
            print(json.dumps({"rank": rank, "error": type(e).__name__, "message": str(e)}),
                  flush=True)
            ck._client.abandon()
            dist.destroy_process_group()
            sys.exit(0)
    step, st = got
    ok = bool(torch.equal(st["w"], state(step)["w"]))
    print(json.dumps({"rank": rank, "step": step, "source": ck.last_load_source, "ok": ok,
                      "warnings": [str(w.message) for w in caught]}), flush=True)
    ck._client.abandon()
dist.destroy_process_group()
