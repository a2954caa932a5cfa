"""A torchtitan checkpoint manager that saves through safepoint.

torchtitan builds its checkpoint manager from the trainer configuration: ``Trainer.Config.
checkpoint`` is a ``BaseCheckpointManager.Config``, and the class of that config is the manager
the trainer builds. Selecting safepoint is therefore one line of a torchtitan config function:

    from torchtitan.models.llama3.config_registry import llama3_debugmodel
    from safepoint.torchtitan import SafepointCheckpointManager

    def llama3_debugmodel_safepoint():
        config = llama3_debugmodel()
        config.checkpoint = SafepointCheckpointManager.Config(enable=True, interval=10)
        return config

and ``torchrun ... -m torchtitan.train --module my_configs --config llama3_debugmodel_safepoint``.

What it does. Every ``interval`` steps (and at the last step) the trainer's ``save`` snapshots
the model parts, the optimizers, the LR schedulers, the data loader and the train state (step,
tokens seen) into host shared memory with ``safepoint.Checkpointer`` and returns; the node
agent persists every ``persist_every``-th snapshot to ``<dump_folder>/<folder>`` (a safepoint
checkpoint directory) and keeps the newest ``keep_latest_k`` (0: all). ``load`` (the trainer
calls it before training) restores the newest step in place, from this node's memory after a
process restart (hot reload), else from the fastest storage; every rank agrees on the step.
Sharded states (FSDP2 / TP DTensors) are saved per rank and restored into any other sharding
or world size (resharding reads the byte ranges each rank needs). ``tiers`` (URIs or
``safepoint.Tier``), ``redundancy`` (peer copies), ``persist_every``, ``job`` and ``shm_dir``
are passed to the Checkpointer.

Preemption (docs/guide.md, "Preemption"): the trainer calls ``save`` every step, so after
SIGTERM (or SIGUSR1) the next step is saved whatever ``interval`` says, on every rank the same
step; once it is committed the process ends as the signal would have ended it (one line on
stderr), which stops the training loop where a scheduler expects it to.
``on_preemption="return"`` makes that save return instead (the trainer trains on; torchtitan
has no stop flag a checkpoint manager could set).

Not supported (refused at build with the option named): ``last_save_in_hf`` and
``initial_load_in_hf`` (Hugging Face safetensors export/import: use torchtitan's DCP manager
for the final export), ``create_seed_checkpoint``; ``initial_load_path`` must name a safepoint
checkpoint (``PATH``, ``PATH@TAG`` or ``PATH@step-N``). ``last_save_model_only`` is ignored:
the last save holds the full state like every other. ``load_step`` and
``exclude_from_loading`` behave as in torchtitan.

torchtitan 0.3.0 does not train on a CPU-only host (``torchtitan.tools.utils`` picks its device
as ``_get_available_device_type() or "cuda"``), so the tests drive this manager through its own
entry points (``Config.build``, ``save``, ``load``, ``close``) with torchtitan's optimizer and
LR scheduler containers, not through ``torchtitan.train``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

import torch.nn as nn
from torchtitan.components.checkpointer.base import (
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    BaseCheckpointManager,
    ModelWrapper,
)

import safepoint
from safepoint.errors import InvalidArgumentError

_KEEP_ALL = 2**31 - 1


class SafepointCheckpointManager(BaseCheckpointManager):
    """torchtitan checkpoint manager backed by ``safepoint.Checkpointer`` (module doc)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        persist_every: int = 1
        """Persist every N-th save to the checkpoint folder (the others stay in memory)."""

        job: Optional[str] = None
        """The safepoint job name (default: from the folder, or $SAFEPOINT_JOB)."""

        shm_dir: Optional[str] = None
        """Shared-memory directory of the snapshots (default $SAFEPOINT_SHM_DIR or /dev/shm)."""

        tiers: list[str] = field(default_factory=list)
        """Storage tiers below the folder (URIs), filled by the node agent."""

        redundancy: Optional[str] = None
        """Copies in other nodes' memory: "mirror", "mirror:N" or "ec:K+P"."""

        on_preemption: str = "exit"
        """After a preemption signal and its save: "exit" (end as the signal would) or
        "return"."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            for name in ("last_save_in_hf", "initial_load_in_hf", "create_seed_checkpoint"):
                if getattr(self, name):
                    raise ValueError(
                        f"checkpoint.{name} is not supported by SafepointCheckpointManager; "
                        "use torchtitan's CheckpointManager (DCP) for Hugging Face "
                        "export/import and seed checkpoints")

    def __init__(self, config: Config, *, dataloader: Any, model_parts: list[nn.Module],
                 optimizers: Any, lr_schedulers: Any, states: dict[str, Any],
                 sd_adapter: Any = None, base_folder: str = "") -> None:
        self.enable = config.enable
        if not self.enable:
            return
        self.save_future = None
        self.config = config
        self.folder = os.path.join(base_folder, config.folder) if base_folder else config.folder
        self.states = dict(states)
        self.states.update({MODEL: ModelWrapper(model_parts), OPTIMIZER: optimizers,
                            LR_SCHEDULER: lr_schedulers})
        if dataloader is not None:
            self.states[DATALOADER] = dataloader
        self._ckpt: Optional[safepoint.Checkpointer] = safepoint.Checkpointer(
            self.folder, job=config.job, shm_dir=config.shm_dir,
            persist_every=config.persist_every,
            keep=config.keep_latest_k or _KEEP_ALL, tiers=list(config.tiers) or None,
            redundancy=config.redundancy, on_preemption=config.on_preemption)

    @property
    def checkpointer(self) -> Optional[safepoint.Checkpointer]:
        """The ``safepoint.Checkpointer`` (``status()``, ``last_restore``)."""
        return self._ckpt

    def _live(self) -> safepoint.Checkpointer:
        if self._ckpt is None:
            raise InvalidArgumentError(f"{self.folder}: the checkpoint manager is closed")
        return self._ckpt

    # -- BaseCheckpointManager hooks ----------------------------------------------------------
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if self.config.load_only:
            return False
        due = curr_step % self.config.interval == 0 or last_step or (
            curr_step == 1 and self.config.enable_first_step_checkpoint)
        ckpt = self._live()
        # After a preemption signal the step is saved whatever the interval (and the process
        # ends once it is committed): every rank calls save every step, so all agree.
        if not due and not ckpt.preemption_pending():
            return False
        saved = ckpt.save(curr_step, self.states, persist=True if last_step else None)
        if last_step:
            ckpt.wait()  # the run ends: the last step is on storage when save returns
        return saved

    def _load(self, step: int = -1) -> bool:
        ckpt = self._live()
        state = {k: v for k, v in self.states.items()
                 if k == MODEL or k not in self.config.exclude_from_loading}
        want = None if step == -1 else step
        got = ckpt.restore(state, want)
        if got is None and self.config.initial_load_path:
            state = ({MODEL: self.states[MODEL]} if self.config.initial_load_model_only
                     else state)
            ckpt.restore(state, from_=self.config.initial_load_path)
            return True
        if got is None and want is not None:
            raise FileNotFoundError(f"{self.folder}: no step {want} to load")
        return got is not None

    def _wait_for_saving(self) -> None:
        self.save_future = None

    def _maybe_wait_for_staging(self) -> None:
        # A flash save returns once the copy into shared memory is done: nothing is staging.
        return None

    def _close(self) -> None:
        ckpt, self._ckpt = getattr(self, "_ckpt", None), None
        if ckpt is not None:
            ckpt.close()

    def wait(self, timeout: Optional[float] = None) -> None:
        """Blocks until every persisted save so far is committed."""
        self._live().wait(timeout)
