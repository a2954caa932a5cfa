"""safepoint benchmarks: save and load against torch.save/load, safetensors and the machine's limits.

    make bench                      # or: python bench/run.py [--sizes 256M,2G,issue14] [--runs 3]

Rewrites the "Storage save and load" section of docs/benchmarks.md. Every figure is a ratio
against a reference measured in the same run (../shared/BENCHMARKING.md): the machine's limits
(a large parallel memory copy; sequential O_DIRECT write and read of the same size in the same
directory, with dd) and the peers on the same state. Median of several runs, contenders
alternated so that drift hits all alike. Reads are cold: the page cache is dropped before each.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import tempfile
import time

import torch

import safepoint

try:
    import safetensors.torch as st
except ImportError:  # pragma: no cover - reported in the output
    st = None

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(REPO, "docs", "benchmarks.md")
MiB = 1 << 20
GiB = 1 << 30


# ------------------------------------------------------------------------------------------------
# The state: what an LLM's training state looks like (few large, thousands of small tensors).

def llm_like_state(total: int, small_count: int = 4000) -> dict:
    """fp32 master weights and Adam moments plus bf16 weights: large matrices, thousands of small
    norms/biases and 0-d step counters."""
    g = torch.Generator().manual_seed(0)
    state: dict = {"model": {}, "optim": {"state": {}, "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95)}]},
                   "step": 1000, "rng": b"\x01" * 5056}
    small_bytes = 0
    for i in range(small_count):
        n = 256 + (i * 97) % 3840
        if i % 3 == 0:
            t = torch.randn(n, generator=g).to(torch.bfloat16)
        else:
            t = torch.randn(n, generator=g)
        state["model"][f"layers.{i // 8}.small.{i % 8}"] = t
        small_bytes += t.numel() * t.element_size()
        if i % 4 == 0:
            state["optim"]["state"][i] = {"step": torch.tensor(1000.0)}
    remaining = total - small_bytes
    big = 64 * MiB if total >= GiB else 16 * MiB
    i = 0
    while remaining > 0:
        nbytes = min(big, remaining)
        if i % 3 == 2:
            t = torch.randn(nbytes // 2, generator=g).to(torch.bfloat16)  # bf16 weights
        else:
            t = torch.randn(nbytes // 4, generator=g)  # fp32 master weights / moments
        state["model"][f"layers.{i}.weight"] = t.view(-1, 1024) if t.numel() % 1024 == 0 else t
        remaining -= t.numel() * t.element_size()
        i += 1
    return state


def issue14_state() -> dict:
    """The 1 GiB state of issue 14: 24 tensors of 36 MiB, a 64 MiB fp32 embedding, a 64 MiB bf16
    head and 2,000 tensors of 4 KiB."""
    g = torch.Generator().manual_seed(14)
    model = {f"layers.{i}.weight": torch.randn(36 * MiB // 4, generator=g).view(-1, 1024)
             for i in range(24)}
    model["embed"] = torch.randn(64 * MiB // 4, generator=g).view(-1, 1024)
    model["head"] = torch.randn(64 * MiB // 2, generator=g).to(torch.bfloat16).view(-1, 1024)
    for i in range(2000):
        model[f"norms.{i}"] = torch.randn(1024, generator=g)
    return {"model": model, "step": 1000}


ISSUE14 = "1 GiB LLM-like (issue 14)"


def tensors_of(obj, out=None, prefix=""):
    out = {} if out is None else out
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            tensors_of(v, out, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            tensors_of(v, out, f"{prefix}.{i}")
    return out


def state_bytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(state).values())


# ------------------------------------------------------------------------------------------------
# Helpers

def drop_caches(paths) -> str:
    """Makes the next read of `paths` cold. Returns how."""
    subprocess.run(["sync"], check=False)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        for p in paths:
            for root, _, files in os.walk(p) if os.path.isdir(p) else [(os.path.dirname(p), None, [os.path.basename(p)])]:
                for name in files:
                    fd = os.open(os.path.join(root, name), os.O_RDONLY)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    os.close(fd)
        return "fadvise"


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    dfd = os.open(os.path.dirname(path), os.O_RDONLY)
    os.fsync(dfd)
    os.close(dfd)


def rm(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.unlink(path)


def touch(state) -> None:
    """Reads one byte of every 4 KiB page of every tensor, so that a loader that maps lazily pays
    for its reads inside the measurement like one that reads eagerly."""
    for t in tensors_of(state).values():
        if t.numel():
            flat = t.reshape(-1).view(torch.uint8)
            flat[::4096].sum()


def timed(fn) -> float:
    gc.collect()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def dd_seconds(args) -> float:
    t0 = time.perf_counter()
    subprocess.run(["dd", *args], check=True, capture_output=True)
    return time.perf_counter() - t0


# ------------------------------------------------------------------------------------------------
# Limits

def limit_memcpy(nbytes: int) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src).fill_(0.0)  # warm: every page touched once
    dst.copy_(src)
    return min(timed(lambda: dst.copy_(src)) for _ in range(3))


def limit_direct_write(path: str, nbytes: int) -> float:
    t = dd_seconds(["if=/dev/zero", f"of={path}", "bs=8M", f"count={nbytes // (8 * MiB)}",
                    "oflag=direct", "conv=fsync"])
    return t


def limit_direct_read(path: str) -> float:
    drop_caches([path])
    return dd_seconds([f"if={path}", "of=/dev/null", "bs=8M", "iflag=direct"])


IO_THREADS = 16
IO_REQUEST = 8 * MiB


def parallel_direct(path: str, nbytes: int, write: bool) -> float:
    """The device's limit at depth: IO_THREADS threads issuing IO_REQUEST-byte O_DIRECT
    pwrite/pread (GIL released) over one preallocated file, then fsync for writes. Same thread
    count and preallocation as safepoint, with no checksums, no copies and no commit protocol."""
    import itertools
    import mmap
    import threading

    if write and os.path.exists(path):
        os.unlink(path)
    flags = os.O_DIRECT | (os.O_WRONLY | os.O_CREAT if write else os.O_RDONLY)
    fd = os.open(path, flags, 0o644)
    bufs = [mmap.mmap(-1, IO_REQUEST) for _ in range(IO_THREADS)]
    for b in bufs:
        b.write(b"\x5a" * IO_REQUEST)
    count = nbytes // IO_REQUEST
    ticket = itertools.count()

    def work(buf):
        while (k := next(ticket)) < count:
            if write:
                os.pwritev(fd, [buf], k * IO_REQUEST)
            else:
                os.preadv(fd, [buf], k * IO_REQUEST)

    if not write:
        drop_caches([path])
    t0 = time.perf_counter()
    if write:
        # Preallocate, as safepoint does: ext4 serialises O_DIRECT writes that extend a file.
        os.posix_fallocate(fd, 0, nbytes)
    threads = [threading.Thread(target=work, args=(b,)) for b in bufs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if write:
        os.fsync(fd)
    seconds = time.perf_counter() - t0
    os.close(fd)
    return seconds


MADV_POPULATE_READ = 22  # Linux 5.14; not in Python's mmap module before 3.13


def into_memory(path: str, how: str) -> float:
    """One way to get a file's bytes into touched memory, cold: `direct` / `buffered`
    (IO_THREADS threads of IO_REQUEST-byte preads at depth into a fresh MADV_HUGEPAGE buffer, as
    a loader must allocate one) or `mmap` (MADV_WILLNEED + MADV_POPULATE_READ of a read-only
    mapping). Every page is then read once, like the loads' touch()."""
    import itertools
    import mmap
    import threading

    import numpy as np

    nbytes = os.path.getsize(path)
    drop_caches([path])
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if how == "direct" else 0))
    try:
        if how == "mmap":
            buf = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ)
            buf.madvise(mmap.MADV_WILLNEED)
            buf.madvise(MADV_POPULATE_READ)
        else:
            buf = mmap.mmap(-1, nbytes)
            buf.madvise(mmap.MADV_HUGEPAGE)
            view = memoryview(buf)
            ticket = itertools.count()

            def work():
                while (k := next(ticket)) * IO_REQUEST < nbytes:
                    off = k * IO_REQUEST
                    os.preadv(fd, [view[off:off + min(IO_REQUEST, nbytes - off)]], off)

            threads = [threading.Thread(target=work) for _ in range(IO_THREADS)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            view.release()
        int(np.frombuffer(buf, dtype=np.uint8)[::4096].sum())
        seconds = time.perf_counter() - t0
        buf.close()
    finally:
        os.close(fd)
    return seconds


INTO_MEMORY = ("direct", "buffered", "mmap")
INTO_TEXT = {"direct": f"O_DIRECT at depth ({IO_THREADS} x {IO_REQUEST // MiB} MiB) into fresh "
                       "MADV_HUGEPAGE memory",
             "buffered": "buffered reads at depth into fresh MADV_HUGEPAGE memory",
             "mmap": "mmap + MADV_WILLNEED + MADV_POPULATE_READ"}


# ------------------------------------------------------------------------------------------------
# Contenders. Each save returns the seconds; loads are measured cold.

def make_contenders(state, workdir):
    flat = {k: v.contiguous() for k, v in tensors_of(state).items()}
    sp_path = os.path.join(workdir, "safepoint")
    ts_path = os.path.join(workdir, "model.pt")
    sf_path = os.path.join(workdir, "model.safetensors")

    def sp_save():
        rm(sp_path)
        return timed(lambda: safepoint.save(sp_path, 1, state))

    def torch_save(durable):
        def run():
            with open(ts_path, "wb") as f:
                torch.save(state, f)
                if durable:
                    f.flush()
                    os.fsync(f.fileno())
            if durable:
                fsync_path(ts_path)
        rm(ts_path)
        return timed(run)

    def sf_save(durable):
        def run():
            st.save_file(flat, sf_path)
            if durable:
                fsync_path(sf_path)
        rm(sf_path)
        return timed(run)

    saves = {
        ("safepoint.save", True): sp_save,
        ("torch.save", False): lambda: torch_save(False),
        ("torch.save", True): lambda: torch_save(True),
    }
    if st is not None:
        saves[("safetensors.save_file", False)] = lambda: sf_save(False)
        saves[("safetensors.save_file", True)] = lambda: sf_save(True)

    dcp_path = os.path.join(workdir, "dcp")
    # Restores load into a state the training already holds (allocated and touched): a copy.
    target = {k: v.clone() for k, v in flat.items()}
    target_tree = _same_tree(state, iter(target.values()))

    def sp_load():
        drop_caches([sp_path])
        return timed(lambda: touch(safepoint.load(sp_path)[1]))

    def sp_restore():
        drop_caches([sp_path])
        return timed(lambda: safepoint.restore(sp_path, target_tree))

    def torch_load():
        drop_caches([ts_path])
        return timed(lambda: touch(torch.load(ts_path, weights_only=True)))

    def torch_load_mmap():
        drop_caches([ts_path])
        return timed(lambda: touch(torch.load(ts_path, weights_only=True, mmap=True)))

    def sf_load():
        drop_caches([sf_path])
        return timed(lambda: touch(st.load_file(sf_path)))

    def dcp_load():
        import torch.distributed.checkpoint as dcp

        if not os.path.exists(dcp_path):
            dcp.save(flat, checkpoint_id=dcp_path)
        drop_caches([dcp_path])
        return timed(lambda: dcp.load(target, checkpoint_id=dcp_path))

    loads = {"safepoint.load": sp_load, "safepoint.restore (in place)": sp_restore,
             "torch.load": torch_load, "torch.load(mmap=True)": torch_load_mmap,
             "DCP load (in place)": dcp_load}
    if st is not None:
        loads["safetensors.load_file"] = sf_load
    return saves, loads, [sp_path, ts_path, sf_path, dcp_path]


def _same_tree(obj, tensors):
    """`obj` with each tensor replaced, in tensors_of order, by the next of `tensors`."""
    if isinstance(obj, torch.Tensor):
        return next(tensors)
    if isinstance(obj, dict):
        return {k: _same_tree(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_same_tree(v, tensors) for v in obj)
    return obj


def bench_size(label: str, nbytes: int, runs: int, workdir: str) -> dict:
    print(f"[{label}] building the state", flush=True)
    state = issue14_state() if label == ISSUE14 else llm_like_state(nbytes)
    real = state_bytes(state)
    ntensors = len(tensors_of(state))
    limit_file = os.path.join(workdir, "dd.bin")
    res = {"label": label, "bytes": real, "tensors": ntensors, "memcpy": [], "dwrite": [],
           "dread": [], "pwrite": [], "pread": [], "save": {}, "load": {},
           **{f"into_{h}": [] for h in INTO_MEMORY}}
    saves, loads, paths = make_contenders(state, workdir)
    for k in saves:
        res["save"][k] = []
    for k in loads:
        res["load"][k] = []
    for r in range(runs + 1):  # the first round is a warm-up and is not counted
        print(f"[{label}] round {r}/{runs}", flush=True)
        rnd = {"memcpy": limit_memcpy(real), "dwrite": limit_direct_write(limit_file, real),
               "dread": limit_direct_read(limit_file),
               "pwrite": parallel_direct(limit_file, real, True),
               "pread": parallel_direct(limit_file, real, False)}
        for h in INTO_MEMORY if r % 2 == 0 else reversed(INTO_MEMORY):
            rnd[f"into_{h}"] = into_memory(limit_file, h)
        rm(limit_file)
        keys = list(saves)
        if r % 2:
            keys.reverse()
        save_t = {k: saves[k]() for k in keys}
        load_keys = list(loads) if r % 2 == 0 else list(reversed(list(loads)))
        load_t = {k: loads[k]() for k in load_keys}
        if r == 0:
            continue
        for k, v in rnd.items():
            res[k].append(v)
        for k, v in save_t.items():
            res["save"][k].append(v)
        for k, v in load_t.items():
            res["load"][k].append(v)
    for p in paths:
        rm(p)
    del state
    gc.collect()
    return res


# ------------------------------------------------------------------------------------------------
# Report

def gbps(nbytes, seconds):
    return nbytes / seconds / 1e9


def free_port() -> int:
    """A free TCP port on the loopback (the benchmarks' gloo rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def machine() -> str:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    disk = subprocess.run(["df", "-h", "--output=source,fstype,size", REPO], capture_output=True,
                          text=True).stdout.strip().splitlines()[-1]
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            m = re.search(r"model name\s*:\s*(.*)", f.read())
            cpu = m.group(1) if m else cpu
    except OSError:
        pass
    return (f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB memory, disk `{disk}`, "
            f"Linux {platform.release()}, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads), safepoint {safepoint.__version__}")


def render(results, runs, cache_method) -> str:
    med = statistics.median
    lines = []
    lines.append(f"Measured {datetime.date.today().isoformat()} on {machine()}.")
    lines.append(f"Command: `make bench` (`python bench/run.py`); median of {runs} runs after a "
                 f"warm-up round, contenders alternated; cold reads ({cache_method} before each "
                 "load; every loaded tensor is touched once per 4 KiB page inside the timing, so "
                 "lazily mapped loads pay for their reads). "
                 f"safepoint uses {IO_THREADS} I/O threads (on {os.cpu_count()} cores) "
                 "with 4 MiB requests; torch and safetensors write and read with one thread. The "
                 "dd figures are the issue's reference (one stream, one request in flight); the "
                 "figures at depth show what the virtual disk gives with as many requests in "
                 "flight as safepoint keeps.")
    lines.append("")
    lines.append("State: an LLM-like training state: fp32 master weights and moments and bf16 "
                 "weights in large tensors, plus 4,000 small tensors (norms, biases; a third "
                 "bf16) and 0-d step counters. \"Durable\" = fsync (file and directory) returned; "
                 "safepoint.save is always durable (it has no non-durable mode).")
    for r in results:
        n = r["bytes"]
        mc, dw, dr = med(r["memcpy"]), med(r["dwrite"]), med(r["dread"])
        pw, pr = med(r["pwrite"]), med(r["pread"])
        lines.append("")
        lines.append(f"### {r['label']} state ({n / GiB:.2f} GiB in {r['tensors']:,} tensors)")
        lines.append("")
        lines.append(f"Machine limits in the same run: memory copy {gbps(n, mc):.2f} GB/s; "
                     f"O_DIRECT sequential write+fsync (dd bs=8M) {gbps(n, dw):.2f} GB/s; "
                     f"O_DIRECT sequential read {gbps(n, dr):.2f} GB/s; at depth "
                     f"({IO_THREADS} threads of {IO_REQUEST // MiB} MiB O_DIRECT requests): write+fsync "
                     f"{gbps(n, pw):.2f} GB/s, read {gbps(n, pr):.2f} GB/s.")
        lines.append("")
        lines.append("| save | durable | seconds | GB/s | vs dd O_DIRECT write | vs O_DIRECT write at depth | vs torch.save (same durability) |")
        lines.append("|---|---|---:|---:|---:|---:|---:|")
        ts = {d: med(r["save"][("torch.save", d)]) for d in (False, True)}
        for (name, durable), times in r["save"].items():
            t = med(times)
            vs_torch = ts[durable] / t
            lines.append(f"| {name} | {'yes' if durable else 'no'} | {t:.3f} | {gbps(n, t):.2f} | "
                         f"{dw / t:.0%} | {pw / t:.0%} | {vs_torch:.2f}x |")
        lines.append("")
        into = {h: med(r[f"into_{h}"]) for h in INTO_MEMORY if r.get(f"into_{h}")}
        best = min(into.values()) if into else None
        if into:
            lines.append("")
            lines.append("The bytes into touched memory, cold, same run (the machine limit for a "
                         "load): " + "; ".join(
                             f"{INTO_TEXT[h]} {into[h]:.3f} s ({gbps(n, into[h]):.2f} GB/s)"
                             for h in into) + f". Best: {best:.3f} s.")
        lines.append("")
        lines.append("| load (cold) | seconds | GB/s | vs dd O_DIRECT read | vs O_DIRECT read at depth | vs best into touched memory | vs torch.load |")
        lines.append("|---|---:|---:|---:|---:|---:|---:|")
        tl = med(r["load"]["torch.load"])
        for name, times in r["load"].items():
            t = med(times)
            vs_best = f"{best / t:.0%}" if best else "n/a"
            lines.append(f"| {name} | {t:.3f} | {gbps(n, t):.2f} | {dr / t:.0%} | {pr / t:.0%} | "
                         f"{vs_best} | {tl / t:.2f}x |")
    return "\n".join(lines) + "\n"


def write_doc_section(name: str, title: str, section: str) -> None:
    """Replaces the text between this benchmark's markers in docs/benchmarks.md (appending the
    section under `title` when missing); other sections stay as they are."""
    begin = f"<!-- BEGIN {name} (generated by bench/) -->"
    end = f"<!-- END {name} -->"
    doc = open(DOC).read() if os.path.exists(DOC) else "# Benchmarks\n\n"
    block = f"{begin}\n{section}{end}"
    old_begin = re.search(rf"<!-- BEGIN {re.escape(name)} [^>]*-->", doc)
    if old_begin and end in doc:
        doc = doc[: old_begin.start()] + block + doc[doc.index(end) + len(end):]
    else:
        doc = doc.rstrip("\n") + f"\n\n## {title}\n\n" + block + "\n"
    with open(DOC, "w") as f:
        f.write(doc)


def publish(args: argparse.Namespace, name: str, title: str, section: str, results) -> None:
    """Prints a benchmark's section, keeps its raw results as <dir>/<name>.json and, unless
    --no-doc, writes the section into docs/benchmarks.md."""
    print(section)
    with open(os.path.join(args.dir, f"{name}.json"), "w") as f:
        json.dump(results, f)
    if not args.no_doc:
        write_doc_section(f"{name}-bench", title, section)
        print(f"wrote {DOC}")


def run_took(t0: float) -> str:
    """The closing words of a benchmark's conditions: how long it ran (since t0) and the load
    average at the end."""
    return (f" The run took {time.perf_counter() - t0:.0f} s; load average at the end "
            f"{os.getloadavg()[0]:.2f}.")


def parse_size(s: str) -> int:
    m = re.fullmatch(r"(\d+)([MG])", s.strip())
    if not m:
        raise SystemExit(f"bad size {s!r}: use e.g. 256M or 2G")
    return int(m.group(1)) * (MiB if m.group(2) == "M" else GiB)


def bench_arguments(doc: str) -> argparse.Namespace:
    """The options every benchmark takes."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="256M,2G")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", default=os.path.join(REPO, "build", "bench"),
                    help="where to write (a directory on the disk being measured)")
    ap.add_argument("--no-doc", action="store_true", help="print, do not rewrite docs/benchmarks.md")
    args = ap.parse_args()
    if args.runs < 1:
        raise SystemExit("--runs must be at least 1")
    torch.set_num_threads(os.cpu_count() or 1)
    os.makedirs(args.dir, exist_ok=True)
    return args


def run_sizes(args: argparse.Namespace, bench_size) -> list:
    """bench_size(label, nbytes, runs, workdir) for each of --sizes, in a scratch directory."""
    workdir = tempfile.mkdtemp(dir=args.dir)
    try:
        return [bench_size(s.strip().replace("M", " MiB").replace("G", " GiB"), parse_size(s),
                           args.runs, workdir) for s in args.sizes.split(",")]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    args = bench_arguments(__doc__)
    # "issue14" in --sizes (default: added) is the 1 GiB state of issue 14.
    sizes = [x.strip() for x in args.sizes.split(",") if x.strip()]
    issue = "issue14" in sizes or args.sizes == "256M,2G"
    args.sizes = ",".join(x for x in sizes if x != "issue14")
    results = run_sizes(args, bench_size) if args.sizes else []
    if issue:
        workdir = tempfile.mkdtemp(dir=args.dir)
        try:
            results.append(bench_size(ISSUE14, GiB, args.runs, workdir))
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    cache = drop_caches([])
    section = render(results, args.runs, cache)
    publish(args, "storage", "Storage save and load", section,
            [{**r, "save": {f"{k[0]}|{k[1]}": v for k, v in r["save"].items()}} for r in results])


if __name__ == "__main__":
    main()
