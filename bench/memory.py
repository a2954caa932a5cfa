"""Host memory of a rank per configuration, as a multiple of its state S (issue 21, "a host-memory
budget"; docs/operations.md, "Host memory"):

    python bench/memory.py [--mib 256] [--saves 4] [--no-nodes]

For each configuration a fresh process builds a state of S bytes (a few large tensors), saves it
`--saves` times (persisting each step to a temporary directory) and reports, after the last save,
the job's shared memory on the node (the slot files' allocated pages) and the process's private
memory beyond the state, both over S. Prints a Markdown table. Memory, not time: the figures do
not depend on the machine's load.

The mirror rows (needs root; skipped with --no-nodes or where nodes cannot be made) run a
2-node job, one rank per node, on network-namespace nodes with their own /dev/shm
(tests/common/nodes.py), with redundancy="mirror": each node keeps its rank's slots and the
replica of the other node's rank. Each save is waited for (committed and replicated) before the
next. Reported per node: its whole /dev/shm after the last save (slots, replica files, spares),
its peak during the run (sampled every 20 ms: a push being received shows there), and the
rank's and agent's private memory, over S.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

CHILD = r"""
import json, sys, tempfile, torch, safepoint
mib, saves, budget = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
S = mib << 20
state = {f"w{i}": torch.ones(S // 8 // 4) for i in range(8)}
base = anon()
with tempfile.TemporaryDirectory() as d:
    ck = safepoint.Checkpointer(d + "/ckpt", job=f"memb{budget:d}",
                                max_shm_bytes=(S * 3 // 2) if budget else None)
    for step in range(1, saves + 1):
        ck.save(step, state)
    ck.wait()
    mem = ck.status()["memory"]
    print(json.dumps({"shm": mem["shm_node_bytes"], "slots": mem["slots"],
                      "private": anon() - base, "agent": mem["agent_private_bytes"] or 0, "S": S}))
    ck.close()
"""


def node_shm(node) -> dict:
    """Allocated bytes in a node's /dev/shm: slot files (and the job's other files), replica
    files (those being received included), spares."""
    from replication import shm_dirs  # bench/replication.py

    use = {"slots": 0, "replicas": 0, "spares": 0}
    for d in shm_dirs(node.shm).values():
        for kind, b in d.items():
            use[kind] += b
    return use


def mirror_rows(mib: int, saves: int) -> list[tuple[str, dict]]:
    sys.path.insert(0, os.path.join(REPO, "tests", "common"))
    from nodes import Cluster, Job, unavailable  # noqa: E402

    reason = unavailable()
    if reason:
        print(f"(mirror rows skipped: {reason})", file=sys.stderr)
        return []
    worker = os.path.join(HERE, "workloads", "memory_worker.py")
    S = mib << 20
    rows = []
    for name, cap in (("flash + mirror, default (two slots, no max_shm_bytes)", 0),
                      ("flash + mirror, budget mode (max_shm_bytes = 1.5 S)", S * 3 // 2)):
        with tempfile.TemporaryDirectory() as d, \
                Cluster(2, shm_size=f"{4 * mib + 256}m") as c:
            peaks = [0] * len(c)
            stop = threading.Event()

            def sample(c=c, peaks=peaks, stop=stop) -> None:
                while not stop.is_set():
                    for i, node in enumerate(c):
                        peaks[i] = max(peaks[i], sum(node_shm(node).values()))
                    time.sleep(0.02)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            done = os.path.join(d, "DONE")
            job = Job(c, worker, [d + "/ckpt", f"memm{cap > 0:d}", mib, saves, cap, done])
            outs = job.expect_all("done")
            stop.set()
            sampler.join()
            for i, node in enumerate(c):
                use = node_shm(node)
                o = outs[i]
                mem = o["memory"]
                rows.append((f"{name}, {node.name}", {
                    "S": S, "slots": mem["slots"], "shm": sum(use.values()),
                    "slot_bytes": use["slots"], "replicas": use["replicas"],
                    "spares": use["spares"], "peak": peaks[i],
                    "private": o["private"], "agent": mem["agent_private_bytes"] or 0,
                    "in_place": o["received_in_place"], "protected": o["protected"],
                    "goal": 2.1 if cap else 3.1}))
            open(done, "w").close()
            job.check()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--saves", type=int, default=4)
    ap.add_argument("--no-nodes", action="store_true", help="skip the mirror rows")
    args = ap.parse_args()
    rows = []
    for name, budget in (("flash, default (two slots)", 0),
                         ("flash, budget mode (max_shm_bytes = 1.5 S)", 1)):
        out = subprocess.run([sys.executable, "-c", CHILD, str(args.mib), str(args.saves),
                              str(budget)], check=True, capture_output=True, text=True,
                             cwd=tempfile.gettempdir()).stdout
        r = json.loads(out.strip().splitlines()[-1])
        rows.append((name, r))
    print(f"State S = {args.mib} MiB in 8 tensors, {args.saves} saves each persisted; one rank.\n")
    print("| configuration | slots | shared memory / S | private memory beyond the state / S "
          "| agent's private memory / S | total / S |")
    print("|---|---|---|---|---|---|")
    for name, r in rows:
        s = r["S"]
        total = (r["shm"] + max(r["private"], 0)) / s
        print(f"| {name} | {r['slots']} | {r['shm'] / s:.3f} | {max(r['private'], 0) / s:.3f} "
              f"| {r['agent'] / s:.3f} | {total:.3f} |")
    nodes = [] if args.no_nodes else mirror_rows(args.mib, args.saves)
    if not nodes:
        return
    print(f"\nWith `redundancy=\"mirror\"`: 2 nodes (network namespaces, each its own /dev/shm), "
          f"one rank each, S = {args.mib} MiB in 8 tensors, {args.saves} saves, each persisted "
          "and waited for (replicated) before the next; per node, after the last save.\n")
    print("| configuration, node | slots | slot files / S | replica files / S | spares / S "
          "| shared memory / S | peak shared memory during the run / S | received in place "
          "| private memory beyond the state / S | agent's private memory / S | total / S "
          "| goal | met |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in nodes:
        s = r["S"]
        total = (r["shm"] + max(r["private"], 0)) / s
        print(f"| {name} | {r['slots']} | {r['slot_bytes'] / s:.3f} | {r['replicas'] / s:.3f} "
              f"| {r['spares'] / s:.3f} | {r['shm'] / s:.3f} | {r['peak'] / s:.3f} "
              f"| {r['in_place']} | {max(r['private'], 0) / s:.3f} | {r['agent'] / s:.3f} "
              f"| {total:.3f} | ≤ {r['goal']} S | {'met' if total <= r['goal'] else 'missed'} |")


if __name__ == "__main__":
    main()
