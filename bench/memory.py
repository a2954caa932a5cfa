"""Host memory of a rank per configuration, as a multiple of its state S (issue 21, "a host-memory
budget"; docs/operations.md, "Host memory"):

    python bench/memory.py [--mib 256] [--saves 4]

For each configuration a fresh process builds a state of S bytes (a few large tensors), saves it
`--saves` times (persisting each step to a temporary directory) and reports, after the last save,
the job's shared memory on the node (the slot files' allocated pages) and the process's private
memory beyond the state, both over S. Prints a Markdown table. Memory, not time: the figures do
not depend on the machine's load.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--saves", type=int, default=4)
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


if __name__ == "__main__":
    main()
