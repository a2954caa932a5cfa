"""Replicated state restored from an object store once per job, not once per rank (issue 33
item 5; docs/benchmarks.md, "Object stores: replicated state restored once per job, and host
memory").

W real processes (gloo over the loopback) hold the same DDP-like state, a replicated model of
--mib MiB (float32 tensors of 16 MiB, the same bytes on every rank). They save it once to the
store (``Checkpointer(uri)``, ``save`` + ``wait``: committed; the default dedupe writes each
replicated tensor once per node) and close. Then, --restores times each, a fresh set of W
processes (a new job name and shm directory: nothing in memory) restores the step from the
store into zeroed targets, checking every byte:

- **shared**: ``restore(state)`` with the default ``share_reads``: the byte ranges several ranks
  need are read from the store once for the job, split among the ranks, and sent over gloo
  (docs/architecture.md, "Restore at scale");
- **each**: ``Checkpointer(share_reads=False)``: every rank fetches all it needs itself.

Measured at the store's side, so that nothing the client could miscount is counted: the RADOS
Gateway's own perf counters (``rgw.get``, ``rgw.get_b``: GET requests and bytes it served) for
``s3://``, the OSD's (``osd.op_r``, ``osd.op_r_out_bytes``: read ops and bytes) for ``rados://``,
read over their admin sockets before and after each restore. Beside them the client's own
counts (``last_load``: storage bytes read, bytes sent to and received from other ranks) and the
restore's time (the slowest rank's, after a barrier; median over the restores).

Needs the throwaway Ceph: run it as ``scripts/with-ceph.sh .venv/bin/python
bench/share_objstore.py`` (or ``make bench-share-objstore``); without $SAFEPOINT_TEST_CEPH_DIR
the object stores are skipped, saying why. ``--stores posix`` runs on a local directory (no
store-side counters there).

    python bench/share_objstore.py [--world 8] [--mib 128] [--restores 3] [--stores s3,rados]
                                   [--out build/bench/share_objstore.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from run import free_port  # noqa: E402
from scale import stop_agents  # noqa: E402  (the same shutdown of a job's agents)

TENSOR = 16 << 20  # bytes of each replicated tensor


def state(mib: int) -> dict:
    """The replicated model: the same bytes on every rank."""
    import torch

    g = torch.Generator().manual_seed(33)
    n = max(1, (mib << 20) // TENSOR)
    return {"model": {f"layer{i}": torch.randn(TENSOR // 4, generator=g) for i in range(n)},
            "step": 1}


def worker(phase: str, uri: str, shm: str, job: str, port: int, rank: int, world: int,
           mib: int) -> dict:
    import torch
    import torch.distributed as dist

    from safepoint import Checkpointer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    out: dict[str, Any] = {"rank": rank}
    want = state(mib)
    if phase == "save":
        ck = Checkpointer(uri, job=job, shm_dir=shm, keep=2)
        ck.save(1, want)
        ck.wait()
        ck.close()
    else:
        targets = {"model": {k: torch.zeros_like(v) for k, v in want["model"].items()},
                   "step": 0}
        ck = Checkpointer(uri, job=job, shm_dir=shm, keep=2, share_reads=phase == "shared")
        dist.barrier()
        t0 = time.perf_counter()
        step = ck.restore(targets)
        out["seconds"] = time.perf_counter() - t0
        out["step"] = step
        out["exact"] = all(torch.equal(targets["model"][k], v) for k, v in want["model"].items())
        last = ck.status()["last_load"]
        out.update({k: last.get(k) or 0 for k in ("storage_bytes_read", "peer_bytes_sent",
                                                  "peer_bytes_received")})
        out["source"] = last.get("source")
        ck.close()
    dist.barrier()
    dist.destroy_process_group()
    return out


def launch(phase: str, uri: str, world: int, mib: int, timeout: float) -> list[dict]:
    """One phase's W ranks (a new job and shm directory each time); the JSON of each rank."""
    shm = tempfile.mkdtemp(prefix="sp-share-shm-", dir="/dev/shm" if os.path.isdir("/dev/shm")
                           else None)
    job = f"share-{phase}-{uuid.uuid4().hex[:8]}"
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank", phase, uri,
                               shm, job, port, str(r), str(world), str(mib)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
             for r in range(world)]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise
    finally:
        stop_agents(shm, grace=10, own_exit=20)
        shutil.rmtree(shm, ignore_errors=True)
    results = []
    for p, (text, err) in zip(procs, outs):
        if p.returncode != 0:
            raise RuntimeError(f"{phase}: a rank failed ({p.returncode}):\n{text}\n{err[-3000:]}")
        results.append(json.loads(text.strip().splitlines()[-1]))
    return results


def perf(ceph_dir: str, daemon: str) -> dict:
    """The perf counters of one daemon of the throwaway cluster (its admin socket)."""
    got = subprocess.run(["ceph", "--admin-daemon", os.path.join(ceph_dir, "run",
                                                                  f"{daemon}.asok"),
                          "perf", "dump"], capture_output=True, text=True, timeout=60, check=True)
    return json.loads(got.stdout)


def store_counts(store: str, ceph_dir: Optional[str]) -> dict:
    """(requests, bytes) the store served, from its own counters; empty for POSIX."""
    if store == "s3":
        rgw = perf(ceph_dir, "client.rgw")["rgw"]
        return {"requests": rgw["get"], "bytes": rgw["get_b"]}
    if store == "rados":
        osd = perf(ceph_dir, "osd.0")["osd"]
        return {"requests": osd["op_r"], "bytes": osd["op_r_out_bytes"]}
    return {}


def run_store(store: str, uri: str, args: argparse.Namespace) -> dict:
    ceph_dir = os.environ.get("SAFEPOINT_TEST_CEPH_DIR")
    size = len(state(args.mib)["model"]) * TENSOR
    launch("save", uri, args.world, args.mib, args.timeout)
    runs: dict[str, list] = {"shared": [], "each": []}
    for _ in range(args.restores):
        for mode in ("shared", "each"):  # alternated, so that drift hits both alike
            before = store_counts(store, ceph_dir)
            ranks = launch(mode, uri, args.world, args.mib, args.timeout)
            after = store_counts(store, ceph_dir)
            bad = [r for r in ranks if not (r["exact"] and r["step"] == 1)]
            if bad:
                raise RuntimeError(f"{store} {mode}: a rank did not restore step 1 exactly: {bad}")
            runs[mode].append({
                "store": {k: after[k] - before[k] for k in after},
                "slowest_s": max(r["seconds"] for r in ranks),
                "client_bytes_read": sum(r["storage_bytes_read"] for r in ranks),
                "peer_bytes_received": sum(r["peer_bytes_received"] for r in ranks),
                "sources": sorted({r["source"] for r in ranks}),
            })
    return {"store": store, "uri": uri, "world": args.world, "state_bytes": size, "runs": runs}


def table(results: list[dict]) -> str:
    med = statistics.median
    rows = ["| store | restore | bytes from the store / state | requests at the store | "
            "client bytes read / state | bytes received from other ranks / state | "
            "slowest rank (s), median | vs each |",
            "|---|---|---|---|---|---|---|---|"]
    for res in results:
        size = res["state_bytes"]
        each_s = med(r["slowest_s"] for r in res["runs"]["each"])
        for mode in ("shared", "each"):
            runs = res["runs"][mode]
            got = [r["store"] for r in runs]
            served = f"{med(g['bytes'] for g in got) / size:.2f}x" if got and got[0] else "-"
            reqs = f"{med(g['requests'] for g in got):,.0f}" if got and got[0] else "-"
            slow = med(r["slowest_s"] for r in runs)
            rows.append(f"| {res['store']} | {mode} | {served} | {reqs} | "
                        f"{med(r['client_bytes_read'] for r in runs) / size:.2f}x | "
                        f"{med(r['peer_bytes_received'] for r in runs) / size:.2f}x | "
                        f"{slow:.2f} | {slow / each_s:.2f}x |")
    return "\n".join(rows)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        phase, uri, shm, job, port, rank, world, mib = sys.argv[2:10]
        print(json.dumps(worker(phase, uri, shm, job, int(port), int(rank), int(world),
                                int(mib))))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--mib", type=int, default=128)
    ap.add_argument("--restores", type=int, default=3)
    ap.add_argument("--stores", default="s3,rados")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--out", default=os.path.join(ROOT, "build", "bench", "share_objstore.json"))
    args = ap.parse_args()
    run_id = uuid.uuid4().hex[:8]
    results = []
    for store in args.stores.split(","):
        if store == "posix":
            root = tempfile.mkdtemp(prefix="sp-share-")
            try:
                results.append(run_store(store, os.path.join(root, "ckpt"), args))
            finally:
                shutil.rmtree(root, ignore_errors=True)
            continue
        base = os.environ.get({"s3": "SAFEPOINT_TEST_S3_URI",
                               "rados": "SAFEPOINT_TEST_RADOS_URI"}[store])
        if not base or not os.environ.get("SAFEPOINT_TEST_CEPH_DIR"):
            print(f"share_objstore: {store} skipped: no throwaway Ceph (run under "
                  "scripts/with-ceph.sh)", file=sys.stderr)
            continue
        results.append(run_store(store, f"{base}/share-{run_id}", args))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(table(results))
    print(f"share_objstore: results in {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
