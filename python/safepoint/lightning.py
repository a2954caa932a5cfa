"""A Lightning ``CheckpointIO`` plugin that saves through safepoint.

    from safepoint.lightning import SafepointCheckpointIO

    trainer = Trainer(plugins=[SafepointCheckpointIO("/ckpt/run1")],
                      callbacks=[ModelCheckpoint(dirpath="/ckpt/run1/lightning", save_last=True,
                                                 every_n_train_steps=100)])
    trainer.fit(model, data, ckpt_path="last")   # resumes from memory after a crash

Where things go. Lightning names every checkpoint by a path (``epoch=0-step=100.ckpt``,
``last.ckpt``) and manages those paths itself (top-k, ``last``, links, removal). The plugin keeps
the data in one safepoint checkpoint directory (``path``, by default a ``safepoint`` directory
beside the first checkpoint Lightning saves), one safepoint step per ``save_checkpoint`` call,
and writes at Lightning's path a small JSON *pointer file* that names the directory and the step
(and the ``global_step`` and ``epoch``). Lightning's own file handling (``exists``, ``ls``,
modification times for ``ckpt_path="last"``, symlinks for ``save_last="link"``) keeps working on
the pointers. Safepoint steps are save numbers, not global steps: Lightning saves the same
global step twice (a top-k checkpoint, then ``last``) with different contents.

Flash or synchronous (``mode``):

- ``"flash"`` (default): ``save_checkpoint`` returns once the checkpoint is copied into host
  shared memory; the node agent persists every save to the directory in the background. If the
  process dies, the agent still persists what was snapshotted, and ``trainer.fit(ckpt_path=...)``
  in the restarted process loads it from memory. This is the right semantics for the frequent
  checkpoints a run is resumed from. A pointer can therefore name a step that is not on storage
  yet; only a node failure before the agent finished loses it (loading it then raises
  ``NotFoundError`` naming the step; pass an older checkpoint). ``teardown()`` (the end of
  ``fit``) waits until everything is committed.
- ``"sync"``: ``save_checkpoint`` returns when the checkpoint and its pointer are durable (the
  safepoint commit protocol, then an fsynced pointer). No agent, no shared memory. Use it where
  a checkpoint must be on storage when Lightning moves on, e.g. the final export, or on hosts
  without ``/dev/shm`` room.

Retention follows Lightning: when ``ModelCheckpoint`` removes a checkpoint (``save_top_k``), the
pointer goes and its step is deleted from the directory once it is committed and no other pointer
in the same directory names it. The agent itself prunes nothing.

Non-tensor values. A standard Lightning checkpoint (loops, callbacks, optimizer and scheduler
states, ``hyper_parameters`` of plain values) is stored with safepoint's safe encoding, no
pickle. Hyper-parameters or callback states holding other objects (an ``argparse.Namespace``, a
dataclass, an OmegaConf container) are refused with an error that names the key, unless the
plugin is given ``allow_pickle=True`` or a list of trusted classes (``allow_pickle=
["argparse.Namespace"]``); they are then pickled and loaded with safepoint's restricted
unpickler. ``load_checkpoint(..., weights_only=True)`` never unpickles.

Random generators: with ``include_rng=True`` (default) each checkpoint carries this process's
torch/CUDA/numpy/``random`` states, and ``load_checkpoint`` restores them, so a run resumed at an
epoch boundary continues bit for bit like the uninterrupted run.

Processes: Lightning's single-device and DDP strategies save on global rank 0 only (the state
is the same on every rank), so the plugin saves as rank 0 of a world of one, and every rank loads
the checkpoint Lightning resumes from: rank 0 from this node's memory when the step is there,
else from storage; the other ranks from storage, waiting (up to ``commit_timeout`` seconds,
default 300) until the node agent has committed the step, so that all ranks resume from the
same step. The generator states are rank 0's: with ``seed_everything`` (the same seed on every
rank) the ranks' generators advance alike and a resumed run continues bit for bit; ranks seeded
differently resume with rank 0's generators. ``ModelCheckpoint``'s ``every_n_train_steps``,
``every_n_epochs``, ``save_top_k`` (with ``monitor``) and ``save_last`` (also ``"link"``) work
as with Lightning's own files: each checkpoint is a pointer, and the steps of the pointers top-k
removes are deleted. DeepSpeed writes its own checkpoints and never calls the plugin. Only
local directories (no ``s3://`` URLs) can hold pointer files.

Sharded strategies. Lightning's ``FSDPStrategy`` and ``ModelParallelStrategy`` load full
checkpoints with ``torch.load`` and write sharded ones with DCP, never through a
``CheckpointIO``: the plugin refuses them at the first save, naming the way out, which is the
strategies of this module, used in their place with the same arguments and the plugin:
``SafepointFSDPStrategy`` (FSDP1; given a 1-D device mesh when it has none, so that its sharded
state dicts are DTensors) and ``SafepointModelParallelStrategy`` (FSDP2 ``fully_shard`` / tensor
parallel in ``configure_model``). With them every rank saves its own shard of each checkpoint
(a flash save into its own Checkpointer, rank r of the world) as one step that the ranks number
alike (rank 0's choice, broadcast), and rank 0 writes the pointer, which records the world size,
after a barrier. Loading, every rank loads its shard of the pointer's step (the Checkpointer's
collective: from this node's memory, else storage; the ranks agree or fail together), copies it
into the model's and optimizers' DTensors through DCP's state-dict API, and restores its own
generator states; Lightning restores the rest (loops, callbacks, schedulers). A resume needs the
world size that saved (``safepoint.restore`` reshards outside the Trainer). Full state dicts
(``state_dict_type="full"``, ``save_distributed_checkpoint=False``) and ``mode="sync"`` are
refused with the way out.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import sys
import tempfile
import time
import types
from typing import TYPE_CHECKING, Any, Optional

import torch

import safepoint
from safepoint import _core, _pointers
from safepoint._files import fsync_dir
from safepoint._pickle import AllowPickle
from safepoint._stateful import RNG_KEY, capture_rng, restore_into, restore_rng
from safepoint.errors import CorruptionError, InvalidArgumentError, NotFoundError

POINTER_FORMAT = "safepoint-lightning-checkpoint"
POINTER_VERSION = 1


# Where Lightning's CheckpointIO lives: the unified package (lightning.pytorch), and the
# standalone one (pytorch_lightning uses lightning_fabric's).
_CHECKPOINT_IO_MODULES = ("lightning.fabric.plugins.io.checkpoint_io",
                          "lightning_fabric.plugins.io.checkpoint_io")


def _checkpoint_io_base() -> type:
    """Lightning's CheckpointIO: ``lightning``'s and/or ``pytorch_lightning``'s (one class that
    derives from both when both packages are installed, so that either Trainer accepts it)."""
    bases: list[type] = []
    for module in _CHECKPOINT_IO_MODULES:
        try:
            cls = importlib.import_module(module).CheckpointIO
        except ImportError:
            continue
        if cls not in bases:
            bases.append(cls)
    if not bases:
        raise ImportError("safepoint.lightning needs `lightning` or `pytorch_lightning` "
                          "(pip install pytorch-lightning)")
    if len(bases) == 1:
        return bases[0]
    return types.new_class("CheckpointIO", tuple(bases),
                           exec_body=lambda ns: ns.update(__module__=__name__))


if TYPE_CHECKING:  # the classes are found at import time; type-check against pytorch_lightning's
    from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO as _CheckpointIO
else:
    _CheckpointIO = _checkpoint_io_base()


def read_pointer(path: str | os.PathLike[str]) -> Optional[dict]:
    """The pointer file at ``path`` (symlinks followed) as a dict, or None when ``path`` is not a
    pointer file (missing, a directory, another kind of file)."""
    doc = _pointers.read_pointer(path, POINTER_FORMAT, POINTER_VERSION)
    if doc is not None and (not isinstance(doc.get("root"), str)
                            or type(doc.get("step")) is not int):
        raise CorruptionError(f"{os.fspath(path)}: a safepoint pointer without a valid root and "
                              f"step: {doc!r}")
    return doc


def _write_pointer(path: str, doc: dict, durable: bool) -> None:
    """Atomically replaces ``path`` with the pointer (temporary file + rename)."""
    d = os.path.dirname(path) or "."
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".tmp.", dir=d)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
            f.write("\n")
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)  # replaces a file or a symlink (a `last` link), never its target
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if durable:
        fsync_dir(d)


def delete_step(root: str, step: int) -> None:
    """Deletes a committed step the way safepoint's retention does (docs/format.md): its commit
    record first, durably, so the step stops existing before its images go."""
    _core.delete_step(root, step)


def _map_location(obj: Any, device: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _map_location(v, device) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_map_location(v, device) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_map_location(v, device) for v in obj)
    return obj


def _own_byte_views(obj: Any) -> Any:
    """`obj` with every small uint8 tensor that views a larger buffer (as loaded tensors do)
    copied into a tensor of its own. Such a tensor may be a generator's state (a
    ``StatefulDataLoader``'s shuffle generator, in Lightning's loop state), and torch's
    ``Generator.set_state`` misreads a view that starts past its storage's first byte ("Invalid
    mt19937 state", or a crash: torch 2.13)."""
    if isinstance(obj, torch.Tensor):
        if (type(obj) is torch.Tensor and obj.dtype == torch.uint8 and obj.numel() <= 1 << 16
                and obj.storage_offset()):
            return obj.clone()
        return obj
    # Containers are changed in place (a tuple rebuilt only where an item changed), so that
    # their types and attributes (an OrderedDict's `_metadata`, a namedtuple) stay as loaded.
    if isinstance(obj, (dict, list)):
        for k, v in (obj.items() if isinstance(obj, dict) else enumerate(obj)):
            new = _own_byte_views(v)
            if new is not v:
                obj[k] = new
        return obj
    if isinstance(obj, tuple):
        items = [_own_byte_views(v) for v in obj]
        if all(a is b for a, b in zip(items, obj)):
            return obj
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


_UNSUPPORTED_STRATEGIES = ("FSDPStrategy", "ModelParallelStrategy")


def _refuse_strategy(target: str) -> None:
    """Raises when a strategy that reads its checkpoints without the CheckpointIO (FSDP, model
    parallel) is the one saving: its resume would fail on the pointer file. The strategy is the
    ``self`` of the frame that called ``save_checkpoint`` (Lightning's ``Strategy``)."""
    frame: Optional[types.FrameType] = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            return
        owner = frame.f_locals.get("self")
        names = {c.__name__ for c in type(owner).__mro__} if owner is not None else set()
        if "Strategy" in names:
            bad = names.intersection(_UNSUPPORTED_STRATEGIES)
            if bad:
                kind = bad.pop()
                raise InvalidArgumentError(
                    f"{target}: Lightning's {kind} loads checkpoints with torch.load and "
                    "writes sharded ones with DCP, not through the CheckpointIO: use "
                    f"strategy=safepoint.lightning.Safepoint{kind}(...) (the same arguments) "
                    "with the plugin, whose ranks each save their shard through it")
            return
        frame = frame.f_back


_NO_PRUNE = 2**31 - 1  # the agent's `keep`: retention is Lightning's (pointer removal)


class SafepointCheckpointIO(_CheckpointIO):
    """Lightning ``CheckpointIO`` that stores checkpoints with safepoint (see the module doc).

    ``path``: the safepoint checkpoint directory (default: ``<dir of the first checkpoint>/
    safepoint``). ``mode``: ``"flash"`` (return after the copy into shared memory; the agent
    persists) or ``"sync"`` (durable on return). ``allow_pickle``: as for ``safepoint.save``.
    ``include_rng``: save this process's generator states and restore them on load. ``job``,
    ``shm_dir``, ``on_busy``, ``tiers``: passed to ``safepoint.Checkpointer`` (flash mode; the
    storage tiers keep their own retention, Lightning's applies to ``path``). ``commit_timeout``:
    how long a rank other than 0 waits for the step it loads to be committed (seconds).
    ``on_preemption`` (flash mode; docs/guide.md, "Preemption"): after SIGTERM, Lightning stops
    its loop at the end of the batch (its own signal handling); a ``save_checkpoint`` after the
    signal (Lightning's ``OnExceptionCheckpoint`` callback makes one) is the preemption save,
    committed before it returns. With ``"exit"`` (default) ``teardown`` then ends the process
    as the signal would have (one line on stderr) instead of Lightning's exit status 0;
    ``"return"`` leaves Lightning's.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *, mode: str = "flash",
                 allow_pickle: AllowPickle = False, include_rng: bool = True,
                 job: Optional[str] = None, shm_dir: Optional[str] = None,
                 on_busy: str = "wait", tiers: Optional[list[Any]] = None,
                 commit_timeout: float = 300.0, on_preemption: str = "exit") -> None:
        super().__init__()
        if mode not in ("flash", "sync"):
            raise InvalidArgumentError(f"mode must be 'flash' or 'sync', got {mode!r}")
        if on_preemption not in ("exit", "return"):
            raise InvalidArgumentError(
                f"on_preemption must be 'exit' or 'return', got {on_preemption!r}")
        self.on_preemption = on_preemption
        if on_busy not in ("wait", "skip"):
            raise InvalidArgumentError(f"on_busy must be 'wait' or 'skip', got {on_busy!r}")
        self._root: Optional[str] = None
        if path is not None:
            self._root = self._local_dir(path, "the safepoint checkpoint directory")
        self.mode = mode
        self.allow_pickle = allow_pickle
        self.include_rng = include_rng
        self.job, self.shm_dir, self.on_busy = job, shm_dir, on_busy
        self.tiers = tiers
        self.commit_timeout = float(commit_timeout)
        self._ckpt: Optional[safepoint.Checkpointer] = None
        self._next: Optional[int] = None        # the next safepoint step (save number)
        self._doomed: set[int] = set()          # unreferenced steps, deleted once committed
        # Who saves: rank 0 of a world of one (Lightning's DDP convention), or, under a sharded
        # strategy (SafepointFSDPStrategy, SafepointModelParallelStrategy), every rank.
        self._rank, self._world_size = 0, 1

    # -- helpers ------------------------------------------------------------------------------
    @staticmethod
    def _local_dir(path: Any, what: str) -> str:
        p = os.fspath(path)
        if not isinstance(p, str) or not p:
            raise InvalidArgumentError(f"{what} must be a non-empty path, got {path!r}")
        if "://" in p and not p.startswith("file://"):
            raise InvalidArgumentError(f"{p}: SafepointCheckpointIO writes pointer files and "
                                       "needs a local path, not a URL")
        return os.path.abspath(p[len("file://"):] if p.startswith("file://") else p)

    @property
    def path(self) -> Optional[str]:
        """The safepoint checkpoint directory (None until the first save or load decides it)."""
        return self._root

    @property
    def checkpointer(self) -> Optional[safepoint.Checkpointer]:
        """The flash ``Checkpointer`` while one is open (for ``status()``), else None."""
        return self._ckpt

    def _global_rank(self) -> int:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
        return 0

    def _checkpointer(self) -> safepoint.Checkpointer:
        if self._ckpt is None:
            assert self._root is not None
            self._ckpt = safepoint.Checkpointer(
                self._root, job=self.job, rank=self._rank, world_size=self._world_size,
                keep=_NO_PRUNE, on_busy=self.on_busy, shm_dir=self.shm_dir,
                allow_pickle=self.allow_pickle, tiers=self.tiers,
                on_preemption=self.on_preemption)
            # The preemption save returns (its pointer follows); teardown ends the process.
            self._ckpt._preemption_exit_deferred = True
        return self._ckpt

    def _take_step(self, root: str) -> int:
        if self._next is None:
            known = list(safepoint.steps(root)) if os.path.isdir(root) else []
            if self.mode == "flash":
                known += [s["step"] for s in self._checkpointer().status()["snapshots"]
                          if s.get("state") == "COMPLETE"]
            self._next = max(known, default=0) + 1
        step, self._next = self._next, self._next + 1
        return step

    def _collect(self, wait: bool = False) -> None:
        """Deletes unreferenced steps that are committed (never one the agent still writes)."""
        if not self._doomed or self._root is None:
            return
        if wait and self._ckpt is not None:
            self._ckpt.wait()
        committed = set(safepoint.steps(self._root)) if os.path.isdir(self._root) else set()
        for step in sorted(self._doomed & committed):
            delete_step(self._root, step)
            self._doomed.discard(step)
        if wait:  # everything persisted is committed: what is not there never will be
            self._doomed.clear()

    # -- CheckpointIO ---------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict, path: Any,
                        storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError("SafepointCheckpointIO.save_checkpoint takes no storage_options "
                            f"(got {storage_options!r})")
        if not isinstance(checkpoint, dict):
            raise InvalidArgumentError(
                f"a Lightning checkpoint is a dict, got {type(checkpoint).__name__}")
        target = self._local_dir(path, "the checkpoint path")
        _refuse_strategy(target)
        self._save(checkpoint, target, self._take_step(self._root_for(target)))

    def _root_for(self, target: str) -> str:
        """The safepoint directory (decided by the first save) after checking that ``target``
        can hold a pointer next to it."""
        if self._root is None:
            self._root = os.path.join(os.path.dirname(target), "safepoint")
        if target == self._root or target.startswith(self._root + os.sep):
            raise InvalidArgumentError(f"{target}: a Lightning checkpoint path cannot lie inside "
                                       f"the safepoint directory {self._root}")
        if os.path.isdir(target) and not os.path.islink(target):
            raise InvalidArgumentError(f"{target}: is a directory; a Lightning checkpoint path "
                                       "for SafepointCheckpointIO names a file (its pointer)")
        return self._root

    def _save(self, checkpoint: dict, target: str, step: int, pointer: bool = True,
              before_pointer: Any = None) -> None:
        """Saves ``checkpoint`` (this rank's part) as ``step``; with ``pointer``, then writes the
        pointer at ``target`` (after ``before_pointer()``, e.g. a barrier) and releases the step
        the pointer named before."""
        assert self._root is not None
        state = dict(checkpoint)
        if self.include_rng:
            state[RNG_KEY] = capture_rng()
        try:
            if self.mode == "flash":
                # Every save is persisted: a pointer must eventually name a step on storage.
                self._checkpointer().save(step, state, persist=True)
            else:
                safepoint.save(self._root, step, state, allow_pickle=self.allow_pickle)
        except InvalidArgumentError as e:
            if "allow_pickle" in str(e):
                raise InvalidArgumentError(
                    f"{target}: {e}. Lightning checkpoints hold hyper-parameters and callback "
                    "states; to store other objects pass SafepointCheckpointIO(allow_pickle=True) "
                    "or a list of trusted classes") from None
            raise
        if before_pointer is not None:
            before_pointer()
        if not pointer:
            return
        old = read_pointer(target) if not os.path.islink(target) else None
        doc = {"format": POINTER_FORMAT, "version": POINTER_VERSION, "root": self._root,
               "step": step, "mode": self.mode,
               "global_step": checkpoint.get("global_step"), "epoch": checkpoint.get("epoch")}
        if self._world_size > 1:
            doc["world_size"] = self._world_size  # every rank saved its shard of the step
        _write_pointer(target, doc, durable=self.mode == "sync")
        if old is not None:  # e.g. `last.ckpt` saved again: its previous step may be unnamed now
            self._release(os.path.dirname(target), old["root"], old["step"])
        self._collect()

    def load_checkpoint(self, path: Any, map_location: Optional[Any] = None,
                        weights_only: Optional[bool] = None) -> dict:
        target = os.path.abspath(os.fspath(path))
        allow = False if weights_only else self.allow_pickle
        doc = read_pointer(target)
        if doc is not None:
            root, step = doc["root"], doc["step"]
            if doc.get("world_size", 1) != 1:
                raise InvalidArgumentError(
                    f"{target}: names step {step} of {root}, saved in shards by "
                    f"{doc['world_size']} ranks (a sharded strategy); resume it with "
                    "SafepointFSDPStrategy or SafepointModelParallelStrategy (as saved) on "
                    f"{doc['world_size']} ranks, or read it with safepoint.restore, which "
                    "assembles the shards into any sharding")
        elif os.path.isdir(target) and safepoint.steps(target):
            root, step = target, None  # a safepoint directory itself: its newest step
        elif not os.path.exists(target):
            raise FileNotFoundError(f"Checkpoint file not found: {target}")
        else:
            raise InvalidArgumentError(
                f"{target}: not a safepoint checkpoint (neither a pointer file written by "
                "SafepointCheckpointIO nor a safepoint checkpoint directory); load torch "
                "checkpoints without the plugin")
        if self._root is None:
            self._root = root
        try:
            # The Checkpointer reads memory first; it unpickles as the plugin was configured,
            # so a weights_only load that must not unpickle reads storage instead.
            if (self.mode == "flash" and root == self._root and allow == self.allow_pickle
                    and self._global_rank() == 0):
                got = self._checkpointer().load(step)
                if got is None:
                    raise NotFoundError(f"{root}: nothing to load")
                _, state = got
            else:
                if self._global_rank() != 0 and step is not None:
                    self._wait_committed(root, step, target)
                _, state = safepoint.load(root, step, allow_pickle=allow)
        except NotFoundError as e:
            raise NotFoundError(f"{target}: names step {step} of {root}, which is neither in "
                                f"this node's memory nor committed on storage ({e})") from None
        if not isinstance(state, dict):
            raise CorruptionError(f"{target}: step {step} of {root} is not a Lightning checkpoint")
        rng = state.pop(RNG_KEY, None)
        if rng is not None and self.include_rng:
            restore_rng(rng)
        if isinstance(map_location, (str, torch.device)):
            state = _map_location(state, map_location)
        return _own_byte_views(state)

    # -- sharded strategies: every rank saves and loads its own shard -------------------------
    def _shard_as(self, strategy: Any, target: str) -> None:
        """Opens the plugin as ``strategy``'s rank of its world (before the first save or load)."""
        if self.mode != "flash":
            raise InvalidArgumentError(
                f"{target}: {type(strategy).__name__} saves every rank's shard with flash "
                "checkpoints, whose steps the ranks agree on; mode='sync' saves one process's "
                "state: use mode='flash' (the default)")
        rank, world = int(strategy.global_rank), int(strategy.world_size)
        if self._ckpt is not None and (self._rank, self._world_size) != (rank, world):
            raise InvalidArgumentError(
                f"{target}: this SafepointCheckpointIO already saves as rank {self._rank} of "
                f"{self._world_size}; give every Trainer its own plugin")
        self._rank, self._world_size = rank, world

    def _save_sharded(self, checkpoint: dict, path: Any, strategy: Any) -> None:
        """``strategy.save_checkpoint`` on every rank: this rank's shard as one step that all
        ranks number alike (rank 0's choice); rank 0 writes the pointer once every rank saved."""
        if not isinstance(checkpoint, dict):
            raise InvalidArgumentError(
                f"a Lightning checkpoint is a dict, got {type(checkpoint).__name__}")
        target = self._local_dir(path, "the checkpoint path")
        self._shard_as(strategy, target)
        root = self._root_for(target)
        step = strategy.broadcast(self._take_step(root))
        self._next = step + 1
        self._save(checkpoint, target, step, pointer=self._rank == 0,
                   before_pointer=strategy.barrier)

    def _load_sharded(self, path: Any, strategy: Any, weights_only: Optional[bool]) -> dict:
        """``strategy.load_checkpoint`` on every rank: this rank's shard of the step the pointer
        at ``path`` (the same on every rank) names, from this node's memory or from storage. The
        ranks load one step or fail together (the Checkpointer's agreement)."""
        target = os.path.abspath(os.fspath(path))
        doc = _pointers.require_pointer(
            target, read_pointer,
            f"not a pointer file written by SafepointCheckpointIO; {type(strategy).__name__} "
            "resumes only from those (load a DCP checkpoint with Lightning's own strategy, "
            "without the plugin)")
        self._shard_as(strategy, target)
        root, step, saved = doc["root"], doc["step"], doc.get("world_size", 1)
        if saved != self._world_size:
            how = "in shards by" if saved > 1 else "as one full state by"
            raise InvalidArgumentError(
                f"{target}: step {step} of {root} was saved {how} {saved} rank(s); this run has "
                f"{self._world_size}. A Lightning resume loads each rank's own shard: resume "
                f"with {saved} ranks, or load the step into this sharding with "
                "safepoint.restore(root, state, step), which reshards (docs/guide.md)")
        if self._root is None:
            self._root = root
        allow = False if weights_only else self.allow_pickle
        try:
            if root == self._root and allow == self.allow_pickle:
                got = self._checkpointer().load(step)  # a collective: memory, else storage
                if got is None:
                    raise NotFoundError(f"{root}: nothing to load")
                _, state = got
            else:
                _, state = safepoint.load(root, step, rank=self._rank, allow_pickle=allow)
        except NotFoundError as e:
            raise NotFoundError(f"{target}: names step {step} of {root}, which not every rank "
                                f"can load from memory or storage ({e})") from None
        if not isinstance(state, dict) or "state_dict" not in state:
            raise CorruptionError(f"{target}: step {step} of {root} is not a Lightning checkpoint")
        rng = state.pop(RNG_KEY, None)
        if rng is not None and self.include_rng:
            restore_rng(rng)
        return _own_byte_views(state)

    def _wait_committed(self, root: str, step: int, target: str) -> None:
        """Waits until `step` of `root` is committed: rank 0 may resume it from memory while the
        node agent still persists it (after a crash, its emergency flush)."""
        deadline = time.monotonic() + self.commit_timeout
        while step not in (safepoint.steps(root) if os.path.isdir(root) else []):
            if time.monotonic() > deadline:
                raise NotFoundError(f"{target}: step {step} of {root} was not committed within "
                                    f"{self.commit_timeout:g} s (commit_timeout); this rank "
                                    "reads it from storage")
            time.sleep(0.05)

    def remove_checkpoint(self, path: Any) -> None:
        target = os.path.abspath(os.fspath(path))
        if os.path.islink(target):  # save_last="link": the link goes, never what it names
            os.unlink(target)
            return
        doc = read_pointer(target)
        if doc is None:  # not ours: behave like TorchCheckpointIO
            if os.path.isdir(target):
                shutil.rmtree(target)
            elif os.path.exists(target):
                os.unlink(target)
            return
        os.unlink(target)
        self._release(os.path.dirname(target), doc["root"], doc["step"])
        self._collect()

    def _release(self, folder: str, root: str, step: int) -> None:
        """Marks ``step`` for deletion unless a pointer in ``folder`` still names it."""
        if root != self._root:
            return  # another directory's step: its own writer manages it
        for name in os.listdir(folder):
            other = read_pointer(os.path.join(folder, name))
            if other is not None and other["root"] == root and other["step"] == step:
                return  # still named by another checkpoint
        self._doomed.add(step)

    def teardown(self) -> None:
        """Waits until every save is committed, deletes removed steps, closes the Checkpointer
        (its snapshots leave shared memory: the run is over). A later load reopens it."""
        try:
            self._collect(wait=True)
            if self._ckpt is not None:  # after a preemption signal ("exit"): the process ends
                self._ckpt._exit_after_preemption("Lightning stopped")
        finally:
            if self._ckpt is not None:
                ckpt, self._ckpt = self._ckpt, None
                ckpt.close()
            self._next = None


# -- sharded strategies ---------------------------------------------------------------------------

def _load_into_model_and_optimizers(strategy: Any, state: dict) -> None:
    """Copies this rank's loaded shards into the strategy's sharded model and optimizers, through
    DCP's state-dict API (the DTensors of FSDP1 with a device mesh, and of FSDP2/TP)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    module = strategy.lightning_module
    strict = bool(getattr(module, "strict_loading", True))
    options = StateDictOptions(full_state_dict=False, strict=strict)
    model = strategy.model
    current = get_model_state_dict(model, options=options)
    loaded = state["state_dict"]
    if not strict:
        current = {k: v for k, v in current.items() if k in loaded}
    restore_into(current, loaded, "state_dict")
    set_model_state_dict(model, current, options=options)
    saved = state.get("optimizer_states")
    fitting = str(getattr(module.trainer.state.fn, "value", "")) == "fit"
    if saved is None or not fitting or not strategy.optimizers:
        return
    if len(saved) != len(strategy.optimizers):
        raise InvalidArgumentError(
            f"the run has {len(strategy.optimizers)} optimizers, the checkpoint {len(saved)}")
    for i, (opt, osd) in enumerate(zip(strategy.optimizers, saved)):
        inner = getattr(opt, "_optimizer", opt)  # LightningOptimizer
        # Its state is created first (DCP's zero-gradient step with lr 0), then overwritten.
        target = get_optimizer_state_dict(model, inner, options=options)
        restore_into(target, osd, f"optimizer_states.{i}")
        set_optimizer_state_dict(model, inner, target, options=options)


def _sharded_options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=False)


class _ShardedSaves:
    """What SafepointFSDPStrategy and SafepointModelParallelStrategy add to Lightning's
    strategies: checkpoints through the SafepointCheckpointIO on every rank."""

    checkpoint_io: Any
    broadcast: Any

    def _safepoint_io(self) -> SafepointCheckpointIO:
        io = self.checkpoint_io
        if not isinstance(io, SafepointCheckpointIO):
            raise InvalidArgumentError(
                f"{type(self).__name__} checkpoints through SafepointCheckpointIO, got "
                f"{type(io).__name__}: pass Trainer(strategy={type(self).__name__}(...), "
                "plugins=[SafepointCheckpointIO(dir)]), or use Lightning's own strategy")
        return io

    def save_checkpoint(self, checkpoint: dict, filepath: Any,
                        storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options")
        self._safepoint_io()._save_sharded(checkpoint, self.broadcast(filepath), self)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict:
        state = self._safepoint_io()._load_sharded(self.broadcast(checkpoint_path), self,
                                                   weights_only)
        _load_into_model_and_optimizers(self, state)
        return state  # the rest (loops, callbacks, schedulers) Lightning restores itself


def _strategies_module() -> Any:
    for name in ("pytorch_lightning.strategies", "lightning.pytorch.strategies"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError("the sharded strategies need pytorch_lightning or lightning "
                      "(pip install pytorch-lightning)")


def _make_fsdp_strategy() -> type:
    base = _strategies_module().FSDPStrategy

    class SafepointFSDPStrategy(_ShardedSaves, base):  # type: ignore[misc, valid-type]
        """Lightning's ``FSDPStrategy`` (FSDP1) whose checkpoints every rank saves through
        ``SafepointCheckpointIO`` (its shard, a flash save) and loads from memory or storage.
        Takes FSDPStrategy's arguments; the state dicts are always sharded (DTensors: without
        a ``device_mesh``, a 1-D mesh over the ranks is given to FSDP)."""

        def __init__(self, *args: Any, state_dict_type: str = "sharded", **kwargs: Any) -> None:
            if state_dict_type != "sharded":
                raise InvalidArgumentError(
                    f"SafepointFSDPStrategy saves every rank's shard (state_dict_type="
                    f"'sharded'), got state_dict_type={state_dict_type!r}; a full state dict "
                    "(e.g. for export) is read from the saved shards with safepoint.load or "
                    "safepoint.restore into an unsharded model")
            super().__init__(*args, state_dict_type="sharded", **kwargs)

        def setup_environment(self) -> None:
            super().setup_environment()
            if "device_mesh" in self.kwargs:
                return
            hybrid = "HYBRID" in str(getattr(self.sharding_strategy, "name", ""))
            if hybrid:
                raise InvalidArgumentError(
                    f"SafepointFSDPStrategy with {self.sharding_strategy.name} needs "
                    "device_mesh=(nodes, devices per node): the shards are saved as DTensors")
            from torch.distributed.device_mesh import init_device_mesh

            # FSDP1 with a device mesh gives DTensor state dicts (ShardedTensors without one).
            self.kwargs["device_mesh"] = init_device_mesh(self.root_device.type,
                                                          (self.world_size,))

        def lightning_module_state_dict(self) -> dict:
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            return get_model_state_dict(self.model, options=_sharded_options())

        def optimizer_state(self, optimizer: Any) -> dict:
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            inner = getattr(optimizer, "_optimizer", optimizer)
            return get_optimizer_state_dict(self.model, inner, options=_sharded_options())

    SafepointFSDPStrategy.__module__ = __name__
    return SafepointFSDPStrategy


def _make_model_parallel_strategy() -> type:
    base = _strategies_module().ModelParallelStrategy

    class SafepointModelParallelStrategy(_ShardedSaves, base):  # type: ignore[misc, valid-type]
        """Lightning's ``ModelParallelStrategy`` (FSDP2 ``fully_shard`` / tensor parallel in
        ``configure_model``) whose checkpoints every rank saves through
        ``SafepointCheckpointIO`` (its DTensor shards, a flash save) and loads from memory or
        storage. Takes ModelParallelStrategy's arguments."""

        def __init__(self, *args: Any, save_distributed_checkpoint: bool = True,
                     **kwargs: Any) -> None:
            if not save_distributed_checkpoint:
                raise InvalidArgumentError(
                    "SafepointModelParallelStrategy saves every rank's shard "
                    "(save_distributed_checkpoint=True); a full state dict (e.g. for export) is "
                    "read from the saved shards with safepoint.load or safepoint.restore into "
                    "an unsharded model")
            super().__init__(*args, save_distributed_checkpoint=True, **kwargs)

        def teardown(self) -> None:
            try:
                super().teardown()
            finally:  # ModelParallelStrategy's teardown leaves the CheckpointIO open
                self.checkpoint_io.teardown()

    SafepointModelParallelStrategy.__module__ = __name__
    return SafepointModelParallelStrategy


_FACTORIES = {"SafepointFSDPStrategy": _make_fsdp_strategy,
              "SafepointModelParallelStrategy": _make_model_parallel_strategy}
_MADE: dict[str, type] = {}


def __getattr__(name: str) -> Any:
    """The strategies are made on first use: they derive from Lightning's own classes, whose
    import (``pytorch_lightning.strategies``) is heavy and not needed by the plugin alone."""
    if name not in _FACTORIES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _MADE:
        _MADE[name] = _FACTORIES[name]()
    return _MADE[name]
