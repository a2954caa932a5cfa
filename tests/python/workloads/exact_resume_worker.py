"""One rank of a gloo DDP run whose data position and randomness must survive a SIGKILL and a
restart, also with another data-parallel size: for tests/python/test_exact_resume.py.

examples/tiny_gpt.py's model (small dims, with dropout on the embeddings) trained on a fixed
data set of SAMPLES sequences through ``safepoint.data.GlobalBatchSampler`` (a global batch of
GLOBAL_BATCH samples per step, every rank its contiguous share), with augmentation drawn from
the torch, numpy and ``random`` generators. The state holds the model, AdamW, an LR schedule
and the data position: the sampler itself (cfg["loader"] == "sampler", a plain DataLoader over
it) or a torchdata ``StatefulDataLoader`` over it ("stateful"). The randomness is either derived
from (seed, global step, rank) at the start of each step (cfg["rng"] == "derived",
``safepoint.data.seed_for_step``, no generator state saved) or saved with each snapshot and
restored (``"saved"``: ``include_rng=True``).

``run(conn, cfg)`` is the body of one process (forked from the test's forkserver, which has
torch imported). It sends tuples through ``conn``:

    ("fresh",) | ("resumed", step, source)   what ckpt.restore() found
    ("batch", step, ids)                     the sample ids this rank trained on at global step
    ("saved", step)                          ckpt.save(step) returned
    ("paused", step)                         (cfg["pause_at"]) step trained, not saved: waits
                                             to be killed
    ("done", weights)                        SHA-256 of the final weights
"""

from __future__ import annotations

import hashlib
import os
import random
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "examples"))
import tiny_gpt  # noqa: E402

import safepoint  # noqa: E402
from safepoint.data import GlobalBatchSampler, seed_for_step  # noqa: E402

VOCAB, DIM, LAYERS, HEADS, CONTEXT, EXTRA = 64, 32, 2, 2, 12, 3
SAMPLES, GLOBAL_BATCH = 64, 12  # 5 global steps per epoch; 4 samples of each epoch left out
DATA_SEED, RNG_SEED = 11, 23


class Sequences(Dataset):
    """SAMPLES fixed sequences (a pure function of the index); an item is (index, tokens)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(4242)
        start = torch.randint(0, VOCAB, (SAMPLES, 1), generator=g)
        seq = (start + torch.arange(CONTEXT + 1 + EXTRA)) % VOCAB
        noise = torch.rand(seq.shape, generator=g) < 0.1
        self.seqs = torch.where(noise, torch.randint(0, VOCAB, seq.shape, generator=g), seq)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        return i, self.seqs[i]


def augment(seqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A random crop (numpy); random rows (``random``) get random tokens (torch)."""
    off = int(np.random.randint(0, EXTRA + 1))
    seqs = seqs[:, off:off + CONTEXT + 1].clone()
    for row in range(seqs.shape[0]):
        if random.random() < 0.5:
            mask = torch.rand(CONTEXT + 1) < 0.15
            seqs[row] = torch.where(mask, torch.randint(0, VOCAB, (CONTEXT + 1,)), seqs[row])
    return seqs[:, :-1], seqs[:, 1:]


def weights_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in model.state_dict().items():
        h.update(name.encode())
        h.update(p.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def run(conn, cfg: dict) -> None:
    """One rank: restore (when asked), train to cfg["steps"] saving every step, report."""
    torch.set_num_threads(1)  # bit-reproducible CPU kernels (and several ranks on few cores)
    rank, world = cfg["rank"], cfg["world"]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["port"]),
                      RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)  # the same initial model on every rank
    model = tiny_gpt.TinyGPT(vocab=VOCAB, dim=DIM, layers=LAYERS, heads=HEADS, context=CONTEXT)
    # Dropout on the embeddings: the step's result depends on torch's global generator.
    model.embed.register_forward_hook(lambda m, args, out: F.dropout(out, 0.1, m.training))
    derived = cfg["rng"] == "derived"
    if not derived:  # each rank's generators differ; saved and restored with every snapshot
        torch.manual_seed(1000 + rank)
        np.random.seed(2000 + rank)
        random.seed(3000 + rank)
    net = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** (s // 6))
    data = Sequences()
    sampler = GlobalBatchSampler(data, GLOBAL_BATCH, seed=DATA_SEED)  # rank, world: dist's
    # A DataLoader draws its workers' base seed from its generator on every iter(): from
    # torch's global one without a generator of its own, one draw more after a resume
    # mid-epoch than the uninterrupted run made. Its own generator keeps that draw out of the
    # generator the training draws from.
    loader_gen = torch.Generator().manual_seed(5)
    if cfg["loader"] == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader = StatefulDataLoader(data, batch_sampler=sampler, generator=loader_gen)
        position = loader
    else:
        loader = DataLoader(data, batch_sampler=sampler, generator=loader_gen)
        position = sampler
    state = {"model": net, "optim": opt, "sched": sched, "data": position}

    ckpt = safepoint.Checkpointer(cfg["path"], job=cfg["job"], shm_dir=cfg["shm_dir"],
                                  persist_every=cfg["persist_every"], keep=3)
    start = ckpt.restore(state) if cfg.get("resume") else None
    if start is None:
        conn.send(("fresh",))
        start = 0
    else:
        conn.send(("resumed", start, ckpt.last_load_source))

    step = start
    batches = iter(loader)
    while step < cfg["steps"]:
        try:
            ids, seqs = next(batches)
        except StopIteration:  # the epoch ended: the sampler's cursor is in the next one
            batches = iter(loader)
            continue
        step += 1
        if derived:
            seed_for_step(RNG_SEED, step, rank)
        x, y = augment(seqs)
        loss = F.cross_entropy(net(x).reshape(-1, VOCAB), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if step == cfg.get("pause_at"):
            # Killed here by the test: mid-run, the in-process state already past the snapshot.
            conn.send(("paused", step))
            while True:
                time.sleep(3600)
        conn.send(("batch", step, ids.tolist()))
        ckpt.save(step, state, include_rng=not derived)
        conn.send(("saved", step))

    conn.send(("done", weights_digest(model)))
    ckpt.close()
    dist.destroy_process_group()
