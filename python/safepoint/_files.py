"""Small file-system helpers of the Python layer."""

from __future__ import annotations

import os


def fsync_dir(path: str) -> None:
    """Makes the names in directory ``path`` (files created, renamed or removed) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
