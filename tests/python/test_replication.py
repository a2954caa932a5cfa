"""Peer replication across nodes (docs/replication.md): nodes are network namespaces with their
own /dev/shm and address (tests/common/nodes.py; needs root, else skipped). Every test loses
whole nodes (every process and the node's memory) and checks where each rank's state came from
and that it is bit-identical to what was saved."""

import os
import sys

import safepoint
from conftest import cli_path
from nodes import Job
from processes import job_dir, wait_until

WORKER = os.path.join(os.path.dirname(__file__), "workloads", "replica_worker.py")


def _save(c, ckpt, name, redundancy, k, persisted):
    job = Job(c, WORKER, ["save", ckpt, name, redundancy, k, persisted])
    saved = job.expect_all("saved")
    assert [o["step"] for o in saved] == [k] * len(c)
    assert safepoint.steps(ckpt)[-1] == persisted
    return job, saved


def _lose(c, *nodes):
    """Nodes die at once (their ranks, agents and /dev/shm are gone); replacements join."""
    for i in nodes:
        c[i].kill()
    for i in nodes:
        c.replace(i)


def _reload(job, ckpt, name, redundancy):
    job = job.restart(["load", ckpt, name, redundancy])
    loaded = job.expect_all("loaded")
    job.check()
    return job, loaded


def _digest(st):
    sys.path.insert(0, os.path.dirname(WORKER))
    from replica_worker import digest  # noqa: E402  (the worker's own digest)

    return digest(st)


def _agent_logs(c):
    return "\n".join(f"--- {n.name}: {p}\n{p.read_text(errors='replace')[-3000:]}"
                     for n in c for p in n.shm.glob("safepoint-*/agent.log"))


def test_mirror_restores_a_lost_node_from_peer_memory(cluster, tmp_path):
    """3 nodes, mirror: steps 1..2 are committed, 3..5 only in memory (and replicated). Node 1
    dies with its memory; a replacement joins; every rank resumes at step 5, node 1's rank from
    its copy on node 2, bit-identical, nothing read from storage."""
    c = cluster(3, shm_size="64m")
    ckpt, name = tmp_path / "ckpt", f"mirror-{os.getpid()}"
    job, saved = _save(c, ckpt, name, "mirror", 5, 2)
    for o in saved:  # wait() returned: every rank's step 5 is on its peer
        assert o["replication"][0]["step"] == 5 and o["replication"][0]["protected"], o
    # node i's copy is on node i+1: node 2 holds node 1's rank 1, step 5
    held = {(h["source_node"], h["rank"], h["step"]) for h in saved[2]["held"]}
    assert ("node1", 1, 5) in held
    # `safepoint status` on a node shows it too
    out = c[2].run([cli_path(), "status"], check=True).stdout
    assert "replication mirror:1: node node2 (3 nodes)" in out, out
    assert "keeps 1 replicas of other nodes" in out and "rank 2 step 5 protected" in out, out

    _lose(c, 1)  # node loss: its rank, its agent and its /dev/shm are gone
    assert safepoint.steps(ckpt)[-1] == 2  # storage has only step 2: step 5 must come from RAM
    job, loaded = _reload(job, ckpt, name, "mirror")
    assert [o["step"] for o in loaded] == [5, 5, 5]
    assert [o["source"] for o in loaded] == ["memory", "peer", "memory"]
    assert loaded[1]["peers"] == "node2"
    assert all(o["equal"] for o in loaded)
    assert [o["digest"] for o in loaded] == [o["digest"] for o in saved]
    # Rank 1's rebuilt snapshot is an ordinary snapshot of its node again: the clean close
    # persisted it beside the others' emergency flushes, so step 5 is now committed.
    assert safepoint.steps(ckpt)[-1] == 5


def test_erasure_code_survives_two_node_losses(cluster, tmp_path):
    """5 nodes, ec:2+2: each node's snapshot is 2 data + 2 parity fragments on the 4 others.
    Nodes 1 and 2 die at once; their ranks are rebuilt from the 2 fragments left of each."""
    c = cluster(5, shm_size="64m")
    ckpt, name = tmp_path / "ckpt", f"ec-{os.getpid()}"
    job, saved = _save(c, ckpt, name, "ec:2+2", 3, 1)
    assert all(o["replication"][0]["protected"] for o in saved), saved
    _lose(c, 1, 2)
    job, loaded = _reload(job, ckpt, name, "ec:2+2")
    assert [o["step"] for o in loaded] == [3] * 5, "\n".join(
        [job[i].stderr() for i in range(5)] + [_agent_logs(c)])
    assert [o["source"] for o in loaded] == ["memory", "peer", "peer", "memory", "memory"]
    assert all(o["equal"] for o in loaded)
    assert [o["digest"] for o in loaded] == [o["digest"] for o in saved]


def test_losing_every_copy_falls_back_to_storage(cluster, tmp_path):
    """3 nodes, mirror: node 1's only copy is on node 2. Both die: rank 1's step 5 is gone
    everywhere, so every rank falls back to step 2 on storage (no hang, nothing mixed)."""
    c = cluster(3, shm_size="64m")
    ckpt, name = tmp_path / "ckpt", f"lost-{os.getpid()}"
    job, saved = _save(c, ckpt, name, "mirror", 5, 2)
    _lose(c, 1, 2)
    job, loaded = _reload(job, ckpt, name, "mirror")
    assert [o["step"] for o in loaded] == [2, 2, 2]
    assert [o["source"] for o in loaded] == ["storage"] * 3
    assert all(o["equal"] for o in loaded)


def test_too_few_nodes_is_refused_at_start(cluster, tmp_path):
    c = cluster(2, shm_size="32m")
    job = Job(c, WORKER, ["load", tmp_path / "ckpt", f"few-{os.getpid()}", "mirror:2"])
    codes = job.wait()
    # (Once, under make test's load, rank 1 ended with SIGABRT instead: its stderr says where.)
    assert codes == [1, 1], (codes, job[1].stderr()[-4000:])
    err = job[0].stderr()
    assert "mirror:2 needs at least 3 nodes" in err and "the job has 2" in err, err



def test_a_torn_down_job_commits_a_lost_nodes_step_from_its_replica(cluster, tmp_path):
    """3 nodes, mirror. Node 1 dies, then the job is torn down (every rank killed). Ranks 0 and
    2 are emergency-flushed by their agents; rank 1's image of step 5 exists only as the copy on
    node 2, whose agent persists it, so step 5 commits on storage without node 1."""
    c = cluster(3, shm_size="64m")
    ckpt, name = tmp_path / "ckpt", f"torn-{os.getpid()}"
    job, saved = _save(c, ckpt, name, "mirror", 5, 2)
    c[1].kill()
    job.kill()
    assert wait_until(lambda: safepoint.steps(ckpt)[-1] == 5), _agent_logs(c)
    for rank in range(3):  # every rank's image of step 5 loads bit-exact from storage
        got = safepoint.load(ckpt, 5, rank=rank)[1]
        assert _digest(got) == saved[rank]["digest"]


def test_a_restarted_agent_gets_the_peer_setup_again(cluster, tmp_path):
    """3 nodes, mirror. Node 1's agent is killed; rank 1's next call starts a new agent and
    sends it the peer setup and membership again, so rank 1's next snapshot is replicated to
    node 2. Node 0 still knows the old agent's address (its peers learn the new one at the next
    Checkpointer start): its push to node 1 fails with an error in status, nothing hangs."""
    c = cluster(3, shm_size="64m")
    ckpt, name = tmp_path / "ckpt", f"restart-{os.getpid()}"
    job, saved = _save(c, ckpt, name, "mirror", 3, 1)
    lock = job_dir(c[1].shm, name) / "agent.lock"
    pid = lock.read_text().split()[0]
    c[1].run(["kill", "-9", pid], check=True)
    (tmp_path / "AGAIN").touch()
    again = job.expect_all("again")
    assert again[1]["replication"][0]["step"] == 4, again[1]
    assert again[1]["replication"][0]["protected"], again[1]
    assert again[2]["replication"][0]["protected"], again[2]
    assert not again[0]["replication"][0]["protected"] and again[0]["replication"][0]["error"]
    job.kill()


def test_budget_mode_receives_each_replica_in_place_of_the_previous_one(cluster, tmp_path):
    """3 nodes, mirror, max_shm_bytes below two slots (budget mode): one slot per rank, and the
    room the cap leaves (600 KiB) holds one replica of a rank, not two. So each node receives
    the next snapshot of the rank it mirrors into the previous replica's file: it never holds
    more than one replica file. The rank of a lost node still restores from that replica."""
    c = cluster(3, shm_size="64m")
    ckpt, name = tmp_path / "ckpt", f"budget-{os.getpid()}"
    slot = (2 << 20) + 4096  # one slot of this small state (capacity rounded up to 2 MiB)
    job = Job(c, WORKER, ["save", ckpt, name, "mirror", 3, 1],
              env={"SAFEPOINT_TEST_MAX_SHM": str(slot + (600 << 10))})
    saved = job.expect_all("saved")
    assert all(o["replication"][0]["step"] == 3 and o["replication"][0]["protected"]
               for o in saved), saved
    (tmp_path / "AGAIN").touch()  # step 4, not persisted: replicated in place of step 3
    again = job.expect_all("again")
    for o in again:
        assert o["replication"][0]["step"] == 4 and o["replication"][0]["protected"], o
        assert o["memory"]["slots"] == 1, o["memory"]
        assert o["received_in_place"] >= 1, o
        assert [h["step"] for h in o["held"]] == [4], o["held"]
        one_file = 4096 + -(-o["held"][0]["bytes"] // 4096) * 4096
        assert o["memory"]["replica_node_bytes"] == one_file, (o["memory"], o["held"])
        assert o["memory"]["replica_spare_bytes"] == 0, o["memory"]
    _lose(c, 1)
    job, loaded = _reload(job, ckpt, name, "mirror")
    assert [o["step"] for o in loaded] == [4, 4, 4]
    assert [o["source"] for o in loaded] == ["memory", "peer", "memory"]
    assert all(o["equal"] for o in loaded)


def test_the_peer_host_of_an_ipv6_job_is_an_ipv6_address(monkeypatch):
    # IPv6 peers: the address a node's peer service binds follows the master's address family
    # (before: an IPv4-only probe, then the hostname's IPv4 address), and one given in brackets,
    # as in [::1]:PORT, is taken without them. No cluster needed.
    import socket

    import pytest

    from safepoint import _replication

    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as s:
            s.connect(("::1", 29500))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    monkeypatch.delenv("SAFEPOINT_PEER_HOST", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "::1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert _replication.bind_host() == "::1"
    monkeypatch.setenv("MASTER_ADDR", "[::1]")
    assert _replication.bind_host() == "::1"
    monkeypatch.setenv("SAFEPOINT_PEER_HOST", "[::1]")
    assert _replication.bind_host() == "::1"
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.delenv("SAFEPOINT_PEER_HOST")
    assert _replication.bind_host() == "127.0.0.1"


def test_a_peer_service_that_cannot_start_leaves_the_commit_relay_off(tmp_path):
    """The commit relay is optional (no replicas): a node whose peer service cannot start makes
    every rank give up the membership (None, with a warning) instead of failing the job, which
    then commits through storage; with replicas the same failure fails the start. One process,
    a gloo group of one: the decision is the all-gathered addresses'."""
    import pytest
    import torch.distributed as dist

    from safepoint import _replication
    from safepoint.errors import UnavailableError

    class Client:
        def peer_setup(self, node, host, timeout):
            raise UnavailableError("peer service of node n0: cannot listen on 10.9.9.9:0")

        def set_membership(self, *args):
            raise AssertionError("no membership may be given")

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0,
                            world_size=1)
    try:
        with pytest.warns(UserWarning, match="cannot start its peer service"):
            got = _replication.exchange_membership(Client(), dist.group.WORLD, 0, 1, "none", 0,
                                                   5.0, optional=True)
        assert got is None
        with pytest.raises(UnavailableError, match="cannot listen"):
            _replication.exchange_membership(Client(), dist.group.WORLD, 0, 1, "mirror", 0, 5.0)
    finally:
        dist.destroy_process_group()
