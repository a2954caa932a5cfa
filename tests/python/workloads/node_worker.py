"""One rank of a multi-node job for tests/python/test_nodes.py, started by tests/common/nodes.py's
Job inside a node (torchrun's environment: RANK, WORLD_SIZE, GROUP_RANK, MASTER_ADDR, ...).

    python node_worker.py allreduce
    python node_worker.py save CKPT JOB K     steps 1..K persisted, K+1 in memory only, then waits
    python node_worker.py load CKPT JOB       loads the newest step every rank can load

Each prints "KIND {json}" lines on stdout.
"""

import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
from replica_worker import digest  # its neighbour's: a state's bytes, name by name


def say(kind, **fields):
    print(kind, json.dumps(fields), flush=True)


def state(step, rank):
    """A rank's state at `step`: "model.*" the same on every rank (DDP-like, deduplicated on
    storage), "rank<r>.*" this rank's own."""
    g = torch.Generator().manual_seed(step)
    mine = torch.Generator().manual_seed(1000 * step + rank)
    return {"model.w": torch.randn(64 * 1024, generator=g),
            "model.b": torch.randint(0, 1 << 40, (1024,), generator=g),
            f"rank{rank}.x": torch.randn(16 * 1024, generator=mine),
            "step": step}


mode = sys.argv[1]
dist.init_process_group("gloo")  # env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
rank, world = dist.get_rank(), dist.get_world_size()
host = socket.gethostname()

if mode == "allreduce":
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    hosts = [None] * world
    dist.all_gather_object(hosts, (host, os.environ["GROUP_RANK"], os.environ["MASTER_ADDR"]))
    say("allreduce", rank=rank, sum=t.item(), hosts=hosts,
        node_env=os.environ.get("SAFEPOINT_NODE"))
    dist.destroy_process_group()
    sys.exit(0)

import safepoint  # noqa: E402

ckpt, job = sys.argv[2], sys.argv[3]
ck = safepoint.Checkpointer(ckpt, job=job)
assert (ck.rank, ck.world_size) == (rank, world)
if mode == "save":
    k = int(sys.argv[4])
    for step in range(1, k + 1):
        ck.save(step, state(step, rank), persist=True)
        # Each step committed before the next save: a save may take the slot of a snapshot its
        # agent has not persisted yet (the persist is then superseded, by design), and on a
        # loaded machine step 2 was once never persisted (storage held 1 and 3).
        ck.wait()
    ck.save(k + 1, state(k + 1, rank), persist=False)  # in this node's memory only
    dist.barrier()
    say("saved", rank=rank, host=host, step=k, digest=digest(state(k, rank)),
        memory=sorted(s.step for s in ck._live.slots() if s.state == "COMPLETE"),
        relay=ck.status()["commit_relay"],
        requests=ck.status()["storage_requests"]["agent"])
    while True:  # the test kills a node now; the launcher then kills this attempt
        time.sleep(60)
elif mode == "load":
    step, st = ck.load()
    say("loaded", rank=rank, host=host, step=step, source=ck.last_load_source,
        digest=digest(st), equal=all(torch.equal(st[n], v) if isinstance(v, torch.Tensor)
                                     else st[n] == v for n, v in state(step, rank).items())
        and sorted(st) == sorted(state(step, rank)))
    ck.close()
    dist.destroy_process_group()
