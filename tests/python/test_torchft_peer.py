"""SafepointTransport's "peer" mode (issue 34 item 6): a torchft heal memory to memory, nothing
written to storage. On another node the recovering replica's agent fetches the live replica's
snapshot from the live replica's agent over the peer service (UCX); on the same node the
recovering process reads it from the sender's shared memory. A live replica (a worker process
running this file) sends its state, then changes it as training would; the recovering replica
(the test process) receives it bit for bit as sent, both ways, and every failure path is an
error, never a hang or a wrong state: a step not sent (TimeoutError), a wrong secret, a byte of
the sender's snapshot changed in memory since it was taken, the sender's node gone.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

pytest.importorskip("torchft")
import torch  # noqa: E402
from conftest import start_script  # noqa: E402
from processes import kill_and_wait, lock_agent_pid  # noqa: E402

HANG = 120
PREFIX = "safepoint-peer:"


def make_state() -> dict:
    g = torch.Generator().manual_seed(4)
    # 16 MiB of weights: several chunks of the image (4 MiB each), so that a changed byte lies
    # in a chunk whose checksum was recorded when the snapshot was taken.
    return {"user": {"model": {"w": torch.randn(4 << 20, generator=g),
                               "b": torch.randn(32, dtype=torch.bfloat16, generator=g)},
                     "optim": {"step": 5, "lr": 0.01}},
            "torchft": {"step": 5, "batches_committed": 40}}


def worker(argv) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--loc"), ap.add_argument("--shm"), ap.add_argument("--job")
    a = ap.parse_args(argv)
    from safepoint.torchft import SafepointTransport

    t = SafepointTransport(a.loc, shm_dir=a.shm, mode="peer", job=a.job, peer_host="127.0.0.1")
    state = make_state()
    t.send_checkpoint([1], 5, state, timedelta(seconds=30))
    t.disallow_checkpoint()
    state["user"]["model"]["w"].add_(1.0)  # training goes on right after send
    print("SENT", t.metadata(), flush=True)
    sys.stdin.readline()  # stays alive (a live peer) until the receiver is done
    t.shutdown()


def start_sender(tmp_path: Path, shm: str, job: str) -> tuple[subprocess.Popen, str]:
    sender = start_script(__file__, "--loc", tmp_path / "sender", "--shm", shm, "--job", job,
                          stdin=subprocess.PIPE)
    line = sender.stdout.readline().split(maxsplit=1)
    assert line[:1] == ["SENT"], sender.stderr.read()[-3000:]
    return sender, line[1].strip()


def finish(sender: subprocess.Popen) -> None:
    _, err = sender.communicate("done\n", timeout=HANG)
    assert sender.returncode == 0, err[-3000:]


def receiver(tmp_path: Path, shm: str, shm_reads: bool = True):
    from safepoint.torchft import SafepointTransport

    return SafepointTransport(tmp_path / "mine", shm_dir=shm, mode="peer", peer_host="127.0.0.1",
                              shm_reads=shm_reads)


def on_another_node(meta: str) -> str:
    """The metadata as a sender on another node would give it: its shared memory is another."""
    origin = json.loads(meta[len(PREFIX):])
    origin["shm"]["node"] = "another-boot:0:0"
    return PREFIX + json.dumps(origin)


def job_dirs(shm: str) -> list[str]:
    return sorted(p.name for p in Path(shm).glob("safepoint-*"))


def assert_sent_state(got: dict) -> None:
    want = make_state()
    assert got["torchft"] == want["torchft"] and got["user"]["optim"] == want["user"]["optim"]
    for k, v in want["user"]["model"].items():  # the state as sent, not as changed after
        mine = got["user"]["model"][k]
        assert mine.dtype == v.dtype and torch.equal(mine, v)


@pytest.mark.parametrize("where", ["same node", "another node"])
def test_heal_memory_to_memory_between_two_processes(tmp_path, shm, where):
    import safepoint

    sender, meta = start_sender(tmp_path, shm, "peer-send")
    try:
        origin = json.loads(meta[len(PREFIX):])
        assert meta.startswith(PREFIX) and origin["job"] == "peer-send"
        sender_only = job_dirs(shm)
        if where == "another node":
            meta = on_another_node(meta)
        me = receiver(tmp_path, shm)
        assert_sent_state(me.recv_checkpoint(0, meta, 5, timedelta(seconds=HANG)))
        if where == "same node":
            # Read from the sender's slot, by this process alone: no agent (no job directory)
            # of the receiver's.
            assert "peer-send/rank-" in me.last_source, me.last_source
            assert job_dirs(shm) == sender_only
        else:
            # Fetched by this transport's agent into its own slot.
            assert me.last_source.startswith(origin["address"]), me.last_source
            assert f"{me.job}/rank-" in me.last_source, me.last_source
        # torchft's contract (its transport_test's TIMEOUT_REGEX): the text says it timed out.
        with pytest.raises(TimeoutError, match=r"^timed out after 0.5s waiting for step 6 "):
            me.recv_checkpoint(0, meta, 6, timedelta(seconds=0.5))
        # Healed again, the same step: the same state.
        assert_sent_state(me.recv_checkpoint(0, meta, 5, timedelta(seconds=HANG)))
        me.shutdown()
        # Nothing went through storage: the sender's location is still empty.
        assert safepoint.steps(tmp_path / "sender") == []
    finally:
        finish(sender)
    # The sender's shutdown closes its Checkpointer, which persists its newest snapshot (as
    # every close does).
    assert safepoint.steps(tmp_path / "sender") == [5]


def test_a_wrong_secret_is_refused(tmp_path, shm):
    from safepoint.errors import UnavailableError

    sender, meta = start_sender(tmp_path, shm, "peer-secret")
    try:
        origin = json.loads(meta[len(PREFIX):])
        origin["secret"] = os.urandom(32).hex()
        me = receiver(tmp_path, shm, shm_reads=False)
        with pytest.raises(UnavailableError, match="authentication failed"):
            me.recv_checkpoint(0, PREFIX + json.dumps(origin), 5, timedelta(seconds=HANG))
        assert_sent_state(me.recv_checkpoint(0, meta, 5, timedelta(seconds=HANG)))
        me.shutdown()
    finally:
        finish(sender)


@pytest.mark.parametrize("shm_reads", [True, False], ids=["same node", "over the network"])
def test_a_byte_changed_in_the_senders_memory_fails_its_checksum(tmp_path, shm, shm_reads):
    from safepoint.errors import CorruptionError

    sender, meta = start_sender(tmp_path, shm, "peer-flip")
    try:
        # The sender's snapshot in its slot file (a 4 KiB control block, then the image): a
        # byte 6 MiB into the image, in its second chunk, flipped after the snapshot was taken.
        slots = sorted(Path(shm).glob("safepoint-*-peer-flip/rank-*.slot-*"))
        assert slots, list(Path(shm).iterdir())
        flipped = False
        for slot in slots:
            if slot.stat().st_size > 4096 + (8 << 20):
                with open(slot, "r+b") as f:
                    f.seek(4096 + (6 << 20))
                    b = f.read(1)
                    f.seek(4096 + (6 << 20))
                    f.write(bytes([b[0] ^ 0x10]))
                flipped = True
        assert flipped
        me = receiver(tmp_path, shm, shm_reads)
        # Found on arrival over the network, by the copy's verification on the same node.
        with pytest.raises(CorruptionError, match="fails its CRC32C|checksum mismatch in chunk 1"):
            me.recv_checkpoint(0, meta, 5, timedelta(seconds=HANG))
        me.shutdown()
    finally:
        finish(sender)


def test_the_senders_node_gone_is_an_error_not_a_hang(tmp_path, shm):
    from safepoint.errors import UnavailableError

    sender, meta = start_sender(tmp_path, shm, "peer-gone")
    agent = lock_agent_pid(shm, "peer-gone")
    assert agent is not None
    # The node is lost: its training process and its agent.
    sender.send_signal(signal.SIGKILL)
    sender.wait(timeout=HANG)
    kill_and_wait(agent)
    me = receiver(tmp_path, shm, shm_reads=False)  # its memory went with it
    with pytest.raises(UnavailableError):
        me.recv_checkpoint(0, meta, 5, timedelta(seconds=HANG))
    me.shutdown()


@pytest.mark.parametrize("shm_reads", [True, False], ids=["same node", "over the network"])
def test_the_heal_outlives_the_senders_process(tmp_path, shm, shm_reads):
    """The snapshot is in the node's memory, the agent's to serve: a sender that died after
    send still heals."""
    sender, meta = start_sender(tmp_path, shm, "peer-died")
    sender.send_signal(signal.SIGKILL)
    sender.wait(timeout=HANG)
    me = receiver(tmp_path, shm, shm_reads)
    assert_sent_state(me.recv_checkpoint(0, meta, 5, timedelta(seconds=HANG)))
    me.shutdown()


def test_memory_this_process_cannot_open_is_fetched_over_the_network(tmp_path, shm):
    """Where the sender's job directory is not one this process may read (another user's: the
    check of its mode refuses it), the same-node read gives way to the fetch."""
    sender, meta = start_sender(tmp_path, shm, "peer-other")
    try:
        (job,) = Path(shm).glob("safepoint-*-peer-other")
        job.chmod(0o750)  # as JobDirectory refuses another user's
        try:
            me = receiver(tmp_path, shm)
            assert_sent_state(me.recv_checkpoint(0, meta, 5, timedelta(seconds=HANG)))
            assert f"{me.job}/rank-" in me.last_source, me.last_source
            me.shutdown()
        finally:
            job.chmod(0o700)
    finally:
        finish(sender)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
    worker(sys.argv[1:])
