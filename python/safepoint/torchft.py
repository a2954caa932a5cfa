"""A torchft ``CheckpointTransport`` that heals a recovering replica through safepoint.

    from torchft import Manager
    from safepoint.torchft import SafepointTransport

    transport = SafepointTransport("/dev/shm/torchft-heal/replica0", timeout=timedelta(seconds=60))
    manager = Manager(pg=pg, load_state_dict=..., state_dict=..., checkpoint_transport=transport,
                      ...)

How a heal goes. When torchft finds a replica group behind, a live replica's manager calls
``send_checkpoint(step, state_dict)``: the transport snapshots the state into host shared memory
with a ``safepoint.Checkpointer`` (the training thread is blocked only for that copy, so
``disallow_checkpoint`` returns at once: the snapshot no longer depends on ``state_dict``) and
the node agent writes it, with safepoint's checksums and commit protocol, to the transport's
location. ``metadata()`` is that location; the recovering replica's ``recv_checkpoint`` waits
(at most ``timeout``) until the step is committed there and loads it, verified.

The location decides where a heal can come from: a directory in ``/dev/shm`` (shared memory:
replicas on the same node), a node-local or shared file system, or any storage URI safepoint
writes (``s3://...``, ``rados://...``: replicas on other nodes). Each sending replica needs its
own location (``metadata()`` names it). The newest ``keep`` sent steps are kept there.

Not covered: torchft's in-place receive into preallocated (GPU) tensors that ``PGTransport``
does (this transport returns CPU tensors, which torchft's ``load_state_dict`` copies); values
other than tensors and plain values need ``allow_pickle``. Tested with torchft 0.2.0.
"""

from __future__ import annotations

import os
import time
import uuid
from datetime import timedelta
from typing import Optional, TypeVar

from torchft.checkpointing.transport import CheckpointTransport

import safepoint
from safepoint import _core
from safepoint._pickle import AllowPickle
from safepoint.errors import InvalidArgumentError

T = TypeVar("T")


class SafepointTransport(CheckpointTransport[T]):
    """torchft ``CheckpointTransport`` over safepoint (module doc).

    ``location``: where this replica's sent checkpoints go (a directory or a storage URI; its
    ``metadata()``). ``timeout``: the default wait of ``recv_checkpoint``. ``keep``: sent steps
    kept at ``location``. ``job``, ``shm_dir``: as for ``safepoint.Checkpointer`` (default job:
    one per transport). ``allow_pickle``: as for ``safepoint.save``. ``mode``: ``"flash"``
    (send returns after the copy into shared memory; the agent writes the step) or ``"sync"``
    (send writes the step itself: the sender waits longer, the receiver gets it sooner).
    """

    def __init__(self, location: str | os.PathLike[str], *,
                 timeout: timedelta = timedelta(seconds=60), keep: int = 2,
                 job: Optional[str] = None, shm_dir: Optional[str] = None,
                 allow_pickle: AllowPickle = False, mode: str = "flash") -> None:
        loc = os.fspath(location)
        if not isinstance(loc, str) or not loc:
            raise InvalidArgumentError(f"location must be a non-empty path or URI, got "
                                       f"{location!r}")
        if mode not in ("flash", "sync"):
            raise InvalidArgumentError(f"mode must be 'flash' or 'sync', got {mode!r}")
        self.location = loc if "://" in loc else os.path.abspath(loc)
        self.mode = mode
        self.timeout, self.keep, self.allow_pickle = timeout, keep, allow_pickle
        self.job = job or f"torchft-{uuid.uuid4().hex[:12]}"
        self.shm_dir = shm_dir
        self._ckpt: Optional[safepoint.Checkpointer] = None
        self._sent: Optional[int] = None

    def _checkpointer(self) -> safepoint.Checkpointer:
        if self._ckpt is None:
            # One replica's sender: a world of one whatever torch.distributed says (the
            # replica's ranks each have their own transport and location).
            self._ckpt = safepoint.Checkpointer(
                self.location, job=self.job, rank=0, world_size=1, keep=self.keep,
                shm_dir=self.shm_dir, allow_pickle=self.allow_pickle, preemption=False)
        return self._ckpt

    # -- CheckpointTransport ------------------------------------------------------------------
    def metadata(self) -> str:
        return self.location

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: T,
                        timeout: timedelta) -> None:
        """Snapshots ``state_dict`` into shared memory (the agent persists it to ``location``);
        returns once the copy is done. Sending a step already sent does nothing."""
        if step == self._sent:
            return
        if self.mode == "flash":
            self._checkpointer().save(step, {"state": state_dict}, persist=True)
        else:
            safepoint.save(self.location, step, {"state": state_dict},
                           allow_pickle=self.allow_pickle)
            for old in safepoint.steps(self.location)[:-self.keep]:
                _core.delete_step(self.location, old)
        self._sent = step

    def disallow_checkpoint(self) -> None:
        # The snapshot is a copy: the caller may change state_dict as soon as send returned.
        return None

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int,
                        timeout: timedelta) -> T:
        """The state the replica at ``metadata`` sent for ``step``; ``TimeoutError`` when it is
        not committed there within ``timeout``."""
        deadline = time.monotonic() + (timeout or self.timeout).total_seconds()
        delay = 0.001
        while True:
            if step in safepoint.steps(metadata):
                break
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{metadata}: step {step} was not sent (committed) by rank "
                                   f"{src_rank} within {timeout}")
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        _, got = safepoint.load(metadata, step, allow_pickle=self.allow_pickle)
        return got["state"]

    def wait(self, timeout: Optional[float] = None) -> None:
        """Blocks until every sent step is committed at ``location``."""
        if self._ckpt is not None:
            self._ckpt.wait(timeout)

    def shutdown(self, wait: bool = True) -> None:
        ckpt, self._ckpt = self._ckpt, None
        if ckpt is None:
            return
        if wait:
            ckpt.close()
        else:
            ckpt.abandon()
