"""One rank of bench/memory.py's mirror rows (started by tests/common/nodes.py's Job inside a
node, with torchrun's environment):

    python memory_worker.py CKPT JOB MIB SAVES CAP DONE

A state of MIB MiB in 8 tensors, saved SAVES times with redundancy="mirror" (each step
persisted, `wait()` after each so that every push is received before the next save), with
max_shm_bytes=CAP (0: none). Prints "done {json}" (status()["memory"] and the replication
counters, the private memory beyond the state), then waits for the file DONE before it closes.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist


def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def main():
    ckpt, job, mib, saves, cap, done = sys.argv[1:7]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    import safepoint

    S = int(mib) << 20
    state = {f"w{i}": torch.full((S // 8 // 4,), float(rank)) for i in range(8)}
    base = anon()
    ck = safepoint.Checkpointer(ckpt, job=job, redundancy="mirror", dedupe=False, keep=1,
                                max_shm_bytes=int(cap) or None)
    for step in range(1, int(saves) + 1):
        for t in state.values():
            t.add_(1)
        ck.save(step, state)
        ck.wait()  # committed and replicated: the peer received this step
        dist.barrier()
    st = ck.status()
    rep = st["replication"]
    print("done", json.dumps({
        "rank": rank, "memory": st["memory"], "private": anon() - base,
        "received_in_place": rep.get("received_in_place"),
        "protected": [r["protected"] for r in rep["ranks"] if r["rank"] == rank],
        "held": rep["held"]}), flush=True)
    while not os.path.exists(done):
        time.sleep(0.1)
    ck.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
