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
        with pytest.raises(TimeoutError, match="step 6"):
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


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    worker(sys.argv[1:])
