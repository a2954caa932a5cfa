"""Ends a rank that made a DeviceMesh on gloo, without the abort torch can hit at interpreter exit.

Once a DeviceMesh exists, torch's gloo worker threads outlive ``destroy_process_group``. A worker
that drops the last reference to a finished collective (which holds tensors with Python objects)
while the interpreter finalizes takes the GIL, is ended by Python, and the unwind through a
noexcept destructor aborts the process: "terminate called without an active exception" after
the rank's work is done (pytorch/pytorch#190489; a fix, pytorch/pytorch#179291, was abandoned).
It happened to 1 run in 6 to 40 of reshard_worker.py's load on this machine. Leaving with
``os._exit`` skips the finalization the race needs; everything the rank had to do is done.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

import torch.distributed as dist


def leave(code: int = 0) -> NoReturn:
    """Destroys the process group (when there is one), flushes output and exits with ``code``."""
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
