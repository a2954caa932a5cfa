"""The collectives of a save with several ranks (issue 32 item 5): in steady state one, of a
fixed small payload whatever the world size; the replicas' tensor lists are gathered only when a
rank's structure changed; a preemption notice on one rank still reaches every rank.

4 real processes (gloo, CPU), each counting every torch.distributed collective its saves run
(tests/python/workloads/collectives_worker.py). Counts, never times."""

import os

import pytest
from conftest import free_port, run_ranks

WORKER = os.path.join(os.path.dirname(__file__), "workloads", "collectives_worker.py")
RANKS = 4


def run(tmp_path, shm, mode: str, steps: int = 6, persist_every: int = 1) -> list:
    # `shm`: the conftest fixture's short directory (the agent's socket path has a length limit,
    # which a directory under pytest's tmp_path can pass) whose agents it kills afterwards.
    job = f"coll-{mode.replace('+', '-')}-{os.getpid()}"
    port = free_port()
    return run_ranks([[WORKER, tmp_path / "ckpt", shm, job, port, r, RANKS, mode, steps,
                       persist_every] for r in range(RANKS)])


def collectives(out: dict, step: int) -> list:
    """(name, bytes sent, bytes received) of each collective the save of `step` ran."""
    return [tuple(c[:3]) for s, calls in out["saves"] if s == step for c in calls]


ONE = [("all_reduce", 16, 16)]  # the steady state: one all-reduce of two int64, on every W
# (safepoint's own, _collectives.all_reduce_max: the counter records it as one all-reduce)


@pytest.mark.parametrize("mode", ["steady", "overlap"])
def test_a_steady_state_save_runs_one_small_collective(tmp_path, shm, mode):
    outs = run(tmp_path, shm, mode)
    for out in outs:
        # The first save plans the replicas: it gathers every rank's tensor list once.
        first = collectives(out, 1)
        assert first[0] == ONE[0] and [c[0] for c in first[1:]] == ["all_gather_object"], first
        # Every later save of the same structure: one all-reduce of 16 bytes, nothing else.
        for step in range(2, 7):
            assert collectives(out, step) == ONE, (out["rank"], step, collectives(out, step))


def test_a_structure_change_on_one_rank_is_planned_again_on_every_rank(tmp_path, shm):
    outs = run(tmp_path, shm, "change", steps=4)
    for out in outs:
        # Step 3: the last rank's structure changed; every rank gathers the lists (else the
        # ranks' collectives would not match and the run would hang or fail).
        assert [c[0] for c in collectives(out, 3)] == ["all_reduce", "all_gather_object"]
        assert collectives(out, 4) == ONE  # the new structure is the steady state again
        # Every committed step (2, before the change; 3 and 4, after) loads bit-exact from
        # storage, each rank's own structure, the replicas read from whichever rank wrote them.
        assert out["exact"] is True and out["steps"] == [2, 3, 4]


@pytest.mark.parametrize("mode,persist_every", [("preempt", 1), ("preempt", 3),
                                                ("preempt+overlap", 3)])
def test_a_notice_on_one_rank_preempts_every_rank_at_the_same_save(tmp_path, shm, mode,
                                                                   persist_every):
    # The last rank gives the notice after step 3: the save of step 4 brings it to every rank
    # through its one all-reduce, and becomes the preemption save everywhere (committed when
    # it returns, bit-exact). Persisted already (persist_every=1): nothing more to copy, no
    # further collective; not persisted (persist_every=3): copied again, persisted, and that
    # copy's all-reduce.
    outs = run(tmp_path, shm, mode, steps=6, persist_every=persist_every)
    for out in outs:
        assert out["preempted_at"] == 4, out
        assert [s for s, _ in out["saves"]] == [1, 2, 3, 4]
        assert collectives(out, 3) == ONE
        assert collectives(out, 4) == ONE * (1 if persist_every == 1 else 2)
        assert out["exact"] is True and 4 in out["steps"]


def test_a_restore_from_storage_agrees_in_one_collective(tmp_path, shm):
    # Nothing in memory (a fresh set of processes after the job closed): one all-gather of fixed
    # rows (the hot reload's statements and rank 0's committed steps together), then the
    # all-reduce of "did every rank read it". Before: the hot reload's all-gather, then a
    # pickled all_gather_object of every rank's committed steps, then the all-reduce.
    worker = os.path.join(os.path.dirname(__file__), "workloads", "restore_requests_worker.py")

    def phase(name: str) -> list:
        port = free_port()
        return run_ranks([[worker, tmp_path / "ckpt", shm, f"coll-r-{name}-{os.getpid()}", port,
                           r, RANKS, name] for r in range(RANKS)])

    phase("save")
    for out in phase("load"):
        assert (out["step"], out["ok"], out["source"]) == (4, True, "storage")
        assert out["calls"] == ["all_gather", "all_reduce"], out
    for out in phase("restore"):
        # restore shares the reads several ranks need: the agreement's all-gather, then the
        # shared read's plan (all_gather_object), its point-to-point messages and its
        # all-reduce, which also tells every rank that all read the step (before, the
        # agreement's own all-reduce followed: 4 collectives).
        calls = [c for c in out["calls"] if c not in ("isend", "irecv")]
        assert calls == ["all_gather", "all_gather_object", "all_reduce"], out


def test_a_save_gives_up_on_a_missing_rank_after_the_jobs_timeout(tmp_path, shm):
    """The Checkpointer's own gloo group keeps the job's process group timeout (5 s here), not
    gloo's default 30 minutes: the ranks whose save waits on a rank that never saves give up on
    it (a warning; the save goes on alone) while that rank still waits for them (200 s). Found by
    the node campaign: a stale process stuck in a save whose peers were gone waited 30 minutes
    whatever the job's timeout."""
    outs = run(tmp_path, shm, "timeout", steps=1)
    *others, last = outs
    assert last["saw"] is True, outs
    for out in others:
        assert out["saved"] is True, out
        assert any("could not agree" in w for w in out["warnings"]), out


@pytest.mark.parametrize("world", [4, 6])
def test_safepoints_collectives_take_log2_w_rounds(tmp_path, world):
    # The save's collective and the restore's are safepoint's recursive doubling
    # (_collectives.all_reduce_max, all_gather, all_gather_object), not gloo's rings, whose
    # messages in sequence grow with W (bench/collective_depth.py). W ranks not a power of two
    # (the ranks past the largest power of two P hand their values to rank - P first and get
    # the result back: two of 6) and a power of two (4: none), 20 calls of each, one after the
    # other (one sequence of tags), of values that differ per rank and per call, on a group of
    # its own beside the default one: every rank gets the maximum, and every rank's row (and
    # object, of another length) in its place, and sends at most log2(P) + 1 messages an
    # all-reduce or all-gather.
    import subprocess
    import sys

    most = (world.bit_length() - 1) + 1
    script = f"""
import random, sys
import torch
import torch.distributed as dist
from safepoint import _collectives
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=rank,
                        world_size={world})
g = dist.new_group(backend="gloo")
sends = []
for name in ("send", "isend"):
    real = getattr(dist, name)
    def counted(*args, real=real, **kw):
        sends.append(1)
        return real(*args, **kw)
    setattr(dist, name, counted)
for call in range(20):
    values = [[random.Random(call * 100 + r * 10 + i).randint(-2**62, 2**62) for i in range(2)]
              for r in range({world})]
    t = torch.tensor(values[rank], dtype=torch.int64)
    before = len(sends)
    _collectives.all_reduce_max(t, g)
    assert t.tolist() == [max(v[i] for v in values) for i in range(2)], (call, t)
    assert len(sends) - before <= {most}, len(sends) - before
    rows = torch.tensor([[random.Random(call * 1000 + r * 10 + i).randint(-2**62, 2**62)
                          for i in range(5)] for r in range({world})], dtype=torch.int64)
    before = len(sends)
    assert torch.equal(_collectives.all_gather(rows[rank].clone(), g), rows), call
    assert len(sends) - before <= {most}, len(sends) - before
    objs = [{{"rank": r, "text": "x" * (37 * r + call)}} for r in range({world})]  # lengths differ
    got = [None] * {world}
    before = len(sends)
    _collectives.all_gather_object(got, objs[rank], g)
    assert got == objs, (call, got)
    assert len(sends) - before <= 2 * {most}, len(sends) - before  # lengths, then pickles
one = torch.tensor([rank], dtype=torch.int32)  # the preemption notice's int32 too
_collectives.all_reduce_max(one, g)
assert one.item() == {world} - 1
dist.destroy_process_group()
print("ok")
"""
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(world)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0 and out.strip() == "ok", err[-3000:]
