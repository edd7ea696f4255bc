"""Crash-safe file publication: write a temporary, fsync it, rename, fsync the directory."""

from __future__ import annotations

import os
import threading
from typing import BinaryIO, Callable


def fsync_dir(path: str) -> None:
    """Make a rename or creation inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str, data: bytes, *, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` so that readers see either the old or the new file."""
    atomic_write_with(path, lambda handle: handle.write(data), durable=durable)


def atomic_write_with(path: str, fill: Callable[[BinaryIO], object], *, durable: bool = True) -> None:
    """Replace ``path`` with what ``fill`` writes into a temporary file; readers see either the old
    or the complete new file.

    The temporary name carries the pid and the thread id, so that neither two processes nor
    two threads of one process (a heartbeat and the main loop, say) ever share it.
    """
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        with open(tmp, "wb") as handle:
            fill(handle)
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        # A failed write (a full disk, say) leaves the old file, and no stray temporary.
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(os.path.dirname(os.path.abspath(path)))
