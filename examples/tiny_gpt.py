"""A small GPT-style language model and a synthetic data stream, for the demo and the tests.

Everything is deterministic given the seed, so a run that is interrupted and resumed can be
compared bit for bit with one that was not.
"""

from __future__ import annotations


import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        mask = torch.triu(torch.ones(n, n, dtype=torch.bool, device=x.device), diagonal=1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 128, layers: int = 4, heads: int = 4,
                 context: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(context, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied, as in GPT-2
        nn.init.normal_(self.pos, std=0.02)
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def batch(step: int, batch_size: int = 8, context: int = 64, vocab: int = 256, seed: int = 0):
    """The batch of a step: a pure function of (seed, step), like a resumable data loader."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    # A learnable pattern: each sequence counts up from a random start, with noise.
    start = torch.randint(0, vocab, (batch_size, 1), generator=g)
    seq = (start + torch.arange(context + 1)) % vocab
    noise = torch.rand(seq.shape, generator=g) < 0.1
    seq = torch.where(noise, torch.randint(0, vocab, seq.shape, generator=g), seq)
    return seq[:, :-1], seq[:, 1:]


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, seed: int = 0) -> float:
    x, y = batch(step, seed=seed)
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return float(loss.detach())


def make(seed: int = 0, **kwargs):
    torch.manual_seed(seed)
    model = TinyGPT(**kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    return model, opt


def param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


__all__ = ["TinyGPT", "batch", "train_step", "make", "param_bytes"]
