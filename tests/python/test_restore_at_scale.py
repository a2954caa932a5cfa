"""Restore at scale: byte ranges several ranks need are read from storage once and shared over
the checkpointer's gloo group (4 ranks, real processes and agents, restoring from storage with
nothing in memory).

Run as a script, this file is one rank of such a job: argv mode phase ckpt shm job port rank
[share]; it prints one JSON line.
"""

import json
import os
import sys

WORLD = 4
REPLICATED = 10 << 20  # bytes of the replicated model of the tests


def _state(kind: str, step: int, rank: int) -> dict:
    """Rank `rank`'s state at `step`. "ddp": a replicated model only. "mixed": that model, a
    part replicated only within a pair of ranks (tensor parallel x data parallel) and a shard
    only this rank holds (FSDP-like)."""
    import torch

    g = torch.Generator().manual_seed(step)
    # layer i: (i + 1) MiB of float32; every rank holds the same values.
    model = {f"layer{i}": torch.randn(256, 1024 * (i + 1), generator=g) for i in range(4)}
    state = {"model": model, "step": step}
    if kind == "mixed":
        pair = torch.Generator().manual_seed(1000 * step + rank // 2)
        state["tp"] = {f"w{rank // 2}": torch.randn(512, 512, generator=pair)}
        state[f"shard{rank}"] = torch.full((SHARD,), float(100 * rank + step))
    return state


# A rank's own shard, in float32s: 10 MB, so that the chunk (4 MiB, one checksum) around its
# middle holds nothing else (test_ranks_restoring_from_memory_take_part_in_the_shared_read).
SHARD = 2_500_000


def _zeros(tree):
    import torch

    if isinstance(tree, dict):
        return {k: _zeros(v) for k, v in tree.items()}
    return torch.zeros_like(tree) if isinstance(tree, torch.Tensor) else tree


def _equal(a, b) -> bool:
    import torch

    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


def _rank_main(argv: list) -> None:
    import warnings

    import torch.distributed as dist

    import safepoint
    from safepoint import _core

    kind, phase, ckpt, shm, job, port, rank = argv[:7]
    if kind == "bench":
        return _bench_rank(ckpt, shm, job, port, int(rank))
    share = len(argv) < 8 or argv[7] == "share"
    rank = int(rank)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    out: dict = {"rank": rank}
    if phase in ("save", "save-keep"):
        with safepoint.Checkpointer(ckpt, job=job, shm_dir=shm) as ck:
            for step in (1, 2):
                ck.save(step, _state(kind, step, rank), include_rng=True)
            ck.wait()
            if phase == "save-keep":
                ck.abandon()  # like a crash: the snapshots stay in memory
        # else close() removed the snapshots from memory: a restore reads storage.
    else:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with safepoint.Checkpointer(ckpt, job=job, shm_dir=shm, share_reads=share) as ck:
                if phase == "restore-damaged1" and rank == 1:
                    # Rank 1's snapshots in memory are damaged in a chunk of its own tensor
                    # alone (the middle of `shard1`, which no other rank needs): it alone
                    # reads from storage. (Damage in a chunk that holds a tensor rank 1 copied
                    # for its node would send the ranks that fill it from rank 1's slot to
                    # storage too: tests/python/test_share.py.)
                    import numpy as np

                    job_dir = ck.status()["agent"]["job_dir"]
                    for slot in ck._live.slots():
                        if slot.state == "COMPLETE":
                            path = os.path.join(job_dir, f"rank-00001.slot-{slot.slot}")
                            with open(path, "r+b") as f:
                                data = np.frombuffer(f.read(), dtype=np.uint8)
                                run = np.full(1024, 100 * rank + slot.step, np.float32)
                                at = bytes(data).find(run.tobytes())
                                assert at > 0, "shard1 is not in the slot"
                                at += SHARD * 4 // 2  # its middle
                                f.seek(at)
                                byte = f.read(1)
                                f.seek(at)
                                f.write(bytes([byte[0] ^ 0xFF]))
                dist.barrier()
                target = _zeros(_state(kind, 0, rank))
                out["step"] = ck.restore(target)
                out["ok"] = _equal(target, _state(kind, out["step"], rank))
                out["last_load"] = ck.status()["last_load"]
        out["warnings"] = [str(w.message) for w in caught]
    print(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


BENCH_TENSORS = 16  # of 16 MiB each: a 256 MiB replicated model


def _drop_cache(root: str) -> None:
    """Drops the page cache of every file under `root` (they are committed, so clean)."""
    for d, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _bench_rank(ckpt: str, shm: str, job: str, port: str, rank: int) -> None:
    """Saves a 256 MiB DDP state from 4 ranks, then restores it from storage (page cache
    dropped before each), alternately with and without shared reads, and prints the times."""
    import time

    import torch
    import torch.distributed as dist

    import safepoint

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    g = torch.Generator().manual_seed(7)
    state = {f"layer{i}": torch.randn(2048, 2048, generator=g) for i in range(BENCH_TENSORS)}
    with safepoint.Checkpointer(ckpt, job=job + "-save", shm_dir=shm) as ck:
        ck.save(1, state)
        ck.wait()
    runs = []
    with safepoint.Checkpointer(ckpt, job=job, shm_dir=shm) as ck:
        for share in (True, False, True, False):
            ck.share_reads = share
            target = {k: torch.zeros_like(v) for k, v in state.items()}
            if rank == 0:
                _drop_cache(ckpt)
            dist.barrier()
            t0 = time.perf_counter()
            ck.restore(target)
            dist.barrier()
            runs.append({"share": share, "seconds": time.perf_counter() - t0,
                         "ok": all(torch.equal(target[k], v) for k, v in state.items()),
                         **ck.status()["last_load"]})
    print(json.dumps({"rank": rank, "runs": runs}))
    dist.barrier()
    dist.destroy_process_group()


def _bench(workdir: str) -> None:
    """python test_restore_at_scale.py --bench DIR: the measurement in docs/architecture.md."""
    import socket
    import subprocess

    os.makedirs(os.path.join(workdir, "shm"), exist_ok=True)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    argv = [sys.executable, __file__, "bench", "-", os.path.join(workdir, "ckpt"),
            os.path.join(workdir, "shm"), f"bench-{os.getpid()}", str(port)]
    procs = [subprocess.Popen(argv + [str(r)], stdout=subprocess.PIPE, text=True)
             for r in range(WORLD)]
    outs = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
    for i, run in enumerate(outs[0]["runs"]):
        rs = [o["runs"][i] for o in outs]
        print(f"share_reads={run['share']!s:5}  restore {max(r['seconds'] for r in rs):.2f} s  "
              f"read from storage {sum(r['storage_bytes_read'] for r in rs) / 2**20:.0f} MiB  "
              f"sent between ranks {sum(r['peer_bytes_sent'] for r in rs) / 2**20:.0f} MiB  "
              f"(slowest rank: read {max(r.get('storage_read_seconds', 0) for r in rs):.2f} s, "
              f"exchange {max(r.get('exchange_seconds', 0) for r in rs):.2f} s)  "
              f"bit-exact {all(r['ok'] for r in rs)}")


if __name__ == "__main__":
    if sys.argv[1] == "--bench":
        _bench(sys.argv[2])
    else:
        _rank_main(sys.argv[1:])
    sys.exit(0)

import pytest  # noqa: E402
from conftest import free_port, run_ranks  # noqa: E402
from processes import kill_agents  # noqa: E402

from safepoint import _core  # noqa: E402


@pytest.fixture
def run(tmp_path):
    (tmp_path / "shm").mkdir()
    jobs = []

    def phase(kind: str, phase: str, share: bool = True, job: str = "") -> list:
        if not job:
            job = f"scale-{os.getpid()}-{len(jobs)}"
            jobs.append(job)
        port = free_port()
        return run_ranks([[__file__, kind, phase, tmp_path / "ckpt", tmp_path / "shm", job,
                           port, r, "share" if share else "own"] for r in range(WORLD)])

    yield phase
    for job in jobs + ["kept"]:
        kill_agents(tmp_path / "shm", job)


def _sum(outs, key):
    return sum(o["last_load"][key] for o in outs)


def test_replicas_are_read_from_storage_once_and_shared(run):
    run("ddp", "save")
    outs = run("ddp", "restore")
    assert [(o["step"], o["ok"]) for o in outs] == [(2, True)] * WORLD
    assert {o["last_load"]["source"] for o in outs} == {"storage"}
    read = [o["last_load"]["storage_bytes_read"] for o in outs]
    # The model is read once in total (plus each rank's few bytes of generator state), split
    # evenly: every rank reads about a quarter and receives the rest from the others.
    assert REPLICATED <= sum(read) < REPLICATED * 1.02, read
    assert all(REPLICATED / WORLD * 0.7 < r < REPLICATED / WORLD * 1.3 for r in read), read
    assert _sum(outs, "peer_bytes_sent") == _sum(outs, "peer_bytes_received")
    assert REPLICATED * 3 <= _sum(outs, "peer_bytes_received") < REPLICATED * 3.02

    # Opting out: every rank reads the whole model itself.
    own = run("ddp", "restore", share=False)
    assert [(o["step"], o["ok"]) for o in own] == [(2, True)] * WORLD
    assert REPLICATED * WORLD <= _sum(own, "storage_bytes_read") < REPLICATED * WORLD * 1.02
    assert _sum(own, "peer_bytes_received") == 0


def test_mixed_replicated_and_sharded_state(run):
    run("mixed", "save")
    outs = run("mixed", "restore")
    assert [(o["step"], o["ok"]) for o in outs] == [(2, True)] * WORLD
    pair = 512 * 512 * 4  # each pair of ranks shares one such tensor
    shard = SHARD * 4  # each rank has one of these alone
    read = [o["last_load"]["storage_bytes_read"] for o in outs]
    unique = REPLICATED + 2 * pair + WORLD * shard
    assert unique <= sum(read) < unique * 1.02, read
    # A shard travels nowhere: what is sent is the model (to 3 ranks) and each pair tensor (to
    # the other rank of its pair).
    sent = _sum(outs, "peer_bytes_sent")
    assert 3 * REPLICATED + 2 * pair <= sent < (3 * REPLICATED + 2 * pair) * 1.02, sent


@pytest.mark.parametrize("damaged", ["shard3", "model.layer0"])
def test_a_rank_that_cannot_read_makes_every_rank_fall_back(run, tmp_path, damaged):
    # "shard3": only rank 3 needs it (its own read fails); "model.layer0": every rank needs it
    # and one reads it for all.
    run("mixed", "save")
    ckpt = str(tmp_path / "ckpt")
    holder = next(r for r in range(WORLD) for e in _core.read_metadata(ckpt, 2, r).tensors
                  if e.name == damaged and not e.elsewhere)
    img, offset, nbytes = _core.tensor_extent(ckpt, 2, holder, damaged)
    with open(img, "r+b") as f:
        f.seek(offset + nbytes // 2)
        byte = f.read(1)
        f.seek(offset + nbytes // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    outs = run("mixed", "restore")
    assert [(o["step"], o["ok"]) for o in outs] == [(1, True)] * WORLD
    assert any("fall back" in w for o in outs for w in o["warnings"])


def test_a_rank_whose_copy_in_memory_is_damaged_reads_storage_alone(run):
    # Every rank keeps its snapshots in memory, but rank 1's are damaged: ranks 0, 2 and 3
    # restore from memory; rank 1 reads everything it needs from storage itself and nothing is
    # sent. The step is in every rank's memory, so the shared read's collectives do not run at
    # all (test_collectives.py); before, the ranks restoring from memory took part in it.
    run("mixed", "save-keep", job="kept")
    outs = run("mixed", "restore-damaged1", job="kept")
    assert [(o["step"], o["ok"]) for o in outs] == [(2, True)] * WORLD
    assert [o["last_load"]["source"] for o in outs] == ["memory", "storage", "memory", "memory"]
    read = [o["last_load"]["storage_bytes_read"] for o in outs]
    assert read[0] == read[2] == read[3] == 0 and read[1] >= REPLICATED, read
    assert _sum(outs, "peer_bytes_sent") == 0


def test_plan_splits_shared_ranges_evenly_in_storage_order():
    from safepoint._shared_reads import plan_shared_reads

    mib = 1 << 20

    def want(i, n):  # range i of image 0: (key, position in the step)
        return (0, f"t{i}", 0, n), (0, i, 0)

    everyone = [want(i, mib) for i in reversed(range(8))]
    plan = plan_shared_reads([everyone] * 4 + [[]])
    # One buffer of the 8 ranges in storage order; each of the 4 ranks reads a quarter of it (2
    # neighbouring ranges) and sends it to the other 3; rank 4 needs nothing.
    assert len(plan) == 1 and plan[0].ranks == (0, 1, 2, 3)
    assert [k[1] for k, _ in plan[0].layout] == [f"t{i}" for i in range(8)]
    assert plan[0].shares == [(r, 2 * r * mib, 2 * (r + 1) * mib) for r in range(4)]
    # A rank with 4 MiB of its own to read takes less of the shared ones.
    plan = plan_shared_reads([everyone, everyone + [((1, "big", 0, 4 * mib), (1, 0, 0))]])
    assert plan[0].shares == [(0, 0, 6 * mib), (1, 6 * mib, 8 * mib)]
    # Ranges only one rank needs are not in the plan; two sets of ranks get two buffers; small
    # ranges (each at a 64-byte boundary) are not split between readers.
    a, b = [want(0, 100)], [want(1, 100)]
    plan = plan_shared_reads([a, a + [want(2, 100)], b, b])
    assert [(g.ranks, g.size, len(g.shares)) for g in plan] == [((0, 1), 128, 1),
                                                               ((2, 3), 128, 1)]
