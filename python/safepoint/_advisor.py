"""A Checkpointer's ``persist_every="auto"`` schedule and what it learns from the job's history
(docs/guide.md, "Choosing the checkpoint interval").

The job's measurement history (save blocking times and steps, persists, tier copies, restores,
starts and clean ends, the job's shape) is kept by the node agent that serves rank 0, next to
the job's checkpoints (src/advisor/history.h, src/agent/history_recorder.h): each save's report
travels with its snapshot note (one message per save), a restore's and the run's start as
reports. This process writes none of it and polls the agent for none of it; it only reads the
history once, at start (``_core.read_job_history``), for the learned MTBF and restart and restore
times.

One model, one answer (src/advisor/plan.h): with ``persist_every="auto"`` the schedule is the
goodput model's, the same computation as ``safepoint advise`` and ``safepoint simulate``. A
persist costs training nothing (the agent writes in the background), so the model persists as
often as storage takes steps: every ``_core.persist_every_saves(persist, save interval)``-th
save, followed through a ``_core.IntervalController`` (bounded, with hysteresis) and given in
steps. The persist time is read from this rank's snapshot slots, where the agent records how long
each snapshot's write to storage took (``Client.last_persisted``, shared memory: no message; an
agent of an earlier version records none, and is asked for its status instead). With a failure
rate (``mtbf=`` or learned) the status also gives the model's goodput at the job's save interval
and its goodput-optimal save interval (``_core.make_plan``). Every rank must persist the same
steps, so the schedule is re-evaluated every ``ADVISE_EVERY_SAVES`` saves (all ranks save equally
often) and, under torch.distributed, rank 0's result is broadcast.
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


def _nth(n: int) -> str:
    """'' for 1, else '2nd ', '3rd ', '11th ', ..."""
    if n == 1:
        return ""
    suffix = "th" if 11 <= n % 100 <= 13 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix} "


def _steps(n: int) -> str:
    return f"{n} step" if n == 1 else f"{n} steps"


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
        self._periods: collections.deque[float] = collections.deque(maxlen=_WINDOW)
        self._steps_per_save: collections.deque[int] = collections.deque(maxlen=_WINDOW)
        self._restores: dict[str, float] = {}
        self._last: Optional[tuple[int, float]] = None  # (step, time) of the previous save
        self._persisted_step: Optional[int] = None  # the newest persist sampled
        self._target: Optional[float] = None  # the model's persist interval, in seconds
        self._chosen: Optional[int] = None  # the steps of the controller's interval
        self._plan: Optional[Any] = None  # the model at the job's save interval
        self._best: Optional[Any] = None  # the model at its goodput-optimal save interval
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
            self._periods.append(now - self._last[1])
            self._steps_per_save.append(step - self._last[0])
        self._last = (step, now)
        self._blocking.append(blocking)
        self._saves += 1
        if not self.auto or self._saves % ADVISE_EVERY_SAVES:
            return
        if self.rank == 0:
            self._sample_persist(ckpt)
        every = self._reevaluate(ckpt) if self.rank == 0 else self.every
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

    def inputs(self, ckpt: Any, save: float, persist: float, step_seconds: float,
               mtbf: float) -> Any:
        """The goodput model's inputs for this job (the same as ``safepoint advise`` builds from
        its history): this process's measurements, the history's restart and restore times, and
        the job's shape (world size, the ranks of this node, copies on peers)."""
        past = self.past
        restore = dict(self._restores)
        if past is not None:
            for level, m in past.restore.items():
                restore.setdefault(level, m.seconds)
        i = _core.SimulationInputs()
        world = int(getattr(ckpt, "world_size", 1) or 1)
        replication = getattr(ckpt, "replication", None)
        nodes = len(replication["nodes"]) if replication else 0
        i.gpus = world
        i.gpus_per_node = max(1, -(-world // nodes)) if nodes else world
        i.peer_copies = bool(replication) and nodes >= 2
        i.mtbf_seconds = mtbf
        i.step_seconds = step_seconds
        i.snapshot_seconds = save
        i.persist_seconds = persist
        if past is not None and past.restart is not None:
            i.restart_seconds = past.restart.seconds
        i.restore_memory_seconds = restore.get("memory", 0.0)
        i.restore_peer_seconds = restore.get("peer", 0.0)
        i.restore_storage_seconds = restore.get("path", 0.0)
        return i

    def _reevaluate(self, ckpt: Any) -> int:
        if not self._blocking or not self._periods:
            return self.every
        if not self._persist:
            self._why = ("no persist time measured yet: persisting every step until the agent "
                         "has written one")
            return self.every
        save = statistics.median(self._blocking)
        period = statistics.median(self._periods)  # from one save to the next
        per_save = max(1, round(statistics.median(self._steps_per_save)))  # steps
        persist = statistics.median(self._persist)
        saves = _core.persist_every_saves(persist, period)
        fd = _core.format_duration
        self._target = saves * period
        why = (f"path: persist every {_nth(saves)}save "
               f"({fd(saves * period)}, {_steps(saves * per_save)}): a persist takes {fd(persist)} "
               "in the background and costs training nothing, so as often as the storage takes "
               f"steps is best (the goodput model; saves every {fd(period)}, "
               f"{_steps(per_save)})")
        mtbf, mtbf_source = self._mtbf()
        self._plan = self._best = None
        if mtbf is not None:
            step_seconds = max(0.0, (period - save) / per_save)
            try:
                inputs = self.inputs(ckpt, save, persist, step_seconds, mtbf)
                self._plan = _core.make_plan(inputs, period)
                self._best = _core.make_plan(inputs)
            except Error as e:
                why += f"; no goodput: {e}"
            else:
                best = self._best.safepoint
                steps = (f" ({_steps(best.interval_steps)})" if best.interval_steps is not None
                         else "")
                why += (f"; expected goodput {100 * self._plan.safepoint.goodput:.1f}% with "
                        f"failures every {fd(mtbf)} (MTBF {mtbf_source}); the goodput-optimal "
                        f"save interval is {fd(best.interval_seconds)}{steps}")
        # The steps chosen with the reason that chose them (the controller keeps both until the
        # model's interval moves by more than its hysteresis).
        if self._controller.update(saves * period, why):
            self._chosen = saves * per_save
        self._why = self._controller.reason
        return self._chosen or self.every

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
        plan, best = self._plan, self._best
        return {
            "mode": "auto" if self.auto else "steps",
            "every_steps": self.every,
            "seconds": self._controller.interval_seconds if self.auto else None,
            "recommended_seconds": self._target,
            "expected_goodput": plan.safepoint.goodput if plan is not None else None,
            "save_interval": None if best is None else {
                "recommended_seconds": best.safepoint.interval_seconds,
                "recommended_steps": best.safepoint.interval_steps,
                "expected_goodput": best.safepoint.goodput},
            "changes": self._controller.changes,
            "reason": self._why,
            "tiers": {level: "auto: every step committed on the tier above, the newest whenever "
                      "the previous copy is done, so as fast as the tier copies"
                      + (f" (last copy {copy[level]:.3g} s)" if level in copy else "")
                      + "; a copy costs training nothing, so the goodput-optimal interval is as "
                      "often as the tier accepts steps" for level in self._auto_tiers},
        }
