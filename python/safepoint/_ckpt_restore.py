"""The restore path of a ``Checkpointer``: ``load`` and ``restore`` from the fastest valid copy
(this node's memory, peers' memory, ``path``, the tiers), the ranks' agreement on the step
(``_agreement``), shared storage reads, and branching from another checkpoint (``from_``)."""

from __future__ import annotations

import contextlib
import gc
import json
import time
import warnings
from collections.abc import Iterator
from typing import Any, Optional

from safepoint import _collectives, _core
from safepoint._agreement import (
    Agreement,
    Known,
    Statement,
    agree,
    agree_on_step,
    load_newest_agreed,
)
from safepoint._api import load as storage_load
from safepoint._api import load_shard
from safepoint._api import steps as storage_steps
from safepoint._attempt import newest_attempts
from safepoint._ckpt_base import CheckpointerBase, RestoreInfo
from safepoint._shards import read_into, read_newest_into
from safepoint._shared_reads import read_shared_into
from safepoint._staging import pin_for_gpu_copies
from safepoint._stateful import apply_loaded, to_saveable
from safepoint._versions import resolve, same_location, split_ref
from safepoint.errors import CorruptionError, Error, InvalidArgumentError, NotFoundError


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off for the block (as it was after)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class RestoreMixin(CheckpointerBase):
    """Checkpointer's restore path."""

    def load(self, step: Optional[int] = None, *,
             _targets: Any = None) -> Optional[tuple[int, Any]]:
        """The newest (or the given) step from the fastest valid copy: this node's memory when
        it is at least as new as the newest committed step, else storage (falling back to older
        steps). None when there is nothing to load.

        With torch.distributed initialized and several ranks, all ranks first agree on the
        newest step that every rank can load (from its memory or from storage) and load that
        one; if any rank then fails to read it, all fall back together to the next older one.
        Ranks never resume from different steps.

        After a restart with another world size the node agent has persisted the previous
        world's snapshots and dropped them from memory: the step comes from storage. ``restore``
        reshards it into this world's tensors; ``load`` returns this rank's image as saved (a
        rank the saving world did not have gets rank ``rank % W``'s, with a warning)."""
        t0 = time.perf_counter()
        self._io = {"storage_bytes_read": 0, "peer_bytes_sent": 0, "peer_bytes_received": 0}
        if self._group is not None:
            out = self._load_agreed(step, _targets)
        else:
            out = self._load_local(step, _targets)
        if out is None:
            return None
        result, source = out
        peers = ""
        if source.startswith("peer:"):
            source, peers = "peer", source[5:]
        seconds = time.perf_counter() - t0
        uri = self._io.pop("uri", None)
        uri = uri if source == "storage" else None
        self._stats["last_load"] = {"step": result[0], "source": source, "seconds": seconds,
                                    "peers": peers, "uri": uri, **self._io}
        self.last_restore = RestoreInfo(result[0], source, seconds, peers, uri)
        # The steps saved from now on descend from this one (of this checkpoint, wherever the
        # copy was read: memory, a peer, path or a tier).
        self._live.set_lineage(result[0], "", self._metadata)
        level = self._advisor.restored(source, uri, seconds)
        self._stats["restores"][source] = self._stats["restores"].get(source, 0) + 1
        self._live.report("restore", result[0], True, seconds,
                          int(self._io.get("storage_bytes_read") or 0), source, "", level)
        return result

    def _memory_steps(self) -> list[int]:
        return sorted(s.step for s in self._live.slots() if s.state == "COMPLETE")

    def _memory_attempts(self) -> dict[int, Any]:
        """step -> save attempt of the snapshot of it a load would read (of two snapshots of one
        step, the one completed last, as load_step picks)."""
        return newest_attempts((s for s in self._live.slots() if s.state == "COMPLETE"),
                               lambda s: s.complete_time_ns)

    def _stored(self) -> tuple[dict[int, list[int]], Optional[Error],
                               Optional[tuple[int, int, bytes]]]:
        """(step -> indexes into ``_stores`` of the storages that hold it committed, the error
        that kept the only storage from being listed, the newest step's COMMIT record as read
        from the fastest storage that holds it: (step, index, its bytes), which the agreement
        hands to every rank). Per storage one List of the COMMIT
        objects and the records read newest first down to the first valid one (one read when the
        newest is intact; a damaged one is skipped with a warning): the steps are those up to
        that one, the older ones' records unread (a damaged one fails the read of its step, and
        the load falls back). With several ranks only the agreement's lister calls this: the
        job asks storage once. A tier that cannot be listed is skipped with a warning: the
        others serve."""
        where: dict[int, list[int]] = {}
        records: dict[int, tuple[int, bytes]] = {}
        for i, uri in enumerate(self._stores):
            try:
                found, newest, problems, record = _core.committed_view(uri)
            except Error as e:
                if len(self._stores) == 1:
                    return {}, e, None
                warnings.warn(f"safepoint: cannot list the steps of {uri}: {e}", RuntimeWarning,
                              stacklevel=4)
                continue
            for problem in problems:
                warnings.warn(f"safepoint: skipped a damaged checkpoint: {problem}",
                              RuntimeWarning, stacklevel=4)
            for s in found:
                if newest is not None and s <= newest:
                    where.setdefault(s, []).append(i)
            if newest is not None and record:
                records[i] = (newest, record)
        handed = None
        if where:
            top = max(where)
            first = where[top][0]
            if first in records and records[first][0] == top:
                handed = (top, first, records[first][1])
        return where, None, handed

    def _handed(self, agreed: Optional[Agreement], s: Optional[int],
                uri: str) -> Optional[_core.Commit]:
        """The COMMIT record of step `s` on `uri` that the agreement's lister read and handed to
        every rank in its row (checked by its CRC here), so that this rank reads its image
        against it and no record; None when the lister's row carries another (an older step's
        read: the rank reads that record itself)."""
        data = agreed.record(s, uri) if agreed is not None and s is not None else None
        if not data:
            return None
        try:
            return _core.commit_from_bytes(uri, data)
        except Error as e:  # not what the lister read: read the record from storage
            warnings.warn(f"safepoint: the COMMIT record of step {s} rank 0 handed over is "
                          f"damaged, reading it from {uri}: {e}", RuntimeWarning, stacklevel=4)
            return None

    def _read_storage(self, uri: str, step: Optional[int], targets: Any,
                      commit: Optional[_core.Commit] = None):
        """This rank's state of `step` from the storage at `uri`: with targets (restore), only
        the byte ranges the targets need, from whichever ranks' images hold them (any saving
        world size); else this rank's whole image, or, where the step was saved by fewer ranks
        than this one's number (the job grew), the image of rank ``rank % saving world size``
        (``_image_of_smaller_world``). `commit`: the step's record, handed over (``_handed``)."""
        self._io["uri"] = uri
        if targets is None:
            self._io["storage_bytes_read"] = None  # a whole image; not counted
            try:
                if commit is not None and step is not None:
                    return load_shard(uri, step, self.rank, self.allow_pickle, commit)
                return storage_load(uri, step, rank=self.rank, allow_pickle=self.allow_pickle)
            except InvalidArgumentError:
                got = self._image_of_smaller_world(uri, step)
                if got is None:
                    raise
                return got
        return read_newest_into(uri, step, self.rank, targets, self._unpickler, self._io, commit)

    def _image_of_smaller_world(self, uri: str, step: Optional[int]):
        """A whole-image load (``load()``) of a step saved by fewer ranks than this rank's
        number: the job restarted with more ranks (docs/guide.md, "A changed world size"). The
        image of rank ``rank % W`` of the W that saved it, with a warning: its replicated
        tensors (DDP's model and optimizer state) are whole, a sharded tensor is that rank's
        shard as saved; ``restore(state)`` reshards into this world's tensors. None when the
        step's world size does not explain the refusal (the caller raises it)."""
        try:
            s = step
            if s is None:
                saved = storage_steps(uri)
                s = max(saved) if saved else None
            world = _core.read_metadata(uri, s, 0).world_size if s is not None else 0
        except Error:
            return None
        if not 0 < world <= self.rank:
            return None
        warnings.warn(f"safepoint: step {s} was saved by {world} ranks and this is rank "
                      f"{self.rank} of {self.world_size}: load() returns the image of rank "
                      f"{self.rank % world} as saved (replicated tensors whole, a sharded tensor "
                      f"as that rank's shard); restore(state) reshards into this world's tensors",
                      RuntimeWarning, stacklevel=5)
        return storage_load(uri, s, rank=self.rank % world, allow_pickle=self.allow_pickle)

    def _from_storage(self, step: Optional[int], targets: Any, where: dict[int, list[str]],
                      agreed: Optional[Agreement] = None):
        """This rank's state of `step` (None: the newest that reads back) from the fastest
        storage that holds it. A damaged or unreadable copy falls back to the next tier that
        holds the step, and without an exact step to older steps. `agreed`: the agreement whose
        lister's COMMIT record of the step the rank reads against (``_handed``)."""
        if len(self._stores) == 1:  # path alone: its own fallback to older steps
            return self._read_storage(self.path, step, targets,
                                      self._handed(agreed, step, self.path))
        candidates = [step] if step is not None else sorted(where, reverse=True)
        error: Optional[Error] = None
        for s in candidates:
            for uri in where.get(s, []):
                try:
                    return self._read_storage(uri, s, targets, self._handed(agreed, s, uri))
                except Error as e:
                    if isinstance(e, CorruptionError):
                        self._live.report("checksum", s, False, 0.0, 0, "storage", str(e))
                    warnings.warn(f"safepoint: step {s} cannot be read from {uri}, trying the "
                                  f"next copy: {e}", RuntimeWarning, stacklevel=4)
                    error = e
        if error is not None:
            raise error
        raise NotFoundError(f"{self.path}: step {step} is not committed on any storage tier "
                            f"({', '.join(self._stores)})")

    def _usable(self, snap: Optional[_core.Loaded]):
        """A memory snapshot, unless another world size saved it (then storage reshards; the
        node agent drops such snapshots anyway once the job restarted with another world size,
        src/agent/world_change.cc) or it
        leaves out tensors (replicated state copied once per node) that no other rank's
        snapshot of it on this node holds intact: then None, and the load falls back like for
        any missing copy (the ranks agree again, peers, storage)."""
        if snap is None or snap.world_size != self.world_size:
            return None
        if snap.elsewhere:
            left = self._live.fill_from_siblings(snap.step, snap.attempt, snap.elsewhere)
            if left:
                warnings.warn(f"safepoint: step {snap.step} in memory leaves {len(left)} tensors "
                              f"to other ranks of this node, whose snapshots do not hold them "
                              f"(first: {left[0]}); loading another copy", RuntimeWarning,
                              stacklevel=4)
                return None
        return (snap.step, snap.state), "memory"

    def _memory_snapshot(self, step: Optional[int], want: Optional[int], targets: Any):
        """This rank's snapshot in memory: of `step`, or without one the newest at least `want`
        as new. restore (targets) reads the slot itself, once: its tensors are copied straight
        into their targets in the pass that verifies every chunk."""
        in_place = targets is not None
        if step is None:
            return self._live.load_newest(want, self._unpickler, in_place, targets)
        return self._live.load_step(step, self._unpickler, in_place, targets)

    def _memory_while_unlisted(self, step: Optional[int], targets: Any, error: Error):
        """`path`, the only storage, cannot be listed (a storage brownout: the store or its
        gateway down, stalled or full). This node's memory still serves, with a warning: the
        given step, or the newest snapshot when it is at least as new as the newest step this
        node's agent saw committed (its own commits and those its waits read; a resume must
        never be older than a committed step). Otherwise, or when the agent cannot say, the
        listing's error is raised."""
        want = step
        if want is None:
            want = self._agent_newest_committed()
            if want is None:
                raise error
        try:
            snap = self._memory_snapshot(step, want, targets)
        except CorruptionError as e:
            raise error from e
        got = self._usable(snap)
        if got is None:
            raise error
        warnings.warn(f"safepoint: {self.path} cannot be listed ({error}); loading step "
                      f"{got[0][0]} from this node's memory, at least as new as the newest step "
                      f"its agent saw committed", RuntimeWarning, stacklevel=4)
        return got

    def _agent_newest_committed(self) -> Optional[int]:
        """The newest step this node's agent saw committed (its own commits and those its waits
        read): a lower bound of the job's newest committed step. None when it cannot say."""
        try:
            newest = json.loads(self._live.agent_status()).get("newest_committed")
            return None if newest is None else int(newest)
        except Exception:  # noqa: BLE001 (with several ranks, each must reach the all-reduce)
            return None

    def _agreed_while_unlisted(self, agreed: Any, got: Any, step: Optional[int]):
        """The lister could not list `path`, the only storage (a storage brownout), and told
        every rank so in the agreement. As for one process (_memory_while_unlisted), memory
        still serves, with a warning, when every rank loaded the same snapshot of one save
        attempt (``agreed.hot``): the asked-for step, or, without one, when every rank's agent
        can say which step it saw committed newest and that step is at least as new as the
        newest of them (one all-reduce of the agents' views, only on this path; an agent that
        cannot say, one restarted meanwhile, may have committed newer than the others saw).
        Otherwise every rank raises the listing's error."""
        import torch

        error = agreed.listing_error()
        if len(self._stores) != 1 or not agreed.hot:
            raise error
        if step is None:
            newest = self._agent_newest_committed()
            # [the newest step seen committed, whether this rank's agent cannot say]
            view = torch.tensor([-1 if newest is None else newest, 1 if newest is None else 0],
                                dtype=torch.int64)
            _collectives.all_reduce_max(view, self._group)
            if int(view[1]) or agreed.hot_step < int(view[0]):
                raise error
        why = ("the asked-for step" if step is not None else
               "at least as new as the newest step the ranks' agents saw committed")
        warnings.warn(f"safepoint: {self.path} cannot be listed ({error}); every rank loads step "
                      f"{agreed.hot_step} from its node's memory, {why}", RuntimeWarning,
                      stacklevel=4)
        return got

    def _newest_as_listed(self, targets: Any, handed: Optional[tuple[int, int, bytes]]):
        """A process alone in its job (world size 1) reads the newest step against the COMMIT
        record its listing read (``_stored``), not listing and reading it again; None when that
        copy does not read back (the caller falls back as before, to older steps and tiers)."""
        if self.world_size != 1 or handed is None:
            return None
        s, index, data = handed
        uri = self._stores[index]
        try:
            return self._read_storage(uri, s, targets, _core.commit_from_bytes(uri, data))
        except (CorruptionError, NotFoundError) as e:
            warnings.warn(f"safepoint: step {s} cannot be read from {uri}, trying the other "
                          f"copies: {e}", RuntimeWarning, stacklevel=4)
            return None

    def _load_local(self, step: Optional[int], targets: Any = None):
        stored, error, handed = self._stored()
        if error is not None:
            if len(self._stores) != 1:
                raise error
            return self._memory_while_unlisted(step, targets, error)
        committed = {s: [self._stores[u] for u in uris] for s, uris in stored.items()}
        newest_storage = max(committed) if committed else None
        want = step if step is not None else newest_storage
        snap = None
        damaged: Optional[CorruptionError] = None
        try:
            snap = self._memory_snapshot(step, want, targets)
        except CorruptionError as e:
            self._live.report("checksum", want or 0, False, 0.0, 0, "memory", str(e))
            damaged = e
            warnings.warn(
                f"safepoint: the snapshot in memory is damaged, loading from storage: {e}",
                RuntimeWarning, stacklevel=3)
        got = self._usable(snap)  # once: it may fill tensors from other ranks' slots
        if got is not None:
            return got
        if step is not None or committed:
            newest = self._newest_as_listed(targets, handed) if step is None else None
            if newest is not None:
                return newest, "storage"
            return self._from_storage(step, targets, committed), "storage"
        if damaged is not None and targets is not None:
            # The targets may hold bytes of the damaged snapshot: never report "nothing".
            raise CorruptionError(f"{damaged}; nothing on storage to restore from, so the "
                                  "state's tensors may hold damaged bytes")
        return None

    def _peer_attempts(self) -> dict[int, Any]:
        """step -> save attempt of the newest snapshot of this rank that peers can rebuild
        (empty without replication, or when the peers cannot be asked)."""
        if self.replication is None:
            return {}
        try:
            copies = self._live.peer_copies()
        except Error as e:
            warnings.warn(f"safepoint: cannot ask the peers for copies: {e}", RuntimeWarning,
                          stacklevel=4)
            return {}
        return newest_attempts(copies, lambda c: c.complete_ns)

    def _from_peers(self, step: int, attempt: int, targets: Any):
        """Has the agent rebuild this rank's snapshot of `step` from peers into a slot, then
        loads it from there like a hot reload (verified). None when that fails."""
        try:
            fetched = self._live.fetch_from_peers(step, attempt, -1.0)
            got = self._usable(self._live.load_step(step, self._unpickler, targets is not None,
                                                    targets))
        except Error as e:
            warnings.warn(f"safepoint: step {step} cannot be rebuilt from peer memory: {e}",
                          RuntimeWarning, stacklevel=6)
            return None
        if got is None:
            return None
        return got[0], f"peer:{fetched.source}"

    def _load_one(self, step: int, memory: list[int], committed: dict[int, list[str]],
                  targets: Any, peers: Optional[dict[int, Any]] = None,
                  share: Optional[str] = None, loaded: Any = None,
                  agreed: Optional[Agreement] = None):
        """This rank's copy of `step`: memory first (`loaded`: what it already read from memory,
        verified, before the agreement), then peer memory, then storage. None if none reads
        back. With `share` (every rank restores with share_reads) this is a collective: the
        ranks that read from storage share the ranges several need (read_shared_into) from
        `share`, a storage every rank sees the step on, and a rank whose copy is in memory (or
        peer memory) takes part too; its all-reduce says whether every rank has the step, and
        the result is then a ``Known`` (load_newest_agreed needs no all-reduce of its own).
        `agreed`: the agreement, whose lister's COMMIT record of the step a rank reads storage
        against (it reads no record of its own)."""
        got = loaded
        if got is None and step in memory:
            try:
                got = self._usable(self._live.load_step(step, self._unpickler,
                                                        targets is not None, targets))
            except CorruptionError as e:
                self._live.report("checksum", step, False, 0.0, 0, "memory", str(e))
                warnings.warn(f"safepoint: the snapshot of step {step} in memory is damaged: {e}",
                              RuntimeWarning, stacklevel=5)
        if got is None and peers and step in peers and peers[step] is not None:
            got = self._from_peers(step, peers[step], targets)
        if share:
            need = got is None and step in committed
            self._io["uri"] = share
            tree, everyone = read_shared_into(share, step, self.rank, targets, self._unpickler,
                                              self._group, need, got is not None, self._io,
                                              self._handed(agreed, step, share) if need
                                              else None)
            if tree is not None:
                got = (step, tree), "storage"
            if everyone is not None:  # its all-reduce told every rank whether all have the step
                return Known(got, everyone)
            # Some rank could not read its share: each reads on its own, as without sharing.
        if got is not None:
            return got
        if step in committed:
            try:
                return self._from_storage(step, targets, committed, agreed), "storage"
            except Error as e:
                warnings.warn(f"safepoint: step {step} cannot be read from storage: {e}",
                              RuntimeWarning, stacklevel=5)
        return None

    def _load_agreed(self, step: Optional[int], targets: Any):
        """The agreement (_agreement) in one collective. Each rank first loads its newest
        snapshot in memory (or the given step), verified: the hot reload, not with replication
        (peers' copies may hold newer steps). Rank 0 of the group, the lister, asks storage for
        the committed steps, for the whole job (``_stored``). One all-gather of every rank's
        statement follows: when every rank loaded the same step of the same save attempt and
        none is committed newer, that is the result. Otherwise all load the newest step every
        rank can (from memory where every rank holds it of one attempt, else from the storages
        the lister found it on) and fall back together. With replication, a snapshot that peers
        can rebuild counts like one in memory: per rank, a step's attempt comes from its own
        memory, else from its peers' copies."""
        import torch.distributed as dist

        mine = self._memory_attempts()
        peers = {s: a for s, a in self._peer_attempts().items() if s not in mine}
        hot = step if step is not None else (max(mine) if mine else None)
        got = None
        if self.replication is None and hot is not None and mine.get(hot) is not None:
            try:
                got = self._usable(self._live.load_step(hot, self._unpickler,
                                                        targets is not None, targets))
            except CorruptionError:
                pass  # the candidates read it again, report it and fall back
        stored: dict[int, list[int]] = {}
        error = None
        record = None
        if dist.get_rank(self._group) == 0:
            stored, error, record = self._stored()
        share = self.share_reads and targets is not None  # restore's shared storage reads
        statement = Statement(got is not None, hot, mine.get(hot) if hot is not None else None,
                              {**peers, **mine}, share, stored,
                              max(stored) if stored else -1, error, record)
        agreed = agree(self._group, self.world_size, statement, self._stores, step)
        if agreed.listing_error() is not None:
            return self._agreed_while_unlisted(agreed, got, step)
        if agreed.hot:
            return got
        preloaded = got
        memory = [s for s in self._memory_steps() if s in agreed.in_memory]
        peers = {s: a for s, a in peers.items() if s in agreed.in_memory}
        # A step every rank holds in memory (or its peers do) of one attempt is read from there
        # without sharing: nobody expects to need storage for it (a rank whose copy turns out
        # damaged reads storage on its own, and the all-reduce decides as without sharing).
        got = load_newest_agreed(
            self._group, agreed.steps,
            lambda s: self._load_one(s, memory, agreed.committed, targets, peers,
                                     None if s in agreed.in_memory else agreed.shared_uri(s),
                                     preloaded if s == hot and s in agreed.in_memory else None,
                                     agreed),
            agreed.older)
        if got is None and step is not None:
            raise NotFoundError(f"{self.path}: step {step} cannot be loaded by every rank")
        return got

    def restore(self, state: Any, step: Optional[int] = None, *,
                from_: Optional[str] = None) -> Optional[int]:
        """Loads the newest (or the given) step *into* ``state`` in place, like DCP's load:
        tensors are copied into the existing tensors, Stateful values get ``load_state_dict``,
        other values are replaced; generator states saved with ``include_rng`` are restored.
        Returns the step, or None when there is nothing to load.

        ``from_`` branches from another checkpoint: ``"file:///runs/base@pretrained"`` (a tag),
        ``"...@step-100"`` or ``"...@100"`` (a step), or a location alone (its newest step). The
        step is read from storage there, resharded to this run's ranks, and the steps this run
        saves record it as their parent."""
        if from_ is not None:
            if step is not None:
                raise InvalidArgumentError(f"{self.path}: pass step= or from_=, not both")
            return self._restore_from(state, from_)
        # Without the cyclic GC while the state is walked and rebuilt: the thousands of
        # containers a large state creates would start collections over the whole heap (9% of a
        # hot restore's samples in perf); they are freed by reference counting.
        with _gc_paused():
            targets = to_saveable(state)
            loaded = self.load(step, _targets=targets)
            if loaded is None:
                return None
            got_step, got = loaded
            # From memory, `got` views the snapshot slot itself (read in place, verified): copy
            # out of it now, and never keep a reference to it.
            borrowed = self.last_load_source in ("memory", "peer")
            gpu = borrowed and pin_for_gpu_copies(got, targets)
            apply_loaded(state, got, borrowed=borrowed)
        if gpu:
            import torch

            torch.cuda.synchronize()
        return got_step

    def _restore_from(self, state: Any, from_: str) -> int:
        t0 = time.perf_counter()
        location, ref = split_ref(from_)
        got_step = resolve(location, ref)
        if self._group is not None:  # every rank branches from the same step
            got_step = agree_on_step(self._group, got_step)
        targets = to_saveable(state)
        self._io = {"storage_bytes_read": 0}
        tree = read_into(location, got_step, self.rank, targets, self._unpickler, stats=self._io)
        apply_loaded(state, tree)
        seconds = time.perf_counter() - t0
        self._stats["last_load"] = {"step": got_step, "source": "storage", "seconds": seconds,
                                    "peers": "", "uri": location, **self._io}
        self.last_restore = RestoreInfo(got_step, "storage", seconds, "", location)
        same = same_location(location, self.path)
        self._live.set_lineage(got_step, "" if same else location, self._metadata)
        return got_step

    @property
    def last_load_source(self) -> Optional[str]:
        last = self._stats["last_load"]
        return last["source"] if last else None
