"""The preemption part of a ``Checkpointer``: its ``PreemptionWatch`` (``_preemption``), the
notice, whether a save is the preemption save, and what follows that save (docs/guide.md,
"Preemption"): with ``on_preemption="exit"`` (default) the process ends as the signal would have
ended it, once the step is committed; with ``"return"`` the program stops on its own.

The integrations (``safepoint.hf``, ``.lightning``, ``.deepspeed``) have more to do after the
preemption save than a plain loop (pointer files, the framework's own end of training): they set
``_preemption_exit_deferred`` on their Checkpointer, so that the save returns, and end the
process with ``_exit_after_preemption()`` once their loop has stopped."""

from __future__ import annotations

from typing import Optional

from safepoint._ckpt_base import CheckpointerBase
from safepoint._preemption import (
    DEFAULT_SAVE_WAIT_S,
    PreemptionWatch,
    agreed,
    end_as_signal,
    notice_code,
    say,
    signal_name,
)
from safepoint.errors import InvalidArgumentError

ON_PREEMPTION = ("exit", "return")


class PreemptionMixin(CheckpointerBase):
    """Checkpointer's preemption watch and notice."""

    on_preemption: str
    # The ranks' agreed notice (_preemption.notice_code; 0: none yet): the next save preempts
    _notice_agreed: int
    _preempted_step: Optional[int]
    # Set by an integration: the preemption save returns, and the integration ends the process
    # (_exit_after_preemption) once its loop has stopped.
    _preemption_exit_deferred: bool = False

    def _watch_preemption(self, on: Optional[bool], grace_s: Optional[float],
                          signals: tuple[int, ...]) -> Optional[PreemptionWatch]:
        """The preemption watch (None: off), its handlers installed from the main thread."""
        self._notice_agreed, self._preempted_step = 0, None
        if on is None:
            on = self.world_size == 1 or self.dedupe
        if not on:
            return None
        if self.world_size > 1 and self._group is None:
            raise InvalidArgumentError(
                f"{self.path}: preemption=True with {self.world_size} ranks needs "
                "torch.distributed initialized (the ranks agree on the step to preempt at)")
        save_wait = DEFAULT_SAVE_WAIT_S if self.on_preemption == "exit" else None
        watch = PreemptionWatch(signals, grace_s, save_wait, self._who())
        watch.install()
        return watch

    def _who(self) -> str:
        return "safepoint" if self.world_size == 1 else f"safepoint [rank {self.rank}]"

    def _stop_watching(self) -> None:
        if self._watch is not None:
            self._watch.close()

    @property
    def preemption_handlers_installed(self) -> bool:
        """Whether the preemption signal handlers are installed (only from the main thread)."""
        return self._watch is not None and self._watch.installed

    def notify_preemption(self) -> None:
        """Gives the preemption notice without a signal (from any thread, e.g. one that polls a
        cloud provider's spot-interruption notice): the next ``save`` persists its step and
        returns (no signal to end the process with: the program stops on its own). Raises
        when preemption handling is off."""
        if self._watch is None:
            raise InvalidArgumentError(f"{self.path}: preemption handling is off "
                                       "(Checkpointer(..., preemption=False))")
        self._watch.notify()

    def preemption_pending(self) -> bool:
        """Whether a preemption notice reached some rank and its save is still to come: the
        next ``save`` (of any step, due or not) is then the preemption save. For loops that
        call ``save`` only now and then: ``if step % 100 == 0 or ckpt.preemption_pending():
        ckpt.save(step, state)``. With several ranks it is a collective like ``save`` (one
        all-reduce of one int until it is True): every rank calls it at the same steps. (A
        save that copies, with dedupe, needs no call before it: its one collective carries the
        notice.)"""
        if self._watch is None or self.preempted:
            return False
        if not self._notice_agreed:
            self._notice_agreed = agreed(self._group, notice_code(self._watch))
        return self._notice_agreed > 0

    def _preemption_now(self) -> bool:
        """Whether this save is the preemption save: a notice reached some rank (with several
        ranks, a collective while no save has preempted yet). Sets ``preempted``."""
        if not self.preemption_pending():
            return False
        self.preempted = True
        if self._watch is not None:
            self._watch.saving()  # the wait for a save is over: the save's own wait begins
        return True

    def _preemption_agreed(self, notice: int = 0) -> bool:
        """As ``_preemption_now`` without a collective: whether a notice the ranks agreed on
        already (``preemption_pending``, or `notice`: what a save's own collective brought,
        the same on every rank) makes this save the preemption save. Sets ``preempted``."""
        if self._watch is None or self.preempted:
            return False
        self._notice_agreed = self._notice_agreed or notice
        if not self._notice_agreed:
            return False
        self.preempted = True
        self._watch.saving()
        return True

    def _notice_code(self) -> int:
        """This rank's notice for a save's collective to carry (``notice_code``); 0 when none
        is to come: no watch, or the preemption save made already."""
        if self._watch is None or self.preempted:
            return 0
        return notice_code(self._watch)

    def _notice_signal(self) -> Optional[int]:
        """The signal that gave the notice, on this rank or (agreed) on another; None for
        ``notify_preemption()`` or no notice."""
        if self._notice_agreed > 1:
            return self._notice_agreed - 1
        return self._watch.signum if self._watch is not None else None

    def _notice_name(self) -> str:
        signum = self._notice_signal()
        return signal_name(signum) if signum is not None else "preemption notice"

    def _preemption_saved(self, step: int, error: Optional[BaseException] = None) -> None:
        """After the preemption save of `step` (committed, or failed with `error`): one line on
        stderr, and with on_preemption="exit" after a signal, the end of the process (now, or
        after the integration's loop when deferred). Returns when the program goes on."""
        self._preempted_step = step
        signum = self._notice_signal()
        name = self._notice_name()
        # the signal to end the process with (None: the program stops on its own)
        exits = signum if self.on_preemption == "exit" else None
        if error is not None:
            if exits is not None:  # the scheduler's end comes anyway: nothing is gained by going on
                say(f"{self._who()}: {name}: the preemption save of step {step} failed "
                    f"({error}); ending the process as {name} does (the node agent persists "
                    "the newest snapshot in memory)")
                end_as_signal(exits)
            return
        if exits is not None and self._preemption_exit_deferred:
            return  # the integration stops its loop, then _exit_after_preemption says it all
        if exits is not None:
            say(f"{self._who()}: {name}: step {step} is committed to {self.path}; ending the "
                f"process as {name} does (Checkpointer(on_preemption='return') lets the "
                "program stop on its own)")
            end_as_signal(exits)
        say(f"{self._who()}: {name}: step {step} is committed to {self.path}; ckpt.preempted "
            "is True: the program stops on its own")

    def _exit_after_preemption(self, what: str = "training stopped") -> None:
        """For the integrations (``_preemption_exit_deferred``): once their loop has stopped,
        ends the process as the preemption signal would have (one line on stderr), when one
        reached this process (or, agreed, another rank) and ``on_preemption`` is "exit".
        Returns otherwise."""
        signum = self._notice_signal()
        if self.on_preemption != "exit" or signum is None:
            return
        name = signal_name(signum)
        saved = (f"step {self._preempted_step} is committed to {self.path}"
                 if self._preempted_step is not None
                 else "no save came after the notice (the node agent persists the newest "
                      "snapshot in memory)")
        say(f"{self._who()}: {name}: {saved}; {what}; ending the process as {name} does "
            "(on_preemption='return' lets the program stop on its own)")
        end_as_signal(signum)
