"""safepoint benchmark: what monitoring costs (docs/operations.md, "Monitoring").

    python bench/metrics.py [--sizes 1M,32M] [--runs 3]

Rewrites the "Monitoring overhead" section of docs/benchmarks.md. Every save sends one small
message to the agent after the snapshot (REPORT: its blocking time), metrics or not: the agent
keeps its metrics and its event log (by default in the job directory) either way, and serves
them over HTTP only when asked. Measured in the same run, alternating: the median blocking time
of `save()` (every step persisted, the agent writing while the next saves run) with
`metrics="127.0.0.1:0"` and an event log of the user's, and without; the median time of one
REPORT send alone, against the save's blocking time; the median time of a scrape of /metrics
(one rank) and its size.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request

import torch

from safepoint import Checkpointer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run import bench_arguments, publish, run_sizes  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "common"))
from processes import kill_agents  # noqa: E402

SAVES = 40


def median_blocking(path: str, shm: str, job: str, state: dict, **kw) -> float:
    ck = Checkpointer(path, job=job, shm_dir=shm, keep=2, **kw)
    try:
        ck.save(0, state)  # creates the slots
        ck.wait()
        times = []
        for step in range(1, SAVES + 1):
            ck.save(step, state)
            times.append(ck._stats["last_save"]["blocking_seconds"])
            if step % 10 == 0:
                ck.wait()
        ck.wait()
        return statistics.median(times)
    finally:
        ck.close()


def bench_size(label: str, nbytes: int, runs: int, workdir: str) -> dict:
    state = {f"t{i}": torch.randn(nbytes // 4 // 8) for i in range(8)}
    shm = tempfile.mkdtemp(prefix="spbm-")
    on, off = [], []
    try:
        for r in range(runs):
            # A fresh path and job per size, configuration and run.
            tag = f"{nbytes}-{r}"
            configs = [(off, "off", {"metrics": ""}),
                       (on, "on", {"metrics": "127.0.0.1:0",
                                   "event_log": os.path.join(workdir, f"ev{tag}.jsonl")})]
            for out, name, kw in configs if r % 2 == 0 else configs[::-1]:  # no order bias
                out.append(median_blocking(os.path.join(workdir, f"{name}{tag}"), shm,
                                           f"bm-{name}{tag}", state, **kw))
    finally:
        kill_agents(shm)
        shutil.rmtree(shm, ignore_errors=True)
    ratios = [a / b for a, b in zip(on, off)]  # paired: the two ran back to back
    return {"label": label, "bytes": nbytes, "off": statistics.median(off),
            "on": statistics.median(on), "ratios": ratios}


def bench_report_and_scrape(workdir: str) -> dict:
    shm = tempfile.mkdtemp(prefix="spbm-")
    ck = Checkpointer(os.path.join(workdir, "scrape"), job="bm-scrape", shm_dir=shm,
                      metrics="127.0.0.1:0")
    try:
        ck.save(1, {"w": torch.zeros(1000)})
        ck.wait()
        live = ck._live
        sends = []
        for _ in range(2000):
            t0 = time.perf_counter()
            live.report("save", 1, True, 0.001, 4000)
            sends.append(time.perf_counter() - t0)
        ck.status()  # the agent has handled them
        url = ck.status()["metrics_url"]
        scrapes, size = [], 0
        for _ in range(200):
            t0 = time.perf_counter()
            with urllib.request.urlopen(url, timeout=30) as r:
                size = len(r.read())
            scrapes.append(time.perf_counter() - t0)
        return {"report": statistics.median(sends), "scrape": statistics.median(scrapes),
                "scrape_bytes": size}
    finally:
        ck.close()
        kill_agents(shm)
        shutil.rmtree(shm, ignore_errors=True)


def main() -> None:
    args = bench_arguments(__doc__)
    if args.sizes == "256M,2G":
        args.sizes = "1M,32M"
    load0 = os.getloadavg()[0]
    sizes = run_sizes(args, bench_size)
    workdir = tempfile.mkdtemp(dir=args.dir)
    other = bench_report_and_scrape(workdir)
    load1 = os.getloadavg()[0]
    lines = [f"{SAVES} saves per configuration and run, {args.runs} runs (which configuration "
             "comes first alternates), medians; "
             "every step persisted. `on`: `metrics=\"127.0.0.1:0\"` and an event log of the "
             "user's; `off`: no metrics (the default event log in the job directory). Both "
             "send the REPORT message.",
             "", "| state | save blocking, off (ms) | on (ms) | on / off, per run (median) |",
             "|---|---:|---:|---|"]
    for s in sizes:
        per_run = ", ".join(f"{x:.2f}" for x in s["ratios"])
        lines.append(f"| {s['label']} | {s['off'] * 1e3:.3f} | {s['on'] * 1e3:.3f} | "
                     f"{per_run} ({statistics.median(s['ratios']):.2f}) |")
    lines += ["", f"One REPORT message (sent by every save): "
              f"{other['report'] * 1e6:.1f} µs median, "
              f"{other['report'] / sizes[0]['off'] * 100:.2f}% of the {sizes[0]['label']} save's "
              "blocking time. "
              f"A scrape of /metrics (one rank, no lower tiers): {other['scrape'] * 1e3:.2f} ms "
              f"median, {other['scrape_bytes']} bytes.", "",
              f"Measured {time.strftime('%Y-%m-%d')} on this {os.cpu_count()}-core VM, shared "
              f"with other work (1-minute load average {load0:.1f} at the start, {load1:.1f} at "
              "the end). Every step is persisted while the next saves run, so a save's blocking "
              "time also depends on how fast the agent frees a slot, and it moves by a factor of 2 "
              "from run to run with the machine's load; compare `on` and `off` within a run.",
              ""]
    publish(args, "metrics", "Monitoring overhead", "\n".join(lines),
            {"sizes": sizes, **other})


if __name__ == "__main__":
    main()
