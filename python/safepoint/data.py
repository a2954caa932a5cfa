"""Exact resume of the data position, also when the data-parallel size changes.

``GlobalBatchSampler`` keeps the *global* sample cursor of a job: the epoch, the samples of the
epoch's order consumed by the whole job, and the seed. Each epoch's order is one global
permutation of the data set drawn from (seed, epoch); global step k consumes the next
``global_batch_size`` samples of that order; rank r of the D data-parallel ranks takes the r-th
contiguous share of them. The cursor counts the job's samples, not a rank's, so it is the same on
every rank, and a job resumed with another data-parallel size (2 -> 4, 4 -> 3) consumes exactly
the samples the uninterrupted job would have consumed, none skipped, none repeated: only which
rank trains on which of a step's samples changes. Put the sampler (or a torchdata
``StatefulDataLoader`` built on it) in the state that ``Checkpointer.save`` saves::

    sampler = safepoint.data.GlobalBatchSampler(dataset, global_batch_size=12, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler,
                                         generator=torch.Generator())  # not torch's global one
    state = {"model": model, "optim": opt, "data": sampler}
    start = ckpt.restore(state) or 0       # the cursor comes back with the step

``seed_for_step`` seeds a rank's generators (torch on the CPU and every CUDA device, numpy's
global generator, Python's ``random``) from (seed, global step, rank): called at the start of
every step, it makes dropout and augmentation a function of the step and the rank, so a resume
at the same data-parallel size is bit-exact without saved generator states.

docs/guide.md, "Exact resume and the data position", says what to put in the state and what is
bit-exact after a resume and what is not.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Iterator, Mapping, Sized
from typing import Any, NamedTuple, Optional, Union

import numpy as np
import torch
from torch.utils.data import Sampler

from safepoint.errors import InvalidArgumentError

__all__ = ["GlobalBatchSampler", "StepSeeds", "step_seeds", "seed_for_step"]

_STATE_VERSION = 1
_SEED_DOMAIN = 0x5AFE_D47A  # separates the permutation's seed sequence from seed_for_step's


def _data_parallel(rank: Optional[int], world_size: Optional[int]) -> tuple[int, int]:
    """(rank, world size): the given ones, else torch.distributed's, else (0, 1)."""
    if rank is None or world_size is None:
        import torch.distributed as dist

        initialized = dist.is_available() and dist.is_initialized()
        if rank is None:
            rank = dist.get_rank() if initialized else 0
        if world_size is None:
            world_size = dist.get_world_size() if initialized else 1
    return rank, world_size


def _non_negative_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise InvalidArgumentError(f"{name} must be a non-negative int, got {value!r}")
    return int(value)


class GlobalBatchSampler(Sampler[list[int]]):
    """A batch sampler over a map-style data set that keeps the job's global sample cursor.

    ``data`` is the data set (anything with ``len()``) or its length. Every epoch's order is a
    permutation of ``range(len(data))`` drawn from (``seed``, epoch) (``shuffle=False``: the
    indices in order). A global step consumes the next ``global_batch_size`` samples of the
    order; this rank's batch is its contiguous share: rank r of D data-parallel ranks gets
    samples ``[r * B / D, (r + 1) * B / D)`` of the global batch B. ``rank`` and
    ``world_size`` are the *data-parallel* rank and size (default: torch.distributed's, else 0
    and 1); with tensor or pipeline parallelism pass the data-parallel group's. A global batch
    that D does not divide raises ``InvalidArgumentError``: every rank takes an equal share, so
    that DDP's average of the ranks' gradients weights every sample alike.

    An epoch has ``len(self)`` global steps: ``len(data) // B`` with ``drop_last`` (default: the
    last ``len(data) % B`` samples of each epoch's order are not used in that epoch), else
    ``ceil(len(data) / B)``, the last global batch completed with the first samples of the
    epoch's order. Iterating yields this rank's batches (lists of indices) from the cursor to
    the end of the current epoch, advancing the cursor by one global batch as each is yielded;
    the next iteration starts the next epoch (``for epoch ...: for batch in loader``). Use it
    as a ``DataLoader``'s ``batch_sampler``. A ``DataLoader`` with worker processes draws
    batches ahead of the training loop, and then the sampler's cursor is ahead of the batches
    trained on: put the loader in the state instead, a torchdata ``StatefulDataLoader``, which
    saves the sampler's state as of the batches it handed out.

    ``state_dict()`` holds the cursor (``epoch``, ``offset``: the samples of the epoch's order
    consumed, ``consumed``: the samples consumed by the whole job, ``step``: the global steps
    consumed) and what the order depends on (seed, data-set length, ``shuffle``,
    ``drop_last``): no rank-specific value, so that after a restart with another data-parallel
    size any rank's saved copy is the right one (safepoint gives a rank that the saving world
    did not have another rank's copy). ``load_state_dict`` refuses a state of another seed, data-set
    length, ``shuffle`` or ``drop_last`` (the order would differ); another global batch size is
    accepted, and the rest of the epoch's order is consumed in batches of the new size.
    """

    def __init__(self, data: Union[Sized, int], global_batch_size: int, *,
                 rank: Optional[int] = None, world_size: Optional[int] = None, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = True) -> None:
        n = data if isinstance(data, (int, np.integer)) and not isinstance(data, bool) \
            else len(data)  # type: ignore[arg-type]
        self.num_samples = _non_negative_int("the data set's length", n)
        self.global_batch_size = _non_negative_int("global_batch_size", global_batch_size)
        self.seed = _non_negative_int("seed", seed)
        self.shuffle, self.drop_last = bool(shuffle), bool(drop_last)
        rank, world_size = _data_parallel(rank, world_size)
        self.rank = _non_negative_int("rank", rank)
        self.world_size = _non_negative_int("world_size", world_size)
        if not self.rank < self.world_size:
            raise InvalidArgumentError(f"rank {rank} is not in [0, {world_size})")
        self._check_batch(self.global_batch_size)
        self.epoch = 0        # the epoch whose order the cursor is in
        self.offset = 0       # samples of that epoch's order consumed by the job
        self.consumed = 0     # samples consumed by the job in all
        self.step = 0         # global batches consumed by the job in all
        self._order: Optional[tuple[int, np.ndarray]] = None  # (epoch, its order), cached

    def _check_batch(self, global_batch: int) -> None:
        if global_batch < 1:
            raise InvalidArgumentError(f"global_batch_size must be >= 1, got {global_batch}")
        if global_batch % self.world_size:
            raise InvalidArgumentError(
                f"a global batch of {global_batch} samples cannot be split evenly over "
                f"{self.world_size} data-parallel ranks: every rank takes an equal share (so "
                f"that the average of the ranks' gradients weights every sample alike); use a "
                f"data-parallel size that divides {global_batch}, or another global batch")
        if self.num_samples == 0:
            raise InvalidArgumentError("the data set is empty")
        if global_batch > self.num_samples:
            raise InvalidArgumentError(
                f"a global batch of {global_batch} samples is larger than the data set "
                f"({self.num_samples} samples): an epoch would have no full step")

    # -- the order -------------------------------------------------------------------------------
    @property
    def local_batch_size(self) -> int:
        """The samples of a global batch that this rank takes."""
        return self.global_batch_size // self.world_size

    def _usable(self) -> int:
        """The samples of an epoch's order that the epoch's steps consume."""
        b = self.global_batch_size
        if self.drop_last:
            return self.num_samples // b * b
        return -(-self.num_samples // b) * b

    def __len__(self) -> int:
        """Global steps per epoch (a full epoch, wherever the cursor is)."""
        return self._usable() // self.global_batch_size

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The order of `epoch`: a permutation of the data set's indices drawn from (seed,
        epoch), the same on every rank and for every data-parallel size (read-only)."""
        epoch = _non_negative_int("epoch", epoch)
        if self._order is None or self._order[0] != epoch:
            if self.shuffle:
                rng = np.random.Generator(np.random.PCG64(
                    np.random.SeedSequence([_SEED_DOMAIN, self.seed, epoch])))
                order = rng.permutation(self.num_samples)
            else:
                order = np.arange(self.num_samples)
            order.setflags(write=False)
            self._order = (epoch, order)
        return self._order[1]

    def global_batch(self) -> list[int]:
        """The indices of the next global batch (every rank's share, in rank order), without
        advancing the cursor."""
        order = self.epoch_order(self.epoch)
        end = self.offset + self.global_batch_size
        ids = order[self.offset:end]
        if end > self.num_samples:  # not drop_last: the last batch wraps to the order's start
            ids = np.concatenate([ids, order[:end - self.num_samples]])
        return ids.tolist()

    def local_batch(self) -> list[int]:
        """This rank's share of the next global batch, without advancing the cursor."""
        b = self.local_batch_size
        return self.global_batch()[self.rank * b:(self.rank + 1) * b]

    def advance(self) -> None:
        """Moves the cursor past one global batch (what yielding a batch does)."""
        self.offset += self.global_batch_size
        self.consumed += self.global_batch_size
        self.step += 1
        self._normalize()

    def _normalize(self) -> None:
        """Moves a cursor at the end of its epoch to the start of the next one."""
        # Past the data set, or (drop_last) too few samples left for a global batch: the same
        # ends as `_usable` gives for one global batch size, and also right when the state was
        # saved with another (a cursor between the data set's end and `_usable` would otherwise
        # wrap a second time and train samples of the epoch again).
        if self.offset >= self.num_samples or (self.drop_last and
                                               self.num_samples - self.offset
                                               < self.global_batch_size):
            self.epoch += 1
            self.offset = 0

    def __iter__(self) -> Iterator[list[int]]:
        epoch = self.epoch
        while self.epoch == epoch:
            batch = self.local_batch()
            self.advance()  # before the yield: the cursor counts what was handed out
            yield batch

    def set_epoch(self, epoch: int) -> None:
        """Moves the cursor to the start of `epoch` when that is ahead of it. A resumed run's
        loop that calls ``set_epoch`` at each epoch's start, as for a ``DistributedSampler``,
        keeps the restored position: for the epoch the cursor is in, and for an earlier one (a
        loop that counts from 0, or a framework whose epoch counter is one behind a cursor
        saved at an epoch's end), which would replay trained samples; the cursor then stays
        where it is, with a warning. To train an epoch again on purpose, load a state."""
        epoch = _non_negative_int("epoch", epoch)
        if epoch > self.epoch:
            self.epoch, self.offset = epoch, 0
        elif epoch < self.epoch:
            warnings.warn(f"GlobalBatchSampler.set_epoch({epoch}): the cursor is in epoch "
                          f"{self.epoch} (offset {self.offset}) and stays there; moving back "
                          f"would train samples again", RuntimeWarning, stacklevel=2)

    # -- the state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The global cursor and what the order depends on: the same on every rank."""
        return {"version": _STATE_VERSION, "seed": self.seed, "num_samples": self.num_samples,
                "shuffle": self.shuffle, "drop_last": self.drop_last,
                "global_batch_size": self.global_batch_size, "epoch": self.epoch,
                "offset": self.offset, "consumed": self.consumed, "step": self.step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Puts back a cursor that ``state_dict`` returned, saved with any data-parallel size.
        Raises ``InvalidArgumentError`` when the state was saved with another seed, data-set
        length, ``shuffle`` or ``drop_last``, or by a newer version of this class."""
        missing = [k for k in ("version", "seed", "num_samples", "shuffle", "drop_last",
                               "global_batch_size", "epoch", "offset", "consumed", "step")
                   if k not in state]
        if missing:
            raise InvalidArgumentError(f"not a GlobalBatchSampler state: no {', '.join(missing)}")
        if int(state["version"]) > _STATE_VERSION:
            raise InvalidArgumentError(f"a GlobalBatchSampler state of version "
                                       f"{state['version']}; this one reads {_STATE_VERSION}")
        differ = [f"{k} {state[k]!r} (this sampler: {getattr(self, k)!r})"
                  for k in ("seed", "num_samples", "shuffle", "drop_last")
                  if type(getattr(self, k))(state[k]) != getattr(self, k)]
        if differ:
            raise InvalidArgumentError(
                "the saved data position belongs to another order: saved with "
                + ", ".join(differ) + "; resuming would train on other samples")
        self.epoch = _non_negative_int("epoch", state["epoch"])
        self.offset = _non_negative_int("offset", state["offset"])
        self.consumed = _non_negative_int("consumed", state["consumed"])
        self.step = _non_negative_int("step", state["step"])
        self._normalize()  # a cursor saved with another global batch may end its epoch here

    def __repr__(self) -> str:
        return (f"GlobalBatchSampler(samples={self.num_samples}, "
                f"global_batch_size={self.global_batch_size}, rank={self.rank}, "
                f"world_size={self.world_size}, seed={self.seed}, epoch={self.epoch}, "
                f"offset={self.offset}, step={self.step})")


class StepSeeds(NamedTuple):
    """The seeds ``seed_for_step`` gives each generator."""

    torch: int   # torch.manual_seed: the CPU generator and every CUDA device's
    numpy: int   # numpy.random.seed (the legacy global generator)
    python: int  # random.seed


def step_seeds(seed: int, step: int, rank: int = 0) -> StepSeeds:
    """The generators' seeds for (seed, global step, rank): a pure function, different for
    every rank and step (numpy's SeedSequence mixes the three)."""
    words = np.random.SeedSequence(
        [_non_negative_int("seed", seed), _non_negative_int("step", step),
         _non_negative_int("rank", rank)]).generate_state(4, dtype=np.uint32)
    return StepSeeds(torch=int(words[0]) << 32 | int(words[1]), numpy=int(words[2]),
                     python=int(words[3]))


def seed_for_step(seed: int, step: int, rank: Optional[int] = None) -> StepSeeds:
    """Seeds this process's generators from (seed, global step, rank): torch's (CPU and every
    CUDA device), numpy's global generator and Python's ``random``. Call it at the start of
    every step, before anything draws (dropout, augmentation): what a step draws is then a
    function of the step and the rank alone, so a run resumed at the same data-parallel size
    draws what the uninterrupted run drew, whatever generator state was or was not saved.
    ``rank`` defaults to torch.distributed's rank (0 without it). Returns the seeds."""
    if rank is None:
        rank = _data_parallel(None, 1)[0]
    seeds = step_seeds(seed, step, rank)
    torch.manual_seed(seeds.torch)
    np.random.seed(seeds.numpy)
    random.seed(seeds.python)
    return seeds
