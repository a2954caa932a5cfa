"""One rank of a multi-node DDP job whose data position must come back from a peer's memory,
for tests/python/test_exact_resume_peers.py (started by tests/common/nodes.py's Job inside a
node, with torchrun's environment; one rank per node).

    python exact_resume_peer_worker.py MODE CKPT JOB STEPS PERSISTED

A small model with dropout, trained on a fixed data set through
``safepoint.data.GlobalBatchSampler`` (a global batch of GLOBAL_BATCH samples, every rank its
share), the generators seeded by ``seed_for_step``; the state is the DDP model, AdamW and the
sampler, saved every step with ``redundancy="mirror"`` (every node's snapshots also in the next
node's memory); steps <= PERSISTED are persisted. The rank restores first (nothing there for a
fresh job), then trains to STEPS. MODE ``wait``: then waits for the replication, says ``saved``
and sleeps until it is killed; ``run``: says ``done`` and ends. Prints "KIND {json}" lines:

    started {rank, step, source, peers}     what restore() found (step None: a fresh start)
    saved|done {rank, step, batches, weights}  the ids this rank trained on at each step it ran,
                                               and the SHA-256 of its weights
"""

import hashlib
import json
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import safepoint
from safepoint.data import GlobalBatchSampler, seed_for_step

SAMPLES, GLOBAL_BATCH, DATA_SEED, RNG_SEED = 60, 6, 5, 1  # 10 global steps an epoch


def say(kind, **fields):
    print(kind, json.dumps(fields), flush=True)


def weights(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in model.state_dict().items():
        h.update(name.encode())
        h.update(p.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main():
    mode, ckpt, job = sys.argv[1:4]
    steps, persisted = int(sys.argv[4]), int(sys.argv[5])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(7)
    xs, ys = torch.randn(SAMPLES, 8, generator=g), torch.randn(SAMPLES, 1, generator=g)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(16, 1))
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sampler = GlobalBatchSampler(SAMPLES, GLOBAL_BATCH, seed=DATA_SEED)
    state = {"model": ddp, "optim": opt, "data": sampler}

    ck = safepoint.Checkpointer(ckpt, job=job, redundancy="mirror", keep=5, peer_timeout=10.0)
    start = ck.restore(state)
    info = ck.last_restore
    say("started", rank=rank, step=start, source=info.source if start else None,
        peers=info.peers if start else None)
    step, batches = start or 0, {}
    it = iter(sampler)
    while step < steps:
        try:
            ids = next(it)
        except StopIteration:  # the epoch ended: the cursor is in the next one
            it = iter(sampler)
            continue
        step += 1
        seed_for_step(RNG_SEED, step, rank)
        loss = F.mse_loss(ddp(xs[ids]), ys[ids])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        batches[step] = ids
        ck.save(step, state, persist=step <= persisted)
    ck.wait()  # committed what is persisted, and every snapshot is on its peer
    dist.barrier()
    say("saved" if mode == "wait" else "done", rank=rank, step=step, batches=batches,
        weights=weights(model))
    if mode == "wait":
        while True:  # the test kills nodes now
            time.sleep(60)
    ck.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
