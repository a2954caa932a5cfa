"""safepoint: flash checkpoints for large-model training.

Synchronous API (durable when it returns)::

    import safepoint
    safepoint.save("/ckpt", step, {"model": model.state_dict(), "step": step})
    step, state = safepoint.load("/ckpt")
    safepoint.steps("/ckpt")
"""

from safepoint import _core, errors
from safepoint._api import load, restore, save, steps, tag, tags, untag
from safepoint._checkpointer import Checkpointer
from safepoint._stateful import capture_rng, restore_rng
from safepoint._tiers import Tier
from safepoint.errors import *  # noqa: F403  (the exceptions: errors.__all__ names them)

__version__: str = _core.VERSION
FORMAT_VERSION = _core.FORMAT_VERSION

__all__ = [
    "Checkpointer",
    "Tier",
    "save",
    "load",
    "steps",
    "restore",
    "tag",
    "tags",
    "untag",
    "capture_rng",
    "restore_rng",
]
__all__ += errors.__all__
