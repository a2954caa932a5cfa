"""Preemption notices: the signal handlers of a ``Checkpointer`` and the ranks' agreement on them.

A scheduler that preempts a job (Slurm, Kubernetes, spot instances) sends SIGTERM, or a signal
it was told to send ahead of time (SIGUSR1), and kills the process a grace period later. A
``PreemptionWatch`` turns the first such signal into a notice that the Checkpointer's next
``save()`` reads: that save copies and persists the step whatever the schedule
(docs/guide.md, "Preemption").

Handlers are installed only from the main thread (Python runs signal handlers there and allows
installing them nowhere else); elsewhere none is, and ``notify()`` (any thread) gives the notice.
Each handler chains: the handler installed before it (a Python callable) runs too, on every
signal. A second signal, or ``grace_s`` seconds after the first, ends the process as the
signal's default action would (SIG_DFL, raised again): the node agent then persists the newest
snapshot, as when any training process dies. ``save_wait_s`` (the Checkpointer's
``on_preemption="exit"`` without ``grace_s``) does the same when the preemption save has not
begun (``saving()``) that long after the first signal: a loop that makes no further save still
ends. Each of these ends says so in one line on stderr (``say``). ``close()`` puts the previous
handlers back where the watch's handler is still the installed one (a handler installed after
it stays; the watch's then only chains). A Python handler runs only between bytecodes of the
main thread: a main thread blocked in a long call into C (a collective waiting on a dead peer)
sees the notice when the call returns, and the scheduler's kill ends it otherwise.

With several ranks, ``agreed()`` is a collective (one all-reduce of one int, MAX, on the
Checkpointer's gloo group: ``_collectives.all_reduce_max``): a notice on any rank is a notice on
every rank at the same save, and each rank learns the signal that gave it (to end as that signal
would, though its own may come later).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Sequence
from types import FrameType
from typing import Any, Callable, Optional, Union

from safepoint import _collectives

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# With on_preemption="exit" and no grace_s: how long after the notice a loop may take to begin
# the preemption save (its next save() call) before the process ends without it.
DEFAULT_SAVE_WAIT_S = 20.0

_Handler = Union[Callable[[int, Optional[FrameType]], Any], int, signal.Handlers, None]


class PreemptionWatch:
    """The preemption notice of one Checkpointer: signal handlers (main thread only), an
    explicit ``notify()``, and the grace timer. ``noticed`` is whether a notice arrived."""

    def __init__(self, signals: Sequence[int] = DEFAULT_SIGNALS,
                 grace_s: Optional[float] = None, save_wait_s: Optional[float] = None,
                 who: str = "safepoint") -> None:
        self.signals = tuple(signals)
        self.grace_s = grace_s
        self.save_wait_s = save_wait_s
        self.who = who  # how the lines on stderr begin ("safepoint", "safepoint [rank 3]")
        self.signum: Optional[int] = None  # the signal that gave the notice (None: notify())
        self._event = threading.Event()
        self._previous: dict[int, _Handler] = {}
        self._timer: Optional[threading.Timer] = None
        self._saving = False
        self._installed = False
        self._closed = False

    @property
    def noticed(self) -> bool:
        return self._event.is_set()

    @property
    def installed(self) -> bool:
        """Whether this watch's signal handlers are installed (only from the main thread)."""
        return self._installed

    def install(self) -> bool:
        """Installs the handlers when called from the main thread; False (none) elsewhere."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        self._installed = True
        return True

    def notify(self) -> None:
        """A preemption notice given by the program (any thread): no signal, no grace timer."""
        self._event.set()

    def saving(self) -> None:
        """The preemption save begins: the ``save_wait_s`` timer stops (``grace_s`` runs on)."""
        self._saving = True
        if self._timer is not None and self.grace_s is None:
            self._timer.cancel()
            self._timer = None

    def _expire(self, signum: int, seconds: float, hard: bool) -> None:
        if self._closed or (not hard and self._saving):
            return
        name = signal_name(signum)
        what = ("the preemption save did not end" if self._saving and hard
                else "no save() began")
        say(f"{self.who}: {name}: {what} within {seconds:g} s of the notice; ending the process "
            f"as {name} does (the node agent persists the newest snapshot in memory)")
        _default_action(signum)

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        previous = self._previous.get(signum)
        if self._closed:  # closed, but installed still (close() off the main thread) or chained
            if callable(previous):
                previous(signum, frame)
            elif previous in (signal.SIG_DFL, None):
                _default_action(signum)  # as if this handler had never been installed
            return
        second = self.signum is not None
        if not second:
            self.signum = signum
            self._event.set()
            limit = self.grace_s if self.grace_s is not None else self.save_wait_s
            if limit is not None:
                self._timer = threading.Timer(limit, self._expire,
                                              (signum, limit, self.grace_s is not None))
                self._timer.daemon = True
                self._timer.start()
        if callable(previous):
            previous(signum, frame)
        if second:
            name = signal_name(signum)
            say(f"{self.who}: a second {name}: ending the process as {name} does (the node "
                "agent persists the newest snapshot in memory)")
            _default_action(signum)

    def close(self) -> None:
        """Puts the previous handlers back (where this watch's is still installed) and stops
        the grace timer. Idempotent."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._installed or threading.current_thread() is not threading.main_thread():
            return  # signal.signal works only there; the handlers just chain from now on
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._installed = False  # (_previous stays: a handler installed later may chain here)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def say(line: str) -> None:
    """One line on stderr, written at once (safe in a signal handler or a timer thread, and
    before the process ends by a signal: nothing stays in a buffer)."""
    try:
        os.write(2, (line.rstrip("\n") + "\n").encode(errors="replace"))
    except OSError:
        pass


def end_as_signal(signum: int) -> None:
    """Ends the process as ``signum`` would without any handler (its exit status a death by
    that signal), after flushing Python's stdout and stderr buffers. Never returns."""
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:
            pass
    _default_action(signum)


def _default_action(signum: int) -> None:
    """Ends the process as the signal would without any handler, from any thread: the C-level
    disposition back to SIG_DFL (signal.signal is main-thread only, and a main thread blocked in
    C would never run a Python handler), then the signal again. Should the signal not end it
    (blocked in every thread, or a default action that does not terminate), the process exits
    with 128 + signum, as a shell reports a death by that signal."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
    libc.signal(signum, None)  # SIG_DFL is 0
    os.kill(os.getpid(), signum)
    time.sleep(5.0)
    os._exit(128 + signum)


def notice_code(watch: PreemptionWatch) -> int:
    """This rank's notice as the int the ranks agree on: 0 none, 1 ``notify()``, signum + 1
    a signal (the greatest wins: a signal over ``notify()``)."""
    if not watch.noticed:
        return 0
    return 1 if watch.signum is None else watch.signum + 1


def agreed(group: Any, code: int) -> int:
    """The greatest notice code of the ranks (``notice_code``; all-reduce MAX on `group`; a
    collective): a notice on any rank is a notice on every rank, and every rank learns the
    signal that gave it. A failing collective (a peer gone) leaves this rank's own, with a
    warning."""
    if group is None:
        return code
    import torch

    flag = torch.tensor([code], dtype=torch.int32)
    try:
        _collectives.all_reduce_max(flag, group)
    except Exception as e:
        warnings.warn(f"safepoint: the ranks could not agree on a preemption notice ({e}); "
                      "this rank goes by its own", RuntimeWarning, stacklevel=4)
        return code
    return int(flag.item())
