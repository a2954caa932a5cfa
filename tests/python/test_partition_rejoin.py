"""An agent that starts while its node's link is down (docs/reliability.md, OPEN-4): nodes are
network namespaces (tests/common/nodes.py; needs root, else skipped). UCX knows the interfaces
that were up when its context was made; the peer service of an agent started during a cut
waits for the node's interface before it starts UCX, so once the link is back the node
accepts its peers' copies and sends its own.

This file is also the job's worker (run as a script inside each node, with torchrun's
environment):

    python test_partition_rejoin.py CKPT JOB   step 1 (persisted), waits, reports "saved"; then
                                               rank 1 asks its agent for its status every 0.2 s
                                               (a dead agent is started again) until the file
                                               AGAIN exists beside CKPT; then step 2, waits,
                                               reports "again"
"""

import json
import os
import sys
import time

import pytest

WORKER_STEP_SECONDS = 0.2


def _say(kind, **fields):
    print(kind, json.dumps(fields), flush=True)


def _worker(ckpt: str, job: str) -> None:
    import torch
    import torch.distributed as dist

    import safepoint

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ck = safepoint.Checkpointer(ckpt, job=job, redundancy="mirror", dedupe=False, keep=5,
                                peer_timeout=5.0)

    def state(step):
        g = torch.Generator().manual_seed(1000 * step + rank)
        return {"w": torch.randn(64 * 1024, generator=g), "step": step}

    def report(kind, step):
        try:
            ck.wait()  # committed (step 1) and replicated, or failed
            error = None
        except Exception as e:  # noqa: BLE001  (reported: the test says what went wrong)
            error = f"{type(e).__name__}: {e}"
        dist.barrier()  # every rank's push is over: what each node holds is settled
        st = ck.status()
        _say(kind, rank=rank, step=step, wait_error=error,
             replication=[r for r in st["replication"]["ranks"] if r["rank"] == rank])

    ck.save(1, state(1), persist=True)
    report("saved", 1)
    again = os.path.join(os.path.dirname(os.path.abspath(ckpt)), "AGAIN")
    while not os.path.exists(again):
        if rank == 1:
            try:
                ck.status()  # as a training loop's next call: starts an agent if it died
            except Exception:  # noqa: BLE001,S110  (the next call tries again)
                pass
        time.sleep(WORKER_STEP_SECONDS)
    ck.save(2, state(2), persist=False)
    report("again", 2)
    while True:
        time.sleep(60)


def test_an_agent_started_while_its_link_is_down_reaches_its_peers_after_the_heal(cluster,
                                                                                   tmp_path):
    """3 nodes, mirror (rank r's copy on node r+1). Node 1's link is cut, its agent killed; rank
    1 starts a new one (same peer port) during the cut. After the heal, step 2 of rank 0 reaches
    node 1 (its new agent accepts) and step 2 of rank 1 reaches node 2 (it sends): both are
    protected. Before the fix both stayed unprotected until the agent was restarted."""
    import nodes
    from nodes import Job
    from processes import job_dir, wait_until

    reason = nodes.partitions_unavailable()
    if reason:
        pytest.skip(reason)
    c = cluster(3, shm_size="64m")
    ckpt, name = tmp_path / "ckpt", f"rejoin-{os.getpid()}"
    job = Job(c, __file__, [ckpt, name])
    saved = job.expect_all("saved")
    for o in saved:
        assert o["wait_error"] is None and o["replication"][0]["protected"], o
    jd = job_dir(c[1].shm, name)
    lock, log = jd / "agent.lock", jd / "agent.log"

    def serving() -> int:  # peer services the node's agents started, the first one included
        return log.read_text(errors="replace").count("listens on")

    assert serving() == 1, log.read_text(errors="replace")
    old = lock.read_text().split()[0]
    c[1].partition("both")
    try:
        c[1].run(["kill", "-9", old], check=True)
        # Rank 1's next status() starts a new agent, which gets the peer setup again: its peer
        # service starts while eth0 is down.
        restarted = wait_until(lambda: serving() == 2, deadline=60, interval=0.05)
        still_cut = "state DOWN" in c[1].run(["ip", "link", "show", "eth0"]).stdout
    finally:
        c[1].heal()
    assert restarted, log.read_text(errors="replace")[-4000:]
    assert still_cut
    # The new agent's UCX worker and listener exist (started once eth0 came back, with the fix;
    # at the agent's start without it): "peer service of node node1 listening on ...".
    assert wait_until(lambda: log.read_text(errors="replace").count("listening on") >= 2,
                      deadline=60, interval=0.05), log.read_text(errors="replace")[-4000:]
    (tmp_path / "AGAIN").touch()
    again = job.expect_all("again")
    job.kill()
    tail = log.read_text(errors="replace")[-4000:]
    for o in again:
        assert o["step"] == 2 and o["replication"][0]["step"] == 2, (o, tail)
        assert o["wait_error"] is None and o["replication"][0]["protected"], (o, tail)
    text = log.read_text(errors="replace")
    assert "not present during UCP initialization" not in text
    # The new agent's peer service waited for eth0, then started.
    assert "the interface eth0 of" in text and "the interface eth0 is up, the service started" \
        in text, text[-4000:]


if __name__ == "__main__":
    _worker(*sys.argv[1:3])
