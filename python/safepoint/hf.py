"""A Hugging Face ``transformers.Trainer`` callback that checkpoints through safepoint.

    from safepoint.hf import SafepointCallback

    cb = SafepointCallback("/ckpt/run1", every_n_steps=50)
    args = TrainingArguments(output_dir="out", save_strategy="no", ...)
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[cb])
    trainer.train(resume_from_checkpoint=cb.prepare_resume(trainer))   # None on a fresh start

What is saved, where. Each save is one safepoint step, numbered by ``state.global_step``, in the
directory ``path``: the model's ``state_dict``, the optimizer's and the LR scheduler's state
dicts, this process's torch/CUDA/numpy/``random`` generator states, the ``TrainerState`` as its
JSON text (global step, epoch, log history, best metric, stateful callbacks), and ``global_step``
and ``epoch``. Everything is stored with safepoint's safe encoding; nothing is pickled.

When. With ``every_n_steps=N`` the callback saves at the end of every N-th optimizer step
(``on_step_end``); use it with ``save_strategy="no"`` so that the Trainer writes no
``checkpoint-*`` directories of its own. Without it, the callback saves whenever the Trainer
saves (``on_save``, after the Trainer's own checkpoint), which adds the memory copy and
safepoint's checksums to the Trainer's schedule.

Flash or synchronous (``mode``). ``"flash"`` (default): ``safepoint.Checkpointer``; a save
blocks only while the state is copied into host shared memory, the node agent persists every
``persist_every``-th step and keeps the newest ``keep`` committed steps, and a process that dies
is resumed from memory. ``"sync"``: ``safepoint.save``; durable when the callback returns.

Resuming. ``prepare_resume(trainer)`` loads the newest step (from this node's memory when it is
there, else the newest intact step on storage) and returns a small directory holding that step's
``trainer_state.json``; ``trainer.train(resume_from_checkpoint=...)`` with it runs the Trainer's
own resume logic (global step, epoch, skipping the batches already seen, callback states), while
the model, optimizer, scheduler and generator states are loaded from safepoint in place. To do
that, ``prepare_resume`` routes the Trainer's checkpoint-reading hooks (``_load_from_checkpoint``,
``_load_optimizer_and_scheduler``, ``_load_rng_state``) for that directory to safepoint; any
other directory still goes to the Trainer's own code. The generator states are restored where the
Trainer restores them (after skipping batches), so a resumed run continues bit for bit.

Several processes (``torchrun``/``accelerate launch``, DDP or FSDP2): every rank saves its own
part of each step (with DDP the replicated model and optimizer are written to storage once in
total; with FSDP2, ``fsdp_config={"fsdp_version": 2}``, each rank saves its DTensor shards and
its own generator states), and ``prepare_resume`` is a collective: all ranks agree on the newest
step every rank can load (from memory or storage) and load that one, so they never resume from
different steps. Resuming needs the same number of ranks (the Checkpointer's ``restore`` or
``safepoint.restore`` reshards outside the Trainer). Refused with an error naming the way out:
FSDP1 (``fsdp_version`` 1; use 2), DeepSpeed (use FSDP2, or DeepSpeed's own checkpoints with
``save_strategy``), and ``mode="sync"`` with several ranks (use ``"flash"``).

Preemption (flash mode; docs/guide.md, "Preemption"). The Checkpointer is opened when training
begins, so SIGTERM or SIGUSR1 from then on is a preemption notice: at the end of the step in
progress the callback saves that step whatever ``every_n_steps`` says (with several ranks, all at
the same step: the ranks agree in one all-reduce of one int per step), waits until it is
committed, and sets ``control.should_training_stop``; the Trainer stops and, at the end of
``on_train_end``, the process ends as the signal would have ended it (one line on stderr; the
user's code after ``trainer.train()`` does not run, as it would not have after a plain SIGTERM).
``on_preemption="return"`` stops the Trainer the same way but lets ``trainer.train()`` return
(``cb.preempted`` is True). A restart resumes from that step.

Limits: the mixed-precision ``GradScaler`` state is not saved (the callback cannot reach the
Trainer's accelerator; its scale re-adapts). With ``every_n_steps``, the states of other
stateful callbacks (e.g. ``EarlyStoppingCallback``) are those of the Trainer's last own save.
Tested with transformers 5.24 and accelerate 1.15 (1 process; 2 processes on CPU/gloo).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from typing import Any, Optional

from transformers import TrainerCallback

import safepoint
from safepoint._pickle import AllowPickle
from safepoint._stateful import RNG_KEY, capture_rng, restore_into, restore_rng, to_saveable
from safepoint.errors import CorruptionError, InvalidArgumentError

TRAINER_STATE_NAME = "trainer_state.json"
_HOOKS = ("_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_rng_state")


class SafepointCallback(TrainerCallback):
    """Saves model, optimizer, scheduler, RNG and trainer state with safepoint (module doc).

    ``path``: the safepoint checkpoint directory. ``every_n_steps``: save every N global steps
    (``on_step_end``); None: save on the Trainer's ``on_save``. ``mode``: ``"flash"`` or
    ``"sync"``. ``persist_every``, ``keep``, ``job``, ``shm_dir``, ``on_busy``,
    ``allow_pickle``, ``tiers``: as for ``safepoint.Checkpointer`` (flash mode: the agent copies
    committed steps down the storage tiers). ``on_preemption``: ``"exit"`` (end the process as
    the preemption signal would, once the Trainer has stopped after the preemption save) or
    ``"return"`` (``trainer.train()`` returns; ``preempted`` is True); see the module doc.
    """

    def __init__(self, path: str | os.PathLike[str], *, every_n_steps: Optional[int] = None,
                 mode: str = "flash", persist_every: int = 1, keep: int = 3,
                 job: Optional[str] = None, shm_dir: Optional[str] = None, on_busy: str = "wait",
                 allow_pickle: AllowPickle = False, tiers: Optional[list[Any]] = None,
                 on_preemption: str = "exit") -> None:
        p = os.fspath(path)
        if not isinstance(p, str) or not p:
            raise InvalidArgumentError(f"checkpoint path must be a non-empty str, got {path!r}")
        if every_n_steps is not None and (type(every_n_steps) is not int or every_n_steps < 1):
            raise InvalidArgumentError(f"{p}: every_n_steps must be a positive int or None, "
                                       f"got {every_n_steps!r}")
        if mode not in ("flash", "sync"):
            raise InvalidArgumentError(f"{p}: mode must be 'flash' or 'sync', got {mode!r}")
        for name, v in (("persist_every", persist_every), ("keep", keep)):
            if type(v) is not int or v < 1:
                raise InvalidArgumentError(f"{p}: {name} must be a positive int, got {v!r}")
        if on_preemption not in ("exit", "return"):
            raise InvalidArgumentError(
                f"{p}: on_preemption must be 'exit' or 'return', got {on_preemption!r}")
        self.path = p
        self.every_n_steps, self.mode = every_n_steps, mode
        self._ckpt_kw: dict[str, Any] = dict(persist_every=persist_every, keep=keep, job=job,
                                             shm_dir=shm_dir, on_busy=on_busy,
                                             allow_pickle=allow_pickle, tiers=tiers,
                                             on_preemption=on_preemption)
        self.preempted = False  # a preemption save was taken: the Trainer was told to stop
        self.allow_pickle = allow_pickle
        self._ckpt: Optional[safepoint.Checkpointer] = None
        self._last_saved: Optional[int] = None
        self._checked_model: Any = None
        self._resume_dir: Optional[str] = None
        self._resume_state: Optional[dict] = None
        self.resumed_step: Optional[int] = None
        self.resumed_from: Optional[str] = None  # "memory" or "storage"

    # -- plumbing -------------------------------------------------------------------------------
    @property
    def checkpointer(self) -> safepoint.Checkpointer:
        """The flash ``Checkpointer`` (opened on first use), e.g. for ``status()`` or ``wait()``.
        With torch.distributed initialized it is this rank's (every rank opens one)."""
        if self.mode != "flash":
            raise InvalidArgumentError(f"{self.path}: mode='sync' has no Checkpointer")
        if self._ckpt is None:
            rank, world = _world()
            self._ckpt = safepoint.Checkpointer(self.path, rank=rank, world_size=world,
                                                **self._ckpt_kw)
            # The preemption save returns: the Trainer stops, then on_train_end ends the process.
            self._ckpt._preemption_exit_deferred = True
        return self._ckpt

    def _check_setup(self, args, model=None) -> None:
        """Refuses the setups the callback cannot checkpoint, naming the way out."""
        if _deepspeed(args):
            raise InvalidArgumentError(
                f"{self.path}: SafepointCallback does not checkpoint DeepSpeed-backed Trainer runs "
                "(DeepSpeed's engine owns the model and optimizer state); train with FSDP2 "
                "(fsdp_config={'fsdp_version': 2}) or DDP instead, or keep DeepSpeed and its own "
                "checkpoints (save_strategy='steps') without this callback")
        world = max(int(getattr(args, "world_size", 1) or 1), _world()[1])
        if world > 1 and self.mode == "sync":
            raise InvalidArgumentError(
                f"{self.path}: mode='sync' supports one process; this run has {world} ranks: "
                "use mode='flash' (the default), whose steps every rank saves and agrees on")
        if world > 1 and _world()[1] != world:
            raise InvalidArgumentError(
                f"{self.path}: the Trainer runs {world} processes but torch.distributed is not "
                "initialized here; launch with torchrun or accelerate launch")
        if model is not None and model is not self._checked_model:
            if _fsdp1(model):
                raise InvalidArgumentError(
                    f"{self.path}: SafepointCallback saves FSDP2 (fully_shard) models, not "
                    "FSDP1 (FullyShardedDataParallel); set fsdp_config={'fsdp_version': 2}")
            self._checked_model = model  # its modules are walked once, not at every save

    def save(self, args, state, control, model=None, optimizer=None, lr_scheduler=None) -> None:
        """Saves the current training state as step ``state.global_step`` (once per step)."""
        self._check_setup(args, model)
        step = int(state.global_step)
        # With several ranks every rank saves its own part (should_save is rank 0's alone).
        if step == self._last_saved or (_world()[1] == 1 and not args.should_save):
            return
        if model is None or optimizer is None:
            raise InvalidArgumentError(f"{self.path}: the Trainer passed no model or optimizer to "
                                       "the callback; nothing to save")
        trainer_state = dataclasses.asdict(state)
        callbacks = trainer_state.get("stateful_callbacks") or {}
        if isinstance(callbacks.get("TrainerControl"), dict):  # the flags as they are now
            callbacks["TrainerControl"] = control.state()
        out: dict[str, Any] = {"model": model, "optimizer": optimizer,
                               "trainer_state": json.dumps(trainer_state, sort_keys=True),
                               "global_step": step, "epoch": float(state.epoch or 0.0)}
        if lr_scheduler is not None:
            out["scheduler"] = lr_scheduler
        if self.mode == "flash":
            self.checkpointer.save(step, out, include_rng=True)
        else:
            out = to_saveable(out)
            out[RNG_KEY] = capture_rng()
            safepoint.save(self.path, step, out, allow_pickle=self.allow_pickle)
        self._last_saved = step

    # -- TrainerCallback ------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        self._check_setup(args, kwargs.get("model"))
        if self._resume_dir is not None:  # the Trainer has read trainer_state.json by now
            shutil.rmtree(self._resume_dir, ignore_errors=True)
        if self.mode == "flash":
            self.checkpointer  # noqa: B018  (opened now: preemption signals are notices)

    def on_step_end(self, args, state, control, model=None, optimizer=None, lr_scheduler=None,
                    **kwargs):
        if self.every_n_steps is not None and state.global_step % self.every_n_steps == 0:
            self.save(args, state, control, model, optimizer, lr_scheduler)
        elif self._ckpt is not None and self._ckpt.preemption_pending():
            self.save(args, state, control, model, optimizer, lr_scheduler)  # the preemption save
        if self._ckpt is not None and self._ckpt.preempted:
            self.preempted = True
            control.should_training_stop = True

    def on_save(self, args, state, control, model=None, optimizer=None, lr_scheduler=None,
                **kwargs):
        if self.every_n_steps is None:
            self.save(args, state, control, model, optimizer, lr_scheduler)

    def on_train_end(self, args, state, control, **kwargs):
        """Waits until the persisted steps are committed and closes the Checkpointer. After a
        preemption signal (``on_preemption="exit"``), ends the process as the signal would."""
        self._resume_state = None  # loaded into the trainer by now
        if self._ckpt is not None:
            self._ckpt.wait()
            # Returns unless a signal preempted: then the process ends here, the snapshots
            # staying in memory for a restart on this node (as after any death).
            self._ckpt._exit_after_preemption("the Trainer stopped")
        self.close()

    def close(self) -> None:
        if self._ckpt is not None:
            ckpt, self._ckpt = self._ckpt, None
            try:
                ckpt.wait()
            finally:
                ckpt.close()
        self._last_saved = None

    # -- resuming -------------------------------------------------------------------------------
    def load(self, step: Optional[int] = None) -> Optional[tuple[int, dict]]:
        """The newest (or the given) saved step as ``(step, state)``; None when there is none."""
        if self.mode == "flash":
            got = self.checkpointer.load(step)
            source = self.checkpointer.last_load_source
        elif step is None and not safepoint.steps(self.path):
            got, source = None, None
        else:
            got, source = safepoint.load(self.path, step, allow_pickle=self.allow_pickle), "storage"
        if got is None:
            return None
        got_step, got_state = got
        for key in ("model", "optimizer", "trainer_state", RNG_KEY):
            if not isinstance(got_state, dict) or key not in got_state:
                raise CorruptionError(f"{self.path}: step {got_step} is not a SafepointCallback "
                                      f"checkpoint (no {key!r})")
        self.resumed_step, self.resumed_from = got_step, source
        return got_step, got_state

    def prepare_resume(self, trainer, step: Optional[int] = None) -> Optional[str]:
        """Loads the newest (or the given) step and sets ``trainer`` up to resume from it.

        Returns the directory to pass as ``trainer.train(resume_from_checkpoint=...)``, or None
        when nothing was saved yet (then train from scratch). With several ranks every rank calls
        it: the ranks agree on one step (a collective over the Checkpointer's gloo group)."""
        missing = [h for h in _HOOKS if not callable(getattr(trainer, h, None))]
        if missing:
            raise InvalidArgumentError(f"this Trainer has no {missing}: prepare_resume needs the "
                                       "checkpoint-reading hooks of transformers 4.x/5.x")
        if self not in trainer.callback_handler.callbacks:
            raise InvalidArgumentError("prepare_resume: this SafepointCallback is not one of the "
                                       "trainer's callbacks (Trainer(callbacks=[cb]))")
        got = self.load(step)
        if got is None:
            return None
        got_step, state = got
        d = tempfile.mkdtemp(prefix=f"safepoint-hf-resume-{got_step}-")
        with open(os.path.join(d, TRAINER_STATE_NAME), "w", encoding="utf-8") as f:
            f.write(state["trainer_state"])
        self._resume_dir, self._resume_state = d, state
        self._route_hooks(trainer, d)
        return d

    def _route_hooks(self, trainer, resume_dir: str) -> None:
        originals = {h: getattr(type(trainer), h) for h in _HOOKS}
        cb = self

        def ours(checkpoint) -> bool:
            return checkpoint is not None and os.path.abspath(checkpoint) == resume_dir

        def resumed() -> dict:
            assert cb._resume_state is not None  # set before the hooks are routed
            return cb._resume_state

        def load_model(resume_from_checkpoint, model=None):
            if not ours(resume_from_checkpoint):
                return originals["_load_from_checkpoint"](trainer, resume_from_checkpoint, model)
            target = model if model is not None else trainer.model
            # Through the module's own state dict: an FSDP2 module's DTensors get their shards.
            restore_into(target, resumed()["model"], "model")

        def load_optimizer_and_scheduler(checkpoint):
            if not ours(checkpoint):
                return originals["_load_optimizer_and_scheduler"](trainer, checkpoint)
            _load_optimizer(trainer.optimizer, resumed()["optimizer"])
            if "scheduler" in resumed() and trainer.lr_scheduler is not None:
                trainer.lr_scheduler.load_state_dict(resumed()["scheduler"])

        def load_rng_state(checkpoint):
            if not ours(checkpoint):
                return originals["_load_rng_state"](trainer, checkpoint)
            restore_rng(resumed()[RNG_KEY])

        trainer._load_from_checkpoint = load_model
        trainer._load_optimizer_and_scheduler = load_optimizer_and_scheduler
        trainer._load_rng_state = load_rng_state


def _world() -> tuple[int, int]:
    """(rank, world size) of torch.distributed, (0, 1) when it is not initialized."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _deepspeed(args) -> bool:
    return bool(getattr(args, "deepspeed", None)
                or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true")


def _fsdp1(model) -> bool:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def _load_optimizer(optimizer, loaded: dict) -> None:
    """Loads a saved optimizer state dict. An optimizer of DTensor parameters (FSDP2) gets its
    state created first (DCP's own initialization: a step with zero gradients and lr 0), so
    that the saved shards are copied into DTensors of the right placement."""
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer
    if not inner.state and _has_dtensor_params(inner):
        from torch.distributed.checkpoint.state_dict import _init_optim_state

        _init_optim_state(inner)
    restore_into(inner, loaded, "optimizer")


def _has_dtensor_params(optimizer) -> bool:
    from safepoint._shards import _dtensor_type

    dt = _dtensor_type()
    return dt is not None and any(isinstance(p, dt) for g in optimizer.param_groups
                                  for p in g["params"])
