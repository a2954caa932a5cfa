"""How the time of the Python layer's collectives grows with the world size where messages,
not this machine's two cores, set it (issue 32: "their time at 64 processes <= 2x at 2").

On this machine W processes time-share two cores, so a collective's time at W = 64 is mostly
waiting to be scheduled. Here every message each rank sends is delayed by --delay-us (a preload,
bench/message_delay.c, sleeps before each writev, which gloo's TCP transport sends a message
with): a sleeping process needs no core, so a collective then takes about (the messages in
sequence on its critical path) x the delay, as on a network whose latency dominates. Measured,
for W real gloo processes, the slowest rank's time of each (median of --runs, each after a
barrier), without and with the delay:

- the save's one collective, an all-reduce (MAX) of 2 int64 (``_dedupe.agree``): gloo's, and
  ``_collectives.all_reduce_max`` (recursive doubling over point-to-point messages: log2 W
  rounds of one exchange);
- the restore agreement: gloo's all-gather of every rank's row (``_agreement.ROW`` and the
  record slot of W ranks), ``_collectives.all_gather`` (recursive doubling, what
  ``_agreement.agree`` runs), and, tried and not taken, an all-reduce (MAX) of one fixed vector
  of 332 int64 and the record slot (every value stated as v and ~v, memory steps in 61 slots).

"In sequence" = (time with the delay - time without) / the delay.

    python bench/collective_depth.py [--ws 2,4,8,16,32,64] [--delay-us 2000] [--runs 15]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


TRIED_VECTOR = 332  # int64 of the agreement as one all-reduce, before its record slot


def rank_main(rank: int, w: int, port: int, runs: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from safepoint import _agreement, _collectives  # the package make build-tests installed
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=w)
    g = dist.new_group(backend="gloo")
    row = torch.zeros(_agreement.ROW + _agreement.record_words(w), dtype=torch.int64)
    rows = [torch.empty_like(row) for _ in range(w)]
    vector = torch.zeros(TRIED_VECTOR + _agreement.record_words(w), dtype=torch.int64)
    check = torch.tensor([rank, -rank], dtype=torch.int64)
    _collectives.all_reduce_max(check, g)
    assert check.tolist() == [w - 1, 0], check  # the result is every rank's maximum
    mine = torch.full((3,), rank, dtype=torch.int64)
    assert _collectives.all_gather(mine, g)[:, 0].tolist() == list(range(w))
    ops = {
        "save: gloo all-reduce": lambda: dist.all_reduce(
            torch.zeros(2, dtype=torch.int64), op=dist.ReduceOp.MAX, group=g),
        "save: recursive doubling": lambda: _collectives.all_reduce_max(
            torch.zeros(2, dtype=torch.int64), g),
        "agreement: gloo all-gather": lambda: dist.all_gather(rows, row, group=g),
        "agreement: recursive doubling": lambda: _collectives.all_gather(row, g),
        "agreement as an all-reduce (tried)": lambda: dist.all_reduce(
            vector, op=dist.ReduceOp.MAX, group=g),
    }
    times: dict = {}
    for name, op in ops.items():
        op()  # the first of each connects what it needs
        times[name] = []
        for _ in range(runs):
            dist.barrier(group=g)
            t0 = time.perf_counter()
            op()
            times[name].append(time.perf_counter() - t0)
    everyone: list = [None] * w
    dist.all_gather_object(everyone, times, group=g)
    if rank == 0:
        slowest = {name: statistics.median(max(t[name][i] for t in everyone)
                                           for i in range(runs)) for name in ops}
        sizes = {"save: gloo all-reduce": 16, "save: recursive doubling": 16,
                 "agreement: gloo all-gather": row.numel() * 8 * w,
                 "agreement: recursive doubling": row.numel() * 8 * w,
                 "agreement as an all-reduce (tried)": vector.numel() * 8}
        with open(out, "w") as f:
            json.dump({"seconds": slowest, "received": sizes}, f)
    dist.barrier(group=g)
    dist.destroy_process_group()


def run_w(w: int, delay_us: int, runs: int, preload: str) -> dict:
    from run import free_port

    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    env = dict(os.environ)
    env.pop("DELAY_US", None)
    if delay_us:
        env.update(LD_PRELOAD=preload, DELAY_US=str(delay_us))
    port = free_port()
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), str(w), str(port),
                               str(runs), out], env=env) for r in range(w)]
    try:
        for p in procs:
            if p.wait(timeout=900) != 0:
                raise SystemExit(f"W={w}: a rank failed ({p.returncode})")
        with open(out) as f:
            return json.load(f)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        os.unlink(out)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        rank_main(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]),
                  sys.argv[6])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ws", default="2,4,8,16,32,64")
    p.add_argument("--delay-us", type=int, default=2000)
    p.add_argument("--runs", type=int, default=15)
    p.add_argument("--out", default="build/bench/collective_depth.json")
    args = p.parse_args()
    preload = os.path.join(tempfile.mkdtemp(prefix="delay-"), "message_delay.so")
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", preload,
                    os.path.join(HERE, "message_delay.c"), "-ldl"], check=True)
    results = []
    for w in [int(x) for x in args.ws.split(",")]:
        plain = run_w(w, 0, args.runs, preload)
        slow = run_w(w, args.delay_us, args.runs, preload)
        results.append({"w": w, "plain": plain, "delayed": slow})
        print(f"W={w:3}: " + ", ".join(
            f"{n}: {plain['seconds'][n] * 1e3:.1f} / {slow['seconds'][n] * 1e3:.1f} ms"
            for n in plain["seconds"]), flush=True)
    names = list(results[0]["plain"]["seconds"])
    print(f"\nEvery message delayed {args.delay_us} us; time without / with the delay (the "
          "slowest rank's, median), and the messages in sequence that the delay adds "
          "((with - without) / delay); bytes a rank receives (logical)\n")
    print("| W | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for r in results:
        cells = []
        for n in names:
            a, b = r["plain"]["seconds"][n], r["delayed"]["seconds"][n]
            seq = (b - a) / (args.delay_us * 1e-6)
            cells.append(f"{a * 1e3:.1f} / {b * 1e3:.1f} ms, {seq:.0f} in sequence, "
                         f"{r['plain']['received'][n]:,} B")
        print(f"| {r['w']} | " + " | ".join(cells) + " |")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"delay_us": args.delay_us, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
