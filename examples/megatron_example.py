"""Megatron-Core's dist_checkpointing with safepoint: flash saves, a crash, a resharded resume.

    python examples/megatron_example.py [--dir DIR]

A tiny Megatron-Core GPTModel (2 layers, hidden 32) runs on 2 gloo ranks with tensor
parallelism 2. Saving goes through Megatron's own entry point with safepoint's strategy:

    import safepoint.megatron
    dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir,
                            sharded_strategy=("safepoint_flash", 1))

which returns once each rank's shards are in host shared memory; the node agent persists them
under ``DIR/safepoint`` and commits the step. At step 3 both ranks save, at step 5 both are
SIGKILLed. The restarted job runs with TP 1 and DP 2 (another layout), reads
``latest_checkpointed_iteration.txt`` as Megatron-LM does and loads with the plain
``dist_checkpointing.load`` (``metadata.json`` names the backend): each rank reads only the
byte ranges it needs from what the agent persisted, prints ``resumed from step 3 (storage)`` and
checks the weights bit for bit against what the TP-2 ranks held. It then trains on, saves
step 5 and closes the strategy (every save committed, shared memory freed).

megatron-core 0.16.1's GPTModel builds on the CPU (``use_cpu_initialization=True``, the local
layer spec) but its forward does not run there (attention takes a buffer from
``GlobalMemoryBuffer``, allocated on ``torch.cuda.current_device()``), so a "training step"
here is a deterministic update of every weight. Each rank can also be started by torchrun:
``torchrun --nproc-per-node 2 examples/megatron_example.py --phase train --dir DIR``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

SAVE_AT, KILL_AT = 3, 5


def build(tp: int):
    import torch
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                            use_cpu_initialization=True, params_dtype=torch.float32)
    return GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(),
                    vocab_size=64, max_sequence_length=16)


def step(model, it: int) -> None:
    """A deterministic update of every weight (the forward needs CUDA, see the docstring)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            p.mul_(0.99).add_(0.01 * (it + len(name) % 7))


def full_weights(model) -> dict:
    """Every ShardedTensor of the model's sharded state dict, gathered into global tensors."""
    import torch
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    # (a tensor with prepend_axis_num holds a slice of a stacked global tensor: its leading
    # axes are 1 locally)
    mine = [(t.key, t.global_shape, t.global_offset,
             t.data.detach().clone().view((1,) * t.prepend_axis_num + tuple(t.local_shape)))
            for t in nested_values(model.sharded_state_dict()) if isinstance(t, ShardedTensor)]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    out: dict = {}
    for records in every:
        for key, shape, offset, data in records:
            g = out.setdefault(key, torch.zeros(shape, dtype=data.dtype))
            g[tuple(slice(o, o + n) for o, n in zip(offset, data.shape))] = data
    return out


def save(model, workdir: str, it: int) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    import safepoint.megatron  # noqa: F401  (registers the "safepoint" backends)

    ckpt_dir = os.path.join(workdir, f"iter_{it:07d}")
    os.makedirs(ckpt_dir, exist_ok=True)
    state = {"model": model.sharded_state_dict(), "iteration": it}
    dist_checkpointing.save(state, ckpt_dir, sharded_strategy=("safepoint_flash", 1))
    # Megatron-LM's tracker file, written as its sync save does: with flash the checkpoint is
    # durable only once the agent committed the step (a killed process loses nothing, the agent
    # persists its snapshot, and the load waits for the commit; a lost node does lose it). With
    # Megatron-LM's --async-save the tracker is written by the finalize, after the commit.
    if dist.get_rank() == 0:
        with open(os.path.join(workdir, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(it))


def train(workdir: str) -> None:
    """First job: TP 2; saves at step 3, is killed at step 5."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    model = build(tp=2)
    for it in range(1, KILL_AT + 1):
        step(model, it)
        if it == SAVE_AT:
            save(model, workdir, it)  # returns once the state is in shared memory
            ref = full_weights(model)
            if dist.get_rank() == 0:
                torch.save(ref, os.path.join(workdir, "reference.pt"))
    dist.barrier()
    os.kill(os.getpid(), signal.SIGKILL)  # a crash: the agent persists what was saved


def resume(workdir: str) -> None:
    """Restarted job: TP 1, DP 2; loads the newest checkpoint, checks it, trains on."""
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    import safepoint.megatron

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = build(tp=1)
    with open(os.path.join(workdir, "latest_checkpointed_iteration.txt")) as f:
        it = int(f.read())
    ckpt_dir = os.path.join(workdir, f"iter_{it:07d}")
    state = dist_checkpointing.load({"model": model.sharded_state_dict(), "iteration": 0},
                                    ckpt_dir)
    model.load_state_dict(state["model"])
    ref = torch.load(os.path.join(workdir, "reference.pt"))
    same = all(torch.equal(v, ref[k]) for k, v in full_weights(model).items())
    print(f"[rank {rank}] resumed from step {state['iteration']} (storage): weights "
          f"bit-identical to the TP-2 ranks': {same}", flush=True)
    for it in range(state["iteration"] + 1, KILL_AT + 1):
        step(model, it)
    save(model, workdir, KILL_AT)
    safepoint.megatron.close()  # every flash save committed, shared memory freed
    dist.destroy_process_group()
    if not same:
        sys.exit(1)


def launch(workdir: str, phase: str, world: int = 2) -> list[int]:
    """Starts the ranks of one job as torchrun would (env://) and waits for them."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--phase",
                                       phase, "--dir", workdir], env=env))
    return [p.wait() for p in procs]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", help="checkpoint directory (default: a temporary one)")
    ap.add_argument("--phase", choices=["train", "resume"], help="run one rank (torchrun)")
    a = ap.parse_args()
    if a.phase:
        {"train": train, "resume": resume}[a.phase](a.dir)
        return
    workdir = a.dir or tempfile.mkdtemp(prefix="sp-megatron-")
    try:
        codes = launch(workdir, "train")
        if codes != [-signal.SIGKILL] * 2:
            sys.exit(f"the first job should have been killed, its ranks exited {codes}")
        print(f"both ranks killed at step {KILL_AT}; restarting with TP 1", flush=True)
        codes = launch(workdir, "resume")
        if codes != [0, 0]:
            sys.exit(f"the resumed job failed: {codes}")
    finally:
        if a.dir is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
