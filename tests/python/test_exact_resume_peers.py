"""The data position comes back from a peer's memory (docs/guide.md, "Exact resume and the
data position"): a 3-node DDP job (one rank per node; tests/common/nodes.py's network
namespaces, needs root, else skipped) keeps its ``GlobalBatchSampler`` in the state with
``redundancy="mirror"``. Node 1 is lost with its memory after a step that was never persisted;
its replacement's rank restores its state, sampler included, from its copy on node 2, and the
job trains on: every global step's sample ids and the final weights equal those of an
uninterrupted run of the same job on the same nodes (tests/python/workloads/
exact_resume_peer_worker.py)."""

import os

from nodes import Job

import safepoint

WORKER = os.path.join(os.path.dirname(__file__), "workloads", "exact_resume_peer_worker.py")
STEPS, KILLED_AFTER, PERSISTED = 14, 9, 4  # steps 5..9 only in memory (and on the peers)


def global_batches(outs: list[dict]) -> dict[int, list[int]]:
    """step -> every rank's ids of that step, in rank order."""
    steps = set(outs[0]["batches"])
    assert all(set(o["batches"]) == steps for o in outs), [sorted(o["batches"]) for o in outs]
    return {int(s): [i for o in outs for i in o["batches"][s]] for s in steps}


def test_lost_node_resumes_its_data_position_from_peer_memory(cluster, tmp_path):
    c = cluster(3, shm_size="64m")
    name = f"exactpeer-{os.getpid()}"
    ref = Job(c, WORKER, ["run", tmp_path / "ref", name + "r", STEPS, STEPS])
    assert [o["step"] for o in ref.expect_all("started")] == [None] * 3
    done = ref.expect_all("done")
    ref.check()
    want = global_batches(done)
    assert sorted(want) == list(range(1, STEPS + 1))
    assert len({o["weights"] for o in done}) == 1

    ckpt = tmp_path / "ckpt"
    job = Job(c, WORKER, ["wait", ckpt, name, KILLED_AFTER, PERSISTED])
    before = global_batches(job.expect_all("saved"))
    assert safepoint.steps(ckpt)[-1] == PERSISTED  # step KILLED_AFTER is only in memory
    c[1].kill()  # its rank, its agent and its /dev/shm are gone
    c.replace(1)
    job = job.restart(["run", ckpt, name, STEPS, STEPS])
    started = job.expect_all("started")
    assert [o["step"] for o in started] == [KILLED_AFTER] * 3, started
    assert [o["source"] for o in started] == ["memory", "peer", "memory"], started
    after = job.expect_all("done")
    job.check()

    got = {**before, **global_batches(after)}
    assert sorted(got) == list(range(1, STEPS + 1))
    differ = [(s, want[s], got[s]) for s in want if want[s] != got[s]]
    assert not differ, f"samples differ from the uninterrupted run (step, want, got): {differ[:3]}"
    assert {o["weights"] for o in after} == {done[0]["weights"]}
