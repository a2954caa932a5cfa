"""One rank of a DDP run (gloo, CPU) whose state is partly replicated, partly sharded, saved by a
Checkpointer; restarted by tests/python/test_world_change.py with another world size.

argv: ckpt shm_dir job port rank world steps persist_every end(kill|close) [load]
With `load`, the rank first loads the newest step whole (Checkpointer.load, what the HF and
Lightning integrations call) and reports its step and the digest of its model. The rank then
restores (if anything is committed or in memory), trains `steps` more steps, saving each, and
either SIGKILLs itself (end=kill, after every rank saved the last step) or closes.
The state: a DDP model and its Adam state (replicated: every rank holds the same bytes, written
to storage once), a DTensor sharded on dim 0 over the world's ranks (each rank holds its rows),
and the step. Prints one JSON line before it ends: the step and source it restored, the digest
of its state after the restore, and the digest of its state at each step it saved (the same on
every rank and for any world size: the DTensor is digested whole).
"""

import hashlib
import json
import os
import signal
import sys

import torch
import torch.distributed as dist
from gloo_exit import leave
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.nn.parallel import DistributedDataParallel as DDP

import safepoint

ckpt, shm_dir, job, port, rank, world, steps, persist_every, end = sys.argv[1:10]
rank, world, steps, persist_every = int(rank), int(world), int(steps), int(persist_every)
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
dist.init_process_group("gloo", rank=rank, world_size=world)
mesh = init_device_mesh("cpu", (world,))

torch.manual_seed(0)  # the same initial model on every rank (DDP broadcasts it anyway)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
ddp = DDP(model)
opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
# 11 rows: uneven over 2, 3 and 4 ranks
table = distribute_tensor(torch.zeros(11, 6, dtype=torch.float64), mesh, [Shard(0)])
state = {"model": model, "optim": opt, "table": table, "step": 0}


def model_digest(sd) -> str:
    h = hashlib.sha256()
    for k, v in sorted(sd.items()):
        h.update(k.encode())
        h.update(v.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def digest() -> str:
    """sha256 over the state's bytes in a fixed order (collective: the table is gathered)."""
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().contiguous().numpy().tobytes())
    osd = opt.state_dict()
    for pid in sorted(osd["state"]):
        for k, v in sorted(osd["state"][pid].items()):
            h.update(f"{pid}.{k}".encode())
            h.update(v.detach().contiguous().numpy().tobytes() if torch.is_tensor(v)
                     else repr(v).encode())
    h.update(table.full_tensor().numpy().tobytes())
    h.update(str(state["step"]).encode())
    return h.hexdigest()


ck = safepoint.Checkpointer(ckpt, job=job, shm_dir=shm_dir, persist_every=persist_every)
out = {"rank": rank, "world": world}
if sys.argv[10:] == ["load"]:
    loaded = ck.load()
    out["loaded"] = None if loaded is None else [loaded[0], model_digest(loaded[1]["model"])]
restored = ck.restore(state)
out.update(restored=restored, source=ck.last_load_source, restored_digest=digest(), saved={})
start = restored or 0
for step in range(start + 1, start + steps + 1):
    g = torch.Generator().manual_seed(step * 100 + rank)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    opt.step()
    with torch.no_grad():
        rows = table.to_local()
        rows.add_(torch.arange(rows.numel(), dtype=rows.dtype).reshape(rows.shape) * step + rank)
    state["step"] = step
    assert ck.save(step, state)
    out["saved"][str(step)] = digest()
out["model_digest"] = model_digest(model.state_dict())  # at the last step saved
job_dir = ck.status()["agent"]["job_dir"]
with open(os.path.join(job_dir, "job.json")) as f:  # what the agent persists with now
    out["agent_world_size"] = json.load(f)["world_size"]
out["slot_files"] = sorted(n for n in os.listdir(job_dir) if n.startswith("rank-"))
if end == "kill":
    print(json.dumps(out), flush=True)
    dist.barrier()  # every rank has its last snapshot in memory
    os.kill(os.getpid(), signal.SIGKILL)
ck.wait()
ck.close()
print(json.dumps(out), flush=True)
dist.barrier()
leave()
