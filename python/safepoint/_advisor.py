"""A Checkpointer's ``persist_every="auto"`` schedule and what it learns from the job's history
(docs/guide.md, "The interval advisor").

The job's measurement history (save blocking times, persists, tier copies, restores, starts and
clean ends) is kept by the node agent that serves rank 0, next to the job's checkpoints
(src/advisor/history.h, src/agent/history_recorder.h): each save's report travels with its
snapshot note (one message per save), a restore's and the run's start as reports. This process
writes none of it and polls the agent for none of it; it only reads the history once, at start
(``_core.read_job_history``), for the learned MTBF and restart and restore times. With
``persist_every="auto"`` the schedule follows the C++ advisor's interval for the checkpoint path
(``_core.advise_interval``) through a ``_core.IntervalController`` (bounded, with hysteresis),
converted to steps with the measured time per step; the persist time it needs is read from this
rank's snapshot slots, where the agent records how long each snapshot's write to storage took
(``Client.last_persisted``, shared memory: no message; an agent of an earlier version records
none, and is asked for its status instead). Every rank must persist the same steps, so
the schedule is re-evaluated every ``ADVISE_EVERY_SAVES`` saves (all ranks save equally often)
and, under torch.distributed, rank 0's result is broadcast.
"""

from __future__ import annotations

import collections
import statistics
import time
import warnings
from typing import Any, Optional, Union

from safepoint import _core
from safepoint.errors import Error, InvalidArgumentError, NotFoundError

ADVISE_EVERY_SAVES = 10
_WINDOW = 64  # recent samples kept for the medians


def parse_mtbf(path: str, mtbf: Union[None, int, float, str]) -> Optional[float]:
    if mtbf is None:
        return None
    if isinstance(mtbf, str):
        try:
            return _core.parse_duration(mtbf)
        except InvalidArgumentError as e:
            raise InvalidArgumentError(f"{path}: mtbf: {e}") from None
    if isinstance(mtbf, bool) or not isinstance(mtbf, (int, float)) or not mtbf > 0 \
            or mtbf == float("inf"):
        raise InvalidArgumentError(f"{path}: mtbf must be a positive number of seconds or a "
                                   f"duration like '3h', got {mtbf!r}")
    return float(mtbf)


class Advisor:
    """The persist schedule of one Checkpointer, and the names of its history's levels."""

    def __init__(self, path: str, job: str, rank: int, run: int,
                 persist_every: Union[int, str], mtbf: Optional[float],
                 tiers: list[Any]) -> None:
        self.path, self.rank = path, rank
        self.auto = persist_every == "auto"
        self.every = 1 if self.auto else int(persist_every)
        self.mtbf = mtbf
        self._levels = {path: "path", **{t.uri: f"tier {i}" for i, t in enumerate(tiers, 1)}}
        self._auto_tiers = [f"tier {i}" for i, t in enumerate(tiers, 1) if t.every == "auto"]
        self.past: Optional[Any] = None  # the history as it was when this process started
        if rank == 0:
            try:
                self.past = _core.read_job_history(path, job)
            except NotFoundError:
                pass
            except Error as e:
                warnings.warn(f"safepoint: cannot read the measurement history ({e})",
                              RuntimeWarning, stacklevel=3)
        self._saves = 0
        self._blocking: collections.deque[float] = collections.deque(maxlen=_WINDOW)
        self._persist: collections.deque[float] = collections.deque(maxlen=_WINDOW)
        self._step_seconds: collections.deque[float] = collections.deque(maxlen=_WINDOW)
        self._restores: dict[str, float] = {}
        self._last: Optional[tuple[int, float]] = None  # (step, time) of the previous save
        self._persisted_step: Optional[int] = None  # the newest persist sampled
        self._advice: Optional[Any] = None
        self._controller = _core.IntervalController(0.0, 0.0, 86400.0, 0.25)
        self._why = ("no measurements yet: persisting every step until the advisor has them"
                     if self.auto else f"persist_every={self.every}")

    # -- the schedule ---------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        return step % self.every == 0

    def saved(self, ckpt: Any, step: int, blocking: float) -> None:
        """After each save: keep the sample; every ADVISE_EVERY_SAVES saves (auto) re-evaluate
        the schedule. (The agent records the save in the history: its report went with the
        snapshot note.)"""
        now = time.monotonic()
        if self._last is not None and step > self._last[0]:
            self._step_seconds.append((now - self._last[1]) / (step - self._last[0]))
        self._last = (step, now)
        self._blocking.append(blocking)
        self._saves += 1
        if not self.auto or self._saves % ADVISE_EVERY_SAVES:
            return
        if self.rank == 0:
            self._sample_persist(ckpt)
        every = self._reevaluate() if self.rank == 0 else self.every
        if ckpt._group is not None:
            import torch.distributed as dist

            box = [every]
            dist.broadcast_object_list(box, src=0, group=ckpt._group)
            every = box[0]
        self.every = max(1, int(every))

    def _sample_persist(self, ckpt: Any) -> None:
        """The persist time of the newest snapshot the agent wrote to storage, from this rank's
        slots (the agent records it there; no message)."""
        got = ckpt._live.last_persisted()
        if got is None and ckpt._live.last_persist_step() is not None:
            got = self._ask_agent(ckpt)  # an agent of an earlier version records none
        if got is not None and got[0] != self._persisted_step:
            self._persisted_step = got[0]
            self._persist.append(float(got[1]))

    @staticmethod
    def _ask_agent(ckpt: Any) -> Optional[tuple[int, float]]:
        try:
            st = ckpt.status()
        except Exception:  # the agent is restarting: try again at the next evaluation
            return None
        step, seconds = st.get("last_persisted_step"), st.get("last_persist_seconds")
        return (int(step), float(seconds)) if step is not None and seconds else None

    def _mtbf(self) -> tuple[Optional[float], str]:
        if self.mtbf is not None:
            return self.mtbf, "configured"
        past = self.past
        if past is not None and past.learned_mtbf_seconds:
            return past.learned_mtbf_seconds, f"learned from {past.interruptions} restarts"
        return None, ""

    def _reevaluate(self) -> int:
        mtbf, mtbf_source = self._mtbf()
        if mtbf is None:
            self._why = ("no failure rate: pass mtbf= (or it is learned after the job's first "
                         "restart); persisting every step")
            return self.every
        if not self._blocking or not self._step_seconds:
            return self.every
        save = statistics.median(self._blocking)
        persist = statistics.median(self._persist) if self._persist else None
        restore = self._restores.get("path")
        if restore is None and self.past is not None and "path" in self.past.restore:
            restore = self.past.restore["path"].seconds
        restore_note = "measured"
        if restore is None:  # reading back costs about what writing did, until measured
            restore, restore_note = (persist or 0.0), "estimated as the persist time"
        restart = self.past.restart.seconds if self.past is not None and self.past.restart \
            else None
        try:
            advice = _core.advise_interval("path", save, persist, restore, restart, mtbf)
        except Error as e:
            self._why = f"no advice: {e}"
            return self.every
        self._advice = advice
        why = (f"{advice.explain()} (MTBF {mtbf_source}; restore time {restore_note}; "
               f"{statistics.median(self._step_seconds):.3g} s per step)")
        self._controller.update(advice.interval_seconds, why)
        self._why = self._controller.reason
        per_step = statistics.median(self._step_seconds)
        return max(1, round(self._controller.interval_seconds / per_step)) if per_step > 0 else 1

    # -- restores and the end -------------------------------------------------------------------
    def restored(self, source: str, uri: Optional[str], seconds: float) -> str:
        """Keeps a restore's time; returns its level in the history ("memory", "peer", "path",
        "tier N"), which the restore's report gives the agent."""
        level = source if source != "storage" else self._levels.get(uri or self.path, "path")
        self._restores[level] = seconds
        return level

    def status(self, tiers: list[dict[str, Any]]) -> dict[str, Any]:
        """The schedule and why; `tiers`: the agent's tier status (each tier's last copy time)."""
        copy = {f"tier {t.get('tier')}": float(t["last_copy_seconds"])
                for t in tiers if t.get("last_copy_seconds")}
        a = self._advice
        return {
            "mode": "auto" if self.auto else "steps",
            "every_steps": self.every,
            "seconds": self._controller.interval_seconds if self.auto else None,
            "recommended_seconds": a.interval_seconds if a is not None else None,
            "expected_goodput": a.expected_goodput if a is not None else None,
            "changes": self._controller.changes,
            "reason": self._why,
            "tiers": {level: "auto: every step committed on the tier above, the newest whenever "
                      "the previous copy is done, so as fast as the tier copies"
                      + (f" (last copy {copy[level]:.3g} s)" if level in copy else "")
                      + "; a copy costs training nothing, so the goodput-optimal interval is as "
                      "often as the tier accepts steps" for level in self._auto_tiers},
        }
