"""safepoint: flash checkpoints for large-model training.

Synchronous API (durable when it returns)::

    import safepoint
    safepoint.save("/ckpt", step, {"model": model.state_dict(), "step": step})
    step, state = safepoint.load("/ckpt")
    safepoint.steps("/ckpt")
"""

from safepoint import _core
from safepoint._api import load, save, steps
from safepoint._checkpointer import Checkpointer
from safepoint.errors import (
    AlreadyExistsError,
    CancelledError,
    CorruptionError,
    Error,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    StorageError,
    UnavailableError,
)

__version__ = _core.__version__
FORMAT_VERSION = _core.FORMAT_VERSION

__all__ = [
    "Checkpointer",
    "save",
    "load",
    "steps",
    "Error",
    "NotFoundError",
    "CorruptionError",
    "StorageError",
    "InvalidArgumentError",
    "UnavailableError",
    "ResourceExhaustedError",
    "CancelledError",
    "AlreadyExistsError",
]
