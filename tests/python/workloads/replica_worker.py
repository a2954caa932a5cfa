"""One rank of a multi-node job with peer replication, for tests/python/test_replication.py
(started by tests/common/nodes.py's Job inside a node, with torchrun's environment).

    python replica_worker.py save CKPT JOB REDUNDANCY K P   steps 1..K, steps <= P persisted;
                                                           waits for replication, then sleeps
    python replica_worker.py load CKPT JOB REDUNDANCY       restores the newest common step

$SAFEPOINT_TEST_MAX_SHM, when set, is the Checkpointer's max_shm_bytes. Prints "KIND {json}"
lines on stdout.
"""

import hashlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist


def say(kind, **fields):
    print(kind, json.dumps(fields), flush=True)


def state(step, rank):
    """A rank's state at `step`, different on every rank and step (about 0.5 MiB)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {"w": torch.randn(96 * 1024, generator=g),
            "b": torch.randint(0, 1 << 40, (4096,), generator=g),
            "h": torch.randn(8192, generator=g).to(torch.bfloat16),
            "step": step}


def digest(st):
    h = hashlib.sha256()
    for name in sorted(st):
        v = st[name]
        h.update(name.encode())
        h.update(v.view(torch.uint8).numpy().tobytes() if isinstance(v, torch.Tensor)
                 else repr(v).encode())
    return h.hexdigest()


def main():
    mode, ckpt, job, redundancy = sys.argv[1:5]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    import safepoint

    cap = os.environ.get("SAFEPOINT_TEST_MAX_SHM")
    ck = safepoint.Checkpointer(ckpt, job=job, redundancy=redundancy, dedupe=False, keep=5,
                                peer_timeout=10.0, max_shm_bytes=int(cap) if cap else None)
    if mode == "save":
        k, persisted = int(sys.argv[5]), int(sys.argv[6])
        for step in range(1, k + 1):
            ck.save(step, state(step, rank), persist=step <= persisted)
        ck.wait()  # committed on storage and replicated to the peers
        # After every rank's wait: what this node holds includes the other nodes' last pushes.
        dist.barrier()
        st = ck.status()
        mine = [r for r in st["replication"]["ranks"] if r["rank"] == rank]
        say("saved", rank=rank, step=k, digest=digest(state(k, rank)), replication=mine,
            node=st["replication"]["node"], held=st["replication"]["held"])
        # The test kills nodes now (the launcher then kills this attempt), or asks for one more
        # save by creating the file AGAIN beside the checkpoint directory.
        again = os.path.join(os.path.dirname(os.path.abspath(ckpt)), "AGAIN")
        while not os.path.exists(again):
            time.sleep(0.1)
        ck.save(k + 1, state(k + 1, rank), persist=False)
        ck.wait()
        dist.barrier()  # every node's step k+1 is on its peer
        st = ck.status()
        say("again", rank=rank, replication=[r for r in st["replication"]["ranks"]
                                             if r["rank"] == rank],
            held=st["replication"]["held"], memory=st["memory"],
            received_in_place=st["replication"].get("received_in_place"))
        while True:
            time.sleep(60)
    elif mode == "load":
        got = torch.zeros(96 * 1024), torch.zeros(4096, dtype=torch.int64)
        target = {"w": got[0], "b": got[1], "h": torch.zeros(8192, dtype=torch.bfloat16), "step": -1}
        step = ck.restore(target)
        info = ck.last_restore
        say("loaded", rank=rank, step=step, source=info.source if info else None,
            peers=info.peers if info else None, digest=digest(target),
            equal=step is not None and digest(target) == digest(state(step, rank)))
        ck.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
