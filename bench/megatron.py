"""Megatron-Core dist_checkpointing: safepoint's strategies against Megatron's own torch_dist.

    python bench/megatron.py [--size 256M] [--world 4] [--runs 5]

Issue 34 item 1. --world ranks (subprocesses of this script, gloo on the CPU, one torch thread
each) hold a sharded state dict as Megatron-Core builds it for a GPT-style model with TP 2 and
DP --world/2 and a DistributedOptimizer: bf16 weights split over TP (``ShardedTensor.
from_rank_offsets``, replicated over DP: DP rank 0 saves them) and the optimizer's fp32
``exp_avg``, ``exp_avg_sq`` and main params split over all ranks (every rank saves 1/--world of
them), plus common values. --size is what the ranks save together (about 86% optimizer state).

Each contender saves through Megatron's own ``dist_checkpointing.save`` (and loads through
``dist_checkpointing.load``), per repetition into a new directory:

- torch_dist sync: ``sharded_strategy=("torch_dist", 1)`` (Megatron's DCP format, its
  ``FileSystemWriterAsync``, 2 writer threads a rank, fsync);
- torch_dist async: the same with ``async_sharded_save=True`` and Megatron's ``AsyncCallsQueue``
  (a forked writer process per rank, ``TemporalAsyncCaller``);
- safepoint sync / async: ``("safepoint", 1)``, the same two ways (async: the request's
  ``preload_fn`` clones the host tensors and writes on a thread of the rank's process; Megatron's
  forked process only waits for it);
- safepoint flash: ``SafepointSaveStrategy(flash=True)`` (copy into shared memory; the node agent
  persists).

**blocking**: from a barrier until the call that the training loop makes returns (``save``; for
async, ``save`` + ``schedule_async_request``). **next update**: right after, every tensor of the
state is written once in place (``mul_(1.0)``, the same bits), as the next optimizer step would:
while a forked writer (the async contenders) still runs, each page written is copied first
(copy-on-write), a cost the training pays after the save returned. **durable**: until the
checkpoint is on storage (sync: the same; async: ``maybe_finalize_async_calls(blocking=True)``
returned; flash: the strategy's ``wait()`` returned: the agent committed the step), the next
update included. **load**: the checkpoint's files evicted from the page cache (posix_fadvise),
then ``dist_checkpointing.load`` into a template of
the same layout, checked bit for bit against what was saved. Every figure is the slowest rank's,
the median of --runs repetitions after two warm-up rounds (a flash Checkpointer allocates its two
shared-memory slots in its first two saves); contenders alternate in order.

On a CPU-only torch, Megatron 0.16.1's torch_dist finalize, ``AsyncCallsQueue`` and
``TemporalAsyncCaller`` call ``torch.cuda.current_device()`` / ``torch.cuda.synchronize()``
(CUDA-only); the ranks replace those two with ``"cpu"`` and a no-op (a flag tensor on the CPU,
no device to wait for). safepoint's strategies do not call them (the queue does).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

# Run as a script, this file's directory is sys.path[0], where "megatron" would be this file and
# not the megatron package.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

# Warm-up rounds, not measured: a flash Checkpointer allocates its two shared-memory slots in its
# first two saves (steady state reuses them), and every contender's first save pays imports.
WARMUP = 2
CONTENDERS = ["torch_dist sync", "torch_dist async", "safepoint sync", "safepoint async",
              "safepoint flash"]


def parse_size(s: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(s[:-1]) * units[s[-1].upper()]) if s[-1].upper() in units else int(s)


# --- the ranks -----------------------------------------------------------------------------------

def build_state(size: int, rank: int, world: int, empty: bool = False):
    import torch
    from megatron.core.dist_checkpointing import ShardedTensor

    tp, dp = 2, world // 2
    tpr, dpr = rank % tp, rank // tp
    rows, cols = 2048, 1024  # a param of 2 Mi elements; 14 bytes saved per element
    count = max(1, round(size / (rows * cols * 14)))
    def values(seed: int, *shape, dtype=torch.float32):
        # The same values wherever a shard is held (DP replicas of a weight are equal).
        if empty:
            return torch.zeros(*shape, dtype=dtype)
        return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)

    model, optim = {}, {}
    for i in range(count):
        key = f"decoder.layers.{i}.mlp.linear_fc1.weight"
        model[key] = ShardedTensor.from_rank_offsets(
            key, values(1000 * i + tpr, rows // tp, cols, dtype=torch.bfloat16), (0, tpr, tp),
            replica_id=(0, 0, dpr))
        for j, what in enumerate(("exp_avg", "exp_avg_sq", "fp32_param")):
            okey = f"optimizer.state.{what}.{key}"
            shard = tpr * dp + dpr
            optim[okey] = ShardedTensor.from_rank_offsets(
                okey, values(10**6 * (j + 1) + 1000 * i + shard, rows // (tp * dp), cols),
                (0, shard, tp * dp), replica_id=0)
        norm = f"decoder.layers.{i}.input_layernorm.weight"
        model[norm] = ShardedTensor.from_rank_offsets(norm, values(-1 - i, cols),
                                                      replica_id=(0, tpr, dpr))
    return {"model": model, "optimizer": {"state": optim, "param_groups": [{"lr": 1e-4}]},
            "iteration": 1}


def tensors_of(sd) -> list:
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    return [v.data for v in nested_values(sd) if hasattr(v, "data")]


def evict(paths) -> None:
    for path in paths:
        for r, _, fs in os.walk(path):
            for f in fs:
                try:
                    fd = os.open(os.path.join(r, f), os.O_RDONLY)
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    os.close(fd)
                except OSError:
                    pass


def rank_main(a) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.synchronize = lambda *x, **k: None  # module doc: Megatron's CUDA-only calls
    torch.cuda.current_device = lambda: "cpu"
    torch.set_num_threads(1)
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.base import AsyncCallsQueue

    import safepoint.megatron as spm

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    state = build_state(a.size, rank, world)
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import is_main_replica

    mine = sum(v.data.numel() * v.data.element_size() for v in nested_values(state)
               if hasattr(v, "data") and is_main_replica(v.replica_id))
    queue = AsyncCallsQueue()
    roots = {c: os.path.join(a.dir, c.replace(" ", "_")) for c in CONTENDERS}
    strategies = {
        "safepoint sync": spm.SafepointSaveStrategy(roots["safepoint sync"], keep=1),
        "safepoint async": spm.SafepointSaveStrategy(roots["safepoint async"], keep=1),
        "safepoint flash": spm.SafepointSaveStrategy(roots["safepoint flash"], flash=True,
                                                     keep=2, shm_dir=a.shm, job="megatron-bench"),
    }
    out: dict = {c: {"blocking": [], "update": [], "durable": [], "load": []}
                 for c in a.contenders}
    live = tensors_of(state)
    counter = 0
    for rnd in range(a.runs + WARMUP):
        order = a.contenders if rnd % 2 == 0 else a.contenders[::-1]
        for c in order:
            counter += 1
            ckpt = os.path.join(roots[c], f"iter_{counter:07d}")
            if rank == 0:
                os.makedirs(ckpt)
            dist.barrier()
            strategy = ("torch_dist", 1) if c.startswith("torch_dist") else strategies[c]
            is_async = c.endswith("async")
            t0 = time.perf_counter()
            req = dist_checkpointing.save(state, ckpt, sharded_strategy=strategy,
                                          async_sharded_save=is_async)
            if is_async:
                queue.schedule_async_request(req)
            blocking = time.perf_counter() - t0
            # The optimizer step that follows writes every tensor of the state once (x1.0:
            # the same bits): with a forked writer still running, each page it writes is
            # copied first (copy-on-write), a cost the training pays after save returned.
            t1 = time.perf_counter()
            with torch.no_grad():
                for t in live:
                    t.mul_(1.0)
            update = time.perf_counter() - t1
            if is_async:
                queue.maybe_finalize_async_calls(blocking=True)
            elif c == "safepoint flash":
                strategies[c].wait()
            durable = time.perf_counter() - t0
            evict([roots[c]])
            template = build_state(a.size, rank, world, empty=True)
            dist.barrier()
            t0 = time.perf_counter()
            loaded = dist_checkpointing.load(template, ckpt)
            load = time.perf_counter() - t0
            same = all(torch.equal(loaded[part][k], sh.data)
                       for part, group in (("model", state["model"]),)
                       for k, sh in group.items()) and all(
                torch.equal(loaded["optimizer"]["state"][k], sh.data)
                for k, sh in state["optimizer"]["state"].items())
            if not same or loaded["iteration"] != 1:
                raise SystemExit(f"rank {rank}: {c}: the loaded state differs from the saved")
            del loaded, template
            dist.barrier()
            if rank == 0:  # safepoint: the pointer directory (keep= prunes the steps)
                shutil.rmtree(ckpt)
            if rnd >= WARMUP:
                out[c]["blocking"].append(blocking)
                out[c]["durable"].append(durable)
                out[c]["load"].append(load)
                out[c]["update"].append(update)
    strategies["safepoint flash"].close()
    everyone = [None] * world
    dist.all_gather_object(everyone, {"times": out, "bytes": mine})
    if rank == 0:
        print("RESULT " + json.dumps(everyone), flush=True)
    dist.destroy_process_group()


# --- the launcher --------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="256M", help="bytes the ranks save together")
    ap.add_argument("--world", type=int, default=4, help="ranks (even: TP 2 x DP world/2)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--contenders", default=",".join(CONTENDERS),
                    help="comma-separated, of: " + ", ".join(CONTENDERS))
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    ap.add_argument("--shm", help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.size = parse_size(a.size) if isinstance(a.size, str) else a.size
    a.contenders = [c for c in CONTENDERS if c in a.contenders.split(",")]
    if a.rank:
        rank_main(a)
        return
    if a.world < 2 or a.world % 2:
        sys.exit("--world must be even (TP 2)")
    load_before = os.getloadavg()
    work = tempfile.mkdtemp(prefix="sp-megatron-bench-", dir=os.environ.get("BENCH_DIR"))
    shm = tempfile.mkdtemp(prefix="spmb-", dir="/dev/shm")
    started = time.time()
    try:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = []
        for r in range(a.world):
            env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(a.world),
                       LOCAL_WORLD_SIZE=str(a.world), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
            procs.append(subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--rank", "--size", str(a.size),
                 "--runs", str(a.runs), "--dir", work, "--shm", shm,
                 "--contenders", ",".join(a.contenders)], env=env,
                stdout=subprocess.PIPE, text=True))
        outs = [p.communicate()[0] for p in procs]
        if any(p.returncode for p in procs):
            sys.exit(f"a rank failed: exit codes {[p.returncode for p in procs]}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    result = json.loads(next(line for line in outs[0].splitlines()
                             if line.startswith("RESULT "))[7:])
    report(a, result, load_before, time.time() - started)


def report(a, ranks: list, load_before, took: float) -> None:
    import torch

    import safepoint

    total = sum(r["bytes"] for r in ranks)

    def slowest(c: str, what: str) -> list:
        return [max(r["times"][c][what][i] for r in ranks) for i in range(a.runs)]

    def cell(xs: list) -> str:
        return f"{statistics.median(xs):.3f} ({min(xs):.2f}–{max(xs):.2f})"

    def med(c: str, what: str) -> float:
        return statistics.median(slowest(c, what)) if c in a.contenders else float("nan")

    def ratio(x: float, ref: float) -> str:
        return "—" if ref != ref else f"{x / ref:.2f}x"  # nan: that reference did not run

    commit = subprocess.run(["git", "-C", _HERE,
                             "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    print(f"Measured {datetime.date.today()} on {os.cpu_count()} cores (shared with other "
          f"jobs), torch {torch.__version__}, megatron-core 0.16.1, safepoint "
          f"{getattr(safepoint, '__version__', '?')} (repository at {commit.stdout.strip()}). "
          f"Command: `python bench/megatron.py --size {a.size >> 20}M --world {a.world} "
          f"--runs {a.runs}`. Load average before {load_before[0]:.2f} (1 min) / "
          f"{load_before[1]:.2f} (5 min), after {os.getloadavg()[0]:.2f}; the run took "
          f"{took:.0f} s.\n")
    print(f"{a.world} ranks (TP 2 x DP {a.world // 2}) save {total / 2**20:.0f} MiB together "
          f"({', '.join(str(round(r['bytes'] / 2**20)) for r in ranks)} MiB written by ranks "
          f"0..{a.world - 1}: DP rank 0 writes the bf16 weights, every rank its 1/{a.world} of "
          f"the optimizer state).\n")
    print("| contender | blocking s | vs torch_dist sync | vs torch_dist async | next update s | "
          "durable s | load s | vs torch_dist |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for c in a.contenders:
        b, u, d, ld = (slowest(c, w) for w in ("blocking", "update", "durable", "load"))
        mb, ml = statistics.median(b), statistics.median(ld)
        print(f"| {c} | {cell(b)} | {ratio(mb, med('torch_dist sync', 'blocking'))} | "
              f"{ratio(mb, med('torch_dist async', 'blocking'))} | {cell(u)} | {cell(d)} | "
              f"{cell(ld)} | "
              f"{ratio(ml, med('torch_dist sync', 'load'))} |")

if __name__ == "__main__":
    main()
