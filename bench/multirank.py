"""safepoint benchmarks: 2- and 4-rank DDP and FSDP2 checkpoints against DLRover, DCP,
torch-checkpointing, NVRx, lm-resiliency and torch.save, with the node's peak host memory.

    make bench-multirank            # or: python bench/multirank.py [--size 256M] [--runs 3]
                                    #        [--worlds 2,4] [--methods a,b] [--setups ddp,fsdp2]

Rewrites the "Multi-rank checkpoints (DDP, FSDP2)" section of docs/benchmarks.md (issues 4
and 21). N ranks (subprocesses of this script on this node, gloo on the CPU, one torch thread
each; one job for each N of --worlds) hold the training state of a GPT-style model
(examples/tiny_gpt.py, AdamW) of about --size bytes of model + optimizer state (fp32 weights and
both moments), in two setups:

- **DDP**: every rank holds the whole state (replicated).
- **FSDP2**: ``fully_shard`` on an N-rank CPU mesh: every rank holds 1/N of it, as DTensors.

The state handed to every contender is ``torch.distributed.checkpoint.state_dict.get_state_dict``
of the model and optimizer (its tensors are the live parameters and optimizer moments). For each
contender, per repetition: a training step (untimed); the save, timed from a barrier to the
moment the live state may change again (blocking) and to the moment the checkpoint is on disk
(durable); then the live state is overwritten with zeros, the page cache is dropped, and the
load (restore into the live model and optimizer, in place) is timed and checked against the
saved values. Every figure is the slowest rank's, the median of --runs repetitions after a
warm-up round; contenders alternate in order (A B C, C B A) so drift hits all alike. The disk's
own O_DIRECT write bandwidth (dd) is measured in the same rounds (../shared/BENCHMARKING.md).
A sampler thread in the launcher reads the job's host memory every 10 ms (RssAnon of every
process of the job + /dev/shm used); the ranks mark each contender's phases, from which each
contender's peak is put together (memory_of).

Contenders: safepoint ``Checkpointer`` (flash: save copies into shared memory, the node agent
persists; durable = ``wait()`` returned; load = ``restore`` from memory), ``safepoint.save`` /
``safepoint.restore`` (synchronous, from storage), DCP ``dcp.save`` / ``dcp.async_save`` /
``dcp.load`` with the file system writer and reader, ``torch.save`` + fsync / ``torch.load`` per
rank, DLRover's flash checkpoint (``dlrover.trainer.torch.flash_checkpoint``),
torch-checkpointing 0.1.1's ``CheckpointManager`` (async), nvidia-resiliency-ext 0.7.0's async
checkpointing (``FileSystemWriterAsync`` + ``AsyncCallsQueue`` in its CPU shared-memory mode)
and lm-resiliency 0.2.0's ``InMemoryCheckpointManager`` (in-memory replicas on a pair rank).
Each class says how it is driven and what had to be set for it to run on the CPU.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

import torch  # noqa: E402

from run import (  # noqa: E402  (bench/run.py: helpers and the disk limit)
    MiB,
    drop_caches,
    free_port,
    fsync_path,
    gbps,
    limit_direct_write,
    machine,
    parse_size,
    rm,
    tensors_of,
    publish,
    run_took,
)

# DLRover 0.6.1 imports grpc without declaring it: `make bench-multirank` installs grpcio here
# (pip --target) when the environment lacks it. Appended to sys.path, so that the environment's own
# packages win over anything pip put beside it.
# The same for lm-resiliency 0.2.0 (--no-deps: it would pull another torch) and
# nvidia-resiliency-ext 0.7.0 (its only wheel is for CPython 3.12 on glibc 2.39: `make bench-deps`
# unpacks it with pip's --python-version/--platform; its async checkpointing is pure Python).
for _deps in ("dlrover-deps", "lmres-deps", "nvrx-deps", "tckpt-deps"):
    _path = os.path.join(os.path.dirname(HERE), "build", "bench", _deps)
    if os.path.isdir(_path):
        sys.path.append(_path)

WORLD = 2  # set from $WORLD_SIZE in each rank
SETUPS = ("ddp", "fsdp2")
METHODS = ("sp_flash", "sp_sync", "dcp_save", "dcp_async", "torch_save", "dlrover", "torch_ckpt",
           "nvrx", "lmres")
NAMES = {
    "sp_flash": "**safepoint Checkpointer** (flash)",
    "sp_sync": "safepoint.save / restore (sync)",
    "dcp_save": "DCP dcp.save / dcp.load",
    "dcp_async": "DCP dcp.async_save / dcp.load",
    "torch_save": "torch.save + fsync / torch.load, per rank",
    "dlrover": "DLRover flash checkpoint",
    "torch_ckpt": "torch-checkpointing 0.1.1 CheckpointManager (async)",
    "nvrx": "NVRx 0.7.0 async (FileSystemWriterAsync, CPU shm) / dcp.load",
    "lmres": "lm-resiliency 0.2.0 in-memory replicas",
}
# Flash contenders: the load comes from their memory, not from storage.
IN_MEMORY = ("sp_flash", "dlrover", "lmres")


# ------------------------------------------------------------------------------------------------
# The model

def model_shape(nbytes: int) -> dict:
    """tiny_gpt.TinyGPT arguments whose parameters + AdamW moments (16 bytes a parameter) come
    to about `nbytes` (weights and two moments, fp32: 12 bytes a parameter; 12 dim^2 parameters
    a block)."""
    dim = 512 if nbytes >= 128 * MiB else 256
    params = nbytes // 12
    layers = max(1, round(params / (12 * dim * dim)))
    return {"vocab": 256, "dim": dim, "layers": layers, "heads": 8, "context": 64}


def local(t):
    """A DTensor's local shard, or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def localized(obj):
    """The state tree with every DTensor replaced by its local shard (what torch.save and
    DLRover are given: they do not know DTensors)."""
    if isinstance(obj, torch.Tensor):
        return local(obj)
    if isinstance(obj, dict):
        return {k: localized(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(localized(v) for v in obj)
    return obj


def copy_into(targets: dict, loaded) -> None:
    """Copies the loaded tensors into the live ones (same keys), DTensors through their local
    shards."""
    got = tensors_of(loaded)
    for k, t in targets.items():
        local(t).copy_(local(got[k]))


def digest(targets: dict) -> list:
    return [float(local(t).double().sum()) for t in targets.values()]


# ------------------------------------------------------------------------------------------------
# One rank (a subprocess started by main())

class Rank:
    def __init__(self, cfg: dict):
        import torch.distributed as dist
        import tiny_gpt

        self.cfg, self.dist, self.tiny_gpt = cfg, dist, tiny_gpt
        self.rank = int(os.environ["RANK"])
        self.setup = cfg["setup"]
        self.work = cfg["work"]
        torch.set_num_threads(1)  # two ranks on this machine's cores
        dist.init_process_group("gloo")
        torch.manual_seed(0)
        model = tiny_gpt.TinyGPT(**cfg["shape"])
        if self.setup == "ddp":
            self.module = model
            self.net = torch.nn.parallel.DistributedDataParallel(model)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (WORLD,))
            for b in model.blocks:
                fully_shard(b, mesh=mesh)
            fully_shard(model, mesh=mesh)
            self.module = self.net = model
        self.opt = torch.optim.AdamW(self.module.parameters(), lr=1e-4, weight_decay=0.01)
        self.step = 0
        for _ in range(2):  # AdamW's moments exist
            self.train()
        sd = self.state()
        self.targets = tensors_of(sd)
        self.rank_bytes = sum(local(t).numel() * local(t).element_size()
                              for t in self.targets.values())

    def train(self) -> None:
        import torch.nn.functional as F

        self.step += 1
        x, y = self.tiny_gpt.batch(self.step * WORLD + self.rank, batch_size=4,
                                   context=self.cfg["shape"]["context"])
        logits = self.net(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.module, self.opt)
        return {"model": msd, "optim": osd}

    def barrier(self) -> None:
        self.dist.barrier()

    def gather(self, value):
        out = [None] * WORLD
        self.dist.all_gather_object(out, value)
        return out


def dir_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total


def fsync_tree(path: str) -> None:
    for root, _, files in os.walk(path):
        for f in files:
            fsync_path(os.path.join(root, f))


class Contender:
    """save(step, sd) -> (blocking s, durable s); load(sd) -> s; path: what it wrote on disk."""

    error = None

    def __init__(self, r: Rank, name: str):
        self.r, self.name = r, name
        self.root = os.path.join(r.work, name)
        if r.rank == 0:
            rm(self.root)
            os.makedirs(self.root)
        r.barrier()

    def written(self) -> int:
        """The bytes this rank's save put on disk (rank 0 counts the directory)."""
        return dir_bytes(self.root) if self.r.rank == 0 else 0

    def clear(self) -> None:  # after a repetition, untimed
        if self.r.rank == 0:
            for p in os.listdir(self.root):
                rm(os.path.join(self.root, p))

    def close(self) -> None:
        pass


class SpFlash(Contender):
    def __init__(self, r, name):
        super().__init__(r, name)
        import safepoint

        self.ckpt = safepoint.Checkpointer(self.root, job=f"{r.cfg['job']}-flash", keep=1)
        self.extra = {}

    def save(self, step, sd):
        t0 = time.perf_counter()
        self.ckpt.save(step, sd, persist=True)
        t1 = time.perf_counter()
        self.ckpt.wait()
        t2 = time.perf_counter()
        st = self.ckpt.status()
        self.persisted = st["last_persist_bytes"]
        self.extra = {"persist_s": st["last_persist_seconds"], "copy_s": st["last_save"]["copy_seconds"],
                      "wait_s": st["last_save"].get("wait_seconds")}
        return t1 - t0, t2 - t0

    def load(self, sd):
        t0 = time.perf_counter()
        self.ckpt.restore(sd)
        seconds = time.perf_counter() - t0
        self.extra["source"] = self.ckpt.last_load_source
        return seconds

    def written(self):  # the agent's count (the directory may still hold the step it prunes)
        return self.persisted

    def clear(self):  # keep=1: the agent prunes older steps itself
        pass

    def close(self):
        self.ckpt.close()


class SpSync(Contender):
    def save(self, step, sd):
        import safepoint

        self.last = step
        t0 = time.perf_counter()
        safepoint.save(self.root, step, sd, rank=self.r.rank, world_size=WORLD)
        t1 = time.perf_counter()
        self.r.barrier()  # committed once every rank's image is there
        return t1 - t0, time.perf_counter() - t0

    def load(self, sd):
        import safepoint

        t0 = time.perf_counter()
        safepoint.restore(self.root, sd, self.last, rank=self.r.rank)
        return time.perf_counter() - t0


class DcpSave(Contender):
    asynchronous = False

    def save(self, step, sd):
        import torch.distributed.checkpoint as dcp

        self.path = os.path.join(self.root, str(step))
        t0 = time.perf_counter()
        if self.asynchronous:
            fut = dcp.async_save(sd, checkpoint_id=self.path)
            t1 = time.perf_counter()
            if hasattr(fut, "upload_completion"):  # AsyncSaveResponse (newer torch)
                fut = fut.upload_completion
            fut.result()
        else:
            dcp.save(sd, checkpoint_id=self.path)
            t1 = time.perf_counter()
        return t1 - t0, time.perf_counter() - t0  # FileSystemWriter fsyncs (sync_files=True)

    def load(self, sd):
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        dcp.load(sd, checkpoint_id=self.path)
        return time.perf_counter() - t0


class DcpAsync(DcpSave):
    asynchronous = True


class TorchSave(Contender):
    def save(self, step, sd):
        self.path = os.path.join(self.root, f"{step}-rank{self.r.rank}.pt")
        t0 = time.perf_counter()
        with open(self.path, "wb") as f:
            torch.save(localized(sd), f)
            t1 = time.perf_counter()
            f.flush()
            os.fsync(f.fileno())
        fsync_path(self.path)
        return t1 - t0, time.perf_counter() - t0

    def load(self, sd):
        t0 = time.perf_counter()
        copy_into(self.r.targets, torch.load(self.path, weights_only=True))
        return time.perf_counter() - t0


class DLRover(Contender):
    """DLRover's flash checkpoint. DdpCheckpointer for DDP (only local rank 0 saves and persists
    the replicated state); for FSDP2, its FSDP checkpointers use FSDP1's API (tried first, the
    error is reported), so each rank's local shards go through DdpCheckpointer with
    local_shard_num = global_shard_num = 2. Started without dlrover-run, it forks its saver
    (the persisting agent) from local rank 0."""

    def __init__(self, r, name):
        super().__init__(r, name)
        from dlrover.python.common.constants import CheckpointConstant
        from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType

        self.notes = []
        if r.setup == "fsdp2":
            self.notes.append(self.try_fsdp_checkpointer())
        shards = 1 if r.setup == "ddp" else WORLD
        self.storage_type = StorageType.DISK
        self.ckpt = DdpCheckpointer(self.root, local_shard_num=shards, global_shard_num=shards)
        self.tracker = os.path.join(self.root, CheckpointConstant.TRACER_FILE_NAME)

    def try_fsdp_checkpointer(self) -> str:
        """DLRover's FsdpShardCheckpointer on the FSDP2 model, up to the point where it hands
        the state to its engine (no engine started, so its saver is not created twice)."""
        from dlrover.trainer.torch.flash_checkpoint.fsdp import FsdpShardCheckpointer

        class Engine:
            def save_to_memory(self, *a):
                pass

            save_to_storage = save_to_memory

        probe = FsdpShardCheckpointer.__new__(FsdpShardCheckpointer)
        probe.checkpoint_dir, probe._engine = self.root, Engine()
        try:
            probe.save_checkpoint(1, self.r.module, self.r.opt, path=self.root)
            return "FsdpShardCheckpointer accepted the FSDP2 model"
        except Exception as e:
            msg = str(e).strip().splitlines()[0][:240] if str(e).strip() else ""
            return (f"FsdpShardCheckpointer (it calls FSDP1's `FSDP.state_dict_type` and "
                    f"`FSDP.optim_state_dict`) on the FSDP2 model: {type(e).__name__}: {msg}")

    def save(self, step, sd):
        self.step = step
        t0 = time.perf_counter()
        self.ckpt.save_checkpoint(step, localized(sd), storage_type=self.storage_type)
        t1 = time.perf_counter()
        committed = t1
        if self.r.rank == 0:  # its saver writes the step into the tracker file when committed
            deadline = time.monotonic() + 600
            while True:
                try:
                    with open(self.tracker) as f:
                        if f.read().strip() == str(step):
                            break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"DLRover did not commit step {step} in 600 s")
                time.sleep(0.002)
            committed = time.perf_counter()
            # DLRover torch.saves the shards without fsync (only its tracker file is fsynced):
            # the bench fsyncs them to count the time until they are on disk.
            fsync_tree(os.path.join(self.root, str(step)))
        t2 = time.perf_counter()
        self.committed = committed - t0
        return t1 - t0, t2 - t0

    def load(self, sd):
        t0 = time.perf_counter()
        got = self.ckpt.load_checkpoint()  # from its shared memory
        copy_into(self.r.targets, got)
        return time.perf_counter() - t0

    def clear(self):
        if self.r.rank == 0:
            for p in os.listdir(self.root):
                if p.isdigit():
                    rm(os.path.join(self.root, p))

    def close(self):
        try:
            self.ckpt._engine.close()
        except Exception:
            pass


class TorchCkpt(Contender):
    """torch-checkpointing 0.1.1 (PyTorch's async engine): ``CheckpointManager`` with its default
    async saver (staging into shared memory on a thread, a writer subprocess), local file system
    storage. Blocking = ``save()`` returned
    and its staging future done (until then the live state must not change; the library's
    ``lock()`` lets the step overlap it); durable = the write future done, plus the bench's
    fsync of the files (the library does not fsync). Load = ``load(into=live state)``, cold."""

    def __init__(self, r, name):
        super().__init__(r, name)
        from torch_checkpointing import CheckpointManager
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

        # Its default storage opens files with O_DIRECT and writes them through a buffered
        # Python file: closing a file whose size is not a multiple of the block size fails on
        # this ext4 (OSError EINVAL), so the bench turns O_DIRECT off.
        self.notes = ["its default `LocalFileSystemStorageConfig(use_direct_io=True)` fails on "
                      "this disk (`OSError: [Errno 22] Invalid argument` closing a file whose "
                      "size is not block-aligned): run with `use_direct_io=False`; it does not "
                      "fsync, so the durable figure adds the bench's fsync of its files."]
        # With a resharder (`ItemSpec(resharder=DefaultResharder())`, what resharding loads
        # need), its metadata manager all-gathers the ranks' metadata through tensors it puts on
        # "cuda" (metadata_manager._all_gather_pickled_data), which fails on a CPU build of torch
        # with more than one rank: each rank saves and loads its own items (`model_<rank>.pt`,
        # `optim_<rank>.pt`: DTensors as they are), the layout-unchanged path.
        self.notes.append("with a resharder (`ItemSpec(resharder=DefaultResharder())`) its save "
                          "fails here: its metadata manager all-gathers through a tensor on "
                          "`device=\"cuda\"` (`AssertionError: Torch not compiled with CUDA "
                          "enabled`): run without one, each rank saving and loading its own "
                          "items.")
        self.mgr = CheckpointManager(CheckpointManager.Config(
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False)))

    def save(self, step, sd):
        self.path = os.path.join(self.root, str(step))
        if self.r.rank == 0:
            os.makedirs(self.path, exist_ok=True)
        self.r.barrier()
        t0 = time.perf_counter()
        fut = self.mgr.save(self.path, sd)
        if self.mgr._staging_future is not None:
            self.mgr._staging_future.result()
        t1 = time.perf_counter()
        if fut is not None:
            fut.result()
        self.r.barrier()
        if self.r.rank == 0:
            fsync_tree(self.path)
        return t1 - t0, time.perf_counter() - t0

    def load(self, sd):
        t0 = time.perf_counter()
        self.mgr.load(self.path, into=sd)
        return time.perf_counter() - t0

    def close(self):
        self.mgr.close()


class NVRx(Contender):
    """nvidia-resiliency-ext 0.7.0's async checkpointing as Megatron drives it:
    ``FileSystemWriterAsync`` (DCP format, one file a rank, fsync) planned with
    ``save_state_dict_async_plan``, run by a persistent ``AsyncCallsQueue`` worker process, in
    its CPU mode (``cpu_shm_mode=True``, ``use_cpu_shm_for_gpu_tensors=True``: tensors are
    copied into cached shared-memory tensors for the worker) with the cached plan
    (``use_cached_data_structure``). Its ``save_state_dict_async_finalize`` broadcasts the
    failure flag in a tensor on ``torch.cuda.current_device()``, which fails on a CPU build of
    torch: the finalize here does the same steps (gather the write results, write the metadata
    on rank 0, share failures) with gloo. Load: ``dcp.load`` (NVRx has no loader of its own)."""

    def __init__(self, r, name):
        super().__init__(r, name)
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue

        self.notes = []
        try:
            torch.cuda.current_device()
        except Exception as e:  # noqa: BLE001 - reported
            self.notes.append(
                "its own `save_state_dict_async_finalize` (and `maybe_finalize_async_calls` with "
                "no_dist=False) put a flag on `torch.cuda.current_device()`, here "
                f"`{type(e).__name__}: {str(e).strip()}`: the bench finalizes with the same steps "
                "over gloo and calls the queue with no_dist=True.")
        self.queue = AsyncCallsQueue(persistent=True, cpu_shm_mode=True)

    def save(self, step, sd):
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest
        from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import (
            FileSystemWriterAsync,
        )
        from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import (
            save_state_dict_async_plan,
        )

        self.path = os.path.join(self.root, str(step))
        if self.r.rank == 0:
            os.makedirs(self.path, exist_ok=True)
        self.r.barrier()
        dist = self.r.dist
        t0 = time.perf_counter()
        writer = FileSystemWriterAsync(self.path, thread_count=1, use_cpu_shm_for_gpu_tensors=True,
                                       use_cached_data_structure=True)
        writer, metadata, wrapper = save_state_dict_async_plan(sd, writer)
        fn, preload_fn, args = writer.get_save_function_and_args()

        def finalize():
            results = wrapper.gather_object(writer.retrieve_write_results())
            failed = 0
            if wrapper.is_coordinator:
                from torch.distributed.checkpoint.utils import _get_failure_dict

                failed = len(_get_failure_dict(results))
                if not failed:
                    writer.finish(metadata, results)
            flag = torch.tensor([failed], dtype=torch.int)
            dist.broadcast(flag, src=wrapper.coordinator_rank)
            if int(flag):
                raise RuntimeError("NVRx: a rank failed to write its checkpoint")

        self.queue.schedule_async_request(AsyncRequest(fn, args, [finalize], preload_fn=preload_fn))
        t1 = time.perf_counter()
        self.queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
        return t1 - t0, time.perf_counter() - t0

    def load(self, sd):
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        dcp.load(sd, checkpoint_id=self.path)
        return time.perf_counter() - t0

    def close(self):
        self.queue.close()


class LmRes(Contender):
    """lm-resiliency 0.2.0 (GEMINI): ``InMemoryCheckpointManager`` with replication_jump=1 (each
    rank's shard also held by its pair rank; world size divisible by 2 x replication_jump), no
    disk flush (``disk_flush_interval=0``), checksums on (``verify_integrity``), as
    bench/replication.py drives it. It flattens plain tensors, so it gets each rank's local
    shards (like DLRover). Blocking = ``save()``; replicated = ``finalize_replication()``
    returned (in the durable column's place: nothing reaches the disk); load = ``load(step)``
    from its memory, copied into the live tensors."""

    durable_is_replicated = True

    def __init__(self, r, name):
        super().__init__(r, name)
        from lm_resiliency import InMemoryCkptConfig
        from lm_resiliency.checkpointing.manager import InMemoryCheckpointManager

        cfg = InMemoryCkptConfig(interval=1, replication_jump=1, disk_flush_interval=0,
                                 disk_folder=self.root, run_id=f"{r.cfg['job']}-lmres",
                                 pin_memory=False, verify_integrity=True)
        self.mgr = InMemoryCheckpointManager(cfg)

    def save(self, step, sd):
        self.step = step
        t0 = time.perf_counter()
        self.mgr.save(localized(sd), step)
        t1 = time.perf_counter()
        if not self.mgr.finalize_replication():
            raise RuntimeError("lm-resiliency: finalize_replication() returned False")
        return t1 - t0, time.perf_counter() - t0

    def load(self, sd):
        t0 = time.perf_counter()
        got = self.mgr.load(step=self.step)
        if got is None:
            raise RuntimeError(f"lm-resiliency: no checkpoint of step {self.step} in memory")
        copy_into(self.r.targets, got[0])
        return time.perf_counter() - t0

    def written(self):
        return 0

    def clear(self):
        pass

    def close(self):
        try:
            self.mgr.close()
        except Exception:  # noqa: BLE001
            pass


CLASSES = {"sp_flash": SpFlash, "sp_sync": SpSync, "dcp_save": DcpSave, "dcp_async": DcpAsync,
           "torch_save": TorchSave, "dlrover": DLRover, "torch_ckpt": TorchCkpt, "nvrx": NVRx,
           "lmres": LmRes}


def worker(cfg: dict) -> None:
    global WORLD
    WORLD = int(os.environ["WORLD_SIZE"])
    warnings.simplefilter("ignore")
    r = Rank(cfg)
    out = {"setup": r.setup, "world": WORLD, "rank_bytes": r.gather(r.rank_bytes),
           "tensors": len(r.targets), "params": sum(p.numel() for p in r.module.parameters()),
           "methods": {}, "dd": [], "errors": {}, "notes": {}, "phases": []}
    # Phases for the launcher's memory sampler (wall clock, rank 0): [kind, method, start, end],
    # kind "ctor" (the contender is created), "warm" (a warm-up save + load), "rep" (a timed one).
    phases = out["phases"]
    r.barrier()
    time.sleep(0.1)  # a few samples of the job before any contender
    contenders = {}
    for m in cfg["methods"]:
        r.barrier()
        p0 = time.time()
        try:
            contenders[m] = CLASSES[m](r, m)
        except Exception as e:
            out["errors"][m] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
            traceback.print_exc()
        errs = r.gather(out["errors"].get(m))
        if any(errs) and m in contenders:  # the ranks must agree on who takes part
            contenders.pop(m).close()
            out["errors"][m] = next(e for e in errs if e)
        r.barrier()
        phases.append(["ctor", m, p0, time.time()])
        for note in getattr(contenders.get(m), "notes", []):
            out["notes"].setdefault(m, []).append(note)
        out["methods"][m] = {"blocking": [], "durable": [], "load": [], "bytes": [], "extra": []}
    order = [m for m in cfg["methods"] if m in contenders]
    dd_file = os.path.join(cfg["work"], "dd.bin")
    step = 1000
    for rnd in range(cfg["runs"] + 1):  # round 0 is a warm-up
        if r.rank == 0:
            print(f"[{r.setup}] round {rnd}/{cfg['runs']}", flush=True)
        # The warm-up round saves three times with each contender: flash checkpointers create
        # their shared memory (safepoint: two slots, used in turn) on the first saves, a
        # one-time cost; under DDP safepoint's copy plan (each rank copies its share) applies
        # from the second save, and its slots are laid out for the shares by the third.
        for m in [m for m in (order if rnd % 2 == 0 else order[::-1])
                  for _ in range(1 if rnd else 3)]:
            c = contenders[m]
            r.train()
            step += 1
            sd = r.state()
            want = digest(r.targets)
            gc.collect()
            r.barrier()
            p0 = time.time()
            try:
                blocking, durable = c.save(step, sd)
                r.barrier()
                size = c.written()
                with torch.no_grad():
                    for t in r.targets.values():
                        local(t).zero_()
                if r.rank == 0:
                    drop_caches([c.root])  # cold reads from storage (shared memory stays)
                gc.collect()
                r.barrier()
                load = c.load(sd)
                ok = digest(r.targets) == want
                err = None if ok else f"{m}: the restored state differs from the saved one"
            except Exception as e:
                traceback.print_exc()
                err = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
                blocking = durable = load = size = None
            errs = r.gather(err)
            if any(errs):
                raise RuntimeError(f"{m} failed: {[e for e in errs if e]}")
            got = r.gather((blocking, durable, load, size, getattr(c, "extra", None),
                            getattr(c, "committed", None)))
            c.clear()
            gc.collect()
            r.barrier()
            phases.append(["rep" if rnd else "warm", m, p0, time.time()])
            if rnd:
                rec = out["methods"][m]
                rec["blocking"].append(max(g[0] for g in got))
                rec["durable"].append(max(g[1] for g in got))
                rec["load"].append(max(g[2] for g in got))
                rec["bytes"].append(sum(g[3] for g in got))
                rec["extra"].append([g[4] for g in got] + [got[0][5]])
        r.barrier()
        if r.rank == 0:  # the disk's own limit, for the bytes of the whole (unsharded) state
            os.sync()
            seconds = limit_direct_write(dd_file, cfg["dd_bytes"])
            rm(dd_file)
            if rnd:
                out["dd"].append(seconds)
        r.barrier()
        # Memory references, on both ranks at once: a rank's bytes copied into warm memory and
        # into freshly allocated memory (first touch of every page).
        src = torch.empty(r.rank_bytes, dtype=torch.uint8).fill_(1)
        warm = torch.empty_like(src).fill_(0)
        gc.collect()
        r.barrier()
        t0 = time.perf_counter()
        warm.copy_(src)
        t1 = time.perf_counter()
        fresh = torch.empty_like(src)
        fresh.copy_(src)
        t2 = time.perf_counter()
        del src, warm, fresh
        refs = r.gather((t1 - t0, t2 - t1))
        if rnd:
            out.setdefault("memcpy_warm", []).append(max(x[0] for x in refs))
            out.setdefault("memcpy_fresh", []).append(max(x[1] for x in refs))
        r.barrier()
    for c in contenders.values():
        c.close()
    r.barrier()
    if r.rank == 0:
        with open(cfg["result"], "w") as f:
            json.dump(out, f)
    r.dist.destroy_process_group()
    # FSDP2's DeviceMesh keeps torch's gloo worker threads alive past destroy_process_group; one
    # that frees a finished collective's tensors during interpreter shutdown aborts the process
    # (pytorch/pytorch#190489). The results are written: leave without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ------------------------------------------------------------------------------------------------
# The launcher

def kill_strays(job: str) -> None:
    """Ends agents (safepointd) and DLRover savers that this run's jobs left behind."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if job in cmd or f"TORCHELASTIC_RUN_ID={job}".encode() in env:
            if int(pid) != os.getpid():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                    print(f"killed a stray process {pid}: {cmd[:120]}", flush=True)
                except OSError:
                    pass


def job_pids(job: str) -> list:
    """The processes of a job (as kill_strays finds them): the ranks, and what they started
    (agents, savers, writer processes), which inherit its $TORCHELASTIC_RUN_ID."""
    pids = []
    tag = f"TORCHELASTIC_RUN_ID={job}".encode()
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if job.encode() in cmd or tag in env:
            pids.append(int(pid))
    return pids


def shm_used() -> int:
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize


class MemSampler(threading.Thread):
    """Host memory of a job on this node, every `period` s: the anonymous resident memory
    (RssAnon: private memory; library and page-cache pages are left out, and so are
    shared-memory pages, which would count once per process mapping them) of every process of
    the job, plus the bytes used in /dev/shm (tmpfs: files, deleted ones still open included)
    above what was there when the job started."""

    def __init__(self, job: str, period: float = 0.01):
        super().__init__(daemon=True)
        self.job, self.period = job, period
        self.shm0 = shm_used()
        self.samples: list = []  # (wall time, anon bytes, shm bytes)
        self.stopping = threading.Event()

    def run(self) -> None:
        pids: list = []
        rescan = 0.0
        while not self.stopping.is_set():
            now = time.time()
            if now >= rescan:
                pids, rescan = job_pids(self.job), now + 0.25
            anon = 0
            for pid in pids:
                try:
                    with open(f"/proc/{pid}/status", "rb") as f:
                        for line in f:
                            if line.startswith(b"RssAnon:"):
                                anon += int(line.split()[1]) * 1024
                                break
                except OSError:
                    pass
            self.samples.append((now, anon, max(0, shm_used() - self.shm0)))
            self.stopping.wait(self.period)


def memory_of(samples: list, phases: list) -> dict:
    """Per contender, from the sampler and the ranks' phases: `base` the job before any
    contender existed; `held` what the contender keeps between saves (the level after its
    creation and its warm-up saves, less the level before them); `transient` the largest rise
    above the level at the start of one of its timed saves + loads; `peak` base + held +
    transient (the node's peak had it been the job's only checkpointer)."""
    ts = [x[0] for x in samples]
    tot = [x[1] + x[2] for x in samples]
    import bisect

    def before(t):
        i = bisect.bisect_left(ts, t) - 1
        return tot[max(i, 0)]

    def after(t):
        i = bisect.bisect_right(ts, t)
        return tot[min(i, len(tot) - 1)]

    def top(t0, t1):
        i, j = bisect.bisect_left(ts, t0), bisect.bisect_right(ts, t1)
        return max(tot[max(i - 1, 0):j + 1])

    first = min((p[2] for p in phases), default=ts[0] if ts else 0)
    base = before(first)
    out = {}
    for m in dict.fromkeys(p[1] for p in phases):
        held = 0
        for kind in ("ctor", "warm"):
            ps = [p for p in phases if p[1] == m and p[0] == kind]
            if ps:
                held += after(ps[-1][3]) - before(ps[0][2])
        rises = [top(p[2], p[3]) - before(p[2]) for p in phases if p[1] == m and p[0] == "rep"]
        tr = max(rises, default=0)
        out[m] = {"base": base, "held": max(held, 0), "transient": max(tr, 0),
                  "peak": base + max(held, 0) + max(tr, 0)}
    return out


def run_setup(setup: str, world: int, args, workdir: str) -> dict:
    job = f"mrbench-{os.getpid()}-{setup}-{world}"
    work = os.path.join(workdir, f"{setup}-{world}")
    os.makedirs(work, exist_ok=True)
    methods = list(args.methods)
    cfg = {"setup": setup, "shape": model_shape(args.size), "runs": args.runs, "work": work,
           "job": job, "methods": methods, "dd_bytes": args.size,
           "result": os.path.join(work, "result.json")}
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0",
               GROUP_WORLD_SIZE="1", NODE_RANK="0", TORCHELASTIC_RUN_ID=job,
               SAFEPOINT_SHM_DIR="/dev/shm", OMP_NUM_THREADS="1")
    procs = []
    logs = []
    if "dlrover" in args.methods:
        # DLRover's saver (the process that persists its shared memory) runs in the agent, as
        # dlrover-run starts it; the ranks then do not fork one themselves (ROLE_NAME).
        env["ROLE_NAME"] = "dlrover-trainer"
        log = open(os.path.join(args.dir, f"multirank-{setup}{world}-dlrover-saver.log"), "w")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--dlrover-saver"],
                                      env=env, stdout=log, stderr=log, start_new_session=True))
    saver = procs[:]
    sampler = MemSampler(job)
    sampler.start()
    for rank in range(world):
        log = open(os.path.join(args.dir, f"multirank-{setup}{world}-rank{rank}.log"), "w")
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(cfg)],
            env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
            stdout=log if rank else None, stderr=log, start_new_session=True))
    deadline = time.monotonic() + args.timeout
    try:
        ranks = [p for p in procs if p not in saver]
        while any(p.poll() is None for p in ranks):
            if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        sampler.stopping.set()
        sampler.join()
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for log in logs:
            log.close()
        kill_strays(job)
        shutil.rmtree(os.path.join("/tmp/ckpt_sock", job), ignore_errors=True)
        for name in os.listdir("/dev/shm"):
            if job in name:
                rm(os.path.join("/dev/shm", name))
    codes = [p.returncode for p in procs if p not in saver]
    if codes != [0] * world or not os.path.exists(cfg["result"]):
        tail = ""
        for rank in range(world):
            with open(os.path.join(args.dir, f"multirank-{setup}{world}-rank{rank}.log")) as f:
                tail += f"--- rank {rank}:\n" + "".join(f.readlines()[-30:])
        raise SystemExit(f"[{setup}, {world} ranks] the ranks exited with {codes}\n{tail}")
    with open(cfg["result"]) as f:
        res = json.load(f)
    res["shape"] = cfg["shape"]
    res["memory"] = memory_of(sampler.samples, res.pop("phases"))
    res["mem_samples"] = len(sampler.samples)
    return res


# ------------------------------------------------------------------------------------------------
# Report

GOALS = {"ddp": (0.6, 0.8), "fsdp2": (0.8, 0.8)}  # issue 21: blocking, hot reload vs DLRover


def render(results: list, args, conditions: str) -> str:
    med = statistics.median
    worlds = sorted({res["world"] for res in results})
    lines = [f"Measured {datetime.date.today().isoformat()} on {machine()}.",
             f"Command: `make bench-multirank` (`python bench/multirank.py --size "
             f"{args.size // MiB}M --runs {args.runs} --worlds {','.join(map(str, worlds))}`). "
             f"{conditions}",
             "",
             f"{' and '.join(map(str, worlds))} ranks (processes on this one node, gloo on the "
             "CPU, "
             "one torch thread each) train a GPT-style model (`examples/tiny_gpt.py`, AdamW) and "
             "checkpoint model + optimizer state from `get_state_dict` (the live tensors); the "
             "model is the same in every run (--size is the whole model + AdamW state: each rank "
             "holds all of it in DDP, 1/N of it in FSDP2). For each contender, per repetition: "
             "one training step (untimed), the save from a barrier until the live state may change "
             "again (**blocking**: the call returned, and for torch-checkpointing its staging "
             "future too) and until the checkpoint is on disk (**durable**: fsync returned / "
             "committed; for lm-resiliency, which writes nothing, until its replicas are in "
             "place), "
             "then the live state is zeroed, the page cache dropped, and the **load** restores the "
             "step into the live model and optimizer in place (checked against the saved values). "
             "Each figure is the slowest rank's; median (and range) of "
             f"{args.runs} repetitions after a warm-up round, contenders alternated. In-memory "
             "contenders (safepoint Checkpointer, DLRover, lm-resiliency) load from their memory "
             "(**hot reload**); the others cold from disk. safepoint's agent writes with 16 I/O "
             "threads; DCP and NVRx with one thread a rank; torch.save one stream a rank.",
             "",
             "**Peak host memory per node**: a sampler in the launcher reads, every 10 ms, the "
             "anonymous resident memory (RssAnon) of every process of the job (ranks, agents, "
             "savers, writer processes) plus the bytes used in /dev/shm (shared memory, counted "
             "once) above what was there before the job. All contenders live in the same "
             "processes, so each one's figure is put together from its own phases: the job before "
             "any contender (the training state and the processes: *base*), plus what the "
             "contender keeps between saves (its level after creation and the warm-up saves, less "
             "the level before: *held*), plus the largest rise during one of its timed saves + "
             "loads: the node's peak had it been the only checkpointer. *Above base* is that peak "
             "less the base: what the checkpointer costs the node (its buffers, copies and "
             "processes), also as a multiple of *S*, the training state held on the node (the "
             "sum of the ranks' state). /dev/shm is the machine's: shared memory that another "
             "job on it allocates during a contender's phase counts too (the run is under the "
             "measurement lock, but tests may run beside it)."]
    for res in results:
        setup, world = res["setup"], res["world"]
        sh = res["shape"]
        rb = res["rank_bytes"]
        total = sum(rb) if setup == "fsdp2" else rb[0]
        node_state = sum(rb)
        dd = med(res["dd"]) if res["dd"] else None
        mem = res.get("memory", {})
        m = {k: v for k, v in res["methods"].items() if v["blocking"]}
        lines.append("")
        title = ("DDP (replicated state: every rank holds all of it)" if setup == "ddp" else
                 f"FSDP2 (`fully_shard` on a {world}-rank CPU mesh: every rank holds 1/{world}, "
                 "as DTensors)")
        lines.append(f"### {world}-rank {title}")
        lines.append("")
        lines.append(f"Model: dim {sh['dim']}, {sh['layers']} layers, {res['params'] / 1e6:.1f} M "
                     f"parameters; model + AdamW state {total / MiB:.0f} MiB "
                     f"({res['tensors']} tensors a rank; "
                     f"{', '.join(f'{b / MiB:.0f}' for b in rb)} MiB on ranks "
                     f"{', '.join(map(str, range(world)))}; S = {node_state / MiB:.0f} MiB on the "
                     f"node). Disk in the same run: dd O_DIRECT write+fsync (bs=8M) of "
                     f"{total / MiB:.0f} MiB: "
                     + (f"{gbps(total, dd):.2f} GB/s ({dd:.3f} s)." if dd else "not measured."))
        if res.get("memcpy_warm"):
            one = max(rb)
            mw, mf = med(res["memcpy_warm"]), med(res["memcpy_fresh"])
            lines.append("")
            lines.append(f"Memory in the same run (a rank's {one / MiB:.0f} MiB, all {world} ranks "
                         f"at once, one thread each): copy into warm memory {mw:.3f} s "
                         f"({gbps(one, mw):.2f} GB/s); into freshly allocated memory {mf:.3f} s "
                         f"({gbps(one, mf):.2f} GB/s: every page touched for the first time).")
        lines.append("")
        ref = m.get("dlrover")
        ref_b = med(ref["blocking"]) if ref else None
        ref_l = med(ref["load"]) if ref else None
        base = next(iter(mem.values()))["base"] if mem else None
        lines.append("| contender | blocking s | vs DLRover | durable s | written MiB | written "
                     "GB/s (to durable) | vs dd | load s | vs DLRover | peak host memory MiB "
                     "| above base MiB (x S) | held between saves MiB |")
        lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")

        def ratio(x, r):
            return f"{x / r:.2f}x" if r else ""

        def cell(xs):  # the median, and the range over the repetitions
            return (f"{med(xs):.3f} ({min(xs):.2f}–{max(xs):.2f})" if len(xs) > 1
                    else f"{xs[0]:.3f}")

        for k in METHODS:
            if k not in res["methods"]:
                continue
            if k not in m:
                err = res["errors"].get(k, "did not run").replace("|", "\\|")
                lines.append(f"| {NAMES[k]} | failed: {err} | | | | | | | | | | |")
                continue
            v = m[k]
            b, d, ld, nb = med(v["blocking"]), med(v["durable"]), med(v["load"]), med(v["bytes"])
            mm = mem.get(k)
            over = mm["peak"] - mm["base"] if mm else 0
            memcell = (f"{mm['peak'] / MiB:.0f} | {over / MiB:.0f} ({over / node_state:.2f})"
                       if mm else " | ")
            heldcell = f"{mm['held'] / MiB:.0f}" if mm else ""
            if k == "lmres":
                dcell, wcell, rcell, vcell = f"{cell(v['durable'])} replicated", "0", "—", "—"
            else:
                rate = nb / d / 1e9
                dcell, wcell, rcell = cell(v["durable"]), f"{nb / MiB:.0f}", f"{rate:.2f}"
                vcell = f"{rate / (total / dd / 1e9):.0%}" if dd else ""
            lines.append(f"| {NAMES[k]} | {cell(v['blocking'])} | {ratio(b, ref_b)} | {dcell} | "
                         f"{wcell} | {rcell} | {vcell} | {cell(v['load'])} | {ratio(ld, ref_l)} | "
                         f"{memcell} | {heldcell} |")
        if base is not None:
            lines.append("")
            lines.append(f"Base (the job with no checkpointer: {world} ranks, each a Python "
                         f"process with torch, and their training state): {base / MiB:.0f} MiB; "
                         f"{res.get('mem_samples', 0)} memory samples.")
        if "sp_flash" in m:
            sp = {q: med(m["sp_flash"][q]) for q in ("blocking", "durable", "load")}
            goals = []
            gb, gl = GOALS[setup]
            if ref:
                for q, what, g in (("blocking", "blocking", gb), ("load", "hot reload", gl)):
                    r = sp[q] / med(ref[q])
                    goals.append(f"{what} ≤ {g}x DLRover's: {r:.2f}x, "
                                 + ("met" if r <= g else
                                    f"**missed** by {r / g - 1:.0%} ({sp[q]:.3f} s against "
                                    f"a target of {g * med(ref[q]):.3f} s)"))
            for q, what in (("blocking", "blocking"), ("load", "load")):
                worse = [f"{NAMES[k].replace('**', '')} ({sp[q] / med(m[k][q]):.2f}x)"
                         for k in METHODS if k in m and k != "sp_flash" and med(m[k][q]) <= sp[q]]
                goals.append(f"{what} below every other contender: "
                             + ("met" if not worse else
                                "**missed**: not below " + ", ".join(worse)))
            lines.append("")
            lines.append("Goals (issue 21, medians of this run): " + "; ".join(goals) + ".")
            later = [f"{NAMES[k].replace('**', '')} ({sp['durable'] / med(m[k]['durable']):.2f}x)"
                     for k in METHODS if k in m and k not in ("sp_flash", "lmres")
                     and med(m[k]["durable"]) < sp["durable"]]
            if later:
                lines.append("")
                lines.append("Durable later than: " + ", ".join(later) + ".")
        notes = []
        if "sp_flash" in m:
            ex = [e for rep in m["sp_flash"]["extra"] for e in rep[:world] if e]
            ps = [e["persist_s"] for e in ex if e.get("persist_s")]
            cp = [e["copy_s"] for e in ex if e.get("copy_s")]
            wt = max((e.get("wait_s") or 0 for e in ex), default=0)
            src = sorted({e.get("source") for e in ex if e.get("source")})
            notes.append(f"safepoint Checkpointer: the copy into shared memory took "
                         f"{med(cp):.3f} s a rank (median), the agent's persist of a rank's image "
                         f"{med(ps):.3f} s (16 I/O threads); the rest of the blocking time is "
                         f"flattening, indexing and notifying the agent (longest wait for a slot "
                         f"{wt:.3f} s); restore read from {', '.join(src)} (the slot in place, "
                         "copied once into the live tensors while its chunks are verified)."
                         if cp and ps else
                         "safepoint Checkpointer: no status figures.")
        if "dlrover" in m:
            com = [rep[-1] for rep in m["dlrover"]["extra"] if rep[-1]]
            notes.append(f"DLRover: its saver committed the step (tracker file written and "
                         f"fsynced) after {med(com):.3f} s (median); it torch.saves the shards "
                         "without fsync, so the durable figure adds the bench's fsync of its "
                         "files. "
                         + (f"Each rank's local shards go through `DdpCheckpointer` "
                            f"(local_shard_num = global_shard_num = {world}), since its FSDP "
                            "checkpointers take FSDP1 modules (below)." if setup == "fsdp2" else
                            "`DdpCheckpointer`: only local rank 0 copies and persists the "
                            f"(replicated) state; all {world} ranks load it from that shared "
                            "memory."))
        for k, ns in res["notes"].items():
            for n in ns:
                notes.append(f"{NAMES[k]}: {n}")
        for k, e in res["errors"].items():
            if k in m:
                notes.append(f"{NAMES[k]}: {e}")
        if notes:
            lines.append("")
            lines.extend(f"- {n}" for n in notes)
    return "\n".join(lines) + "\n"


def load_conditions() -> str:
    load1, load5, _ = os.getloadavg()
    import safepoint

    rev = subprocess.run(["git", "-C", os.path.dirname(HERE), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True).stdout.strip()
    return (f"safepoint from {os.path.dirname(safepoint.__file__)} (repository at {rev or '?'}). "
            f"Load average at the start {load1:.2f} (1 min) / {load5:.2f} (5 min) on "
            f"{os.cpu_count()} cores; other jobs shared the machine.")


def main() -> None:
    if sys.argv[1:] == ["--dlrover-saver"]:
        from dlrover.python.elastic_agent.torch.ckpt_saver import AsyncCheckpointSaver

        AsyncCheckpointSaver.start_async_saving_ckpt()  # threads; this process is killed at the end
        while True:
            time.sleep(60)
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(json.loads(sys.argv[2]))
        return
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=parse_size, default=parse_size("256M"),
                    help="model + AdamW state of the whole model (default 256M)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--setups", default=",".join(SETUPS))
    ap.add_argument("--worlds", default="2,4", help="ranks a run (default 2,4: one run each)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--dir", default=os.path.join(os.path.dirname(HERE), "build", "bench"),
                    help="where to write (a directory on the disk being measured)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds a setup may take")
    ap.add_argument("--note", default="", help="a sentence for the doc (e.g. which build)")
    ap.add_argument("--no-doc", action="store_true", help="print, do not rewrite docs/benchmarks.md")
    args = ap.parse_args()
    args.methods = [m for m in args.methods.split(",") if m]
    bad = [m for m in args.methods if m not in METHODS] + \
          [s for s in args.setups.split(",") if s not in SETUPS]
    worlds = [int(w) for w in args.worlds.split(",") if w]
    if bad or args.runs < 1 or not worlds or min(worlds) < 2:
        raise SystemExit(f"unknown {bad}, --runs < 1 or a world below 2")
    os.makedirs(args.dir, exist_ok=True)
    conditions = (args.note + " " if args.note else "") + load_conditions()
    t0 = time.perf_counter()
    workdir = tempfile.mkdtemp(prefix="multirank-", dir=args.dir)
    try:
        results = [run_setup(s, w, args, workdir) for w in worlds for s in args.setups.split(",")]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    conditions += run_took(t0)
    section = render(results, args, conditions)
    publish(args, "multirank", "Multi-rank checkpoints (DDP, FSDP2)", section, results)


if __name__ == "__main__":
    main()
