"""A small GPT-style model trained on the CPU, for the compression benchmark (bench/compress.py).

Compression ratios of freshly initialised weights say little: their values are a Gaussian of one
scale, and training spreads them. This trains a 6-layer, d=384 decoder on a character stream it
generates itself (a deterministic "language" of made-up words with a Zipf-like frequency), with
AdamW on fp32 master weights, long enough that the weights have moved far from their
initialisation, and caches the result:

    {"bf16": {name: tensor}, "master": {...}, "exp_avg": {...}, "exp_avg_sq": {...},
     "meta": {"steps", "loss_first", "loss_last", "rel_change", "seconds", "params"}}

bf16 are the weights as mixed-precision training keeps them beside the fp32 master copy.
The cache is bench/.cache/trained_gpt-v1.pt (or $SAFEPOINT_BENCH_CACHE); `python trained_gpt.py`
builds it, `load()` returns it (building it first when missing).
"""

from __future__ import annotations

import math
import os
import random
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
CACHE_DIR = os.environ.get("SAFEPOINT_BENCH_CACHE", os.path.join(os.path.dirname(HERE), ".cache"))
CACHE = os.path.join(CACHE_DIR, "trained_gpt-v1.pt")

LAYERS, DIM, HEADS, CONTEXT, BATCH = 6, 384, 6, 64, 8
STEPS = int(os.environ.get("TRAINED_GPT_STEPS", "120"))
LR = 2e-3


def make_text(n_chars: int, seed: int = 0) -> str:
    """Sentences of made-up words drawn with Zipf-like frequencies and a little grammar (a word's
    successor depends on it), so that there is something to learn beyond letter counts."""
    rng = random.Random(seed)
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    words = []
    for _ in range(2000):
        n = rng.choice([1, 2, 2, 3, 3, 3, 4, 4, 5, 6, 7, 8])
        words.append("".join(rng.choices(letters, weights=range(26, 0, -1), k=n)))
    weights = [1.0 / (i + 1) for i in range(len(words))]
    follow = {i: rng.choices(range(len(words)), weights=weights, k=8) for i in range(len(words))}
    out, size, w = [], 0, 0
    while size < n_chars:
        sentence = []
        for _ in range(rng.randint(4, 14)):
            w = rng.choice(follow[w]) if rng.random() < 0.7 else rng.choices(
                range(len(words)), weights=weights)[0]
            sentence.append(words[w])
        s = " ".join(sentence).capitalize() + rng.choice([". ", ". ", ", ", "? ", "! \n"])
        out.append(s)
        size += len(s)
    return "".join(out)[:n_chars]


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (t.view(b, n, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, n, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, DIM)
        self.pos = nn.Parameter(torch.randn(CONTEXT, DIM) * 0.02)
        self.blocks = nn.ModuleList(Block(DIM, HEADS) for _ in range(LAYERS))
        self.ln = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, vocab, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2 and name != "pos":
                nn.init.normal_(p, std=0.02 / (math.sqrt(2 * LAYERS) if name.endswith(
                    ("proj.weight", "out.weight")) else 1.0))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def train(steps: int = STEPS, log=print) -> dict:
    torch.manual_seed(0)
    text = make_text(2_000_000)
    vocab = sorted(set(text))
    data = torch.frombuffer(bytearray(text.encode("ascii")), dtype=torch.uint8).long()
    table = torch.zeros(256, dtype=torch.long)
    table[torch.tensor([ord(c) for c in vocab])] = torch.arange(len(vocab))
    data = table[data]
    model = GPT(len(vocab))
    init = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    t0 = time.time()
    losses = []
    for step in range(steps):
        cosine = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps))
        lr = LR * min(1.0, (step + 1) / 20) * cosine
        for group in opt.param_groups:
            group["lr"] = lr
        at = torch.randint(0, len(data) - CONTEXT - 1, (BATCH,), generator=g)
        x = torch.stack([data[i : i + CONTEXT] for i in at])
        y = torch.stack([data[i + 1 : i + CONTEXT + 1] for i in at])
        loss = F.cross_entropy(model(x).reshape(-1, len(vocab)), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 25 == 0 or step == steps - 1:
            log(f"trained_gpt: step {step}/{steps} loss {losses[-1]:.3f} "
                f"({time.time() - t0:.0f} s)")
    params = dict(model.named_parameters())
    # How far training moved the weights: ||w - w0|| / ||w0|| over all matrices.
    num = sum(float((params[k].detach() - init[k]).norm() ** 2) for k in init if init[k].dim() == 2)
    den = sum(float(init[k].norm() ** 2) for k in init if init[k].dim() == 2)
    out: dict = {"bf16": {}, "master": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for name, p in params.items():
        out["master"][name] = p.detach().clone()
        out["bf16"][name] = p.detach().to(torch.bfloat16)
        st = opt.state[p]
        out["exp_avg"][name] = st["exp_avg"].clone()
        out["exp_avg_sq"][name] = st["exp_avg_sq"].clone()
    last = losses[-10:]
    out["meta"] = {"steps": steps, "loss_first": losses[0], "loss_last": sum(last) / len(last),
                   "rel_change": math.sqrt(num / den), "seconds": time.time() - t0,
                   "params": sum(p.numel() for p in params.values())}
    return out


def load(log=print) -> dict:
    if not os.path.exists(CACHE):
        os.makedirs(CACHE_DIR, exist_ok=True)
        state = train(log=log)
        tmp = CACHE + ".tmp"
        torch.save(state, tmp)
        os.replace(tmp, CACHE)
    return torch.load(CACHE, weights_only=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--steps":
        state = train(int(sys.argv[2]))
        print(state["meta"])
    else:
        print(load()["meta"])
