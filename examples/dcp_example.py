"""torch.distributed.checkpoint (DCP) with safepoint storage: save, async_save and load.

    python examples/dcp_example.py [--ckpt DIR] [--steps 12]

A training loop keeps using DCP's API (``dcp.save``, ``dcp.async_save``, ``dcp.load`` and
``get_state_dict``/``set_state_dict``); only the storage changes: ``safepoint.dcp.Writer`` /
``Reader`` store each step as safepoint images (one per rank, checksummed, committed once every
rank's image is durable), and ``safepoint.dcp.ShmStager`` copies the state into reusable
shared-memory buffers so ``async_save`` blocks training only for that copy. The same code runs
per rank under ``torchrun`` (every rank writes its shards; DCP reshards on load).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import warnings

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny_gpt  # noqa: E402

import safepoint  # noqa: E402
import safepoint.dcp  # noqa: E402

# Without a process group DCP notes that it saves in a single process; that is intended here.
warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
warnings.filterwarnings("ignore", message=".*torch.distributed is unavailable.*")


def make():
    torch.manual_seed(0)
    model = tiny_gpt.TinyGPT(dim=64, layers=2, context=32)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", help="checkpoint directory (default: a temporary one)")
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    ckpt = args.ckpt or tempfile.mkdtemp(prefix="safepoint-dcp-")

    model, opt = make()
    pending = None
    with safepoint.dcp.ShmStager() as stager:  # shared-memory buffers, reused every save
        for step in range(1, args.steps + 1):
            x, y = tiny_gpt.batch(step, batch_size=8, context=32)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if step % 4 == 0:
                if pending is not None:
                    pending.result()  # the previous save is committed
                msd, osd = get_state_dict(model, opt)
                # stager.writer: a safepoint.dcp.Writer that stages through the stager (any
                # torch; newer ones also take Writer(...) with async_stager=stager).
                pending = dcp.async_save({"model": msd, "optim": osd, "step": step},
                                         storage_writer=stager.writer(ckpt, step=step))
                print(f"step {step}: loss {loss.item():.4f}, async save started", flush=True)
        if pending is not None:
            pending.result()
    # A synchronous save: durable and committed when it returns. checkpoint_id names the step.
    msd, osd = get_state_dict(model, opt)
    final = args.steps + 1
    dcp.save({"model": msd, "optim": osd, "step": final},
             checkpoint_id=f"{ckpt}/step-{final}", storage_writer=safepoint.dcp.Writer(ckpt))
    print(f"committed steps: {safepoint.steps(ckpt)}")

    # Load the newest step into a fresh model and optimizer, in place, as DCP does.
    model2, opt2 = make()
    msd2, osd2 = get_state_dict(model2, opt2)
    state = {"model": msd2, "optim": osd2, "step": 0}
    reader = safepoint.dcp.Reader(ckpt)  # newest committed step; Reader(ckpt, step=N) for another
    dcp.load(state, storage_reader=reader)
    set_state_dict(model2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 model2.state_dict().values()))
    print(f"loaded step {state['step']} from {reader.checkpoint_id}: weights bit-identical: {same}")

    cli = shutil.which("safepoint")
    if cli:
        subprocess.run([cli, "ls", ckpt], check=True)
        subprocess.run([cli, "verify", ckpt, "--all"], check=True)
    if not args.ckpt:
        shutil.rmtree(ckpt)
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
