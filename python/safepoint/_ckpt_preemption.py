"""The preemption part of a ``Checkpointer``: its ``PreemptionWatch`` (``_preemption``), the
notice, and whether a save is the preemption save (docs/guide.md, "Preemption")."""

from __future__ import annotations

from typing import Optional

from safepoint._ckpt_base import CheckpointerBase
from safepoint._preemption import PreemptionWatch, agreed
from safepoint.errors import InvalidArgumentError


class PreemptionMixin(CheckpointerBase):
    """Checkpointer's preemption watch and notice."""

    def _watch_preemption(self, on: Optional[bool], grace_s: Optional[float],
                          signals: tuple[int, ...]) -> Optional[PreemptionWatch]:
        """The preemption watch (None: off), its handlers installed from the main thread."""
        if on is None:
            on = self.world_size == 1 or self.dedupe
        if not on:
            return None
        if self.world_size > 1 and self._group is None:
            raise InvalidArgumentError(
                f"{self.path}: preemption=True with {self.world_size} ranks needs "
                "torch.distributed initialized (the ranks agree on the step to preempt at)")
        watch = PreemptionWatch(signals, grace_s)
        watch.install()
        return watch

    def _stop_watching(self) -> None:
        if self._watch is not None:
            self._watch.close()

    @property
    def preemption_handlers_installed(self) -> bool:
        """Whether the preemption signal handlers are installed (only from the main thread)."""
        return self._watch is not None and self._watch.installed

    def notify_preemption(self) -> None:
        """Gives the preemption notice without a signal (from any thread, e.g. one that polls a
        cloud provider's spot-interruption notice): the next ``save`` persists its step. Raises
        when preemption handling is off."""
        if self._watch is None:
            raise InvalidArgumentError(f"{self.path}: preemption handling is off "
                                       "(Checkpointer(..., preemption=False))")
        self._watch.notify()
    def _preemption_now(self) -> bool:
        """Whether this save is the preemption save: a notice reached some rank (with several
        ranks, a collective while no save has preempted yet). Sets ``preempted``."""
        if self._watch is None or self.preempted:
            return False
        if not agreed(self._group, self._watch.noticed):
            return False
        self.preempted = True
        return True

