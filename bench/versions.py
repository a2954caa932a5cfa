"""Versioning and interchange: how fast `safepoint diff`, `export` and `import` move data.

Rewrites the "Versioning and interchange" section of docs/benchmarks.md (issue 12, parts 3 and
4). Every figure is a ratio against a reference measured in the same run on the same bytes:
diff (reads and verifies two steps) against `safepoint.load` of one step (reads and verifies
one); export (reads, assembles full tensors, writes) against `safepoint.load` + the safetensors
package's own `save_file` of the loaded tensors; import against the safetensors package's
`load_file` + `safepoint.save`. Page cache dropped before each read where the machine allows.
The peak memory (max RSS) of `safepoint export` to one file and to shards of 1/8 of the state
is measured against the interpreter with torch and safetensors imported and nothing done.

    python bench/versions.py [--size 256M] [--runs 3] [--no-doc]
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import subprocess
import sys
import time

import torch

import safepoint
from safepoint.interchange import export_step, import_safetensors

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run import MiB, llm_like_state, machine, parse_size, write_doc_section  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLI = os.path.join(os.path.dirname(sys.executable), "safepoint")


def drop_caches() -> None:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        pass


def timed(f) -> float:
    drop_caches()
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def peak_rss(argv: list) -> int:
    """The peak RSS in bytes of running argv (which must succeed): its VmHWM, polled until it
    exits. (getrusage's maxrss of a child counts the RSS of this process at the fork.)"""
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    peak = 0
    while p.poll() is None:
        try:
            with open(f"/proc/{p.pid}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        peak = max(peak, int(line.split()[1]) * 1024)
        except (OSError, ValueError):
            pass
        time.sleep(0.005)
    if p.returncode != 0:
        raise SystemExit(f"{argv} failed with {p.returncode}")
    return peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="256M")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", default=os.path.join(REPO, "build", "bench", "versions"))
    ap.add_argument("--no-doc", action="store_true")
    a = ap.parse_args()
    size = parse_size(a.size)
    shutil.rmtree(a.dir, ignore_errors=True)
    os.makedirs(a.dir)
    ckpt = os.path.join(a.dir, "ckpt")
    state = llm_like_state(size, small_count=400)
    nbytes = sum(t.numel() * t.element_size() for t in state["model"].values()
                 if isinstance(t, torch.Tensor))
    safepoint.save(ckpt, 1, state)
    g = torch.Generator().manual_seed(1)
    for t in state["model"].values():  # step 2: every floating tensor moved a little
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            t.add_(torch.randn(t.shape, generator=g).to(t.dtype) * 1e-3)
    safepoint.save(ckpt, 2, state)
    del state

    st_out = os.path.join(a.dir, "out.safetensors")
    ref_out = os.path.join(a.dir, "ref.safetensors")
    dst = os.path.join(a.dir, "imported")
    from safetensors.torch import load_file, save_file

    def diff() -> None:
        subprocess.run([CLI, "diff", ckpt, "1", "2", "--json"], check=True,
                       stdout=subprocess.DEVNULL)

    def diff_same() -> None:
        subprocess.run([CLI, "diff", ckpt, "2", "2", "--json"], check=True,
                       stdout=subprocess.DEVNULL)

    def load() -> None:
        safepoint.load(ckpt, 2)

    def export() -> None:
        export_step(ckpt, st_out, format="safetensors", step=2, select="model")

    shards_out = os.path.join(a.dir, "shards")
    shard = max(nbytes // 8, 1)

    def export_shards() -> None:
        shutil.rmtree(shards_out, ignore_errors=True)
        export_step(ckpt, shards_out, format="safetensors", step=2, select="model",
                    max_shard_bytes=shard)

    def load_and_save_file() -> None:
        _, s = safepoint.load(ckpt, 2)
        save_file({k: v for k, v in s["model"].items() if isinstance(v, torch.Tensor)}, ref_out)

    def do_import() -> None:
        shutil.rmtree(dst, ignore_errors=True)
        import_safetensors(st_out, dst, 2)

    def load_file_and_save() -> None:
        shutil.rmtree(dst, ignore_errors=True)
        safepoint.save(dst, 2, {"model": load_file(ref_out)})

    export()
    load_and_save_file()
    pairs = [("diff A B (reads 2 steps, every element changed)", diff,
              "safepoint.load (1 step)", load, 2),
             ("diff A A (reads 2 steps, nothing changed)", diff_same, "safepoint.load (1 step)",
              load, 2),
             ("export --format safetensors", export, "safepoint.load + safetensors save_file",
              load_and_save_file, 1),
             (f"export --max-shard-size {shard / MiB:.0f}MiB (8 files)", export_shards,
              "safepoint.load + safetensors save_file", load_and_save_file, 1),
             ("import (safetensors file)", do_import, "safetensors load_file + safepoint.save",
              load_file_and_save, 1)]
    rows = []
    for name, f, ref_name, ref, factor in pairs:
        f()  # warm-up
        mine, theirs = [], []
        for _ in range(a.runs):
            mine.append(timed(f))
            theirs.append(timed(ref))
        t, r = statistics.median(mine), statistics.median(theirs)
        rows.append((name, t, factor * nbytes / t / 1e9, ref_name, r, r / t))
    lines = [f"Measured {datetime.date.today().isoformat()} on {machine()}.",
             f"Command: `python bench/versions.py --size {a.size}` (median of {a.runs} runs "
             "after a warm-up, page cache dropped before each; the two steps differ in every "
             "floating-point element, the worst case for diff).", "",
             f"State: {nbytes / MiB:.0f} MiB of tensors (an LLM-like model state of large fp32 "
             "and bf16 tensors and 400 small ones), one rank.", "",
             "| operation | seconds | GB/s | reference | reference seconds | speed vs "
             "reference |", "|---|---:|---:|---|---:|---:|"]
    for name, t, gbps, ref_name, r, ratio in rows:
        lines.append(f"| {name} | {t:.2f} | {gbps:.2f} | {ref_name} | {r:.2f} | {ratio:.2f}x |")
    base = peak_rss([sys.executable, "-c", "import torch, safetensors.torch, safepoint"])
    one = peak_rss([CLI, "export", ckpt, "--step", "2", "--format", "safetensors", "--select",
                    "model", st_out])
    shutil.rmtree(shards_out, ignore_errors=True)
    many = peak_rss([CLI, "export", ckpt, "--step", "2", "--format", "safetensors", "--select",
                     "model", "--max-shard-size", str(shard), shards_out])
    lines += ["", "Peak memory (max RSS) of `safepoint export`, the state being "
              f"{nbytes / MiB:.0f} MiB:", "",
              "| export | max RSS MiB | above the bare interpreter, MiB | of the state |",
              "|---|---:|---:|---:|",
              f"| interpreter with torch, safetensors and safepoint imported | {base / MiB:.0f} "
              "| 0 | 0.00x |"]
    for name, rss in (("one file", one), (f"shards of {shard / MiB:.0f} MiB", many)):
        lines.append(f"| {name} | {rss / MiB:.0f} | {(rss - base) / MiB:.0f} | "
                     f"{(rss - base) / nbytes:.2f}x |")
    lines += ["", "GB/s counts the bytes read (diff: both steps; each `diff` row includes "
              "starting the CLI). Diff reads both steps verified, in 32 MiB windows, both at "
              "once; then it compares element by element on one core: where every element "
              "changed (each converted and subtracted for the largest difference) that compare, "
              "not the reads, sets its speed, as the gap between the two diff rows shows. "
              "Export to one file and import hold the tensors in memory once, as the "
              "safetensors writer needs them whole; their reference does the same work with "
              "the library calls directly. A sharded export holds one shard's tensors (and the "
              "writer's copy of them) at a time."]
    section = "\n".join(lines) + "\n"
    print(section)
    if not a.no_doc:
        write_doc_section("versions-bench", "Versioning and interchange", section)


if __name__ == "__main__":
    main()
