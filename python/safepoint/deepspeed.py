"""A DeepSpeed ``CheckpointEngine`` that saves through safepoint.

    import deepspeed
    from safepoint.deepspeed import SafepointCheckpointEngine

    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    engine.checkpoint_engine = SafepointCheckpointEngine("/ckpt/run1/safepoint")
    engine.load_checkpoint("/ckpt/run1")           # after a restart: from memory when it is there
    ...
    engine.save_checkpoint("/ckpt/run1")           # returns once the state is in shared memory

DeepSpeed has no configuration key that names a checkpoint engine class (its ``checkpoint``
section chooses between its own engines), so the engine is set on the ``DeepSpeedEngine``
after ``deepspeed.initialize``, on every rank, before the first ``save_checkpoint`` or
``load_checkpoint``.

Where things go. DeepSpeed writes one checkpoint as several files per tag (``global_step100/
mp_rank_00_model_states.pt`` on data-parallel rank 0, ``zero_pp_rank_R_mp_rank_00_optim_
states.pt`` per ZeRO rank, ...), then a ``latest`` file naming the tag. This engine collects
the files a rank writes (``save``) and, at ``commit``, stores them as that rank's shard of one
safepoint step (the tag's save number, the same on every rank) in the safepoint directory
(``path``; default ``<save_dir>/safepoint``). At each file's path it writes a small JSON
*pointer* (the directory, step, rank and file name), so DeepSpeed's own file checks, ``latest``
and tag directories keep working; ``load`` reads the pointer and returns the file's state dict.

Flash or synchronous (``mode``):

- ``"flash"`` (default): ``safepoint.Checkpointer``; ``save_checkpoint`` returns once each
  rank's files are copied into host shared memory and the node agent persists them (every save
  is persisted) and commits the step when every rank's shard is on storage. A restarted process
  loads its own rank's files from this node's memory (hot reload); files another rank wrote
  (the model states, written by data-parallel rank 0 only) are read from storage, once the
  agent has committed the step (``load_timeout`` seconds are waited for that).
- ``"sync"``: ``safepoint.save``; every rank's shard is durable when ``commit`` returns.

The first ``load`` of a step on each rank is a collective (the ranks agree on where to read
it); DeepSpeed's ``load_checkpoint`` loads the model states on every rank first, so every rank
makes it. Non-tensor values DeepSpeed stores (``torch.Size`` parameter shapes, the config, the
client state) go through safepoint's encoding; the few classes of DeepSpeed's own states it
has no encoding for (``torch.Size``, the loss scaler, the ZeRO stage enum: ``DEFAULT_TRUSTED``)
are pickled and loaded with safepoint's restricted unpickler, which resolves only those; pass
``allow_pickle=DEFAULT_TRUSTED + [...]`` (or ``True``) for a ``client_state`` holding other
objects.

Retention: the agent keeps the newest ``keep`` committed steps (flash mode), and each save
(and ``close``) removes the pointers, then the tag directories they leave empty, of the steps
retention deleted (those committed neither in the directory nor on a tier, and older than the
newest committed one; never the tag ``latest`` names). Loading a tag whose step is gone raises
``NotFoundError`` naming the tag and the tags that can be loaded. DeepSpeed's universal
checkpoints, NVMe offload copies and the decoupled/fast writer engines are not covered. Tested
with DeepSpeed 0.19.8 on its CPU accelerator (ZeRO stages 0 and 1, 1 and 2 ranks).

Closing: ``engine.checkpoint_engine.close()`` at the end of training waits until every save is
committed and frees the snapshots' shared memory. An engine still open when the interpreter
exits is closed then (``atexit``), or, when the program ends by an uncaught exception (a crash,
not the end of the job), left like a dying process's: the agent persists what is not on
storage and keeps the snapshots for a restarted process.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import sys
import time
import weakref
from typing import Any, Optional

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (
    CheckpointCommitInfo,
    CheckpointEngine,
)

import safepoint
from safepoint import _pointers
from safepoint._pickle import AllowPickle
from safepoint._tiers import normalize_tiers
from safepoint.errors import CorruptionError, Error, InvalidArgumentError, NotFoundError

POINTER_FORMAT = "safepoint-deepspeed-file"
POINTER_VERSION = 1
ENGINE_NAME = "SafepointCheckpointEngine"
# The classes DeepSpeed's own checkpoints hold besides tensors and plain values (pickled, loaded
# by safepoint's restricted unpickler).
DEFAULT_TRUSTED = ["torch.Size", "argparse.Namespace", "torch.float16", "torch.bfloat16",
                   "torch.float32", "deepspeed.runtime.fp16.loss_scaler.LossScaler",
                   "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
                   "deepspeed.runtime.zero.config.ZeroStageEnum",
                   "deepspeed.utils.tensor_fragment.fragment_address"]


def _dist() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def read_pointer(path: str | os.PathLike[str]) -> Optional[dict]:
    """The pointer at ``path`` as a dict, or None when ``path`` is not one."""
    return _pointers.read_pointer(path, POINTER_FORMAT, POINTER_VERSION)


def _write_pointer(path: str, doc: dict, durable: bool) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f, sort_keys=True)
        f.write("\n")
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def _tag_of(path: str, doc: dict) -> str:
    """The DeepSpeed tag a pointer belongs to (pointers before the tag was recorded: the name of
    the directory it lies in)."""
    tag = doc.get("tag")
    return str(tag) if tag is not None else os.path.basename(os.path.dirname(path))


def _close_at_exit(ref: weakref.ref, ckpt: safepoint.Checkpointer) -> None:
    """The engine's Checkpointer, still open at interpreter exit (the engine may be gone: the
    hook keeps the Checkpointer alive until now): closed, or abandoned when the program ended
    by an uncaught exception (a crash, not the end of the job: the agent persists what is not
    on storage and keeps the snapshots for a restarted process's hot reload)."""
    engine: Optional[SafepointCheckpointEngine] = ref()
    if engine is not None and engine._ckpt is not ckpt:
        engine = None  # it closed this one and opened another (which has its own hook)
    crashed = getattr(sys, "last_value", None) is not None
    if engine is None:
        if crashed:
            ckpt.abandon()
        else:
            ckpt.close()
        return
    engine._at_exit = None  # being run: nothing to unregister
    if crashed:
        engine._ckpt = None
        ckpt.abandon()
    else:
        engine.close()  # also removes the pointers of the steps retention deleted


def _to_device(obj: Any, device: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return type(obj)((k, _to_device(v, device)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_to_device(v, device) for v in obj)
    return obj


class SafepointCheckpointEngine(CheckpointEngine):
    """DeepSpeed ``CheckpointEngine`` storing each save as one safepoint step (module doc).

    ``path``: the safepoint directory (default ``<save_dir>/safepoint``). ``mode``: ``"flash"``
    or ``"sync"``. ``keep``, ``job``, ``shm_dir``, ``on_busy``, ``tiers``: as for
    ``safepoint.Checkpointer``. ``allow_pickle``: as for ``safepoint.save`` (default: the
    classes of ``DEFAULT_TRUSTED``). ``load_timeout``: seconds a load of another rank's file
    waits for its step to be committed.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *, mode: str = "flash",
                 keep: int = 3, job: Optional[str] = None, shm_dir: Optional[str] = None,
                 on_busy: str = "wait", tiers: Optional[list[Any]] = None,
                 allow_pickle: Optional[AllowPickle] = None,
                 load_timeout: float = 120.0, on_preemption: str = "exit") -> None:
        super().__init__(None)
        self.name = ENGINE_NAME
        if mode not in ("flash", "sync"):
            raise InvalidArgumentError(f"mode must be 'flash' or 'sync', got {mode!r}")
        if on_preemption not in ("exit", "return"):
            raise InvalidArgumentError(
                f"on_preemption must be 'exit' or 'return', got {on_preemption!r}")
        self.on_preemption = on_preemption
        self.root = os.path.abspath(os.fspath(path)) if path is not None else None
        self.mode, self.keep, self.job, self.shm_dir = mode, keep, job, shm_dir
        self.on_busy, self.tiers, self.load_timeout = on_busy, tiers, load_timeout
        self.allow_pickle: AllowPickle = (list(DEFAULT_TRUSTED) if allow_pickle is None
                                          else allow_pickle)
        self._ckpt: Optional[safepoint.Checkpointer] = None
        self._save_dir: Optional[str] = None
        self._step: Optional[int] = None
        self._files: dict[str, Any] = {}               # this save's files: name -> state dict
        self._shards: dict[tuple[str, int, int], Any] = {}  # (root, step, rank) -> loaded shard
        self._at_exit: Optional[Any] = None  # the atexit hook while a Checkpointer is open

    # -- helpers ------------------------------------------------------------------------------
    @property
    def checkpointer(self) -> Optional[safepoint.Checkpointer]:
        """The flash ``Checkpointer`` while one is open (for ``status()``), else None."""
        return self._ckpt

    def _checkpointer(self) -> safepoint.Checkpointer:
        if self._ckpt is None:
            assert self.root is not None
            rank, world = _dist()
            self._ckpt = safepoint.Checkpointer(
                self.root, job=self.job, rank=rank, world_size=world, keep=self.keep,
                on_busy=self.on_busy, shm_dir=self.shm_dir, allow_pickle=self.allow_pickle,
                tiers=self.tiers, on_preemption=self.on_preemption)
            # The preemption save returns: commit writes the pointers, then ends the process.
            self._ckpt._preemption_exit_deferred = True
            # Closed at exit if the script does not close it (an engine dropped without close()
            # included: the hook holds the Checkpointer, not the engine).
            self._at_exit = functools.partial(_close_at_exit, weakref.ref(self), self._ckpt)
            atexit.register(self._at_exit)
        return self._ckpt

    def _next_step(self) -> int:
        """One more than any step this directory holds (storage or this node's memory), the
        same on every rank (the maximum over the ranks)."""
        assert self.root is not None
        known = list(safepoint.steps(self.root)) if os.path.isdir(self.root) else []
        if self.mode == "flash":
            known += [s["step"] for s in self._checkpointer().status()["snapshots"]
                      if s.get("state") == "COMPLETE"]
        step = max(known, default=0) + 1
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            t = torch.tensor([step], dtype=torch.int64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            step = int(t.item())
        return step

    def _name(self, path: str) -> str:
        assert self._save_dir is not None
        full = os.path.abspath(os.fspath(path))
        if not full.startswith(self._save_dir + os.sep):
            raise InvalidArgumentError(f"{full}: not inside the checkpoint directory "
                                       f"{self._save_dir} of this save")
        return os.path.relpath(full, self._save_dir)

    # -- CheckpointEngine ---------------------------------------------------------------------
    def create(self, info: CheckpointCommitInfo) -> None:
        """Starts the save of ``info.tag``: every rank calls it (a collective: the ranks agree
        on the step number)."""
        self._save_dir = os.path.abspath(info.save_dir)
        if self.root is None:
            self.root = os.path.join(self._save_dir, "safepoint")
        self._files = {}
        self._shards.clear()  # a save means training moved on: loaded shards are stale
        self._step = self._next_step()

    def preserves_storage_sharing(self) -> bool:
        # DeepSpeed clones tensors before torch.save; the copy into shared memory (or the
        # image) copies them anyway.
        return False

    def save(self, state_dict: Any, path: str) -> None:
        """Keeps ``state_dict`` for ``commit`` (nothing is copied yet)."""
        if self._step is None:
            raise InvalidArgumentError(f"{path}: save without create (DeepSpeed's save_checkpoint "
                                       "calls create first)")
        self._files[self._name(path)] = state_dict

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Stores this rank's files as its shard of the step (flash: into shared memory, the
        agent persists; sync: durable), then writes their pointers. Every rank calls it."""
        if self._step is None:
            raise InvalidArgumentError(f"commit of {info.tag!r} without create")
        assert self.root is not None and self._save_dir is not None
        rank, world = _dist()
        step, files = self._step, self._files
        if self.mode == "flash":
            self._checkpointer().save(step, files, persist=True)
        else:
            safepoint.save(self.root, step, files, rank=rank, world_size=world,
                           allow_pickle=self.allow_pickle)
        for name in files:
            doc = {"format": POINTER_FORMAT, "version": POINTER_VERSION, "root": self.root,
                   "step": step, "rank": rank, "file": name, "tag": info.tag}
            _write_pointer(os.path.join(self._save_dir, name), doc, self.mode == "sync")
        self._files, self._step = {}, None
        self._prune_pointers(self._save_dir)
        if self._ckpt is not None and self._ckpt.preempted:
            self._end_preempted(info)  # on_preemption="exit": the process ends here
        return True

    def preemption_pending(self) -> bool:
        """Whether a preemption signal came and its save is still to come (flash mode; a
        collective with several ranks, like ``save_checkpoint``): for a loop that saves now
        and then, ``if step % 100 == 0 or engine.checkpoint_engine.preemption_pending():
        engine.save_checkpoint(...)``. False before the first save or load (no handler yet)."""
        return self._ckpt is not None and self._ckpt.preemption_pending()

    def _end_preempted(self, info: CheckpointCommitInfo) -> None:
        """After the preemption save's pointers: with ``on_preemption="exit"``, writes
        ``latest`` as DeepSpeed would next (global rank 0), then ends the process as the signal
        would have (the Checkpointer says so on stderr). Returns with ``"return"``."""
        assert self._ckpt is not None and self._save_dir is not None
        if self.on_preemption != "exit" or self._ckpt._notice_signal() is None:
            return
        if info.save_latest and _dist()[0] == 0:
            with open(os.path.join(self._save_dir, "latest"), "w") as f:
                f.write(str(info.tag))
        self._ckpt._exit_after_preemption(f"tag {info.tag!r} is DeepSpeed's latest")

    # -- retention of the pointers ------------------------------------------------------------
    def _held_steps(self, root: str) -> set[int]:
        """The steps committed in ``root`` or on one of this engine's tiers."""
        held = set(safepoint.steps(root)) if os.path.isdir(root) else set()
        if root == self.root:
            for tier in normalize_tiers(root, self.tiers):
                held.update(safepoint.steps(tier.uri))
        return held

    def _loadable_tags(self, save_dir: str, root: str) -> list[str]:
        """The tags in ``save_dir`` whose pointers name a step ``root`` (or a tier) holds."""
        try:
            held = self._held_steps(root)
            entries = sorted(os.scandir(save_dir), key=lambda e: e.name)
        except (Error, OSError):
            return []
        tags = []
        for entry in entries:
            if not entry.is_dir(follow_symlinks=False):
                continue
            for name in sorted(os.listdir(entry.path)):
                try:
                    doc = read_pointer(os.path.join(entry.path, name))
                except Error:
                    doc = None
                if doc is not None:
                    if doc.get("root") == root and doc.get("step") in held:
                        tags.append(entry.name)
                    break  # one pointer tells the tag's step
        return tags

    def _prune_pointers(self, save_dir: str) -> None:
        """Removes the pointers in ``save_dir``'s tag directories whose steps retention deleted
        (committed neither in the safepoint directory nor on a tier, and older than the newest
        committed step: a step still being persisted is newer), then the directories that
        leaves empty. The tag ``latest`` names is left alone. Every rank may run it (a file
        another rank removed first is skipped). A failure (a tier that cannot be listed) leaves
        everything for the next save: the save stands."""
        root = self.root
        if root is None:
            return
        try:
            held = self._held_steps(root)
            if not held:
                return
            newest = max(held)
            try:
                with open(os.path.join(save_dir, "latest")) as f:
                    latest: Optional[str] = f.read().strip()
            except OSError:
                latest = None
            for entry in list(os.scandir(save_dir)):
                if entry.name == latest or not entry.is_dir(follow_symlinks=False):
                    continue
                emptied = False
                for folder, _, names in os.walk(entry.path):
                    for name in names:
                        path = os.path.join(folder, name)
                        try:
                            doc = read_pointer(path)
                        except Error:
                            continue  # another version's pointer: not ours to judge
                        if doc is None or doc.get("root") != root:
                            continue
                        step = doc.get("step")
                        if type(step) is not int or step in held or step >= newest:
                            continue
                        try:
                            os.unlink(path)
                        except FileNotFoundError:
                            pass
                        emptied = True
                if emptied:
                    for folder, _, _ in sorted(os.walk(entry.path), reverse=True):
                        try:
                            os.rmdir(folder)  # only when empty: other files stay
                        except OSError:
                            pass
        except (Error, OSError):
            return

    def load(self, path: str, map_location: Any = None) -> Any:
        """The state dict saved at ``path`` (read through its pointer)."""
        doc = _pointers.require_pointer(
            path, read_pointer,
            "not written by SafepointCheckpointEngine (no safepoint pointer); load torch "
            "checkpoints with DeepSpeed's TorchCheckpointEngine")
        root, step, writer, name = doc["root"], doc["step"], doc["rank"], doc["file"]
        tag = _tag_of(path, doc)
        if self.root is None:
            self.root = root
        rank, _ = _dist()
        key = (root, step, writer)
        try:
            if (root, step, rank) not in self._shards:
                # The first load of a step on this rank: every rank makes it (collective).
                self._shards = {(root, step, rank): self._own_shard(root, step, rank)}
            if key not in self._shards:
                self._shards[key] = self._committed_shard(path, root, step, writer)
        except NotFoundError as e:
            save_dir = os.path.dirname(os.path.dirname(os.path.abspath(path)))
            tags = self._loadable_tags(save_dir, root)
            raise NotFoundError(
                f"{path}: tag {tag!r} cannot be loaded: {e}. Retention keeps the newest "
                f"{self.keep} saves; the tags of {save_dir} that can be loaded: "
                f"{', '.join(tags) if tags else 'none'}") from None
        shard = self._shards[key]
        if not isinstance(shard, dict) or name not in shard:
            raise CorruptionError(f"{path}: tag {tag!r} (safepoint step {step} of {root}, rank "
                                  f"{writer}) has no file {name!r}")
        state = shard[name]
        if isinstance(map_location, (str, torch.device)):
            state = _to_device(state, map_location)
        return state

    def _own_shard(self, root: str, step: int, rank: int) -> Any:
        if self.mode == "flash" and root == self.root:
            got = self._checkpointer().load(step)
            if got is None:
                raise NotFoundError(f"its safepoint step {step} of {root} is neither in this "
                                    "node's memory nor committed on storage")
            return got[1]
        return safepoint.load(root, step, rank=rank, allow_pickle=self.allow_pickle)[1]

    def _committed_shard(self, path: str, root: str, step: int, writer: int) -> Any:
        """Another rank's shard, from storage once the step is committed."""
        deadline = time.monotonic() + self.load_timeout
        while True:
            committed = safepoint.steps(root) if os.path.isdir(root) else []
            if step in committed:
                break
            if committed and step < committed[-1]:  # a newer step is committed: this one went
                raise NotFoundError(f"rank {writer} wrote it into safepoint step {step} of "
                                    f"{root}, which retention deleted")
            if time.monotonic() > deadline:
                raise NotFoundError(
                    f"rank {writer} wrote it into safepoint step {step} of {root}, which is "
                    f"not committed after {self.load_timeout:.0f} s (the agent of rank "
                    f"{writer}'s node did not persist it)")
            time.sleep(0.05)
        return safepoint.load(root, step, rank=writer, allow_pickle=self.allow_pickle)[1]

    # -- lifetime -----------------------------------------------------------------------------
    def wait(self, timeout: Optional[float] = None) -> None:
        """Blocks until every save of this rank so far is committed (flash mode)."""
        if self._ckpt is not None:
            self._ckpt.wait(timeout)

    def close(self) -> None:
        """Waits for the saves, then closes the Checkpointer (the snapshots leave memory) and
        removes the pointers of the steps retention deleted meanwhile. Call it at the end of
        training (else it runs at interpreter exit)."""
        self._shards.clear()
        if self._at_exit is not None:
            atexit.unregister(self._at_exit)
            self._at_exit = None
        if self._ckpt is not None:
            ckpt, self._ckpt = self._ckpt, None
            ckpt.close()
            if self._save_dir is not None:
                self._prune_pointers(self._save_dir)

    def cleanup(self) -> None:
        self.close()
