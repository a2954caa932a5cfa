"""torchft with safepoint: healing a replica from a live peer with SafepointTransport.

    python examples/torchft_example.py [--dir DIR]

torchft heals a replica group that fell behind by sending it a live replica's state through a
``CheckpointTransport``; ``Manager(..., checkpoint_transport=SafepointTransport(location))``
makes that transport safepoint. Here two processes play the two replicas of one node: the live
one (a child process) trains 5 steps, sends its state (a flash snapshot: it may train on at
once) and trains on; the recovering one receives step 5 from the location the live one named
(``metadata()``, a directory in /dev/shm) and prints ``healed to step 5 from a live peer:
bit-identical: True``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from datetime import timedelta

import torch

TIMEOUT = timedelta(seconds=120)


def model_after(steps: int) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
        torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
        opt.step()
        opt.zero_grad()
    return model


def live_replica(location: str) -> None:
    from safepoint.torchft import SafepointTransport

    transport = SafepointTransport(location)
    model = model_after(5)
    state = {"user": {"model": model.state_dict()}, "torchft": {"step": 5}}
    transport.send_checkpoint(dst_ranks=[1], step=5, state_dict=state, timeout=TIMEOUT)
    transport.disallow_checkpoint()
    with torch.no_grad():  # training goes on: the snapshot sent is a copy
        for p in model.parameters():
            p.add_(1.0)
    print(transport.metadata(), flush=True)
    sys.stdin.readline()  # stays alive until the other replica healed
    transport.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir"), ap.add_argument("--live", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.live:
        live_replica(a.live)
        return
    shm = os.environ.get("SAFEPOINT_SHM_DIR", "/dev/shm")
    workdir = a.dir or tempfile.mkdtemp(prefix="sp-torchft-", dir=shm)
    from safepoint.torchft import SafepointTransport

    live = subprocess.Popen([sys.executable, __file__, "--live", os.path.join(workdir, "r0")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        metadata = live.stdout.readline().strip()
        me = SafepointTransport(os.path.join(workdir, "r1"))
        got = me.recv_checkpoint(src_rank=0, metadata=metadata, step=5, timeout=TIMEOUT)
        want = model_after(5).state_dict()
        same = all(torch.equal(got["user"]["model"][k], v) for k, v in want.items())
        print(f"healed to step {got['torchft']['step']} from a live peer: bit-identical: {same}",
              flush=True)
        me.shutdown()
    finally:
        live.communicate("done\n", timeout=120)
        if a.dir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    sys.exit(live.returncode)


if __name__ == "__main__":
    main()
