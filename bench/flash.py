"""safepoint benchmarks: flash checkpoints (Checkpointer) against memcpy, torch.save and DCP.

    make bench                      # or: python bench/flash.py [--sizes 256M,2G] [--runs 3]

Rewrites the "Flash checkpoints" section of docs/benchmarks.md (issue 3, "Done when"). Every
figure is a ratio against a reference measured in the same run (../shared/BENCHMARKING.md):

- Blocking time of ``Checkpointer.save`` in the steady state (both shared-memory slots created and
  pre-faulted by two warm-up saves, whose one-time creation cost is reported on its own) against
  a plain parallel memcpy of the same bytes into warm, pre-faulted shared memory (one flat
  ``Tensor.copy_`` on all cores, and the same bytes copied tensor by tensor), against torch.save
  (to /dev/shm: its serialization cost; to disk: buffered) and torch.distributed.checkpoint's
  ``async_save`` (the time until it returns).
- Hot reload: ``Checkpointer.load()`` in a fresh Checkpointer of the same job (source "memory")
  against the same memcpy into warm memory and into freshly allocated memory (a loader must
  allocate its destination).
- Persist throughput: the agent's persist of the snapshot (its own timer) against sequential
  O_DIRECT write bandwidth in the checkpoint directory (dd, and at depth, from bench/run.py;
  and at depth into a preallocated file, as safepoint's storage writes).
- Time to durable: save + wait against torch.save + fsync and DCP async_save + future.result().

Median of several samples after a warm-up round; contenders alternate (A B C, C B A) so drift
hits all alike. The in-memory figures (memcpy, save blocking, reload) are taken three times a
round, the disk figures once a round.
"""

from __future__ import annotations

import datetime
import gc
import math
import mmap
import os
import statistics
import sys
import time
import warnings

import torch

import safepoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run import (  # noqa: E402  (bench/run.py: the storage benchmark's helpers and limits)
    GiB,
    IO_REQUEST,
    IO_THREADS,
    MiB,
    bench_arguments,
    fsync_path,
    gbps,
    limit_direct_write,
    llm_like_state,
    machine,
    parallel_direct,
    rm,
    run_sizes,
    state_bytes,
    tensors_of,
    publish,
)

TARGET_TENSORS = 10_000
IN_MEMORY_REPS = 3  # in-memory samples per round (each is cheap; the machine is noisy)
ALIGN = 64  # per-tensor reference: tensors packed at 64-byte offsets in the warm buffer


# ------------------------------------------------------------------------------------------------
# The state: bench/run.py's LLM-like state with as many small tensors as make ~10,000 in all.

def _small_bytes(count: int) -> int:
    return sum((256 + (i * 97) % 3840) * (2 if i % 3 == 0 else 4) for i in range(count))


def small_count_for(total: int, target: int = TARGET_TENSORS) -> int:
    """The small_count for which llm_like_state(total, small_count) holds about `target` tensors
    (small ones, a 0-d step counter per 4 small ones, the large ones). Small tensors are kept to
    at most a quarter of the bytes, so states under ~256 MiB have fewer tensors."""
    big = 64 * MiB if total >= GiB else 16 * MiB
    small = int(target / 1.25)
    while small > 0:
        sb = _small_bytes(small)
        large = max(0, math.ceil((total - sb) / big))
        if sb <= total // 4 and small + math.ceil(small / 4) + large <= target:
            return small
        small -= max(1, small // 200) if sb > total // 4 else 1
    return 1


# ------------------------------------------------------------------------------------------------
# References: memory copies

class WarmShm:
    """A /dev/shm file of `nbytes`, mapped, every page written once: warm, pre-faulted shared
    memory like a safepoint slot after its creation."""

    def __init__(self, nbytes: int):
        self.path = f"/dev/shm/safepoint-flash-bench-{os.getpid()}"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            self.map = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.tensor = torch.frombuffer(self.map, dtype=torch.uint8)
        self.tensor.fill_(0)

    def close(self) -> None:
        del self.tensor
        gc.collect()
        self.map.close()
        rm(self.path)


class MemoryReferences:
    """The copy limits for the state's bytes: a flat parallel copy into warm shared memory, the
    same bytes copied tensor by tensor into it, and a flat copy into freshly allocated memory
    (4 KiB pages, and with madvise(MADV_HUGEPAGE) like safepoint's hot-reload buffer)."""

    def __init__(self, state, nbytes: int):
        self.nbytes = nbytes
        self.src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)  # warm private source
        self.shm = WarmShm(nbytes + ALIGN * len(tensors_of(state)))
        dst = self.shm.tensor
        self.flat_dst = dst[:nbytes]
        self.flat_dst.copy_(self.src)
        self.pairs = []
        off = 0
        for t in tensors_of(state).values():
            src = t.reshape(-1).view(torch.uint8)
            n = src.numel()
            self.pairs.append((src, dst[off:off + n]))
            off = (off + n + ALIGN - 1) // ALIGN * ALIGN
        self.per_tensor()  # the first pass over the views

    def flat(self) -> float:
        t0 = time.perf_counter()
        self.flat_dst.copy_(self.src)
        return time.perf_counter() - t0

    def per_tensor(self) -> float:
        pairs = self.pairs
        t0 = time.perf_counter()
        for s, d in pairs:
            d.copy_(s)
        return time.perf_counter() - t0

    def fresh(self) -> float:
        t0 = time.perf_counter()
        dst = torch.empty(self.nbytes, dtype=torch.uint8)
        dst.copy_(self.src)
        seconds = time.perf_counter() - t0
        del dst
        return seconds

    def fresh_thp(self) -> float:
        t0 = time.perf_counter()
        m = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        m.madvise(mmap.MADV_HUGEPAGE)
        dst = torch.frombuffer(m, dtype=torch.uint8)
        dst.copy_(self.src)
        seconds = time.perf_counter() - t0
        del dst
        m.close()
        return seconds

    def close(self) -> None:
        self.pairs = []
        self.flat_dst = None
        self.shm.close()


# ------------------------------------------------------------------------------------------------
# Contenders on disk

class Dcp:
    """torch.distributed.checkpoint.async_save in one process (gloo, world size 1). `error` says
    what failed when it cannot run in this torch."""

    def __init__(self, workdir: str):
        self.error = None
        self.started = False
        try:
            import torch.distributed as dist
            import torch.distributed.checkpoint as dcp

            self.dist, self.dcp = dist, dcp
            if not dist.is_initialized():
                store = dist.FileStore(os.path.join(workdir, "dcp.store"), 1)
                dist.init_process_group("gloo", store=store, rank=0, world_size=1)
                self.started = True
        except Exception as e:  # reported in the output
            self.error = f"initializing a gloo process group failed: {type(e).__name__}: {e}"

    def save(self, state, path: str):
        """(blocking seconds, seconds to durable) or None when it failed (self.error says)."""
        if self.error:
            return None
        try:
            t0 = time.perf_counter()
            fut = self.dcp.async_save(state, checkpoint_id=path)
            t1 = time.perf_counter()
            if hasattr(fut, "upload_completion"):  # AsyncSaveResponse (newer torch)
                fut = fut.upload_completion
            fut.result()
            t2 = time.perf_counter()
            return t1 - t0, t2 - t0
        except Exception as e:  # reported in the output
            self.error = f"dcp.async_save failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
            return None

    def close(self) -> None:
        if self.started:
            self.dist.destroy_process_group()


def torch_save(state, path: str, durable: bool):
    """(seconds until torch.save returned, seconds until fsync returned)."""
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state, f)
        t1 = time.perf_counter()
        if durable:
            f.flush()
            os.fsync(f.fileno())
    if durable:
        fsync_path(path)
    return t1 - t0, time.perf_counter() - t0


# ------------------------------------------------------------------------------------------------
# One size

def settle() -> None:
    """Between contenders, untimed: write back dirty pages and collect garbage, so that one
    contender's leftovers are not billed to the next."""
    os.sync()
    gc.collect()


def bench_size(label: str, nbytes: int, runs: int, workdir: str) -> dict:
    print(f"[{label}] building the state", flush=True)
    state = llm_like_state(nbytes, small_count=small_count_for(nbytes))
    real = state_bytes(state)
    ntensors = len(tensors_of(state))
    ckpt_dir = os.path.join(workdir, f"flash-{label.replace(' ', '')}")
    job = f"flash-bench-{os.getpid()}-{label.replace(' ', '')}"
    torch_disk = os.path.join(workdir, "model.pt")
    torch_shm = f"/dev/shm/safepoint-flash-bench-{os.getpid()}.pt"
    dd_file = os.path.join(workdir, "dd.bin")
    dcp_dir = os.path.join(workdir, "dcp")
    res = {"label": label, "bytes": real, "tensors": ntensors, "create": [], "first_save": [],
           "mem": {k: [] for k in ("memcpy_flat", "memcpy_tensors", "memcpy_fresh", "memcpy_fresh_thp",
                                   "sp_save", "sp_copy", "sp_load")},
           "disk": {k: [] for k in ("sp_save", "sp_durable", "sp_persist", "torch_shm",
                                    "torch_disk", "torch_durable", "dcp_blocking", "dcp_durable",
                                    "dd_write", "depth_write")},
           "persist_bytes": None, "image_bytes": None, "dcp_error": None, "load_sources": set()}
    refs = MemoryReferences(state, real)
    dcp = Dcp(workdir)
    ckpt = safepoint.Checkpointer(ckpt_dir, job=job, keep=1)
    loaders = []  # fresh Checkpointers of the job; dropped after ckpt.close() (see the end)
    step = 0
    try:
        # Two warm-up saves create and pre-fault both slots: a one-time cost, reported alone.
        for _ in range(2):
            step += 1
            t0 = time.perf_counter()
            ckpt.save(step, state, persist=False)
            res["first_save"].append(time.perf_counter() - t0)
            res["create"].append(ckpt.status()["last_save"]["create_seconds"])
        print(f"[{label}] {ntensors:,} tensors, {real / MiB:.0f} MiB; slot creation "
              f"{', '.join(f'{s:.2f}' for s in res['create'])} s", flush=True)

        def sp_save():
            nonlocal step
            step += 1
            gc.collect()
            t0 = time.perf_counter()
            ckpt.save(step, state, persist=False)
            seconds = time.perf_counter() - t0
            res["mem"]["sp_copy"].append(ckpt.status()["last_save"]["copy_seconds"])
            return seconds

        def sp_load(check=False):
            loader = safepoint.Checkpointer(ckpt_dir, job=job, keep=1)
            loaders.append(loader)
            gc.collect()
            t0 = time.perf_counter()
            out = loader.load()
            seconds = time.perf_counter() - t0
            res["load_sources"].add(loader.last_load_source)
            if out is None or out[0] != step:
                raise RuntimeError(f"hot reload returned step {out and out[0]}, expected {step}")
            if check:  # once: the reloaded state is the saved one, bit for bit
                got = tensors_of(out[1])
                for k, t in tensors_of(state).items():
                    if not torch.equal(got[k], t):
                        raise RuntimeError(f"hot reload: tensor {k} differs")
            del out
            return seconds

        mem = {"memcpy_flat": refs.flat, "memcpy_tensors": refs.per_tensor,
               "memcpy_fresh": refs.fresh, "memcpy_fresh_thp": refs.fresh_thp,
               "sp_save": sp_save}
        # The reload follows the round's save in either order: it comes last both ways.
        mem_order = ["memcpy_flat", "sp_save", "memcpy_tensors", "memcpy_fresh", "memcpy_fresh_thp"]

        def sp_durable():
            nonlocal step
            step += 1
            t0 = time.perf_counter()
            ckpt.save(step, state, persist=True)
            t1 = time.perf_counter()
            ckpt.wait()
            t2 = time.perf_counter()
            st = ckpt.status()
            res["persist_bytes"] = st["last_persist_bytes"]
            res["image_bytes"] = st["last_save"]["image_bytes"]
            return {"sp_save": t1 - t0, "sp_durable": t2 - t0, "sp_persist": st["last_persist_seconds"]}

        def torch_to_shm():
            try:
                return {"torch_shm": torch_save(state, torch_shm, False)[0]}
            finally:
                rm(torch_shm)

        def torch_to_disk():
            rm(torch_disk)
            settle()
            blocking, durable = torch_save(state, torch_disk, True)
            rm(torch_disk)
            return {"torch_disk": blocking, "torch_durable": durable}

        def dcp_save():
            rm(dcp_dir)
            settle()
            out = dcp.save(state, dcp_dir)
            rm(dcp_dir)
            return {} if out is None else {"dcp_blocking": out[0], "dcp_durable": out[1]}

        def dd():
            out = {"dd_write": limit_direct_write(dd_file, real)}
            rm(dd_file)
            settle()
            out["depth_write"] = parallel_direct(dd_file, real, True)
            rm(dd_file)
            return out

        disk = [sp_durable, torch_to_shm, torch_to_disk, dcp_save, dd]

        for r in range(runs + 1):  # round 0 is a warm-up and is not counted
            print(f"[{label}] round {r}/{runs}", flush=True)
            for rep in range(IN_MEMORY_REPS):
                order = mem_order if (r * IN_MEMORY_REPS + rep) % 2 == 0 else mem_order[::-1]
                got = {k: mem[k]() for k in order}
                got["sp_load"] = sp_load(check=(r == 0 and rep == 0))
                if r:
                    for k, v in got.items():
                        res["mem"][k].append(v)
            if not r:
                res["mem"]["sp_copy"].clear()
            settle()
            for fn in (disk if r % 2 == 0 else disk[::-1]):
                got = fn()
                settle()
                if r:
                    for k, v in got.items():
                        res["disk"][k].append(v)
        res["dcp_error"] = dcp.error
    finally:
        try:
            ckpt.close()
        finally:
            # Only now: a Checkpointer that goes without closing is taken for a dead process,
            # and the agent would flush its newest unpersisted snapshot in the background.
            loaders.clear()
            gc.collect()
            dcp.close()
            refs.close()
            for p in (ckpt_dir, torch_disk, torch_shm, dd_file, dcp_dir):
                rm(p)
    res["load_sources"] = sorted(s for s in res["load_sources"] if s)
    del state
    gc.collect()
    return res


# ------------------------------------------------------------------------------------------------
# Report

def render(results, runs) -> str:
    med = statistics.median
    lines = []
    cores = os.cpu_count()
    lines.append(f"Measured {datetime.date.today().isoformat()} on {machine()}.")
    lines.append(f"Command: `make bench` (`python bench/flash.py`). In-memory figures (memcpy, "
                 f"save blocking, hot reload) are the median of {runs}x{IN_MEMORY_REPS} samples, "
                 f"disk figures the median of {runs} rounds, all after a warm-up round, contenders "
                 f"alternated. torch uses {torch.get_num_threads()} threads (`torch.set_num_threads`), "
                 f"safepoint's copies {cores} threads, its agent {IO_THREADS} I/O threads; "
                 "torch.save and DCP write with one thread. Throughputs count the state's tensor "
                 "bytes. Each save and load is timed from the call to its return, in Python.")
    lines.append("")
    lines.append("State: bench/run.py's LLM-like training state (fp32 master weights and moments "
                 "and bf16 weights in large tensors; thousands of small norms/biases, a third bf16; "
                 "0-d step counters) with enough small tensors for about 10,000 tensors. "
                 "`Checkpointer(path, keep=1)`; a save blocks only while it copies into a "
                 "shared-memory slot. Before each timed save the agent is idle (the previous "
                 "persist waited for).")
    for r in results:
        n = r["bytes"]
        m = {k: med(v) for k, v in r["mem"].items() if v}
        d = {k: med(v) for k, v in r["disk"].items() if v}
        lines.append("")
        lines.append(f"### {r['label']} state ({n / GiB:.2f} GiB in {r['tensors']:,} tensors)")
        lines.append("")
        lines.append(f"References measured in the same run: memcpy of the same bytes into warm, "
                     f"pre-faulted shared memory {gbps(n, m['memcpy_flat']):.2f} GB/s "
                     f"(one flat `copy_`, {torch.get_num_threads()} threads) and "
                     f"{gbps(n, m['memcpy_tensors']):.2f} GB/s (tensor by tensor, "
                     f"{r['tensors']:,} `copy_` calls); into freshly allocated memory "
                     f"{gbps(n, m['memcpy_fresh']):.2f} GB/s (4 KiB pages) and "
                     f"{gbps(n, m['memcpy_fresh_thp']):.2f} GB/s (MADV_HUGEPAGE); O_DIRECT "
                     f"write+fsync in the checkpoint directory {gbps(n, d['dd_write']):.2f} GB/s "
                     f"(dd bs=8M) and {gbps(n, d['depth_write']):.2f} GB/s at depth "
                     f"({IO_THREADS} threads of {IO_REQUEST // MiB} MiB requests into a "
                     "preallocated file).")
        lines.append("")
        create = r["create"]
        lines.append(f"One-time cost: the first two saves create and pre-fault the two slots "
                     f"({(r['image_bytes'] or n) / MiB:.0f} MiB image each): "
                     f"{' and '.join(f'{c:.2f} s' for c in create)} of creation "
                     f"({gbps(n, max(create[0], 1e-9)):.2f} GB/s); those saves blocked "
                     f"{' and '.join(f'{s:.2f} s' for s in r['first_save'])}. Every later save "
                     "reuses the slots.")
        lines.append("")
        sp = m["sp_save"]
        flat, per = m["memcpy_flat"], m["memcpy_tensors"]
        goal = "met" if sp <= 1.2 * flat else "not met"
        per_tensor_us = (sp - m.get("sp_copy", sp)) / r["tensors"] * 1e6
        lines.append("**Blocking time of a save** (training stalls this long; goal: within 1.2x "
                     f"of the flat memcpy: {goal}; beside the copy, a save spends "
                     f"{per_tensor_us:.1f} us per tensor)")
        lines.append("")
        lines.append("| save | blocking s | GB/s | vs memcpy (flat) | vs memcpy (per tensor) | vs Checkpointer.save |")
        lines.append("|---|---:|---:|---:|---:|---:|")

        def row(name, t, rate=True):
            lines.append(f"| {name} | {t:.4f} | {f'{gbps(n, t):.2f}' if rate else ''} | "
                         f"{t / flat:.2f}x | {t / per:.2f}x | {t / sp:.2f}x |")

        row("memcpy into warm shm (flat)", flat)
        row("memcpy into warm shm (per tensor)", per)
        row("**safepoint Checkpointer.save**", sp)
        if "sp_copy" in m:
            row("- of which the copy into the slot", m["sp_copy"])
            row("- of which the rest (flatten, index, slot, notify)", sp - m["sp_copy"], False)
        row("Checkpointer.save, persist requested", d["sp_save"])
        row("torch.save to /dev/shm (serialization)", d["torch_shm"])
        row("torch.save to disk (buffered, not durable)", d["torch_disk"])
        if "dcp_blocking" in d:
            row("DCP async_save (until it returns)", d["dcp_blocking"])
        else:
            lines.append(f"| DCP async_save | failed: {r['dcp_error']} | | | | |")
        lines.append("")
        ld = m["sp_load"]
        goal = "met" if ld <= 1.5 * flat else "not met"
        lines.append(f"**Hot reload**: `Checkpointer.load()` in a fresh Checkpointer of the job "
                     f"(source: {', '.join(r['load_sources'])}; the copy out of the slot is "
                     f"verified and allocated; goal: within 1.5x of the memcpy into warm memory: "
                     f"{goal})")
        lines.append("")
        lines.append("| load | seconds | GB/s | vs memcpy into warm shm | vs memcpy into fresh memory | vs memcpy into fresh MADV_HUGEPAGE memory |")
        lines.append("|---|---:|---:|---:|---:|---:|")
        for name, t in (("**safepoint Checkpointer.load (memory)**", ld),
                        ("memcpy into warm shm (flat)", flat),
                        ("memcpy into fresh memory", m["memcpy_fresh"]),
                        ("memcpy into fresh MADV_HUGEPAGE memory", m["memcpy_fresh_thp"])):
            lines.append(f"| {name} | {t:.4f} | {gbps(n, t):.2f} | {t / flat:.2f}x | "
                         f"{t / m['memcpy_fresh']:.2f}x | {t / m['memcpy_fresh_thp']:.2f}x |")
        lines.append("")
        pb = r["persist_bytes"] or n
        lines.append(f"**Persist** by the agent in the background ({pb / MiB:.0f} MiB image; the "
                     "agent's own timer for writing the rank's image: checksums, O_DIRECT writes, "
                     "fsync, rename, directory fsync; the commit record follows, and is in the "
                     "time to durable below)")
        lines.append("")
        lines.append("| write | seconds | GB/s | vs dd O_DIRECT write | vs O_DIRECT write at depth |")
        lines.append("|---|---:|---:|---:|---:|")
        for name, b, t in (("**safepoint agent persist**", pb, d["sp_persist"]),
                           ("dd O_DIRECT write+fsync", n, d["dd_write"]),
                           (f"O_DIRECT write+fsync at depth ({IO_THREADS} threads, preallocated)",
                            n, d["depth_write"])):
            bw = b / t
            lines.append(f"| {name} | {t:.3f} | {bw / 1e9:.2f} | {bw / (n / d['dd_write']):.0%} | "
                         f"{bw / (n / d['depth_write']):.0%} |")
        lines.append("")
        lines.append("**Time to durable** (from the call until the state is on disk: fsync or "
                     "O_DIRECT+fsync returned and, for safepoint, the step committed)")
        lines.append("")
        lines.append("| contender | seconds | GB/s | vs safepoint | of which blocking |")
        lines.append("|---|---:|---:|---:|---:|")
        rows = [("**safepoint Checkpointer.save + wait()**", d["sp_durable"], d["sp_save"]),
                ("torch.save + fsync", d["torch_durable"], d["torch_disk"])]
        if "dcp_durable" in d:
            rows.append(("DCP async_save + future.result()", d["dcp_durable"], d["dcp_blocking"]))
        for name, t, b in rows:
            lines.append(f"| {name} | {t:.3f} | {gbps(n, t):.2f} | {t / d['sp_durable']:.2f}x | {b:.3f} s |")
        if "dcp_durable" not in d:
            lines.append(f"| DCP async_save | failed: {r['dcp_error']} | | | |")
        elif r["dcp_error"]:
            lines.append("")
            lines.append(f"DCP failed in a later round: {r['dcp_error']}")
    return "\n".join(lines) + "\n"


def main() -> None:
    args = bench_arguments(__doc__)
    warnings.simplefilter("ignore", FutureWarning)  # DCP's deprecation notices
    t0 = time.perf_counter()
    results = run_sizes(args, bench_size)
    section = render(results, args.runs)
    publish(args, "flash", "Flash checkpoints", section, results)
    print(f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
