"""One rank of a resharding run: saves DTensor-sharded state with one world size, or restores it
into another (torch.distributed with gloo on the CPU).

argv: ckpt_dir mode(save|flash|hot|load|shared) mesh(e.g. "2" or "2x2") port rank [shm_dir job]
("shared": load through the shared read of every rank of the job, as Checkpointer.restore from
storage does, instead of each rank on its own)
Prints one JSON line: {"rank", "ok", "step", "mismatches"}.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import safepoint
from gloo_exit import leave

ckpt, mode, mesh_spec, port, rank = sys.argv[1:6]
dims = tuple(int(x) for x in mesh_spec.split("x"))
world = 1
for d in dims:
    world *= d
rank = int(rank)
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
dist.init_process_group("gloo", rank=rank, world_size=world)
mesh = init_device_mesh("cpu", dims)


def full(i, shape, dtype=torch.float32):
    """The global tensors: a pure function of their index (uneven sizes on purpose)."""
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, dtype=torch.float64) * (i + 1) + i).reshape(shape).to(dtype)


SHAPES = [(7, 5), (5, 9), (6, 4), (3, 11)]
if len(dims) == 1:
    PLACEMENTS = [[Shard(0)], [Shard(1)], [Replicate()], [Shard(0)]]
else:
    PLACEMENTS = [[Shard(0), Shard(1)], [Replicate(), Shard(0)], [Shard(1), Replicate()],
                  [Shard(1), Shard(0)]]


def state(fill: bool):
    out = {}
    for i, (shape, pl) in enumerate(zip(SHAPES, PLACEMENTS)):
        g = full(i, shape, torch.bfloat16 if i == 3 else torch.float32)
        out[f"w{i}"] = distribute_tensor(g if fill else torch.zeros_like(g), mesh, pl)
    out["plain"] = full(9, (4, 3)) if fill else torch.zeros(4, 3)
    out["meta"] = {"lr": 0.5 if fill else 0.0, "name": "run"}
    return out


if mode == "save":
    safepoint.save(ckpt, 7, state(True), rank=rank, world_size=world)
    print(json.dumps({"rank": rank, "ok": True, "step": 7, "mismatches": []}))
elif mode == "flash":
    shm_dir, job = sys.argv[6:8]
    with safepoint.Checkpointer(ckpt, job=job, shm_dir=shm_dir) as ck:
        ck.save(7, state(True))
        ck.wait()
        # Same world size: restore from the memory snapshot, straight into the DTensor shards.
        target = state(False)
        got = ck.restore(target)
        source = ck.last_load_source
    bad = [f"w{i}" for i, shape in enumerate(SHAPES)
           if not torch.equal(target[f"w{i}"].full_tensor(),
                              full(i, shape, target[f"w{i}"].dtype))]
    print(json.dumps({"rank": rank, "ok": got == 7 and not bad and source == "memory",
                      "step": got, "mismatches": bad, "source": source}))
elif mode == "hot":
    # Hot reloads of DTensors (issue 21): the second save and every restore after the first
    # reuse their plans (the structure is the same), each restore bit-exact.
    shm_dir, job = sys.argv[6:8]

    def bad_of(target, bump):
        return [f"w{i}" for i, shape in enumerate(SHAPES)
                if not torch.equal(target[f"w{i}"].full_tensor(),
                                   full(i, shape, target[f"w{i}"].dtype) + bump)]

    plans, whole, bad = [], [], []
    with safepoint.Checkpointer(ckpt, job=job, shm_dir=shm_dir) as ck:
        s = state(True)
        ck.save(7, s)
        plans.append(ck.status()["last_save"]["reused_plan"])
        with torch.no_grad():
            for i in range(len(SHAPES)):
                s[f"w{i}"].to_local().add_(1)
        ck.save(8, s)  # other values, the same structure
        plans.append(ck.status()["last_save"]["reused_plan"])
        def zeros():  # the saved non-tensor values (the plan's signature holds them too)
            out = state(False)
            out["meta"] = {"lr": 0.5, "name": "run"}
            return out

        target = zeros()
        for again in (target, target, zeros()):  # the same tensors, then new ones
            got = ck.restore(again)
            plans.append(ck._live.last_restore_reused_plan())
            whole.append(ck._live.last_restore_whole())
            bad += bad_of(again, 1) + ([] if got == 8 and ck.last_load_source == "memory"
                                       else [f"step {got} from {ck.last_load_source}"])
            with torch.no_grad():
                for i in range(len(SHAPES)):
                    again[f"w{i}"].to_local().zero_()

        # A module whose parameters are DTensors (FSDP2's), restored through its
        # load_state_dict again and again: each state_dict() call makes new DTensor objects, so
        # a restore must hand it the shards, never the targets' own DTensors (review of the
        # whole restore in place).
        class Module(torch.nn.Module):
            def __init__(self, fill: bool):
                super().__init__()
                for i, (shape, pl) in enumerate(zip(SHAPES, PLACEMENTS)):
                    g = full(i, shape)
                    self.register_parameter(f"w{i}", torch.nn.Parameter(
                        distribute_tensor(g if fill else torch.zeros_like(g), mesh, pl)))

        ck.save(9, {"model": Module(True), "step": 9})
        module = Module(False)
        for _ in range(3):
            got = ck.restore({"model": module, "step": 9})
            whole.append(ck._live.last_restore_whole())
            bad += [f"module w{i}" for i, shape in enumerate(SHAPES)
                    if not torch.equal(getattr(module, f"w{i}").full_tensor(), full(i, shape))]
            bad += [] if got == 9 else [f"module step {got}"]
            with torch.no_grad():
                for p in module.parameters():
                    p.to_local().zero_()
    print(json.dumps({"rank": rank, "ok": not bad, "plans": plans, "whole": whole,
                      "mismatches": bad}))
else:
    target = state(False)
    if mode == "shared":
        from safepoint._shared_reads import read_shared_into

        tree, everyone = read_shared_into(ckpt, 7, rank, target, None, dist.group.WORLD, True)
        got = 7 if everyone else None
        if tree is not None:
            target["meta"] = tree["meta"]
    else:
        got = safepoint.restore(ckpt, target, rank=rank)
    bad = []
    for i, shape in enumerate(SHAPES):
        k = f"w{i}"
        if not torch.equal(target[k].full_tensor(), full(i, shape, target[k].dtype)):
            bad.append(k)
    if not torch.equal(target["plain"], full(9, (4, 3))):
        bad.append("plain")
    if target["meta"] != {"lr": 0.5, "name": "run"}:
        bad.append("meta")
    print(json.dumps({"rank": rank, "ok": got == 7 and not bad, "step": got, "mismatches": bad}))
dist.barrier()
leave()
