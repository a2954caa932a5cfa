"""torchft's own CheckpointTransport tests, run against safepoint.torchft.SafepointTransport.

torchft ships its shared transport test in its package (``torchft.checkpointing.
transport_test.run_multi_recovery_test``: the one its HTTPTransport and PGTransport tests call
with a transport factory). It is imported from the installed torchft, not copied: three replicas
(threads) in one process, replica 0 sends step 1 to replicas 1 and 2 and step 2 to replica 2, its
state holding a plain tensor, a DTensor on a 0-dimensional mesh, a string and an int; replica 2
then asks for a step never sent (a timeout whose text must say so) and sends one itself.

Only the CPU case runs here: the suite's CUDA case (``device=cuda``) needs a GPU.
"""

from __future__ import annotations

import os
import unittest

import pytest

pytest.importorskip("torchft", reason="torchft is not installed (pip install torchft)")
import torch  # noqa: E402
from torchft.checkpointing import transport_test  # noqa: E402

from safepoint.torchft import SafepointTransport  # noqa: E402


class _Suite(unittest.TestCase):
    """The TestCase that torchft's test asserts through (its checks take ``self``)."""

    __test__ = False  # not a test of its own

    def runTest(self) -> None:
        pass


def _run(tmp_path, shm: str, mode: str, device: torch.device) -> list[SafepointTransport]:
    made: list[SafepointTransport] = []

    def init_transport(rank: int, world_size: int) -> SafepointTransport:
        t = SafepointTransport(tmp_path / f"replica{rank}", shm_dir=shm, mode=mode,
                               job=f"suite-{mode}-{os.getpid()}-{rank}", peer_host="127.0.0.1")
        made.append(t)
        return t

    try:
        transport_test.run_multi_recovery_test(_Suite(), init_transport, device)
    finally:
        # torchft's test makes the process group and destroys it only when it passes; the
        # transports it did not shut down are closed here (their agents: the shm fixture).
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
            for t in made:
                t.shutdown(wait=False)
    return made


@pytest.mark.parametrize("mode", ["sync", "flash", "peer"])
def test_torchft_multi_recovery_cpu(tmp_path, shm, mode):
    import safepoint

    made = _run(tmp_path, shm, mode, torch.device("cpu"))
    if mode == "peer":
        # Memory to memory: no heal wrote a location; each transport's shutdown closed its
        # Checkpointer, which persisted its newest snapshot: replica 0's step 2, replica 2's own
        # step 4. Replica 1 only received, on this node from replica 0's shared memory itself:
        # it had no Checkpointer and no snapshot (over the network, its agent's slot would
        # have held the healed step 1).
        got = {os.path.basename(t.location): safepoint.steps(t.location) for t in made}
        assert got == {"replica0": [2], "replica1": [], "replica2": [4]}
        sources = [t.last_source for t in made if t.last_source]
        assert sources and all(f"suite-peer-{os.getpid()}-0/rank-" in x for x in sources), sources
        return
    by_rank = {os.path.basename(t.metadata()): t for t in made}
    # What torchft's test sent: steps 1 and 2 from replica 0, step 4 from replica 2 (committed
    # by the time the suite shut the transports down, which waits in flash mode).
    assert safepoint.steps(by_rank["replica0"].metadata()) == [1, 2]
    assert safepoint.steps(by_rank["replica2"].metadata()) == [4]


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="torchft's CUDA case needs a GPU (its state's tensor on cuda)")
@pytest.mark.parametrize("mode", ["sync", "flash", "peer"])
def test_torchft_multi_recovery_cuda(tmp_path, shm, mode):
    _run(tmp_path, shm, mode, torch.device("cuda"))
