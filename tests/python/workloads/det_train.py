"""Deterministic training with flash checkpoints, for tests/python/test_determinism.py.

A small GPT-style model (examples/tiny_gpt.py) trained with AdamW, an LR schedule, a shuffled
data order that walks epochs (a Stateful object: epoch and position) and random augmentation
drawn from the torch, numpy and ``random`` global generators, so that a resumed run only matches
an uninterrupted one when model, optimizer, scheduler, data position *and* every generator's
state are restored. It runs in one process or as one rank of a gloo DDP group.

``run(conn, cfg)`` is the body of one process (started by the test through a multiprocessing
forkserver that has torch imported already). It sends tuples through ``conn``:

    ("fresh",) | ("resumed", step, source)      what ckpt.restore() found
    ("loss", step, hex)                          the loss of a step, float.hex() of its exact bits
    ("saved", step)                              ckpt.save(step) returned
    ("paused", step)                             (cfg["pause_at"]) step trained, not saved: waits
                                                 to be killed
    ("done", digests)                            SHA-256 of the final weights, optimizer state,
                                                 scheduler, data position and generator states
"""

from __future__ import annotations

import hashlib
import os
import random
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "examples"))
import tiny_gpt  # noqa: E402

import safepoint  # noqa: E402

VOCAB, DIM, LAYERS, HEADS, CONTEXT = 64, 32, 2, 2, 16
SAMPLES, EXTRA, BATCH = 24, 4, 4  # fixed data set; EXTRA tokens of room for a random crop


def make_deterministic() -> None:
    # The CPU kernels reduce in chunks across threads, and the chunking depends on the thread
    # count and scheduling: with several threads the loss varied in its last bits from run to
    # run even without any interruption. One thread and deterministic algorithms make every run
    # of this workload bit-reproducible, so any difference after a resume is safepoint's.
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)


def dataset() -> torch.Tensor:
    """The fixed data: SAMPLES sequences that count up from a random start, with noise."""
    g = torch.Generator().manual_seed(4242)
    start = torch.randint(0, VOCAB, (SAMPLES, 1), generator=g)
    seq = (start + torch.arange(CONTEXT + 1 + EXTRA)) % VOCAB
    noise = torch.rand(seq.shape, generator=g) < 0.1
    return torch.where(noise, torch.randint(0, VOCAB, seq.shape, generator=g), seq)


class DataOrder:
    """A resumable, shuffled, rank-sharded order over the data set (like a DistributedSampler
    with a cursor): a new permutation every epoch; ``state_dict`` is the epoch and position."""

    def __init__(self, n: int, batch: int, rank: int, world: int, seed: int = 7):
        self.n, self.batch, self.rank, self.world, self.seed = n, batch, rank, world, seed
        self.epoch, self.pos = 0, 0

    def next_indices(self) -> torch.Tensor:
        per_epoch = self.n // (self.batch * self.world)
        if self.pos == per_epoch:
            self.epoch, self.pos = self.epoch + 1, 0
        perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(
            self.seed * 1000 + self.epoch))
        lo = (self.pos * self.world + self.rank) * self.batch
        self.pos += 1
        return perm[lo:lo + self.batch]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, sd: dict) -> None:
        self.epoch, self.pos = int(sd["epoch"]), int(sd["pos"])


def augment(seqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A random crop (numpy), random rows (``random``) get random tokens (torch)."""
    off = int(np.random.randint(0, EXTRA + 1))
    seqs = seqs[:, off:off + CONTEXT + 1].clone()
    for row in range(seqs.shape[0]):
        if random.random() < 0.5:
            mask = torch.rand(CONTEXT + 1) < 0.15
            seqs[row] = torch.where(mask, torch.randint(0, VOCAB, (CONTEXT + 1,)), seqs[row])
    return seqs[:, :-1], seqs[:, 1:]


def lr_lambda(step: int) -> float:
    return min(1.0, (step + 1) / 4) * (0.5 ** (step // 5))


def digest(*tensors_or_values) -> str:
    h = hashlib.sha256()
    for v in tensors_or_values:
        if isinstance(v, torch.Tensor):
            h.update(str((v.dtype, tuple(v.shape))).encode())
            h.update(v.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(v, dict):
            for k in sorted(v, key=str):
                h.update(repr(k).encode())
                h.update(digest(v[k]).encode())
        elif isinstance(v, (list, tuple)):
            for x in v:
                h.update(digest(x).encode())
        else:
            h.update(repr(v).encode())
    return h.hexdigest()


def final_digests(model, opt, sched, data) -> dict:
    np_state = np.random.get_state()
    return {
        "weights": digest(model.state_dict()),
        "optim": digest(opt.state_dict()),
        "sched": digest(sched.state_dict()),
        "data": digest(data.state_dict()),
        "rng": digest(torch.get_rng_state(), np_state[1], np_state[2:], random.getstate()),
    }


def run(conn, cfg: dict) -> None:
    """One process: restore (when asked), train to cfg["steps"] saving every step, report."""
    make_deterministic()
    rank, world = cfg.get("rank", 0), cfg.get("world", 1)
    if world > 1:
        import torch.distributed as dist

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["port"]),
                          RANK=str(rank), WORLD_SIZE=str(world))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    # Every rank starts from the same seed; each rank's augmentation generators differ.
    torch.manual_seed(0)
    model = tiny_gpt.TinyGPT(vocab=VOCAB, dim=DIM, layers=LAYERS, heads=HEADS, context=CONTEXT)
    torch.manual_seed(1000 + rank)
    np.random.seed(2000 + rank)
    random.seed(3000 + rank)
    net = model
    if world > 1:
        net = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    data = DataOrder(SAMPLES, BATCH, rank, world)
    seqs = dataset()
    state = {"model": net, "optim": opt, "sched": sched, "data": data}

    ckpt = safepoint.Checkpointer(cfg["path"], job=cfg["job"], shm_dir=cfg["shm_dir"],
                                  persist_every=cfg.get("persist_every", 4), keep=3)
    start = ckpt.restore(state) if cfg.get("resume") else None
    if start is None:
        conn.send(("fresh",))
        start = 0
    else:
        conn.send(("resumed", start, ckpt.last_load_source))

    for step in range(start + 1, cfg["steps"] + 1):
        x, y = augment(seqs[data.next_indices()])
        logits = net(x)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step == cfg.get("pause_at"):
            # Killed here by the test: mid-run, the in-process state already past the snapshot.
            conn.send(("paused", step))
            while True:
                time.sleep(3600)
        conn.send(("loss", step, loss.item().hex()))
        ckpt.save(step, state, include_rng=True)
        conn.send(("saved", step))

    conn.send(("done", final_digests(model, opt, sched, data)))
    ckpt.close()
    if world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
