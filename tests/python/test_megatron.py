"""safepoint.megatron: Megatron-Core's dist_checkpointing (megatron-core 0.16.1) saving and loading
in safepoint's format, with gloo ranks as processes on the CPU.

The sharded state dicts are built with Megatron's own classes the way its models and its
DistributedOptimizer build them: ``ShardedTensor.from_rank_offsets`` for tensor-parallel
(column and row split), replicated (``replica_id``) and layer-stacked (``prepend_axis_num``)
tensors, the SwiGLU ``ShardedTensorFactory`` of Megatron's MLP (``apply_swiglu_sharded_factory``),
``ShardedObject``s (a per-rank one, as the RNG state, and one per DP group, as the
DistributedOptimizer's ``dp_reshardable`` buffers), the DistributedOptimizer's
``fully_reshardable`` state (``optimizer.state.{exp_avg,exp_avg_sq,fp32_param}.<param>``, sharded
as the param) and common values. Every value derives from its key (a seeded generator), so any
layout's shard of it is known: each load is compared bit for bit with what the saving layout
held, across TP 2->4, PP 2->1 and DP 4->2 (also on fewer processes than saved), for the sync,
async (Megatron's AsyncCallsQueue, the source tensors overwritten while the request runs) and
flash saves, and through Megatron-LM's default ``FullyParallelSaveStrategyWrapper``. A tiny
Megatron GPTModel's own ``sharded_state_dict()`` (TP 2, parallel_state over gloo) is saved and
loaded into a TP 1 model.

Megatron's AsyncCallsQueue calls ``torch.cuda.synchronize()`` and puts its flags on
``torch.cuda.current_device()``; a CPU-only torch has neither, so the workers make those two a
no-op and ``"cpu"`` (``cpu_shims``) before scheduling requests through it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import sys
import time
import zlib

import pytest

pytest.importorskip("megatron.core")
import torch  # noqa: E402
from conftest import communicate, flip_byte, free_port, start_script  # noqa: E402

HANG = 240  # seconds: only a guard against a hung process
H, F, V, L = 8, 16, 32, 4  # hidden, FFN, vocab, layers of the hand-built model


# --- the state: every value derives from its key -------------------------------------------------

def glob(key: str, shape, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    return torch.randn(shape, generator=g).to(dtype)


def coords(rank: int, tp: int, pp: int, dp: int) -> tuple[int, int, int]:
    """(pp, tp, dp) ranks in Megatron's default order (tp fastest, then dp, then pp)."""
    return rank // (tp * dp), rank % tp, (rank // tp) % dp


def _split(t: torch.Tensor, dim: int, i: int, n: int) -> torch.Tensor:
    return t.chunk(n, dim)[i].clone()


def sharded_sd(tp: int, pp: int, dp: int, rank: int, *, empty: bool = False,
               per_layout: bool = True) -> dict:
    """This rank's sharded state dict of the model and its DistributedOptimizer state in layout
    (tp, pp, dp). ``empty``: zero tensors (a load template). ``per_layout``: add the objects
    only the same layout loads (the per-rank RNG state and the dp_reshardable buffers)."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    ppr, tpr, dpr = coords(rank, tp, pp, dp)

    def data(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(t) if empty else t

    def tensor(key, shape, dtype, dim, replica_tp=False):
        full = glob(key, shape, dtype)
        if dim is None:
            return ShardedTensor.from_rank_offsets(key, data(full.clone()),
                                                   replica_id=(0, tpr, dpr))
        return ShardedTensor.from_rank_offsets(key, data(_split(full, dim, tpr, tp)),
                                               (dim, tpr, tp), replica_id=(0, 0, dpr))

    model: dict = {}
    params: list = []
    if ppr == 0:
        params.append(("embedding.word_embeddings.weight",
                       tensor("embedding.word_embeddings.weight", (V, H), torch.bfloat16, 0)))
    per = L // pp
    for i in range(ppr * per, (ppr + 1) * per):
        pre = f"decoder.layers.{i}."
        params.append((pre + "self_attention.linear_qkv.weight",
                       tensor(pre + "self_attention.linear_qkv.weight", (3 * H, H),
                              torch.bfloat16, 0)))
        params.append((pre + "self_attention.linear_proj.weight",
                       tensor(pre + "self_attention.linear_proj.weight", (H, 3 * H),
                              torch.bfloat16, 1)))
        params.append((pre + "input_layernorm.weight",
                       tensor(pre + "input_layernorm.weight", (H,), torch.float32, None)))
        # Layer-stacked tensor: global [L, 3H], this layer's row, TP-split columns.
        key = "decoder.layers.stacked_bias"
        full = glob(key, (L, 3 * H))[i]
        model[pre + "stacked_bias"] = ShardedTensor.from_rank_offsets(
            key, data(_split(full, 0, tpr, tp)), (0, i, L), (1, tpr, tp),
            replica_id=(0, 0, dpr), prepend_axis_num=1)
        # SwiGLU fc1: global [2F, H] = [W; V]; locally cat(W_r, V_r), saved as two tensors.
        key = pre + "mlp.linear_fc1.weight"
        full = glob(key, (2 * F, H), torch.bfloat16)
        local = torch.cat([_split(full[:F], 0, tpr, tp), _split(full[F:], 0, tpr, tp)])
        sh = ShardedTensor.from_rank_offsets(key, data(local), (0, tpr, tp),
                                             replica_id=(0, 0, dpr))
        model[pre + "mlp.linear_fc1.weight"] = apply_swiglu_sharded_factory(sh, ())
    for name, sh in params:
        model[name] = sh
    # DistributedOptimizer, fully_reshardable: each param's state sharded as the param.
    state = {}
    for idx, (_, sh) in enumerate(params):
        entry = {}
        for what in ("exp_avg", "exp_avg_sq", "fp32_param"):
            key = f"optimizer.state.{what}.{sh.key}"
            full = glob(key, sh.global_shape)
            dim = next((d for d, (g, n) in enumerate(zip(sh.global_shape, sh.local_shape))
                        if g != n), None)
            local = full if dim is None else _split(full, dim, tpr, tp)
            entry[what] = dataclasses.replace(sh, key=key, data=data(local.clone()),
                                              dtype=torch.float32)
        state[idx] = entry
    out = {"model": model,
           "optimizer": {"param_state": state, "param_state_sharding_type": "fully_reshardable",
                         "param_groups": [{"lr": 0.25, "betas": (0.9, 0.95), "step": 7}]},
           "iteration": 100,
           # One object every layout loads (replicated: rank 0 saves it).
           "data_state": ShardedObject("data_state", None if empty else {"consumed": 4096},
                                       (1,), (0,), replica_id=rank)}
    if per_layout:
        out["rng_state"] = ShardedObject("rng_state", None if empty else
                                         {"rank": rank, "seed": torch.tensor([rank, 7])},
                                         (pp, tp, dp), (ppr, tpr, dpr), replica_id=0)
        group = ppr * tp + tpr
        out["optimizer"]["dp_buffers"] = ShardedObject(
            f"optimizer.distributed.dp_group_idx_{group}.param_state",
            None if empty else {"flat": glob(f"flat.{group}.{dpr}", (37,)), "dp": dpr},
            (dp,), (dpr,), replica_id=0)
    return out


def mismatches(loaded: dict, tp: int, pp: int, dp: int, rank: int, per_layout: bool) -> list:
    """Where ``loaded`` differs, bit for bit, from layout (tp, pp, dp)'s own state dict."""
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject,
        ShardedTensor,
        ShardedTensorFactory,
    )

    want = sharded_sd(tp, pp, dp, rank, per_layout=per_layout)
    bad: list = []

    def walk(w, got, path):
        if isinstance(w, (ShardedTensor, ShardedTensorFactory)):
            if not isinstance(got, torch.Tensor):
                bad.append(f"{path}: got {type(got).__name__}")
            elif got.dtype != w.data.dtype or got.shape != w.data.shape:
                bad.append(f"{path}: {got.dtype}{tuple(got.shape)} vs "
                           f"{w.data.dtype}{tuple(w.data.shape)}")
            elif not torch.equal(got.view(torch.uint8) if got.dtype == torch.bfloat16 else got,
                                 w.data.view(torch.uint8) if got.dtype == torch.bfloat16
                                 else w.data):
                bad.append(f"{path}: values differ")
        elif isinstance(w, ShardedObject):
            walk(w.data, got, path)
        elif isinstance(w, dict):
            if not isinstance(got, dict) or set(got) != set(w):
                bad.append(f"{path}: keys {sorted(map(str, got)) if isinstance(got, dict) else got}"
                           f" vs {sorted(map(str, w))}")
                return
            for k in w:
                walk(w[k], got[k], f"{path}.{k}")
        elif isinstance(w, (list, tuple)):
            if len(got) != len(w):
                bad.append(f"{path}: length {len(got)} vs {len(w)}")
                return
            for i, (a, b) in enumerate(zip(w, got)):
                walk(a, b, f"{path}[{i}]")
        elif isinstance(w, torch.Tensor):
            if not (isinstance(got, torch.Tensor) and torch.equal(got, w)):
                bad.append(f"{path}: tensor differs")
        elif got != w:
            bad.append(f"{path}: {got!r} vs {w!r}")

    walk(want, loaded, "")
    return bad


# --- the workers ---------------------------------------------------------------------------------

def cpu_shims() -> None:
    """Megatron 0.16.1's async queue on a CPU-only torch (module doc)."""
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"


def overwrite(sd) -> None:
    """Overwrites every tensor of a sharded state dict in place (training going on)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    for v in nested_values(sd):
        t = getattr(v, "data", None)
        if isinstance(t, torch.Tensor):
            t.fill_(-3.0)


def load_and_check(ckpt_dir: str, layout: tuple, rank: int, per_layout: bool) -> dict:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.base import (
        StrategyAction,
        get_default_strategy,
    )

    loaded = dist_checkpointing.load(sharded_sd(*layout, rank, empty=True, per_layout=per_layout),
                                     ckpt_dir)
    reader = get_default_strategy(StrategyAction.LOAD_SHARDED, "safepoint", 1).last_reader
    return {"bad": mismatches(loaded, *layout, rank, per_layout), "bytes_read": reader.bytes_read}


def save_worker(a) -> None:
    """4 ranks: sync, async and flash saves in several layouts, then loads in other ones."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.base import AsyncCallsQueue

    import safepoint.megatron as spm

    cpu_shims()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    d = a.dir
    rep: dict = {}

    def mkdir(name):
        path = os.path.join(d, name)
        os.makedirs(path, exist_ok=True)
        return path

    # sync, saved as TP2 x PP2 x DP1
    dist_checkpointing.save(sharded_sd(2, 2, 1, rank), mkdir("iter_1"),
                            sharded_strategy=("safepoint", 1))
    # async, saved as TP1 x PP1 x DP4 through Megatron's queue (a forked writer per rank)
    queue = AsyncCallsQueue()
    sd = sharded_sd(1, 1, 4, rank)
    req = dist_checkpointing.save(sd, mkdir("iter_2"), sharded_strategy=("safepoint", 1),
                                  async_sharded_save=True)
    # Megatron's PersistentAsyncCaller sends the request to its worker pickled.
    rep["async_request_pickles"] = len(pickle.dumps(req._replace(finalize_fns=[]))) > 0
    queue.schedule_async_request(req)
    overwrite(sd)  # training goes on: the saved state is the one at the call
    rep["async_finalized"] = queue.maybe_finalize_async_calls(blocking=True)
    # flash, saved as TP2 x PP2 x DP1; the state overwritten once the call returned
    flash = spm.SafepointSaveStrategy(flash=True, job=a.job, shm_dir=a.shm, keep=10)
    sd = sharded_sd(2, 2, 1, rank)
    dist_checkpointing.save(sd, mkdir("iter_3"), sharded_strategy=flash)
    overwrite(sd)
    # flash through the async queue: finalized once the agent committed the step
    sd = sharded_sd(1, 1, 4, rank)
    req = dist_checkpointing.save(sd, mkdir("iter_4"), sharded_strategy=flash,
                                  async_sharded_save=True)
    queue.schedule_async_request(req)
    overwrite(sd)
    rep["flash_async_finalized"] = queue.maybe_finalize_async_calls(blocking=True)
    rep["flash_async_committed"] = spm.read_pointer(os.path.join(d, "iter_4"))[1] in \
        spm._steps(spm.read_pointer(os.path.join(d, "iter_4"))[0])
    flash.close()
    # Megatron-LM's default wrapper (--ckpt-fully-parallel-save): the replicated shards' saves
    # spread over the DP ranks, then safepoint's strategy; saved as TP2 x PP1 x DP2.
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper,
    )

    wrapped = FullyParallelSaveStrategyWrapper(spm.SafepointSaveStrategy())
    dist_checkpointing.save(sharded_sd(2, 1, 2, rank), mkdir("iter_5"), sharded_strategy=wrapped)
    rep["pointers"] = {n: spm.read_pointer(os.path.join(d, n))[1]
                       for n in ("iter_1", "iter_2", "iter_3", "iter_4", "iter_5")}
    with open(os.path.join(d, "iter_1", "metadata.json")) as f:
        rep["metadata"] = json.load(f)

    rep["loads"] = {
        "sync same layout": load_and_check(os.path.join(d, "iter_1"), (2, 2, 1), rank, True),
        "sync TP2->4 PP2->1": load_and_check(os.path.join(d, "iter_1"), (4, 1, 1), rank, False),
        "async same layout": load_and_check(os.path.join(d, "iter_2"), (1, 1, 4), rank, True),
        "async DP4->2 TP1->2": load_and_check(os.path.join(d, "iter_2"), (2, 1, 2), rank, False),
        "flash TP2->4 PP2->1": load_and_check(os.path.join(d, "iter_3"), (4, 1, 1), rank, False),
        "flash async same layout": load_and_check(os.path.join(d, "iter_4"), (1, 1, 4), rank,
                                                  True),
        "fully parallel same layout": load_and_check(os.path.join(d, "iter_5"), (2, 1, 2), rank,
                                                     True),
        "fully parallel TP2->4 DP2->1": load_and_check(os.path.join(d, "iter_5"), (4, 1, 1),
                                                       rank, False),
    }
    print(json.dumps(rep), flush=True)
    dist.destroy_process_group()


def load_worker(a) -> None:
    """2 ranks load what 4 saved: DP 4->2, TP 2->1 and PP 2->1."""
    import torch.distributed as dist

    import safepoint.megatron  # noqa: F401  (registers the backend)

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    d = a.dir
    rep = {"loads": {
        "sync TP2->1 PP2->1 DP1->2": load_and_check(os.path.join(d, "iter_1"), (1, 1, 2), rank,
                                                    False),
        "sync TP2->2 PP2->1": load_and_check(os.path.join(d, "iter_1"), (2, 1, 1), rank, False),
        "async DP4->2": load_and_check(os.path.join(d, "iter_2"), (1, 1, 2), rank, False),
        "flash TP2->2 PP2->1": load_and_check(os.path.join(d, "iter_3"), (2, 1, 1), rank, False),
    }}
    print(json.dumps(rep), flush=True)
    dist.destroy_process_group()


def gpt_worker(a) -> None:
    """2 ranks: a GPTModel saved with TP 2, loaded into a TP 1 model (DP 2)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    import safepoint.megatron  # noqa: F401

    dist.init_process_group("gloo")
    ckpt = os.path.join(a.dir, "gpt_iter_5")

    def build(tp: int, seed: int) -> GPTModel:
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tp, 1)
        torch.manual_seed(seed)
        cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                                use_cpu_initialization=True, params_dtype=torch.float32)
        return GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(),
                        vocab_size=64, max_sequence_length=16)

    def shards(model) -> list:
        return [(t.key, t.global_shape, t.global_offset, t.prepend_axis_num, t.data.clone())
                for t in nested_values(model.sharded_state_dict())
                if isinstance(t, ShardedTensor)]

    model = build(2, seed=1)
    os.makedirs(ckpt, exist_ok=True)
    dist_checkpointing.save(model.sharded_state_dict(), ckpt, sharded_strategy=("safepoint", 1))
    saved = [None] * dist.get_world_size()
    dist.all_gather_object(saved, shards(model))
    full: dict = {}
    for records in saved:
        for key, shape, offset, prepend, data in records:
            g = full.setdefault(key, torch.full(shape, float("nan"), dtype=data.dtype))
            view = data.view((1,) * prepend + tuple(data.shape))
            g[tuple(slice(o, o + n) for o, n in zip(offset, view.shape))] = view

    model = build(1, seed=2)  # other values everywhere until loaded
    state = dist_checkpointing.load(model.sharded_state_dict(), ckpt)
    model.load_state_dict(state)
    bad, checked = [], 0
    for key, _, offset, prepend, data in shards(model):
        view = data.view((1,) * prepend + tuple(data.shape))
        want = full[key][tuple(slice(o, o + n) for o, n in zip(offset, view.shape))]
        checked += 1
        if not torch.equal(view, want):
            bad.append(key)
    print(json.dumps({"bad": bad, "checked": checked, "keys": len(full)}), flush=True)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def corrupt_worker(a) -> None:
    """1 rank: a flipped byte in an image fails the load, naming the image."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    import safepoint.megatron as spm

    dist.init_process_group("gloo")
    ckpt = os.path.join(a.dir, "iter_9")
    os.makedirs(ckpt)
    dist_checkpointing.save(sharded_sd(1, 1, 1, 0), ckpt, sharded_strategy=("safepoint", 1))
    ok = load_and_check(ckpt, (1, 1, 1), 0, True)["bad"] == []
    # Megatron's metadata entry points: the global shapes, and plain whole tensors.
    meta = dist_checkpointing.load_tensors_metadata(ckpt)
    key = "decoder.layers.stacked_bias"
    shapes_ok = tuple(meta[key].global_shape) == (L, 3 * H) and \
        meta["embedding.word_embeddings.weight"].dtype == torch.bfloat16
    plain = dist_checkpointing.load_plain_tensors(ckpt)
    plain_ok = torch.equal(plain[key], glob(key, (L, 3 * H))) and torch.equal(
        plain["optimizer.state.exp_avg.decoder.layers.1.self_attention.linear_proj.weight"],
        glob("optimizer.state.exp_avg.decoder.layers.1.self_attention.linear_proj.weight",
             (H, 3 * H)))
    root, step = spm.read_pointer(ckpt)
    from safepoint import _core

    flip_byte(_core.image_path(root, step, 0), os.path.getsize(
        _core.image_path(root, step, 0)) // 2, 0x10)
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dist_checkpointing.load(sharded_sd(1, 1, 1, 0, empty=True), ckpt)
        err = None
    except CheckpointException as e:  # DCP's (a BaseException) wraps the reader's error
        err = "; ".join(f"{type(x).__name__}: {x}" for x, _ in e.failures.values())
    # keep=1: the older step goes once a newer one is committed; its directory says so.
    keep1 = spm.SafepointSaveStrategy(os.path.join(a.dir, "kept"), keep=1)
    for name in ("iter_10", "iter_11"):
        os.makedirs(os.path.join(a.dir, name))
        dist_checkpointing.save(sharded_sd(1, 1, 1, 0), os.path.join(a.dir, name),
                                sharded_strategy=keep1)
    kept_ok = load_and_check(os.path.join(a.dir, "iter_11"), (1, 1, 1), 0, True)["bad"] == []
    try:
        dist_checkpointing.load(sharded_sd(1, 1, 1, 0, empty=True), os.path.join(a.dir, "iter_10"))
        pruned = None
    except Exception as e:
        pruned = f"{type(e).__name__}: {e}"
    # A step deleted and taken again by another save (another job, say): the first pointer
    # refuses it (the save attempt it records) instead of loading the other save's data.
    reused = os.path.join(a.dir, "reused")
    for name in ("iter_20", "iter_21"):
        os.makedirs(os.path.join(a.dir, name))
    dist_checkpointing.save(sharded_sd(1, 1, 1, 0), os.path.join(a.dir, "iter_20"),
                            sharded_strategy=spm.SafepointSaveStrategy(reused))
    _core.delete_step(reused, 1)
    other = sharded_sd(1, 1, 1, 0)
    overwrite(other)
    dist_checkpointing.save(other, os.path.join(a.dir, "iter_21"),
                            sharded_strategy=spm.SafepointSaveStrategy(reused))
    try:
        got = dist_checkpointing.load(sharded_sd(1, 1, 1, 0, empty=True),
                                      os.path.join(a.dir, "iter_20"))
        retaken = f"loaded; the other save's data: {all_filled(got)}"
    except Exception as e:
        retaken = f"{type(e).__name__}: {e}"
    print(json.dumps({"ok_before": ok, "shapes_ok": shapes_ok, "plain_ok": plain_ok,
                      "error": err, "kept_ok": kept_ok, "pruned": pruned,
                      "kept_steps": list(_core.steps(os.path.join(a.dir, "kept"))),
                      "retaken": retaken,
                      "retaken_steps": [spm.read_pointer(os.path.join(a.dir, n))[1]
                                        for n in ("iter_20", "iter_21")]}), flush=True)
    dist.destroy_process_group()


def all_filled(loaded: dict) -> bool:
    """Whether every tensor of the model and optimizer state loaded is -3 (``overwrite``'s)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    ts = [t for t in nested_values({"m": loaded["model"],
                                    "o": loaded["optimizer"]["param_state"]})
          if isinstance(t, torch.Tensor)]
    return len(ts) > 0 and all(bool((t.float() == -3.0).all()) for t in ts)


def races_worker(a) -> None:
    """2 ranks: saves that overlap, the forked process's part, ranks that see storage fail.

    A spy wraps the core's storage functions (the real ones still run) and records each call
    made from a process other than the rank's own (Megatron's forked writer): there must be
    none. A listing failure is injected on one rank (the wrappers raise StorageError)."""
    import datetime
    import signal
    import threading

    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.base import AsyncCallsQueue

    import safepoint.megatron as spm
    from safepoint import _core
    from safepoint.errors import StorageError

    cpu_shims()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, d = dist.get_rank(), a.dir
    main_pid, spy = os.getpid(), os.path.join(a.dir, f"forked-core-calls-{rank}")
    fail = {"listing": False}

    def spied(name, fn):
        def call(*args, **kwargs):
            if os.getpid() != main_pid:
                with open(spy, "a") as f:
                    f.write(f"{name} pid {os.getpid()}\n")
            if fail["listing"] and name in ("steps", "image_ranks"):
                raise StorageError(f"injected listing failure on rank {rank}")
            return fn(*args, **kwargs)
        return call

    for name in ("save", "steps", "image_ranks", "step_lineage", "read_metadata"):
        setattr(_core, name, spied(name, getattr(_core, name)))
    rep: dict = {}

    def mkdir(*names):
        path = os.path.join(d, *names)
        os.makedirs(path, exist_ok=True)
        return path

    def attempt(what, fn):
        try:
            rep[what] = fn()
        except BaseException as e:  # noqa: BLE001 (DCP's CheckpointException is one)
            rep[what] = f"error: {type(e).__name__}: {e}"[:2000]

    def loaded(name, check):
        state = dist_checkpointing.load(sharded_sd(1, 1, 2, rank, empty=True), mkdir(name))
        return check(state)

    # B1 (a): two async requests in flight at once (Megatron's queue allows it). The older one
    # writes longer on rank 1 (a 48 MiB object): its step must commit before the newer one's,
    # whose commit cleans up the uncommitted images of older steps.
    from megatron.core.dist_checkpointing import ShardedObject

    queue = AsyncCallsQueue()
    sd_a, sd_b = sharded_sd(1, 1, 2, rank), sharded_sd(1, 1, 2, rank)
    sd_a["blob"] = ShardedObject("blob", bytes(48 << 20) if rank == 1 else b"x", (2,), (rank,),
                                 replica_id=0)
    overwrite(sd_b)
    req_a = dist_checkpointing.save(sd_a, mkdir("iter_a"), sharded_strategy=("safepoint", 1),
                                    async_sharded_save=True)
    req_b = dist_checkpointing.save(sd_b, mkdir("iter_b"), sharded_strategy=("safepoint", 1),
                                    async_sharded_save=True)
    queue.schedule_async_request(req_a)
    queue.schedule_async_request(req_b)
    overwrite(sd_a)
    attempt("two_in_flight_finalized", lambda: queue.maybe_finalize_async_calls(blocking=True))
    attempt("two_in_flight_steps", lambda: [spm.read_pointer(mkdir(n))[1]
                                            for n in ("iter_a", "iter_b")])
    attempt("iter_a_ok", lambda: loaded(
        "iter_a", lambda s: mismatches(s, 1, 1, 2, rank, True) == []))
    attempt("iter_b_ok", lambda: loaded("iter_b", all_filled))

    # B1 (b): a flash step only in the agent's memory (the agent stopped) and a non-flash save
    # to the same directory (named as a file:// URI by one, a path by the other).
    root = mkdir("mixed")
    flash = spm.SafepointSaveStrategy("file://" + root, flash=True, job=a.job, shm_dir=a.shm,
                                      keep=10)
    plain = spm.SafepointSaveStrategy(root)
    # (A first flash save sets up the snapshot slots, which needs the agent.)
    dist_checkpointing.save(sharded_sd(1, 1, 2, rank), mkdir("iter_f0"), sharded_strategy=flash)
    flash.wait(60)
    agent = flash.checkpointer.status()["agent"]["pid"]
    dist.barrier()
    if rank == 0:
        os.kill(agent, signal.SIGSTOP)
    dist.barrier()
    try:
        attempt("flash_save", lambda: dist_checkpointing.save(
            sharded_sd(1, 1, 2, rank), mkdir("iter_f"), sharded_strategy=flash))
        sd = sharded_sd(1, 1, 2, rank)
        overwrite(sd)
        # The non-flash save plans at once, then waits to write until the flash step is
        # committed (its commit would clean up an older step's uncommitted images): the agent
        # goes on a moment later.
        if rank == 0:
            threading.Timer(0.5, os.kill, (agent, signal.SIGCONT)).start()
        attempt("beside_flash", lambda: dist_checkpointing.save(sd, mkdir("iter_n"),
                                                                sharded_strategy=plain))
    finally:
        dist.barrier()
        if rank == 0:
            os.kill(agent, signal.SIGCONT)
    attempt("flash_wait", lambda: flash.wait(60))
    attempt("mixed_steps", lambda: [spm.read_pointer(mkdir(n))[1] for n in ("iter_f", "iter_n")])
    attempt("iter_f_ok", lambda: loaded(
        "iter_f", lambda s: mismatches(s, 1, 1, 2, rank, True) == []))
    attempt("iter_n_ok", lambda: loaded("iter_n", all_filled))
    # Flash through the queue (the forked process waits; a file:// root).
    sd = sharded_sd(1, 1, 2, rank)
    req = dist_checkpointing.save(sd, mkdir("iter_fa"), sharded_strategy=flash,
                                  async_sharded_save=True)
    queue.schedule_async_request(req)
    overwrite(sd)
    attempt("flash_async_finalized", lambda: queue.maybe_finalize_async_calls(blocking=True))
    attempt("iter_fa_ok", lambda: loaded(
        "iter_fa", lambda s: mismatches(s, 1, 1, 2, rank, True) == []))
    flash.close()

    # R4: flash requests whose step the agent's retention (keep=1) deleted before their
    # finalize ran (scheduled once a newer step was committed: a slow finalize's view).
    import warnings

    kept = mkdir("kept1")
    keep1 = spm.SafepointSaveStrategy(kept, flash=True, job=a.job + "-keep1", shm_dir=a.shm,
                                      keep=1, commit_timeout=20)
    reqs = [dist_checkpointing.save(sharded_sd(1, 1, 2, rank), mkdir(n), sharded_strategy=keep1,
                                    async_sharded_save=True) for n in ("iter_k1", "iter_k2")]
    keep1.wait(60)
    newest = keep1.last_step
    for _ in range(3000):  # (bounded) until the agent's retention deleted the older step
        if _core.steps(kept) == [newest]:
            break
        time.sleep(0.01)
    rep["kept_before_finalize"] = list(_core.steps(kept))
    for r in reqs:
        queue.schedule_async_request(r)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        attempt("pruned_finalized", lambda: queue.maybe_finalize_async_calls(blocking=True))
    rep["pruned_warnings"] = [str(w.message) for w in caught if "retention" in str(w.message)]
    attempt("iter_k2_ok", lambda: loaded(
        "iter_k2", lambda s: mismatches(s, 1, 1, 2, rank, True) == []))
    keep1.close()

    # R7: the request's parts called in one process, as Megatron's persistent worker does
    # (preload_fn, then the trainer goes on, then async_fn).
    sd = sharded_sd(1, 1, 2, rank)
    req = dist_checkpointing.save(sd, mkdir("iter_p"), sharded_strategy=("safepoint", 1),
                                  async_sharded_save=True)
    rep["request_pickles"] = len(pickle.dumps(req._replace(finalize_fns=[]))) > 0
    preloaded = req.preload_fn()
    overwrite(sd)
    args = list(req.async_fn_args)
    args[1] = preloaded
    req.async_fn(*args)

    def finalize():
        for fn in req.finalize_fns:
            fn()
    attempt("persistent_finalized", finalize)
    attempt("iter_p_ok", lambda: loaded(
        "iter_p", lambda s: mismatches(s, 1, 1, 2, rank, True) == []))

    # R3: rank 1 cannot list storage: saves and loads go on (rank 0 decides for all).
    dist.barrier()
    fail["listing"] = rank == 1
    attempt("rank1_fails_save", lambda: dist_checkpointing.save(
        sharded_sd(1, 1, 2, rank), mkdir("iter_r"), sharded_strategy=("safepoint", 1)) or "ok")
    attempt("rank1_fails_load", lambda: loaded(
        "iter_r", lambda s: mismatches(s, 1, 1, 2, rank, True) == []))
    # rank 0 cannot: every rank raises rank 0's error.
    dist.barrier()
    fail["listing"] = rank == 0
    attempt("rank0_fails_load", lambda: loaded("iter_r", lambda s: "loaded"))
    fail["listing"] = False
    with open(spy, "a"):
        pass
    with open(spy) as f:
        rep["forked_core_calls"] = f.read().splitlines()
    print(json.dumps(rep), flush=True)
    dist.destroy_process_group()


def worker(argv) -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("what"), ap.add_argument("--dir"), ap.add_argument("--shm")
    ap.add_argument("--job", default="megatron-test")
    a = ap.parse_args(argv)
    {"save": save_worker, "load": load_worker, "gpt": gpt_worker,
     "corrupt": corrupt_worker, "races": races_worker}[a.what](a)


# --- tests ---------------------------------------------------------------------------------------

def run_world(world: int, args: list, timeout: float = HANG) -> list:
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1")
        procs.append(start_script(__file__, *args, env=env))
    outs = [communicate(p, timeout) for p in procs]
    for r in outs:
        assert r.returncode == 0, r.stderr[-4000:]
    return [json.loads(r.stdout.strip().splitlines()[-1]) for r in outs]


def test_sync_async_flash_saves_reshard_tp_pp_dp_bit_for_bit(tmp_path, shm, cli):
    reps = run_world(4, ["save", "--dir", tmp_path, "--shm", shm])
    for rank, rep in enumerate(reps):
        assert rep["metadata"]["sharded_backend"] == "safepoint", rep["metadata"]
        assert rep["async_finalized"] == [0] and rep["flash_async_finalized"] == [1]
        assert rep["async_request_pickles"] is True
        assert rep["flash_async_committed"] is True  # finalize ran after the agent's commit
        assert rep["pointers"] == {"iter_1": 1, "iter_2": 2, "iter_3": 3, "iter_4": 4,
                                   "iter_5": 5}
        for name, got in rep["loads"].items():
            assert got["bad"] == [], (rank, name, got["bad"][:5])
            assert got["bytes_read"] > 0
    root = tmp_path / "safepoint"
    out = cli("verify", root, "--all", check=0).stdout
    assert "rank 3" in out
    # A resharded load reads less than every image: TP4 rank 0 needs a quarter of the layers.
    from safepoint import _core

    stored = sum(e.nbytes for r in range(4) for e in _core.read_metadata(str(root), 1, r).tensors)
    assert reps[0]["loads"]["sync TP2->4 PP2->1"]["bytes_read"] < stored / 2

    # Two processes load what four saved.
    for rank, rep in enumerate(run_world(2, ["load", "--dir", tmp_path])):
        for name, got in rep["loads"].items():
            assert got["bad"] == [], (rank, name, got["bad"][:5])


def test_gpt_model_saved_with_tp2_loads_into_tp1(tmp_path):
    reps = run_world(2, ["gpt", "--dir", tmp_path])
    for rep in reps:
        assert rep["bad"] == [] and rep["checked"] >= 10, rep


def test_metadata_entry_points_retention_and_a_corrupted_image(tmp_path):
    (rep,) = run_world(1, ["corrupt", "--dir", tmp_path])
    assert rep["ok_before"] is True
    assert rep["shapes_ok"] is True and rep["plain_ok"] is True
    assert rep["error"] is not None and "CorruptionError" in rep["error"], rep
    assert rep["kept_ok"] is True and rep["kept_steps"] == [2], rep
    assert rep["pruned"] is not None and rep["pruned"].startswith("NotFoundError"), rep
    assert "step 1 is not committed" in rep["pruned"], rep
    assert rep["retaken_steps"] == [1, 1], rep  # (the scenario: one step, two saves)
    assert "committed by another save" in rep["retaken"], rep


def test_overlapping_saves_forked_part_and_ranks_that_fail_to_list(tmp_path, shm):
    reps = run_world(2, ["races", "--dir", tmp_path, "--shm", shm])
    for rank, rep in enumerate(reps):
        # Two async requests in flight at once take two steps, each with its own data.
        assert rep["two_in_flight_finalized"] == [0, 1], (rank, rep)
        steps = rep["two_in_flight_steps"]
        assert isinstance(steps, list) and steps[0] != steps[1], (rank, rep)
        assert rep["iter_a_ok"] is True and rep["iter_b_ok"] is True, (rank, rep)
        # A non-flash save beside a flash step still only in the (stopped) agent's memory.
        assert rep["flash_save"] is None and rep["beside_flash"] is None, (rank, rep)
        steps = rep["mixed_steps"]
        assert isinstance(steps, list) and steps[0] != steps[1], (rank, rep)
        assert rep["iter_f_ok"] is True and rep["iter_n_ok"] is True, (rank, rep)
        assert rep["flash_async_finalized"] == [2] and rep["iter_fa_ok"] is True, (rank, rep)
        # A flash step deleted by the agent's retention before its finalize: a warning.
        assert rep["kept_before_finalize"] == [2], (rank, rep)
        assert rep["pruned_finalized"] == [3, 4] and rep["iter_k2_ok"] is True, (rank, rep)
        assert len(rep["pruned_warnings"]) == (1 if rank == 0 else 0), (rank, rep)
        # The persistent caller's order: the data is the one at preload, not what came after.
        assert rep["persistent_finalized"] is None and rep["iter_p_ok"] is True, (rank, rep)
        assert rep["request_pickles"] is True
        # Megatron's forked processes never entered the core.
        assert rep["forked_core_calls"] == [], (rank, rep["forked_core_calls"][:5])
        # One rank's listing fails: rank 0 decides for all.
        assert rep["rank1_fails_save"] == "ok" and rep["rank1_fails_load"] is True, (rank, rep)
        err = rep["rank0_fails_load"]
        assert isinstance(err, str) and err.startswith("error: StorageError"), (rank, err)
        assert "injected listing failure on rank 0" in err, (rank, err)


def test_strategies_are_registered_under_safepoint():
    from megatron.core.dist_checkpointing.strategies.base import (
        StrategyAction,
        get_default_strategy,
    )

    import safepoint.megatron as spm

    save = get_default_strategy(StrategyAction.SAVE_SHARDED, "safepoint", 1)
    flash = get_default_strategy(StrategyAction.SAVE_SHARDED, "safepoint_flash", 1)
    load = get_default_strategy(StrategyAction.LOAD_SHARDED, "safepoint", 1)
    assert isinstance(save, spm.SafepointSaveStrategy) and not save.flash
    assert isinstance(flash, spm.SafepointSaveStrategy) and flash.flash
    assert flash.backend == save.backend == "safepoint"  # what metadata.json records
    assert isinstance(load, spm.SafepointLoadStrategy)
    from megatron.core.dist_checkpointing.core import CheckpointingException

    with pytest.raises(CheckpointingException):
        load.check_backend_compatibility("torch_dist")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
    worker(sys.argv[1:])
