"""The save path of a ``Checkpointer``: ``save`` (a snapshot into shared memory, overlapped or
not, the preemption save), ``before_update``, the record of each save and the agent's notice
(with dedupe, after the ranks agreed on the replicas), and ``wait``.

With several ranks a save runs at most one collective in steady state, of 16 bytes per rank
(docs/architecture.md, "Collectives per save"): with dedupe, the all-reduce after the copy
(``_dedupe.ReplicaPlan.agree``) carries the preemption notice and whether any rank's structure
changed; the replicas' tensor lists are gathered only when one did. A notice that this
all-reduce brings makes the save the preemption save (after its copy: the step is copied again,
persisted, unless every rank's copy already was). A save that copies nothing (not due) asks for
the notice alone (``_preemption.agreed``), and so does every save without dedupe."""

from __future__ import annotations

import contextlib
import json
import time
import warnings
import weakref
from collections.abc import Mapping
from typing import Any, Callable, Optional

from safepoint._ckpt_base import _fields
from safepoint._ckpt_preemption import PreemptionMixin
from safepoint._stateful import to_saveable
from safepoint.errors import InvalidArgumentError

# How often save() asks the node agent whether this rank's persists fail (one status request,
# ~0.1 ms), and how often it warns again while they do.
PERSIST_CHECK_S = 1.0
PERSIST_WARN_EVERY_S = 60.0


class SaveMixin(PreemptionMixin):
    """Checkpointer's save path."""

    _persist_check_at: float = 0.0  # time.monotonic() of the next check
    _persists_failed_seen: int = 0  # the agent's count of this rank's failed persists, last seen
    _persists_failed_warned: int = 0  # ... when save() last warned
    _persist_warn_at: float = 0.0  # no warning before this time (rate limit)
    # The overlapped save in _pending: (its copy persisted, copies it persisted) for the
    # preemption save that its collective may call for.
    _pending_preempt: Optional[tuple[bool, Callable[[], Any]]] = None

    def save(self, step: int, state: Any, *, persist: Optional[bool] = None,
             include_rng: bool = False, overlap: bool = False) -> bool:
        """Snapshots ``state`` for ``step`` into shared memory and returns.

        Values of a top-level mapping that have ``state_dict()``/``load_state_dict()`` (modules,
        optimizers, schedulers, ...) are saved as their state dicts. ``include_rng`` adds this
        process's torch/CUDA/numpy/``random`` generator states. Returns False when the snapshot
        was skipped (``on_busy="skip"`` and no free slot) or the step is not due under
        ``snapshot_every`` (nothing copied). ``persist`` overrides ``persist_every`` for this
        step (``persist=True`` snapshots a step that is not due, too).

        After a preemption notice (a signal, ``notify_preemption()``; on any rank), the save
        copies and persists its step whatever the schedule (``overlap`` and ``persist`` aside),
        sets ``preempted``, and returns once the step is committed: it raises as ``wait()``
        would when it cannot be. (With dedupe, a save that copies learns of a notice given on
        another rank from its one collective, after its copy: it then copies the step again,
        persisted, unless its copy was persisted already; for ``overlap=True`` that happens in
        ``before_update()``.)

        ``overlap=True`` returns as soon as the state is walked (its structure, non-tensor
        values and tensor addresses taken) and copies the tensors into shared memory on a
        background thread while training goes on (forward and backward do not change the
        state). The copy must be done before anything changes the state: ``before_update()``
        waits for it, and is called on its own before ``step()`` of every optimizer that is a
        value of ``state``'s top-level mapping (``register_step_pre_hook``); any other call on
        the Checkpointer waits for it too. The snapshot is then, bit for bit, the state at the
        time of ``save``, provided nothing but the optimizer changes it before ``before_update``
        (not so for module buffers that forward updates, such as BatchNorm's running
        statistics in training mode: call ``before_update()`` before such a forward). Returns
        True; whether the snapshot was skipped is what ``before_update()`` returns.
        """
        if type(step) is not int or step < 0:
            raise InvalidArgumentError(
                f"{self.path}: step must be a non-negative int, got {step!r}")
        client = self._live  # waits for an overlapped save still copying
        t0 = time.perf_counter()
        due = bool(persist) or not step % self.snapshot_every
        # With dedupe, a save that copies learns of a notice from its one collective, after
        # the copy (_saved); before it, only from an agreement made already (no collective).
        preempt = (self._preemption_agreed() if due and self.dedupe
                   else self._preemption_now())
        if not preempt and not due:
            self._stats["saves_not_due"] += 1
            return False
        saveable = to_saveable(state, include_rng)

        def copy_persisted() -> Any:
            return client.save(step, saveable, True, self._pickler, notify=False)

        if preempt:
            return self._save_preempted(client, step, copy_persisted, t0)
        do_persist = bool(persist if persist is not None else self._persist_due(step))

        def copy_again() -> Any:
            return client.save(step, saveable, do_persist, self._pickler, notify=False)

        if overlap:
            self._hook_optimizers(state)
            client.save_begin(step, saveable, do_persist, self._pickler, notify=False)
            self._pending = (step, t0, time.perf_counter() - t0, copy_again)
            self._pending_preempt = (do_persist, copy_persisted)
            return True
        return self._saved(step, copy_again(), t0, copy_again=copy_again,
                           preempt=(do_persist, copy_persisted))

    def _persist_due(self, step: int) -> bool:
        """Whether the snapshot of `step` is persisted: a step due under persist_every fell
        in (step - snapshot_every, step]."""
        if self.snapshot_every == 1:
            return self._advisor.due(step)
        every = self._advisor.every
        return step // every > (step - self.snapshot_every) // every

    def _save_preempted(self, client: Any, step: int, copy_persisted: Optional[Callable[[], Any]],
                        t0: float) -> bool:
        """The preemption save: copied by `copy_persisted` (never skipped: with on_busy="skip",
        the persists in flight are waited for first), persisted, and waited for until
        committed. `copy_persisted` None: every rank's snapshot of `step` is persisted already
        (the save whose collective brought the notice), only the wait remains."""
        grace = self._watch.grace_s if self._watch is not None else None
        timeout = -1.0 if grace is None else float(grace)
        try:
            saved = True
            if copy_persisted is not None:
                if self.on_busy == "skip":
                    client.wait(timeout)
                saved = self._saved(step, copy_persisted(), t0, copy_again=copy_persisted)
            client.wait(timeout)
        except Exception as e:
            self._preemption_saved(step, e)  # with on_preemption="exit": the process ends
            raise
        self._preemption_saved(step)  # with on_preemption="exit": the process ends here
        return saved

    def before_update(self) -> Optional[bool]:
        """Waits until the copy of an overlapped save (``save(..., overlap=True)``) is done, so
        that the state may change. Returns whether that snapshot was taken (False: skipped;
        None: no overlapped save was running). Called on its own before ``step()`` of the
        optimizers in the saved state."""
        if self._pending is None or self._client is None:
            return None
        step, t0, call_seconds, copy_again = self._pending
        preempt, self._pending, self._pending_preempt = self._pending_preempt, None, None
        t1 = time.perf_counter()
        snap = self._client.save_finish()
        if snap is None:
            return None
        return self._saved(step, snap, t0, (t1, call_seconds), copy_again, preempt)

    def _hook_optimizers(self, state: Any) -> None:
        """Registers before_update() as a step pre-hook of each optimizer among the values of
        `state`'s top-level mapping (once per optimizer)."""
        values = state.values() if isinstance(state, Mapping) else [state]
        for v in values:
            hook = getattr(v, "register_step_pre_hook", None)
            if hook is None or not callable(hook):
                continue
            try:
                if v in self._hooks:
                    continue
            except TypeError:  # not weakly referenceable: no hook, before_update() by hand
                continue
            me = weakref.ref(self)

            def pre_step(_opt: Any, _args: Any, _kwargs: Any, me: Any = me) -> None:
                ckpt = me()
                if ckpt is not None:
                    ckpt.before_update()
            self._hooks[v] = hook(pre_step)

    def _unhook(self) -> None:
        for handle in list(self._hooks.values()):
            handle.remove()
        self._hooks.clear()

    def _saved(self, step: int, snap: Any, t0: float,
               overlapped: Optional[tuple[float, float]] = None,
               copy_again: Optional[Callable[[], Any]] = None,
               preempt: Optional[tuple[bool, Callable[[], Any]]] = None) -> bool:
        """Records a save's result (after its copy) and tells the agent, in one message: the
        snapshot note with the save's report (saves are made with notify=False for that); with
        dedupe, after the ranks agreed on the replicas and on a preemption notice. `overlapped`:
        (when before_update began waiting, how long the save call took) of an overlapped save.
        `copy_again`: saves the same state again (with dedupe, when this rank's copy left out
        tensors under a plan that no longer holds). `preempt`: (whether this copy is
        persisted, a copy that is) for a notice the collective brings: this save then goes on
        as the preemption save (None: it is the preemption save already)."""
        res = _fields(snap)
        skip: list = []
        notice, changed = 0, True
        if self.dedupe:
            # Every rank calls save for the step: agree on a preemption notice, on who copies
            # and who writes which replica, then tell the agent. A rank that dies before this
            # is flushed without skipping (its snapshot leaves out only what its node's other
            # ranks copied).
            again = False
            notice = mine = self._notice_code() if preempt is not None else 0
            try:
                notice, changed = self._replicas.agree(self._live, snap, mine)
                skip, again = self._replicas.skip_ranges(self._live, snap, changed,
                                                         self.replication is None)
            except Exception as e:  # a peer is gone or out of step: write every tensor
                warnings.warn(f"safepoint: step {step}: the ranks could not agree on who writes "
                              f"the replicas ({e}); this rank writes all of its tensors and "
                              f"copies them all from the next save on"
                              + (" (and goes by its own preemption notice)" if mine else ""),
                              RuntimeWarning, stacklevel=3)
                self._replicas.reset(self._live)
                skip = []
            else:
                # What follows is this rank's alone (the plans are agreed): a failure here
                # must not change what the ranks' next collectives are.
                try:
                    if again and copy_again is not None:
                        # The structure changed on some rank since this rank's copy plan was
                        # made: the tensors it left out may be in no other snapshot. The agent
                        # gets that copy as it is (its lease is the agent's to release; the
                        # step commits only once every tensor is held), and the same state,
                        # unchanged (still inside save, or before the optimizer's step), is
                        # copied again in full: the snapshot completed last is the step's.
                        self._live.notify([], step)
                        self._live.set_copy_skip([])
                        snap = copy_again()
                        res = _fields(snap)
                        if not res["saved"]:
                            skip = []
                    self._replicas.apply(self._live)
                except Exception as e:
                    warnings.warn(f"safepoint: step {step}: this rank could not copy its state "
                                  f"again in full or take its share of the next copies ({e}); "
                                  f"it copies every tensor from the next save on",
                                  RuntimeWarning, stacklevel=3)
                    with contextlib.suppress(Exception):
                        self._live.set_copy_skip([])
        now = time.perf_counter()
        if overlapped is None:
            res["blocking_seconds"] = now - t0
            res["overlap_wait_seconds"] = None
        else:  # training stalled in save() and in before_update(), not in between
            res["blocking_seconds"] = overlapped[1] + now - overlapped[0]
            res["overlap_wait_seconds"] = now - overlapped[0]
        res["agent_error"] = self._live.notify(
            skip, step, res["blocking_seconds"], int(res["image_bytes"]) if res["saved"] else 0)
        res["reused_plan"] = self._live.last_save_reused_plan()
        res["step"] = step
        self._advisor.saved(self, step, res["blocking_seconds"])
        self._stats["saves"] += 1
        self._stats["blocking_seconds_sum"] += res["blocking_seconds"]
        self._stats["last_save"] = res
        if not res["saved"]:
            self._stats["skipped_saves"] += 1
        if res["agent_error"]:
            self._stats["agent_errors"] += 1
            warnings.warn(f"safepoint: step {step} is snapshotted in memory but the agent could "
                          f"not be told: {res['agent_error']}", RuntimeWarning, stacklevel=3)
        self._check_persists()
        if preempt is not None and notice > 0 and self._preemption_agreed(notice):
            # The notice reached some rank: this save goes on as the preemption save on every
            # rank (each saw the same all-reduce). Copied again, persisted, unless every rank's
            # copy was taken (none changed) and persisted.
            persisted, copy_persisted = preempt
            return self._save_preempted(self._live, step,
                                        None if persisted and not changed else copy_persisted,
                                        t0)
        return bool(res["saved"])

    def _check_persists(self) -> None:
        """Warns (RuntimeWarning) when the node agent failed to persist snapshots of this rank:
        at the first save that sees a failure, then at most every PERSIST_WARN_EVERY_S while
        new ones come. The agent counts them in its status (ranks[].persists_failed and
        last_error); save() asks at most every PERSIST_CHECK_S seconds."""
        now = time.monotonic()
        if now < self._persist_check_at or self._client is None:
            return
        self._persist_check_at = now + PERSIST_CHECK_S
        try:
            agent = json.loads(self._client.agent_status())
        except Exception:  # the agent is being replaced: the next check asks again
            return
        mine: dict[str, Any] = next(
            (r for r in agent.get("ranks", []) if r.get("rank") == self.rank), {})
        failed = int(mine.get("persists_failed") or 0)
        self._persists_failed_seen = failed
        if failed <= self._persists_failed_warned or now < self._persist_warn_at:
            return
        new = failed - self._persists_failed_warned
        self._persists_failed_warned, self._persist_warn_at = failed, now + PERSIST_WARN_EVERY_S
        warnings.warn(
            f"safepoint: {self.path}: the node agent failed to persist {new} snapshot(s) of "
            f"rank {self.rank} ({failed} in all); the last error: "
            f"{mine.get('last_error') or 'unknown'}. The steps stay in memory only (lost with "
            "this node) and wait() raises; status()['persists_failed'] counts them. (This "
            f"warning repeats at most every {PERSIST_WARN_EVERY_S:g} s while persists fail.)",
            RuntimeWarning, stacklevel=4)

    def wait(self, timeout: Optional[float] = None) -> None:
        """Blocks until every step persisted so far is committed, and with ``redundancy`` until
        the newest snapshot reached its peers; raises if persisting failed (replication failures
        show in ``status()["replication"]``, they do not raise)."""
        self._live.wait(-1.0 if timeout is None else float(timeout))
