"""One rank of a gloo job that saves and loads DTensor state through safepoint.dcp
(tests/python/test_dcp.py).

    python dcp_worker.py STORE_FILE CKPT WORLD RANK PHASE

PHASE ``save``: saves step 1 (DTensors sharded Shard(0) and Shard(1), a replicated tensor, an
int tensor, non-tensor values), loads it back into fresh DTensors and checks every element, then
runs a save of step 2 during which rank 1 fails (its planner raises), checks that step 2 is
not visible, and saves step 3 with dcp.async_save through safepoint.dcp.ShmStager.
PHASE ``load``: loads step 1 into this world size's shards and checks them.
Each rank prints one JSON line.
"""

import json
import os
import sys
import warnings

import torch

warnings.filterwarnings("ignore")


def global_state() -> dict:
    """The full tensors of the checkpointed state, the same on every rank and in the test."""
    g = torch.Generator().manual_seed(1234)
    return {
        "w0": torch.randn(13, 6, generator=g),                        # Shard(0), uneven
        "w1": torch.randn(5, 11, generator=g).to(torch.bfloat16),     # Shard(1), uneven
        "big": torch.randn(300, 257, generator=g, dtype=torch.float64),  # Shard(1), strided reads
        "idx": torch.randint(-2**40, 2**40, (9,), generator=g),        # Shard(0), int64
        "rep": torch.randn(4, 3, generator=g),                         # replicated plain tensor
    }


PLACEMENT = {"w0": 0, "w1": 1, "big": 1, "idx": 0}  # shard dim of each DTensor


def sharded(mesh, full: dict, fill=None) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor

    out = {}
    for k, t in full.items():
        src = t if fill is None else torch.full_like(t, fill)
        out[k] = (distribute_tensor(src, mesh, [Shard(PLACEMENT[k])]) if k in PLACEMENT
                  else src.clone())
    return out


def main() -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.device_mesh import init_device_mesh

    import safepoint
    import safepoint.dcp as sdcp
    from gloo_exit import leave

    store_file, ckpt, world, rank, phase = sys.argv[1:6]
    world, rank = int(world), int(rank)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank,
                            world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    full = global_state()
    report: dict = {"rank": rank, "world": world}

    def load_and_check(step) -> dict:
        target = {"model": sharded(mesh, full, fill=0), "meta": {"step": -1, "name": ""}}
        reader = sdcp.Reader(ckpt, step=step)
        dcp.load(target, storage_reader=reader)
        ok = {k: bool(torch.equal(v.full_tensor() if k in PLACEMENT else v, full[k]))
              for k, v in target["model"].items()}
        # Only what this rank's shards overlap is read (plus the small non-tensor items).
        local = sum(v.to_local().numel() * v.element_size() if k in PLACEMENT
                    else v.numel() * v.element_size() for k, v in target["model"].items())
        extra = sum(reader.storage_data[MetadataIndex(f"meta.{k}")].nbytes
                    for k in ("step", "name"))
        return {"ok": ok, "meta": target["meta"], "bytes_read": reader.bytes_read,
                "needed": local + extra, "step": reader._loaded_step}

    if phase == "save":
        state = {"model": sharded(mesh, full), "meta": {"step": 1, "name": "run"}}
        dcp.save(state, storage_writer=sdcp.Writer(ckpt, step=1))
        report["steps_after_save"] = safepoint.steps(ckpt)
        report["load"] = load_and_check(None)

        class FailingOnRank1(DefaultSavePlanner):
            """Rank 1 fails while its data is resolved: rank 0's image lands, rank 1's never."""

            def resolve_data(self, write_item):
                if rank == 1:
                    raise RuntimeError("rank 1 fails during the save")
                return super().resolve_data(write_item)

        state["meta"]["step"] = 2
        try:
            dcp.save(state, storage_writer=sdcp.Writer(ckpt, step=2), planner=FailingOnRank1())
            report["failed_save"] = "no error"
        except BaseException as e:  # CheckpointException derives from BaseException
            report["failed_save"] = type(e).__name__
        dist.barrier()
        report["steps_after_failure"] = safepoint.steps(ckpt)
        reader = sdcp.Reader(ckpt)
        dcp.load({"meta": {"step": -1, "name": ""}}, storage_reader=reader)
        report["newest_loaded"] = reader._loaded_step
        try:  # the unfinished step cannot be re-saved over its leftover image
            dcp.save(state, storage_writer=sdcp.Writer(ckpt, step=2))
            report["resave"] = "no error"
        except BaseException as e:
            report["resave"] = str(e)
        # async_save: the DTensors' local shards are staged into shared memory, then written.
        with sdcp.ShmStager() as stager:
            state["meta"]["step"] = 3
            dcp.async_save(state, storage_writer=stager.writer(ckpt, step=3)).result()
            report["stager_files"] = len(stager.files)
        report["async"] = load_and_check(3)
    else:
        report["load"] = load_and_check(1)
    dist.barrier()
    print(json.dumps(report), flush=True)
    leave()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
