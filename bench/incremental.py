"""Incremental checkpoints (issue 12): a LoRA fine-tune of a frozen small GPT base, on the CPU.

1. Makes the base: a small GPT-style model trained briefly (Adam) on a synthetic token stream
   (a fixed random Markov chain), so that its weights have moved from their initialization.
2. Fine-tunes it with LoRA adapters (rank 4), the base
   frozen (LoRA's own choice: the attention projections, qkv and out), and saves {"model":
   state_dict, "optim": optimizer state, "step"} every few steps
   to two directories on the same disk: plain (the default layout) and packed incremental.
3. Reports bytes written per checkpoint after the first as a fraction of the state's bytes,
   persist and load throughput of every layout in the same run (plain; packed incremental with
   compression none, zstd, planes and auto), and the first save's compression ratio.
4. XOR-delta against the previous step (ZipLLM's idea), measured on consecutive steps of the
   base's own training (where every weight changes): zstd(level 3) of the raw bytes of step t+1
   against zstd of (step t+1 XOR step t), per kind of tensor (fp32 weights, Adam moments).
5. The whole training state of bench/workloads/trained_gpt.py's model (cached under
   bench/.cache): plain, packed none/zstd/planes, auto, packed incremental auto, and DCP plain
   and with its ZStandard extension, on the same disk in one run: bytes on disk, ratio, persist
   and load throughput (--full-runs saves per layout, medians).

    python bench/incremental.py [--dir DIR] [--steps N] [--json OUT]
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import math
import os
import shutil
import tempfile
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import safepoint

# --- a small GPT ------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab=1024, d=192, layers=4, heads=4, ctx=32):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


class LoRA(nn.Module):
    """y = base(x) + (x A^T) B^T * scale, base frozen."""

    def __init__(self, base: nn.Linear, r: int = 4):
        super().__init__()
        self.base = base
        self.a = nn.Parameter(torch.randn(r, base.in_features) / math.sqrt(base.in_features))
        self.b = nn.Parameter(torch.zeros(base.out_features, r))
        self.scale = 2.0 / r

    def forward(self, x):
        return self.base(x) + (x @ self.a.t()) @ self.b.t() * self.scale


def batches(vocab: int, ctx: int, batch: int, seed: int):
    """A synthetic language: a fixed random Markov chain over the vocabulary (8 successors per
    token), so that a model can learn something in a few hundred steps."""
    g = np.random.default_rng(seed)
    nxt = g.integers(0, vocab, size=(vocab, 8))
    while True:
        x = np.empty((batch, ctx + 1), dtype=np.int64)
        x[:, 0] = g.integers(0, vocab, size=batch)
        for i in range(1, ctx + 1):
            x[:, i] = nxt[x[:, i - 1], g.integers(0, 8, size=batch)]
        t = torch.from_numpy(x)
        yield t[:, :-1], t[:, 1:]


def train_step(model, opt, data) -> float:
    x, y = next(data)
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.detach())


# --- zstd through libzstd (for the XOR-delta measurement) ---------------------------------------

_zstd = ctypes.CDLL(ctypes.util.find_library("zstd") or "libzstd.so.1")
_zstd.ZSTD_compressBound.restype = ctypes.c_size_t
_zstd.ZSTD_compress.restype = ctypes.c_size_t
_zstd.ZSTD_isError.restype = ctypes.c_uint


def zstd_size(data: bytes, level: int = 3) -> int:
    cap = _zstd.ZSTD_compressBound(ctypes.c_size_t(len(data)))
    dst = ctypes.create_string_buffer(cap)
    n = _zstd.ZSTD_compress(dst, ctypes.c_size_t(cap), data, ctypes.c_size_t(len(data)), level)
    if _zstd.ZSTD_isError(ctypes.c_size_t(n)):
        raise RuntimeError("zstd failed")
    return n


def flat_bytes(tensors) -> bytes:
    return b"".join(t.detach().contiguous().view(torch.uint8).numpy().tobytes() for t in tensors)


def xor_delta(prev: bytes, cur: bytes) -> bytes:
    a = np.frombuffer(prev, dtype=np.uint8)
    b = np.frombuffer(cur, dtype=np.uint8)
    return (a ^ b).tobytes()


# --- the benchmark ------------------------------------------------------------------------------


def state_bytes(state) -> int:
    n = 0
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    if isinstance(state, torch.Tensor):
        n = state.numel() * state.element_size()
    return n


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def drop_caches(path: str) -> None:
    """Evicts `path`'s files from the page cache (posix_fadvise DONTNEED), so that loads read
    the disk where the kernel lets us."""
    for r, _, fs in os.walk(path):
        for f in fs:
            try:
                fd = os.open(os.path.join(r, f), os.O_RDONLY)
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
            except OSError:
                pass


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def dcp_layouts(state: dict, root: str, runs: int) -> dict:
    """torch.distributed.checkpoint (FileSystemWriter, one process) plain and with its zstd
    extension: bytes on disk, save and load time of the same state."""
    try:
        import warnings

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._extension import ZStandard
    except Exception as e:  # noqa: BLE001
        return {"DCP": {"error": f"import failed: {type(e).__name__}: {e}"}}
    out = {}
    sb = state_bytes(state)
    for label, ext in (("DCP", None), ("DCP + ZStandard", [ZStandard()])):
        saves, loads, sizes = [], [], []
        try:
            for i in range(runs):
                path = os.path.join(root, f"{label.replace(' ', '')}-{i}")
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    t = time.perf_counter()
                    dcp.save(state, storage_writer=dcp.FileSystemWriter(path, _extensions=ext),
                             no_dist=True)
                    saves.append(time.perf_counter() - t)
                    sizes.append(dir_bytes(path))
                    back = {k: {n: torch.empty_like(v) for n, v in d.items()}
                            for k, d in state.items()}
                    drop_caches(path)
                    t = time.perf_counter()
                    dcp.load(back, storage_reader=dcp.FileSystemReader(path), no_dist=True)
                    loads.append(time.perf_counter() - t)
                assert all(torch.equal(back[k][n], v) for k, d in state.items()
                           for n, v in d.items())
                shutil.rmtree(path, ignore_errors=True)
        except Exception as e:  # noqa: BLE001
            out[label] = {"error": f"{type(e).__name__}: {e}"}
            continue
        out[label] = {"bytes_per_step": median(sizes), "ratio": sb / median(sizes),
                      "persist_MBps": sb / median(saves) / 1e6,
                      "load_MBps": sb / median(loads) / 1e6}
    return out


def full_state(root: str, runs: int) -> dict:
    """The trained GPT's whole training state (bf16 weights, fp32 master weights, Adam moments;
    every byte changes between steps, so incremental saves nothing) saved `runs` times per layout,
    the layouts in turn, into directories on the same disk; each step loaded back after dropping
    its files from the page cache."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "workloads"))
    import trained_gpt

    cached = trained_gpt.load()
    state = {k: v for k, v in cached.items() if k != "meta"}
    sb = state_bytes(state)
    layouts = {"plain": {}, "packed": {"compression": "none", "incremental": True},
               "packed zstd": {"compression": "zstd"}, "packed planes": {"compression": "planes"},
               "auto": {"compression": "auto"},
               "packed incremental auto": {"compression": "auto", "incremental": True}}
    res = {name: {"save": [], "load": [], "bytes": [], "stored": []} for name in layouts}
    names = list(layouts)
    ints = {2: torch.int16, 4: torch.int32}
    for i in range(runs):
        # Each step's bytes differ from the last one's (the lowest mantissa bits XOR i), as a
        # trained state's do, so that no layout finds a chunk stored before.
        step_state = {k: {n: (v.view(ints[v.element_size()]) ^ i).view(v.dtype)
                          for n, v in d.items()} for k, d in state.items()}
        for name in names[i % len(names):] + names[: i % len(names)]:  # rotate the order
            path = os.path.join(root, "full-" + name.replace(" ", "-"))
            before = dir_bytes(path) if os.path.exists(path) else 0
            t = time.perf_counter()
            r = safepoint.save(path, i + 1, step_state, **layouts[name])
            res[name]["save"].append(time.perf_counter() - t)
            res[name]["bytes"].append(dir_bytes(path) - before)
            res[name]["stored"].append(r["stored_bytes"])
            drop_caches(path)
            t = time.perf_counter()
            step, back = safepoint.load(path, i + 1)
            res[name]["load"].append(time.perf_counter() - t)
            assert all(torch.equal(back[k][n].view(ints[v.element_size()]),
                               v.view(ints[v.element_size()]))
                       for k, d in step_state.items() for n, v in d.items())
            del back
    out = {"state_bytes": sb, "runs": runs, "meta": cached["meta"], "layouts": {}}
    for name in layouts:
        r = res[name]
        row = {"bytes_per_step": median(r["bytes"]), "ratio": sb / median(r["bytes"]),
               "persist_MBps": sb / median(r["save"]) / 1e6,
               "load_MBps": sb / median(r["load"]) / 1e6}
        if "auto" in name:
            row["chose"] = ", ".join("plain" if s == 0 else f"packed ({sb / s:.2f}x)"
                                     for s in r["stored"])
        out["layouts"][name] = row
    out["layouts"].update(dcp_layouts(state, root, runs))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--base-steps", type=int, default=150)
    ap.add_argument("--steps", type=int, default=40, help="LoRA fine-tune steps")
    ap.add_argument("--every", type=int, default=5, help="save every N fine-tune steps")
    ap.add_argument("--json", default=None)
    ap.add_argument("--full-runs", type=int, default=3,
                    help="saves per layout of the trained GPT state (0: skip that part)")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    root = tempfile.mkdtemp(prefix="sp-incr-", dir=args.dir)
    out: dict = {"machine": f"{os.cpu_count()} cores"}
    try:
        # 1. The base, and XOR-delta on its consecutive steps.
        vocab, ctx = 1024, 32
        model = GPT(vocab=vocab, ctx=ctx)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        data = batches(vocab, ctx, 8, seed=1)
        t0 = time.perf_counter()
        first_loss = None
        snaps = {}
        xor_rows = []
        gap = args.every
        for i in range(args.base_steps):
            loss = train_step(model, opt, data)
            first_loss = first_loss if first_loss is not None else loss
            # The last steps: checkpoints of a model in training, 1 and `every` steps apart.
            if i in (args.base_steps - 2 - gap, args.base_steps - 2, args.base_steps - 1):
                params = [p for p in model.parameters()]
                moments = [opt.state[p]["exp_avg"] for p in params] + \
                          [opt.state[p]["exp_avg_sq"] for p in params]
                snaps[i] = {"fp32 weights": flat_bytes(params),
                            "bf16 weights": flat_bytes([p.to(torch.bfloat16) for p in params]),
                            "fp32 Adam moments": flat_bytes(moments)}
        last = args.base_steps - 1
        for apart, prev in ((1, snaps[last - 1]), (gap, snaps[last - 1 - gap])):
            cur = snaps[last]
            for kind in cur:
                raw = zstd_size(cur[kind])
                delta = zstd_size(xor_delta(prev[kind], cur[kind]))
                xor_rows.append({"kind": kind, "apart": apart, "bytes": len(cur[kind]),
                                 "zstd_ratio": len(cur[kind]) / raw,
                                 "xor_delta_zstd_ratio": len(cur[kind]) / delta})
        out["base"] = {"params": sum(p.numel() for p in model.parameters()),
                       "steps": args.base_steps, "seconds": time.perf_counter() - t0,
                       "loss_first": first_loss, "loss_last": loss}
        out["xor_delta"] = xor_rows

        # 2. LoRA on every projection, the base frozen.
        for p in model.parameters():
            p.requires_grad_(False)
        for b in model.blocks:
            b.qkv, b.proj = LoRA(b.qkv), LoRA(b.proj)
        lora = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(lora, lr=1e-3)
        data = batches(vocab, ctx, 8, seed=2)  # another "task"
        layouts = {"plain": {}, "packed incremental": {"incremental": True},
                   "packed incremental zstd": {"incremental": True, "compression": "zstd"},
                   "packed incremental planes": {"incremental": True, "compression": "planes"},
                   "packed incremental auto": {"incremental": True, "compression": "auto"}}
        results = {name: {"writes": [], "write_s": [], "image": []} for name in layouts}
        saves = 0
        for i in range(1, args.steps + 1):
            train_step(model, opt, data)
            if i % args.every:
                continue
            state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": i}
            saves += 1
            for name, kw in layouts.items():
                path = os.path.join(root, name.replace(" ", "-"))
                before = dir_bytes(path) if os.path.exists(path) else 0
                t = time.perf_counter()
                r = safepoint.save(path, i, state, **kw)
                results[name]["write_s"].append(time.perf_counter() - t)
                results[name]["writes"].append(dir_bytes(path) - before)
                results[name]["image"].append(r["bytes"])
                results[name].setdefault("stored", []).append(r["stored_bytes"])
        sb = state_bytes(state)
        out["lora"] = {"state_bytes": sb, "trainable_params": sum(p.numel() for p in lora),
                       "saves": saves, "every": args.every}
        # 3. Loads of the last step, page cache dropped where the kernel lets us.
        for name in layouts:
            path = os.path.join(root, name.replace(" ", "-"))
            drop_caches(path)
            t = time.perf_counter()
            step, back = safepoint.load(path)
            load_s = time.perf_counter() - t
            assert step == args.steps - args.steps % args.every
            assert all(torch.equal(back["model"][k], v) for k, v in state["model"].items())
            r = results[name]
            later = r["writes"][1:]
            out[name] = {
                "first_write_bytes": r["writes"][0],
                "later_write_bytes_mean": sum(later) / max(1, len(later)),
                "later_fraction_of_state": (sum(later) / max(1, len(later))) / sb,
                "persist_MBps_first": r["image"][0] / r["write_s"][0] / 1e6,
                "persist_MBps_later": sum(r["image"][1:]) / max(1e-9, sum(r["write_s"][1:])) / 1e6,
                "load_MBps": r["image"][-1] / load_s / 1e6,
                "dir_bytes": dir_bytes(path),
                # The first save writes every chunk: its image bytes over what it stored.
                "first_ratio": (r["image"][0] / r["stored"][0]) if r["stored"][0] else 1.0,
            }
        # 4. The trained GPT's whole state, every layout and DCP, the same disk, the same run.
        if args.full_runs > 0:
            out["full"] = full_state(root, args.full_runs)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(f"base: {out['base']['params']:,} params, {out['base']['steps']} steps, loss "
          f"{out['base']['loss_first']:.2f} -> {out['base']['loss_last']:.2f} "
          f"({out['base']['seconds']:.0f} s)")
    print(f"LoRA: {out['lora']['trainable_params']:,} trainable params, state "
          f"{out['lora']['state_bytes'] / 1e6:.1f} MB, {out['lora']['saves']} saves")
    print(f"{'layout':26} {'first MB':>9} {'later MB':>9} {'later/state':>12} "
          f"{'persist 1st MB/s':>17} {'later MB/s':>11} {'load MB/s':>10}")
    for name in layouts:
        r = out[name]
        print(f"{name:26} {r['first_write_bytes'] / 1e6:9.2f} "
              f"{r['later_write_bytes_mean'] / 1e6:9.3f} "
              f"{100 * r['later_fraction_of_state']:11.2f}%"
              f" {r['persist_MBps_first']:17.0f} {r['persist_MBps_later']:11.0f}"
              f" {r['load_MBps']:10.0f}  first-save ratio {r['first_ratio']:.3f}x")
    if "full" in out:
        f = out["full"]
        print(f"trained GPT state (bench/workloads/trained_gpt.py): {f['state_bytes'] / 2**20:.1f} "
              f"MiB, {f['runs']} saves per layout (median), same directory tree, same run:")
        print(f"{'layout':26} {'MB on disk/step':>16} {'ratio':>7} {'persist MB/s':>13} "
              f"{'load MB/s':>10}  auto chose")
        for name, r in f["layouts"].items():
            print(f"{name:26} {r['bytes_per_step'] / 1e6:16.2f} {r['ratio']:7.3f} "
                  f"{r['persist_MBps']:13.0f} {r['load_MBps']:10.0f}  {r.get('chose', '')}")
    print("XOR-delta vs raw, zstd level 3, steps of the base's training:")
    for row in out["xor_delta"]:
        print(f"  {row['kind']:18} {row['bytes'] / 1e6:6.1f} MB, {row['apart']} step(s) apart: "
              f"zstd {row['zstd_ratio']:.3f}x, XOR-delta + zstd {row['xor_delta_zstd_ratio']:.3f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
