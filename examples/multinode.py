"""Several nodes under torchrun: redundancy="mirror" (every node's snapshots also in another
node's memory) and an S3 tier below the checkpoint directory (docs/guide.md, "Getting started").

On each of two nodes (the same --ckpt on a filesystem both see, the same --tier):

    torchrun --nnodes 2 --node-rank N --nproc-per-node 1 --master-addr HOST0 --master-port 29500 \\
        examples/multinode.py --ckpt /shared/run1 --tier s3://bucket/run1

On one machine, two "nodes" are two launchers with their own $SAFEPOINT_NODE and
$SAFEPOINT_SHM_DIR (docs/guide.md shows the commands, with the test Ceph of scripts/with-ceph.sh
as the S3 store). The first run trains --steps steps; run it again with more steps and every
rank resumes from the newest step (from memory after a crash; after a clean end, as here, from
the checkpoint directory). Each rank ends by printing how its step is protected: by
a copy in another node's memory and on each tier.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny_gpt  # noqa: E402

import safepoint  # noqa: E402
from safepoint import Tier  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True, help="checkpoint directory shared by the nodes")
    ap.add_argument("--tier", help="a lower tier, e.g. s3://bucket/run1 (default: none)")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, GROUP_RANK
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(tiny_gpt.TinyGPT(dim=64, layers=2, context=32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"model": model, "optim": opt}
    tiers = [Tier(args.tier, every=10, keep=2)] if args.tier else []

    with safepoint.Checkpointer(args.ckpt, persist_every=5, keep=2, redundancy="mirror",
                                tiers=tiers) as ckpt:
        start = ckpt.restore(state)  # memory, else a peer's memory, else the directory or tier
        if start is None:
            print(f"[rank {rank}] fresh start", flush=True)
            start = 0
        else:
            print(f"[rank {rank}] resumed from step {start} ({ckpt.last_load_source})", flush=True)
        for step in range(start + 1, args.steps + 1):
            x, y = tiny_gpt.batch(step * world + rank, batch_size=8, context=32)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            ckpt.save(step, state)  # the copy into this node's memory; the rest in the background
        ckpt.wait()  # persisted steps committed, the newest snapshot at its peer
        dist.barrier()  # every node is still up (and holds its peers' copies) while we look
        mine = [r for r in ckpt.status()["replication"]["ranks"] if r["rank"] == rank]
        print(f"[rank {rank}] step {mine[0]['step']} in a peer's memory: "
              f"{bool(mine[0]['protected'])}", flush=True)
        if rank == 0 and args.tier:
            deadline = time.monotonic() + 120  # the agent copies down in the background
            while time.monotonic() < deadline and args.steps not in safepoint.steps(args.tier):
                time.sleep(0.5)
            print(f"[rank 0] on {args.tier}: steps {safepoint.steps(args.tier)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
