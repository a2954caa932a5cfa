"""Megatron-Core's ``dist_checkpointing`` in safepoint's format.

    from megatron.core import dist_checkpointing
    import safepoint.megatron                     # registers the backend "safepoint"

    dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir,
                            sharded_strategy=("safepoint", 1))                 # sync
    req = dist_checkpointing.save(sd, ckpt_dir, sharded_strategy=("safepoint", 1),
                                  async_sharded_save=True)                     # async
    dist_checkpointing.save(sd, ckpt_dir, sharded_strategy=("safepoint_flash", 1))  # flash
    state = dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir)     # any of them

``SafepointSaveStrategy`` is a Megatron ``AsyncSaveShardedStrategy`` and
``SafepointLoadStrategy`` a ``LoadShardedStrategy``; importing this module registers both with
Megatron's own registry (``strategies.base.register_default_strategy``) under the backend
``"safepoint"`` (version 1), and the flash save strategy under ``"safepoint_flash"``. Megatron
writes the backend's name into the checkpoint's ``metadata.json``, so ``dist_checkpointing.load``
picks ``SafepointLoadStrategy`` by itself. Tested with megatron-core 0.16.1.

Why on top of Megatron's ``torch_dist`` machinery. Megatron's ``torch_dist`` strategy is DCP
underneath: it turns Megatron's ``ShardedTensor``s (after the factories are applied and
replicas dropped: ``_replace_state_dict_keys_with_sharded_keys``, ``mcore_to_pyt_state_dict``)
into DCP-checkpointable tensors and ``ShardedObject``s into byte items, plans with its
``MCoreSavePlanner``, and loads with ``MCoreLoadPlanner`` (global-shape checks,
``allow_shape_mismatch``). All of that is format-independent, and resharding (another TP, PP or
DP layout) is DCP's planner reading the overlaps of the saved chunks. safepoint already has a
DCP storage layer (``safepoint.dcp.Writer``/``Reader``: one image per rank, CRC per 4 MiB chunk,
a commit record once every rank's image is durable, reads of only the byte ranges a rank needs).
So these strategies reuse Megatron's translation and planners unchanged and swap only the
storage: ``safepoint.dcp.Writer``'s image instead of ``FileSystemWriterAsync``'s ``.distcp``
files, ``safepoint.dcp.Reader`` instead of ``FileSystemReader``. What is not reused is Megatron's
``save_state_dict_async_finalize`` (it gathers every rank's write results and broadcasts a flag
on ``torch.cuda.current_device()``): a safepoint step needs neither a metadata file (the
Reader rebuilds DCP's metadata from the images) nor the gather (the step is committed when
every image is there), so the finalize here only checks the commit: rank 0 looks at storage
and every rank gets its verdict (success, or its error raised on every rank), so ranks never
part ways on what one of them saw; loads likewise.

Layout. Megatron's checkpoint directory (``ckpt_dir``, e.g. ``<save>/iter_0000100``) keeps
``metadata.json`` and ``common.pt`` (Megatron's common strategy: the non-sharded values,
``torch.save`` by rank 0, as with ``torch_dist``), and gets ``safepoint.json``, a pointer naming
the safepoint directory (``root``; default ``<parent of ckpt_dir>/safepoint``), the step that
holds this checkpoint's tensors and ``ShardedObject``s and the save attempt that commits it (a
load checks it). Each save takes the next free step of ``root``: past every step committed there
(the coordinator lists storage), holding an image of an unfinished save, or taken by any save
strategy of any rank's process and not yet seen committed (an async request still writing, a
flash snapshot in the agent's memory: each rank reports those in its local plan), so saves in
flight at once, sync, async and flash ones to one ``root``, never share a step; the finalize
checks that the step was committed by this save's attempt. A process's non-flash writes to one
``root`` commit in step order: each waits for the write planned before it and for the older
flash steps to be committed (at most ``commit_timeout`` each), since safepoint's core, after a
commit, cleans up the uncommitted images of older steps. ``safepoint ls/inspect/verify ROOT``
work on it.

Modes:

- sync: ``save`` returns once every rank's image is durable and the step committed.
- async: ``save(..., async_sharded_save=True)`` returns Megatron's ``AsyncRequest``: its
  ``preload_fn`` copies this rank's tensors to host memory (device tensors copied, host tensors
  cloned: training may mutate them once it returns) and writes the image on a thread of the
  process that called it (the core releases the GIL); its ``async_fn``, which Megatron's
  ``TemporalAsyncCaller`` runs in a forked process, only waits for that thread's result (a small
  file, at most ``commit_timeout`` seconds): safepoint's core never runs in a forked process,
  whose copy of the parent's core state (a connected cluster's threads, locks) is not usable.
  The finalize reports the thread's error on every rank, then rank 0 writes the pointer (and
  Megatron ``metadata.json``). Under Megatron's ``PersistentAsyncCaller`` (a spawned worker)
  ``preload_fn`` and ``async_fn`` both run in the worker, which writes; the finalize reads the
  same result file (untested: its worker needs CUDA in 0.16.1).
- flash (``SafepointSaveStrategy(flash=True)``, registered as ``"safepoint_flash"``): the state
  is copied into host shared memory by a ``safepoint.Checkpointer`` and ``save`` returns; the
  node agent persists it and commits the step once every rank's image is on storage (a process
  that dies after the copy loses nothing: the agent persists its snapshot). The pointer is
  written at once, so a sync flash checkpoint is durable only once the agent committed its step
  (``wait()``); Megatron-LM writes ``latest_checkpointed_iteration.txt`` right after a sync save,
  so use flash with ``--async-save``. ``async_sharded_save=True`` with flash: the copy happens in
  the call, and the request's ``preload_fn`` starts a thread that waits until the agent committed
  the step (as this save's attempt), so Megatron's finalize (``metadata.json``, Megatron-LM's
  ``latest_checkpointed_iteration.txt``) runs only once the checkpoint is durable. With a small
  ``keep``, a step the agent committed and already deleted for newer ones by then finalizes with
  a warning (that checkpoint does not load, as any pruned one). Loading a flash checkpoint waits
  (``load_timeout``) for its step to be committed; it reads storage, not the agent's memory (no
  hot reload here).
  ``close()`` (or the interpreter's exit) waits for every flash save and frees the memory.

Megatron's ``FullyParallelSaveStrategyWrapper`` (what Megatron-LM's ``--ckpt-fully-parallel-save``
puts around the save strategy) wraps ``SafepointSaveStrategy`` as it does ``torch_dist``'s: it
spreads the saves of replicated shards over the ranks, and these strategies write what it
marks as main replicas (tested). Its load counterpart exchanges the loaded tensors on CUDA
devices (``exchange_utils``), which the CPU tests cannot run.

Retention: ``keep=K`` deletes committed steps older than the newest K of ``root`` (sync/async:
rank 0 after a save, as ``safepoint.dcp.Writer``; flash: the agent's retention, default 3);
their Megatron directories then fail to load with ``NotFoundError`` naming the step. Megatron's
``remove_sharded_tensors`` is not supported.

On a CPU-only torch (the tests): Megatron 0.16.1's ``AsyncCallsQueue`` and
``TemporalAsyncCaller`` call ``torch.cuda.synchronize()`` and put their flags on
``torch.cuda.current_device()``, and so does ``torch_dist``'s own save finalize; these strategies
do not, but scheduling an async request through Megatron's queue needs those two calls to work
(the tests and bench/megatron.py make them CPU no-ops there). Megatron's ``GPTModel`` builds on
the CPU (``use_cpu_initialization=True``, the local layer spec) and its ``sharded_state_dict()``
works; its forward does not (``DotProductAttention`` takes a buffer from
``GlobalMemoryBuffer.get_tensor``, allocated on ``torch.cuda.current_device()``), nor does the
``DistributedOptimizer`` (its ``DistributedDataParallel`` grad buffers are allocated on
``torch.cuda.current_device()``), so its state is tested in the format its
``sharded_state_dict`` produces (``fully_reshardable`` and ``dp_reshardable``).
"""

from megatron.core.dist_checkpointing.strategies.base import (
    StrategyAction,
    register_default_strategy,
)

from safepoint.megatron._load import SafepointLoadStrategy
from safepoint.megatron._save import SafepointSaveStrategy
from safepoint.megatron._storage import (
    BACKEND,
    FLASH_BACKEND,
    POINTER,
    VERSION,
    _steps,  # noqa: F401  (the tests use it)
    read_pointer,
)

_FLASH = SafepointSaveStrategy(flash=True)


def register() -> None:
    """Registers the strategies with Megatron (done on import): save ``("safepoint", 1)``
    (sync and async) and ``("safepoint_flash", 1)`` (flash, this process's one instance:
    ``close()`` it); load ``("safepoint", 1)``, which ``metadata.json`` names."""
    register_default_strategy(StrategyAction.SAVE_SHARDED, BACKEND, VERSION,
                              SafepointSaveStrategy())
    register_default_strategy(StrategyAction.SAVE_SHARDED, FLASH_BACKEND, VERSION, _FLASH)
    register_default_strategy(StrategyAction.LOAD_SHARDED, BACKEND, VERSION,
                              SafepointLoadStrategy())


def close() -> None:
    """Closes the registered flash strategy (``"safepoint_flash"``): waits for its saves."""
    _FLASH.close()


register()

__all__ = ["SafepointSaveStrategy", "SafepointLoadStrategy", "register", "close", "read_pointer",
           "BACKEND", "FLASH_BACKEND", "VERSION", "POINTER"]
