"""The torchft adapter (safepoint.torchft.SafepointTransport) with the real torchft 0.2.0:
torchft's CheckpointTransport contract between two processes. A live replica (a worker process
running this file) sends its state for a step, disallows, then changes its state as training
would; the recovering replica (the test process) receives the step, bit for bit the state that
was sent, and a step never sent times out within the timeout it asked for.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta

import pytest

pytest.importorskip("torchft")
import torch  # noqa: E402
from conftest import start_script  # noqa: E402

HANG = 120


def make_state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"user": {"model": {"w": torch.randn(64, 32, generator=g),
                               "b": torch.randn(32, dtype=torch.bfloat16, generator=g)},
                     "optim": {"step": 5, "lr": 0.01}},
            "torchft": {"step": 5, "batches_committed": 40}}


def worker(argv) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--loc"), ap.add_argument("--shm")
    a = ap.parse_args(argv)
    from safepoint.torchft import SafepointTransport

    t = SafepointTransport(a.loc, shm_dir=a.shm)
    state = make_state()
    t.send_checkpoint([1], 5, state, timedelta(seconds=30))
    t.send_checkpoint([1], 5, state, timedelta(seconds=30))  # sent again: nothing new
    t.disallow_checkpoint()
    state["user"]["model"]["w"].add_(1.0)  # training goes on right after disallow
    print("SENT", t.metadata(), flush=True)
    sys.stdin.readline()  # stays alive (a live peer) until the receiver is done
    t.shutdown()


def test_send_recv_timeout_disallow_between_two_processes(tmp_path, shm):
    import safepoint
    from safepoint.torchft import SafepointTransport

    sender = start_script(__file__, "--loc", tmp_path / "heal", "--shm", shm,
                          stdin=__import__("subprocess").PIPE)
    try:
        line = sender.stdout.readline().split()
        assert line[:1] == ["SENT"], sender.stderr.read()[-3000:]
        me = SafepointTransport(tmp_path / "mine", shm_dir=shm)
        got = me.recv_checkpoint(0, line[1], 5, timedelta(seconds=HANG))
        want = make_state()
        assert got["torchft"] == want["torchft"] and got["user"]["optim"] == want["user"]["optim"]
        for k, v in want["user"]["model"].items():  # the state as sent, not as changed after
            mine = got["user"]["model"][k]
            assert mine.dtype == v.dtype and torch.equal(mine, v)
        # torchft's contract (its transport_test's TIMEOUT_REGEX): the text says it timed out.
        with pytest.raises(TimeoutError, match=r"^timed out after 0.5s waiting for step 6 "):
            me.recv_checkpoint(0, line[1], 6, timedelta(seconds=0.5))
        me.shutdown()
        assert safepoint.steps(line[1]) == [5]
    finally:
        out, err = sender.communicate("done\n", timeout=HANG)
    assert sender.returncode == 0, err[-3000:]


def test_sync_mode_writes_in_send_and_keeps_the_newest(tmp_path):
    import safepoint
    from safepoint.torchft import SafepointTransport

    t = SafepointTransport(tmp_path / "heal", mode="sync", keep=2)
    for step in (1, 2, 3):
        state = make_state()
        t.send_checkpoint([1], step, state, timedelta(seconds=5))
        t.disallow_checkpoint()
        assert safepoint.steps(t.metadata())[-1] == step  # durable when send returned
    assert safepoint.steps(t.metadata()) == [2, 3]
    got = SafepointTransport(tmp_path / "other").recv_checkpoint(0, t.metadata(), 3,
                                                                 timedelta(seconds=5))
    assert torch.equal(got["user"]["model"]["w"], make_state()["user"]["model"]["w"])
    with pytest.raises(Exception, match="mode must be"):
        SafepointTransport(tmp_path / "x", mode="async")
    t.shutdown()


@pytest.fixture
def gloo_world():
    """A one-rank gloo world (as torchft's transport test makes one) for DTensors."""
    import torch.distributed as dist

    dist.init_process_group(backend="gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    dist.destroy_process_group()


def test_dtensor_on_a_zero_dimensional_mesh_saves_loads_and_restores(tmp_path, gloo_world):
    """torchft's test's DTensor: ``DeviceMesh("cpu", 1)``, no placements: nothing is split, the
    local tensor is the whole tensor (torch's own box for it is empty: the mesh's one device is
    rank 1, not this rank 0)."""
    from torch.distributed.tensor import DeviceMesh, distribute_tensor

    import safepoint

    mesh = DeviceMesh("cpu", 1)
    assert mesh.ndim == 0 and mesh.get_coordinate() is None
    d = distribute_tensor(torch.tensor([5, 6, 7]), mesh, [])
    safepoint.save(tmp_path, 1, {"d": d})
    _, got = safepoint.load(tmp_path, 1)
    assert torch.equal(got["d"], torch.tensor([5, 6, 7]))
    # Into a DTensor of the same layout: from storage, by its box (the resharding path) ...
    into = distribute_tensor(torch.zeros(3, dtype=torch.int64), mesh, [])
    safepoint.restore(tmp_path, {"d": into}, 1)
    assert torch.equal(into.to_local(), torch.tensor([5, 6, 7]))
    # ... and into a plain tensor: the saved box is the whole tensor.
    plain = torch.zeros(3, dtype=torch.int64)
    safepoint.restore(tmp_path, {"d": plain}, 1)
    assert torch.equal(plain, torch.tensor([5, 6, 7]))


@pytest.mark.parametrize("mode", ["sync", "flash", "peer"])
def test_dtensors_come_back_as_dtensors_with_the_senders_spec(tmp_path, shm, gloo_world, mode):
    """As torchft's own transports give them: a DTensor, its spec equal to the sent one (mesh,
    placements, global shape and stride), which the receiver copies into its own DTensors."""
    from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, Shard, distribute_tensor

    from safepoint.torchft import SafepointTransport

    def state():
        line = DeviceMesh("cpu", [0], mesh_dim_names=("dp",))
        return {"model": {"zero_d": distribute_tensor(torch.tensor([5, 6, 7]),
                                                      DeviceMesh("cpu", 1), []),
                          "w": distribute_tensor(torch.arange(12.).reshape(3, 4), line,
                                                 [Shard(1)]),
                          "layers": [(distribute_tensor(torch.ones(2), line, [Replicate()]),
                                      7)]},
                "step": 3}

    sent = state()
    t = SafepointTransport(tmp_path / "heal", shm_dir=shm, mode=mode, peer_host="127.0.0.1")
    t.send_checkpoint([1], 3, sent, timedelta(seconds=30))
    me = SafepointTransport(tmp_path / "mine", shm_dir=shm, peer_host="127.0.0.1")
    got = me.recv_checkpoint(0, t.metadata(), 3, timedelta(seconds=HANG))
    assert got["step"] == 3 and got["model"]["layers"][0][1] == 7
    pairs = [(got["model"]["zero_d"], sent["model"]["zero_d"]),
             (got["model"]["w"], sent["model"]["w"]),
             (got["model"]["layers"][0][0], sent["model"]["layers"][0][0])]
    for g, s in pairs:
        assert isinstance(g, DTensor) and g._spec == s._spec
        assert torch.equal(g.to_local(), s.to_local())
    mine = state()["model"]["w"]  # the receiver's own DTensor takes the received one
    with torch.no_grad():
        mine.zero_()
        mine.copy_(got["model"]["w"])
    assert torch.equal(mine.full_tensor(), torch.arange(12.).reshape(3, 4))
    me.shutdown()
    t.shutdown()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    worker(sys.argv[1:])
