"""Exceptions raised by safepoint. Every one names the path (or peer) and the cause.

Each C++ StatusCode (include/safepoint/status.h) raises one of these, chosen in one switch in the
binding (``ExceptionName`` in python/ext/module.cc, which does not compile without a case for
every code): NotFound, Corruption, IOError (StorageError), InvalidArgument, Unavailable,
ResourceExhausted, Cancelled, AlreadyExists, Superseded.
"""


class Error(Exception):
    """Base class of every safepoint error."""


class NotFoundError(Error, FileNotFoundError):
    """The checkpoint, step or object does not exist."""


class CorruptionError(Error):
    """Stored bytes failed validation (checksum, bounds, truncation, bad magic)."""


class StorageError(Error, OSError):
    """The storage failed: I/O error, failed fsync, short write."""


class InvalidArgumentError(Error, ValueError):
    """The caller passed something that cannot work (a type that cannot be saved, a bad rank)."""


class UnavailableError(Error):
    """A service (the node agent, a peer) cannot be reached."""


class PermissionDeniedError(StorageError, PermissionError):
    """The storage may not be written: a read-only filesystem, a directory without write
    permission, an immutable one (raised by the Checkpointer's check of its directory, before
    any save: no C++ code maps to it)."""


class ResourceExhaustedError(StorageError):
    """Out of space: a full disk (ENOSPC), a quota, too little shared memory."""


class CancelledError(Error):
    """The operation was cancelled."""


class AlreadyExistsError(Error):
    """It exists already: e.g. a committed step saved again without ``overwrite=True`` (a
    committed step is immutable)."""


class SupersededError(Error):
    """This process was superseded: a newer run of the job took its rank on this node while it
    still ran (a stale process, e.g. one a network partition left hung in a collective). Its
    saves fail and the agent refuses it, so that nothing it writes can be taken for the job's
    newest snapshot; end it (docs/reliability.md, "Superseded processes")."""


__all__ = [
    "Error",
    "NotFoundError",
    "CorruptionError",
    "StorageError",
    "PermissionDeniedError",
    "InvalidArgumentError",
    "UnavailableError",
    "ResourceExhaustedError",
    "CancelledError",
    "AlreadyExistsError",
    "SupersededError",
]
