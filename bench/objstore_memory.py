"""Host memory of an object-store persist and load beyond the data (issue 33 item 4; docs/
operations.md, "Host memory"; docs/benchmarks.md, "Object stores: replicated state restored once
per job, and host memory").

For each store (s3://, rados://, and a local directory for reference), a fresh process builds a
state of --mib MiB (float32 tensors of 64 MiB) and measures, sampling every 5 ms:

- **persist**: ``Checkpointer(uri)``, two ``save`` + ``wait`` (the node agent copies each
  snapshot from its shared-memory slot to the store): the peak of the *agent's* private memory
  (RssAnon) over its level before its first persist (so that buffers it keeps count). The slot
  is shared memory, counted apart; what the agent holds privately is what the transfer buffers.
- **load**: ``safepoint.load(uri)`` in this process (the image read into its buffer, tensors
  built over it): the peak of this process's RssAnon over its level before, less the state's
  size (the result itself).
- **restore**: ``Checkpointer(uri).restore(targets)`` into preallocated tensors (a fresh job:
  nothing in memory): the peak over the level with the targets allocated.

The bound the issue sets: ``part size x connections + 64 MiB`` beyond the data (16 MiB x 8 + 64
MiB = 192 MiB with the defaults, ``part_size`` and ``connections`` of s3://; rados:// writes and
reads ``chunk_size`` objects 8 at a time). Memory, not time: the figures do not depend on the
machine's load. Needs the throwaway Ceph for the object stores: ``scripts/with-ceph.sh
.venv/bin/python bench/objstore_memory.py``; without it they are skipped, saying why.

    python bench/objstore_memory.py [--mib 1024] [--stores posix,s3,rados] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MiB = 1 << 20
PART, CONNECTIONS = 16 * MiB, 8  # s3:// defaults (docs/operations.md)
BOUND = PART * CONNECTIONS + 64 * MiB

CHILD = r"""
import json, os, sys, tempfile, threading, time, torch, safepoint
uri, mib, job = sys.argv[1], int(sys.argv[2]), sys.argv[3]

def anon(pid="self"):
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None

class Peak:
    # The peak RssAnon of a process (sampled every 5 ms) while the block runs.
    def __init__(self, pid="self"):
        self.pid, self.peak, self.done = pid, anon(pid) or 0, False
    def __enter__(self):
        self.base = anon(self.pid) or 0
        self.peak = self.base
        def run():
            while not self.done:
                a = anon(self.pid)
                if a is not None:
                    self.peak = max(self.peak, a)
                time.sleep(0.005)
        self.t = threading.Thread(target=run, daemon=True)
        self.t.start()
        return self
    def __exit__(self, *exc):
        self.done = True
        self.t.join()
        a = anon(self.pid)
        if a is not None:
            self.peak = max(self.peak, a)

def agent_pid(shm):
    # The safepointd whose command line names `shm` (bench/scale.py's agents_of).
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if os.path.basename(argv[0]) == b"safepointd" and shm.encode() in argv:
            return int(pid)
    return None

S = mib << 20
n = max(1, S // (64 << 20))
state = {f"w{i}": torch.full(((64 << 20) // 4,), float(i)) for i in range(n)}
out = {"state_bytes": n * (64 << 20)}
shm = tempfile.mkdtemp(prefix="sp-mem-", dir="/dev/shm")
ck = safepoint.Checkpointer(uri, job=job, shm_dir=shm, keep=2)
pid = agent_pid(shm)  # started by the Checkpointer; nothing persisted yet
out["agent_pid_found"] = pid is not None
if pid:
    # From the agent's level before its first persist: buffers it keeps between persists count.
    with Peak(pid) as p:
        for step in (1, 2):
            ck.save(step, state)
            ck.wait()
    out["persist_agent_extra"] = p.peak - p.base
else:
    for step in (1, 2):
        ck.save(step, state)
        ck.wait()
ck.close()
del ck
with Peak() as p:
    got = safepoint.load(uri)
out["load_extra"] = p.peak - p.base - out["state_bytes"]
assert all(torch.equal(got[1][k], v) for k, v in state.items())
del got
targets = {k: torch.zeros_like(v) for k, v in state.items()}
ck = safepoint.Checkpointer(uri, job=job + "-r", shm_dir=shm, keep=2)
with Peak() as p:
    step = ck.restore(targets)
out["restore_extra"] = p.peak - p.base
assert step == 2 and all(torch.equal(targets[k], v) for k, v in state.items())
ck.close()
print(json.dumps(out))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--stores", default="posix,s3,rados")
    ap.add_argument("--options", default="",
                    help="a query string for the object-store URIs, e.g. connections=4")
    ap.add_argument("--out", default=os.path.join(ROOT, "build", "bench", "objstore_memory.json"))
    args = ap.parse_args()
    results = []
    run = uuid.uuid4().hex[:8]
    for store in args.stores.split(","):
        if store == "posix":
            uri = os.path.join(tempfile.mkdtemp(prefix="sp-mem-"), "ckpt")
        else:
            base = os.environ.get({"s3": "SAFEPOINT_TEST_S3_URI",
                                   "rados": "SAFEPOINT_TEST_RADOS_URI"}[store])
            if not base:
                print(f"objstore_memory: {store} skipped: no throwaway Ceph (run under "
                      "scripts/with-ceph.sh)", file=sys.stderr)
                continue
            uri = f"{base}/mem-{run}" + (f"?{args.options}" if args.options else "")
        got = subprocess.run([sys.executable, "-c", CHILD, uri, str(args.mib),
                              f"mem-{store}-{run}"],
                             capture_output=True, text=True, timeout=1800, cwd=ROOT)
        if got.returncode != 0:
            raise RuntimeError(f"{store}: {got.stderr[-3000:]}")
        res = json.loads(got.stdout.strip().splitlines()[-1])
        res["store"] = store
        results.append(res)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"Peak host memory beyond the data ({args.mib} MiB state); the issue's bound is part "
          f"size x connections + 64 MiB = {BOUND // MiB} MiB:\n")
    print("| store | persist: agent's private memory | load: beyond the result | "
          "restore: beyond the targets |")
    print("|---|---|---|---|")
    for r in results:
        cells = [f"{r[k] / MiB:,.0f} MiB" if k in r else "-"
                 for k in ("persist_agent_extra", "load_extra", "restore_extra")]
        print(f"| {r['store']} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
