"""safepoint benchmark: healing a torchft replica, SafepointTransport against torchft's own
HTTPTransport and PGTransport (gloo) on the same state.

    python bench/torchft_heal.py [--size 256M] [--tensors 64] [--reps 3] [--no-thp] [--kinds ...]

Two processes on this host: a live replica (sender) and a recovering one (receiver). For each
transport, ``--reps`` heals of the same state (float32, ``--size`` in ``--tensors`` tensors):
the sender's ``send_checkpoint`` (its *blocking* time: the live replica's training waits for it;
``disallow_checkpoint`` follows once the heal is over, as in torchft's Manager), the receiver's
``recv_checkpoint`` (the *heal* time: from the start of send until the receiver holds the
state, checked equal; the receiver then drops it, as torchft's Manager does once
``load_state_dict`` copied it into the model). Two heals first warm each transport up and are
not counted (the agents' start, the peer service, and the sender's two shared-memory slots,
created at its first two sends). SafepointTransport's location is a
directory in /dev/shm (replicas on one node), flash and sync; its peer mode writes no location:
the receiver reads the sender's snapshot from the sender's shared memory (``safepoint-peer``:
replicas on one node), or (``safepoint-peer-ucx``, ``shm_reads=False``: as between nodes) its
agent fetches it from the sender's agent over UCX (TCP on loopback: the peer service excludes
UCX's shared-memory transports). Prints a markdown table of medians with ratios to
HTTPTransport and PGTransport, for docs/benchmarks.md ("torchft heal"). ``--kinds`` picks
transports (HTTP and PG are always measured: the ratios need them).

``--fresh-receiver``: each heal goes to a new receiving process (a replica that restarted and
heals once), whose transport is made and whose ``metadata()`` is called (as torchft's Manager
does for its quorum) before the heal; torchft's process group is configured anew for each.
By default one receiving process heals again and again.

``--no-thp``: both processes (and the agents they start, which inherit it) run with transparent
huge pages off (prctl PR_SET_THP_DISABLE), for every transport alike: with the kernel's THP
defrag "madvise", a buffer that asks for huge pages (safepoint's load buffers do) compacts
memory when it faults, which on a fragmented host costs more than the copy itself.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import time
from datetime import timedelta

TIMEOUT = timedelta(seconds=120)
WARMUP = 2
NAMES = {"http": "torchft HTTPTransport", "pg": "torchft PGTransport (gloo)",
         "safepoint": "safepoint SafepointTransport, flash (/dev/shm)",
         "safepoint-sync": "safepoint SafepointTransport, sync (/dev/shm)",
         "safepoint-peer": "safepoint SafepointTransport, peer, same node (shared memory)",
         "safepoint-peer-ucx": "safepoint SafepointTransport, peer, agent to agent (UCX)"}


def parse_size(s: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    return int(float(s[:-1]) * units[s[-1]]) if s[-1] in units else int(s)


def make_state(size: int, n: int):
    import torch

    g = torch.Generator().manual_seed(0)
    return {"user": {f"layer{i}.weight": torch.randn(size // 4 // n, generator=g)
                     for i in range(n)}, "torchft": {"step": 7, "batches_committed": 70}}


def run(rank: int, kind: str, args, store_port: int, shm: str, q, reps: range) -> None:
    """One replica's process: the sender (rank 0) or a receiver (rank 1), for the heals
    `reps`."""
    if args.no_thp:
        import ctypes

        ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE
    import torch
    import torch.distributed as dist

    state = make_state(args.size, args.tensors)
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=TIMEOUT)
    pg = None
    if kind == "http":
        from torchft.checkpointing.http_transport import HTTPTransport

        t = HTTPTransport(TIMEOUT, num_chunks=0)
    elif kind == "pg":
        from torchft.checkpointing.pg_transport import PGTransport
        from torchft.process_group import ProcessGroupGloo

        pg = ProcessGroupGloo(timeout=TIMEOUT)
        t = PGTransport(pg=pg, timeout=TIMEOUT, device=torch.device("cpu"))
    else:
        from safepoint.torchft import SafepointTransport

        mode = kind.split("-")[1] if "-" in kind else "flash"
        t = SafepointTransport(os.path.join(shm, f"heal-{kind}-{rank}"), shm_dir=shm, mode=mode,
                               peer_host="127.0.0.1", shm_reads=not kind.endswith("-ucx"))
    # torchft's Manager sends every replica's metadata() in its quorum request (a peer-mode
    # transport starts its agent and peer service there).
    mine = t.metadata()
    if rank == 0:
        store.set("meta", mine)
    meta = store.get("meta").decode()
    for rep in reps:
        step = 10 + rep
        if pg is not None and (rep == reps[0] or args.fresh_receiver):
            # A new quorum (a new receiving process): torchft configures the group anew.
            pg.configure(store_addr=f"127.0.0.1:{store_port}/pg{rep}", replica_id="0",
                         rank=rank, world_size=2)
        store.set(f"go{rep}/{rank}", "1")
        store.wait([f"go{rep}/0", f"go{rep}/1"])
        if rank == 0:
            t0 = time.time()
            store.set(f"t0/{rep}", repr(t0))
            t.send_checkpoint([1], step, state, TIMEOUT)
            q.put((kind, "blocking", time.time() - t0))
            # As torchft's Manager does: disallow once the heal is over (HTTPTransport's
            # disallow takes a write lock that would hold off a receiver not yet reading).
            store.wait([f"done{rep}"])
            t.disallow_checkpoint()
        else:
            got = t.recv_checkpoint(0, meta, step, TIMEOUT)
            end = time.time()
            t0 = float(store.get(f"t0/{rep}").decode())
            ok = all(torch.equal(got["user"][k], v) for k, v in state["user"].items())
            # Dropped, as torchft's Manager drops it once load_state_dict copied it into the
            # model: the next heal's allocation may reuse its memory, for every transport alike.
            del got
            q.put((kind, "heal", end - t0 if ok else float("nan")))
            store.set(f"done{rep}", "1")
    if rank == 0 or reps[-1] == args.reps + WARMUP - 1:
        store.set(f"end/{rank}", "1")
        store.wait(["end/0", "end/1"])
    t.shutdown(wait=True)
    if pg is not None:
        pg.shutdown()


def measure(kind: str, args, shm: str) -> dict:
    import torch.distributed as dist

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=TIMEOUT,
                           wait_for_workers=False)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    every = range(args.reps + WARMUP)  # the first WARMUP heals warm up (not counted)
    # The receiver: one process for every heal, or (--fresh-receiver) a new one for each.
    receivers = [range(r, r + 1) for r in every] if args.fresh_receiver else [every]
    sender = ctx.Process(target=run, args=(0, kind, args, master.port, shm, q, every))
    sender.start()
    out: dict = {"blocking": [], "heal": []}
    for reps in receivers:
        p = ctx.Process(target=run, args=(1, kind, args, master.port, shm, q, reps))
        p.start()
        for _ in range(2 * len(reps)):
            _, what, secs = q.get(timeout=600)
            out[what].append(secs)
        p.join(timeout=120)
    out = {k: v[WARMUP:] for k, v in out.items()}  # without the warm-up heals
    sender.join(timeout=120)
    res: dict = {k: statistics.median(v) for k, v in out.items()}
    res["heals"], res["blockings"] = out["heal"], out["blocking"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="256M")
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-thp", action="store_true",
                    help="transparent huge pages off in both processes (prctl)")
    ap.add_argument("--fresh-receiver", action="store_true",
                    help="a new receiving process for every heal (a replica that restarted), "
                         "its transport made and metadata() called before the heal")
    ap.add_argument("--kinds", default=",".join(NAMES),
                    help=f"comma-separated, of {', '.join(NAMES)}")
    args = ap.parse_args()
    kinds = ["http", "pg"] + [k for k in args.kinds.split(",") if k not in ("http", "pg")]
    if not set(kinds) <= set(NAMES):
        ap.error(f"--kinds: unknown {sorted(set(kinds) - set(NAMES))}")
    args.size = parse_size(args.size)
    load_before = os.getloadavg()[0]
    shm = tempfile.mkdtemp(prefix="sp-heal-", dir="/dev/shm")
    try:
        res = {k: measure(k, args, shm) for k in kinds}
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    ref, pg = res["http"], res["pg"]
    print(f"state: {args.size / 2**20:.0f} MiB float32 in {args.tensors} tensors, "
          f"{args.reps} heals each, medians; load average {load_before:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after"
          f"{'; transparent huge pages off' if args.no_thp else ''}"
          f"{'; a new receiving process for every heal' if args.fresh_receiver else ''}\n")
    print("| transport | sender blocking s | heal s | heal × HTTP | heal × PG |")
    print("|---|---:|---:|---:|---:|")
    for k, r in res.items():
        print(f"| {NAMES[k]} | {r['blocking']:.3f} | {r['heal']:.3f} | "
              f"{r['heal'] / ref['heal']:.2f} | {r['heal'] / pg['heal']:.2f} |")
    print("\nevery heal, s (warm-up excluded):")
    for k, r in res.items():
        print(f"  {k}: heal {', '.join(f'{x:.3f}' for x in r['heals'])}; blocking "
              f"{', '.join(f'{x:.3f}' for x in r['blockings'])}")


if __name__ == "__main__":
    main()
