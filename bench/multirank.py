"""safepoint benchmarks: 2-rank DDP and FSDP2 checkpoints against DCP, torch.save and DLRover.

    make bench-multirank            # or: python bench/multirank.py [--size 256M] [--runs 3]

Rewrites the "Multi-rank checkpoints (DDP, FSDP2)" section of docs/benchmarks.md (issue 4,
"Done when"). Two ranks (subprocesses of this script, gloo on the CPU, one torch thread each)
hold the training state of a GPT-style model (examples/tiny_gpt.py, AdamW) of about --size bytes
of model + optimizer state (fp32 weights and both moments), in two setups:

- **DDP**: every rank holds the whole state (replicated).
- **FSDP2**: ``fully_shard`` on a 2-rank CPU mesh: every rank holds half of it, as DTensors.

The state handed to every contender is ``torch.distributed.checkpoint.state_dict.get_state_dict``
of the model and optimizer (its tensors are the live parameters and optimizer moments). For each
contender, per repetition: a training step (untimed); the save, timed from a barrier to the
return of the save call (blocking) and to the moment the checkpoint is on disk (durable); then
the live state is overwritten with zeros, the page cache is dropped, and the load (restore into
the live model and optimizer, in place) is timed and checked against the saved values. Every
figure is the slowest rank's, the median of --runs repetitions after a warm-up round; contenders
alternate in order (A B C, C B A) so drift hits all alike. The disk's own O_DIRECT write
bandwidth (dd) is measured in the same rounds (../shared/BENCHMARKING.md).

Contenders: safepoint ``Checkpointer`` (flash: save copies into shared memory, the node agent
persists; durable = ``wait()`` returned; load = ``restore`` from memory), ``safepoint.save`` /
``safepoint.restore`` (synchronous, from storage), DCP ``dcp.save`` / ``dcp.async_save`` /
``dcp.load`` with the file system writer and reader, ``torch.save`` + fsync / ``torch.load`` per
rank, and DLRover's flash checkpoint (``dlrover.trainer.torch.flash_checkpoint``).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
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
DLROVER_DEPS = os.path.join(os.path.dirname(HERE), "build", "bench", "dlrover-deps")
if os.path.isdir(DLROVER_DEPS):
    sys.path.append(DLROVER_DEPS)

WORLD = 2
SETUPS = ("ddp", "fsdp2")
METHODS = ("sp_flash", "sp_sync", "dcp_save", "dcp_async", "torch_save", "dlrover")
NAMES = {
    "sp_flash": "**safepoint Checkpointer** (flash)",
    "sp_sync": "safepoint.save / restore (sync)",
    "dcp_save": "DCP dcp.save / dcp.load",
    "dcp_async": "DCP dcp.async_save / dcp.load",
    "torch_save": "torch.save + fsync / torch.load, per rank",
    "dlrover": "DLRover flash checkpoint",
}


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


CLASSES = {"sp_flash": SpFlash, "sp_sync": SpSync, "dcp_save": DcpSave, "dcp_async": DcpAsync,
           "torch_save": TorchSave, "dlrover": DLRover}


def worker(cfg: dict) -> None:
    warnings.simplefilter("ignore")
    r = Rank(cfg)
    out = {"setup": r.setup, "rank_bytes": r.gather(r.rank_bytes), "tensors": len(r.targets),
           "params": sum(p.numel() for p in r.module.parameters()),
           "methods": {}, "dd": [], "errors": {}, "notes": {}}
    contenders = {}
    for m in cfg["methods"]:
        try:
            contenders[m] = CLASSES[m](r, m)
        except Exception as e:
            out["errors"][m] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
            traceback.print_exc()
        errs = r.gather(out["errors"].get(m))
        if any(errs) and m in contenders:  # the ranks must agree on who takes part
            contenders.pop(m).close()
            out["errors"][m] = next(e for e in errs if e)
        for note in getattr(contenders.get(m), "notes", []):
            out["notes"].setdefault(m, []).append(note)
        out["methods"][m] = {"blocking": [], "durable": [], "load": [], "bytes": [], "extra": []}
    order = [m for m in cfg["methods"] if m in contenders]
    dd_file = os.path.join(cfg["work"], "dd.bin")
    step = 1000
    for rnd in range(cfg["runs"] + 1):  # round 0 is a warm-up
        if r.rank == 0:
            print(f"[{r.setup}] round {rnd}/{cfg['runs']}", flush=True)
        # The warm-up round saves twice with each contender: flash checkpointers create their
        # shared memory (safepoint: two slots, used in turn) on the first saves, a one-time cost.
        for m in [m for m in (order if rnd % 2 == 0 else order[::-1])
                  for _ in range(1 if rnd else 2)]:
            c = contenders[m]
            r.train()
            step += 1
            sd = r.state()
            want = digest(r.targets)
            gc.collect()
            r.barrier()
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
            r.barrier()
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

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def run_setup(setup: str, args, workdir: str) -> dict:
    job = f"mrbench-{os.getpid()}-{setup}"
    work = os.path.join(workdir, setup)
    os.makedirs(work, exist_ok=True)
    cfg = {"setup": setup, "shape": model_shape(args.size), "runs": args.runs, "work": work,
           "job": job, "methods": args.methods, "dd_bytes": args.size,
           "result": os.path.join(work, "result.json")}
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD), GROUP_RANK="0",
               GROUP_WORLD_SIZE="1", NODE_RANK="0", TORCHELASTIC_RUN_ID=job,
               SAFEPOINT_SHM_DIR="/dev/shm", OMP_NUM_THREADS="1")
    procs = []
    logs = []
    if "dlrover" in args.methods:
        # DLRover's saver (the process that persists its shared memory) runs in the agent, as
        # dlrover-run starts it; the ranks then do not fork one themselves (ROLE_NAME).
        env["ROLE_NAME"] = "dlrover-trainer"
        log = open(os.path.join(args.dir, f"multirank-{setup}-dlrover-saver.log"), "w")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--dlrover-saver"],
                                      env=env, stdout=log, stderr=log, start_new_session=True))
    saver = procs[:]
    for rank in range(WORLD):
        log = open(os.path.join(args.dir, f"multirank-{setup}-rank{rank}.log"), "w")
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
    if codes != [0] * WORLD or not os.path.exists(cfg["result"]):
        tail = ""
        for rank in range(WORLD):
            with open(os.path.join(args.dir, f"multirank-{setup}-rank{rank}.log")) as f:
                tail += f"--- rank {rank}:\n" + "".join(f.readlines()[-30:])
        raise SystemExit(f"[{setup}] the ranks exited with {codes}\n{tail}")
    with open(cfg["result"]) as f:
        res = json.load(f)
    res["shape"] = cfg["shape"]
    return res


# ------------------------------------------------------------------------------------------------
# Report

def render(results: list, args, conditions: str) -> str:
    med = statistics.median
    lines = [f"Measured {datetime.date.today().isoformat()} on {machine()}.",
             f"Command: `make bench-multirank` (`python bench/multirank.py --size "
             f"{args.size // MiB}M --runs {args.runs}`). {conditions}",
             "",
             "Two ranks (processes, gloo on the CPU, one torch thread each) train a GPT-style model "
             "(`examples/tiny_gpt.py`, AdamW) and checkpoint model + optimizer state from "
             "`get_state_dict` (the live tensors). For each contender, per repetition: one "
             "training step (untimed), the save from a barrier until the call returns "
             "(**blocking**) and until the checkpoint is on disk (**durable**: fsync returned / "
             "committed), then the live state is zeroed, the page cache dropped, and the "
             "**load** restores the step into the live model and optimizer in place (checked "
             "against the saved values). Each figure is the slower rank's; median (and range) of "
             f"{args.runs} repetitions after a warm-up round, contenders alternated. Flash "
             "contenders (safepoint Checkpointer, DLRover) load from their shared memory; the "
             "others cold from disk. safepoint's agent writes with 16 I/O threads; DCP with one "
             "thread a rank; torch.save one stream a rank."]
    for res in results:
        setup = res["setup"]
        sh = res["shape"]
        rb = res["rank_bytes"]
        total = sum(rb) if setup == "fsdp2" else rb[0]
        dd = med(res["dd"]) if res["dd"] else None
        m = {k: v for k, v in res["methods"].items() if v["blocking"]}
        lines.append("")
        title = ("DDP (replicated state: every rank holds all of it)" if setup == "ddp" else
                 "FSDP2 (`fully_shard` on a 2-rank CPU mesh: every rank holds half, as DTensors)")
        lines.append(f"### 2-rank {title}")
        lines.append("")
        lines.append(f"Model: dim {sh['dim']}, {sh['layers']} layers, {res['params'] / 1e6:.1f} M "
                     f"parameters; model + AdamW state {total / MiB:.0f} MiB "
                     f"({res['tensors']} tensors a rank; {', '.join(f'{b / MiB:.0f}' for b in rb)} "
                     f"MiB on ranks 0, 1). Disk in the same run: dd O_DIRECT write+fsync (bs=8M) of "
                     f"{total / MiB:.0f} MiB: "
                     + (f"{gbps(total, dd):.2f} GB/s ({dd:.3f} s)." if dd else "not measured."))
        if res.get("memcpy_warm"):
            one = max(rb)
            mw, mf = med(res["memcpy_warm"]), med(res["memcpy_fresh"])
            lines.append("")
            lines.append(f"Memory in the same run (a rank's {one / MiB:.0f} MiB, both ranks at once, "
                         f"one thread each): copy into warm memory {mw:.3f} s "
                         f"({gbps(one, mw):.2f} GB/s); into freshly allocated memory {mf:.3f} s "
                         f"({gbps(one, mf):.2f} GB/s: every page touched for the first time).")
        lines.append("")
        ref_b = med(m["dcp_async"]["blocking"]) if "dcp_async" in m else None
        ref_d = med(m["dcp_async"]["durable"]) if "dcp_async" in m else None
        ref_l = med(m["dcp_async"]["load"]) if "dcp_async" in m else None
        lines.append("| contender | blocking s | vs DCP async_save | durable s | vs DCP async_save "
                     "| written MiB | written GB/s (to durable) | vs dd | load s | vs dcp.load |")
        lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for k in METHODS:
            if k not in res["methods"]:
                continue
            if k not in m:
                err = res["errors"].get(k, "did not run")
                lines.append(f"| {NAMES[k]} | failed: {err} | | | | | | | | |")
                continue
            v = m[k]
            b, d, ld, nb = med(v["blocking"]), med(v["durable"]), med(v["load"]), med(v["bytes"])
            rate = nb / d / 1e9

            def ratio(x, ref):
                return f"{x / ref:.2f}x" if ref else ""
            def cell(xs):  # the median, and the range over the repetitions
                return f"{med(xs):.3f} ({min(xs):.2f}–{max(xs):.2f})" if len(xs) > 1 else f"{xs[0]:.3f}"
            lines.append(f"| {NAMES[k]} | {cell(v['blocking'])} | {ratio(b, ref_b)} | "
                         f"{cell(v['durable'])} | {ratio(d, ref_d)} | {nb / MiB:.0f} | {rate:.2f} | "
                         f"{(rate / (total / dd / 1e9)) if dd else 0:.0%} | {cell(v['load'])} | "
                         f"{ratio(ld, ref_l)} |")
        if "sp_flash" in m:  # where the flash Checkpointer loses, in words
            sp = {q: med(m["sp_flash"][q]) for q in ("blocking", "durable", "load")}
            losses = []
            for q, what in (("blocking", "blocks longer than"), ("durable", "is durable later than"),
                            ("load", "loads slower than")):
                worse = [f"{NAMES[k].replace('**', '')} ({sp[q] / med(m[k][q]):.1f}x)"
                         for k in METHODS if k in m and k != "sp_flash" and med(m[k][q]) < sp[q]]
                if worse:
                    losses.append(f"{what} {', '.join(worse)}")
            lines.append("")
            lines.append("Where the safepoint Checkpointer loses here (medians): "
                         + ("; ".join(losses) if losses else "nowhere") + ".")
        notes = []
        if "sp_flash" in m:
            ex = [e for rep in m["sp_flash"]["extra"] for e in rep[:WORLD] if e]
            ps = [e["persist_s"] for e in ex if e.get("persist_s")]
            cp = [e["copy_s"] for e in ex if e.get("copy_s")]
            wt = max((e.get("wait_s") or 0 for e in ex), default=0)
            src = sorted({e.get("source") for e in ex if e.get("source")})
            notes.append(f"safepoint Checkpointer: the copy into shared memory took "
                         f"{med(cp):.3f} s a rank (median), the agent's persist of a rank's image "
                         f"{med(ps):.3f} s (16 I/O threads); the rest of the blocking time is "
                         f"flattening, indexing and notifying the agent (longest wait for a slot "
                         f"{wt:.3f} s); restore read from {', '.join(src)}: it copies out of the "
                         "slot into new memory, verifying checksums, then into the live tensors."
                         if cp and ps else
                         "safepoint Checkpointer: no status figures.")
        if "dlrover" in m:
            com = [rep[-1] for rep in m["dlrover"]["extra"] if rep[-1]]
            notes.append(f"DLRover: its saver committed the step (tracker file written and "
                         f"fsynced) after {med(com):.3f} s (median); it torch.saves the shards "
                         "without fsync, so the durable figure adds the bench's fsync of its "
                         "files. "
                         + ("Each rank's local shards go through `DdpCheckpointer` "
                            "(local_shard_num = global_shard_num = 2), since its FSDP "
                            "checkpointers take FSDP1 modules (below)." if setup == "fsdp2" else
                            "`DdpCheckpointer`: only local rank 0 copies and persists the "
                            "(replicated) state; both ranks load it from that shared memory."))
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
    if bad or args.runs < 1:
        raise SystemExit(f"unknown {bad} or --runs < 1")
    os.makedirs(args.dir, exist_ok=True)
    conditions = (args.note + " " if args.note else "") + load_conditions()
    t0 = time.perf_counter()
    workdir = tempfile.mkdtemp(prefix="multirank-", dir=args.dir)
    try:
        results = [run_setup(s, args, workdir) for s in args.setups.split(",")]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    conditions += run_took(t0)
    section = render(results, args, conditions)
    publish(args, "multirank", "Multi-rank checkpoints (DDP, FSDP2)", section, results)


if __name__ == "__main__":
    main()
