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
snapshot, as when any training process dies. ``close()`` puts the previous handlers back where
the watch's handler is still the installed one (a handler installed after it stays; the watch's
then only chains). A Python handler runs only between bytecodes of the main thread: a main
thread blocked in a long call into C (a collective waiting on a dead peer) sees the notice when
the call returns, and the scheduler's kill ends it otherwise.

With several ranks, ``agreed()`` is a collective (one all-reduce of one int, MAX, on the
Checkpointer's gloo group): a notice on any rank is a notice on every rank at the same save.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import warnings
from collections.abc import Sequence
from types import FrameType
from typing import Any, Callable, Optional, Union

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

_Handler = Union[Callable[[int, Optional[FrameType]], Any], int, signal.Handlers, None]


class PreemptionWatch:
    """The preemption notice of one Checkpointer: signal handlers (main thread only), an
    explicit ``notify()``, and the grace timer. ``noticed`` is whether a notice arrived."""

    def __init__(self, signals: Sequence[int] = DEFAULT_SIGNALS,
                 grace_s: Optional[float] = None) -> None:
        self.signals = tuple(signals)
        self.grace_s = grace_s
        self.signum: Optional[int] = None  # the signal that gave the notice (None: notify())
        self._event = threading.Event()
        self._previous: dict[int, _Handler] = {}
        self._timer: Optional[threading.Timer] = None
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
            if self.grace_s is not None:
                self._timer = threading.Timer(self.grace_s, _default_action, (signum,))
                self._timer.daemon = True
                self._timer.start()
        if callable(previous):
            previous(signum, frame)
        if second:
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


def _default_action(signum: int) -> None:
    """Ends the process as the signal would without any handler, from any thread: the C-level
    disposition back to SIG_DFL (signal.signal is main-thread only, and a main thread blocked in
    C would never run a Python handler), then the signal again."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
    libc.signal(signum, None)  # SIG_DFL is 0
    os.kill(os.getpid(), signum)


def agreed(group: Any, noticed: bool) -> bool:
    """Whether any rank has a notice (all-reduce MAX on `group`; a collective). A failing
    collective (a peer gone) leaves this rank's own notice, with a warning."""
    if group is None:
        return noticed
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1 if noticed else 0], dtype=torch.int32)
    try:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    except Exception as e:
        warnings.warn(f"safepoint: the ranks could not agree on a preemption notice ({e}); "
                      "this rank goes by its own", RuntimeWarning, stacklevel=4)
        return noticed
    return bool(flag.item())
