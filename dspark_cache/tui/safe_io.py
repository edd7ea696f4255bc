"""Opening cache files without trusting them: regular files inside the cache only, bounded reads.

Anyone can drop anything into a cache directory. Opening a FIFO blocks until a writer shows up
(forever), reading a device or ``/dev/zero`` never ends, and a symlink can lead anywhere. So
every file is checked with ``lstat`` before it is opened, opened non-blocking, and checked again
with ``fstat`` on the open descriptor (it may have been swapped in between); reads are capped.
The one file the monitor writes (the stop request) gets the same care.
"""

from __future__ import annotations

import os
import stat
from typing import BinaryIO

from dspark_cache.tui.display import human_bytes

_CHUNK = 1 << 16  # read size once a file turns out larger than its fstat said


class Refused(Exception):
    """A file the monitor will not open; the message says why, for the warnings line."""


_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symlink"))


def kind_of(mode: int) -> str:
    """What a non-regular file is, in words."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def inside(path: str, root_real: str) -> bool:
    """Whether ``path``, all symlinks resolved, lies within the (resolved) cache root."""
    real = os.path.realpath(path)
    try:
        return os.path.commonpath([real, root_real]) == root_real
    except ValueError:  # different drives: never inside
        return False


def check_dir(path: str, root_real: str) -> None:
    """Refuse a cache subdirectory that is not a directory or leads outside the cache.

    ``FileNotFoundError`` passes through (not created yet).
    """
    st = os.stat(path)
    if not inside(path, root_real):
        raise Refused("a symlink to outside the cache, not followed")
    if not stat.S_ISDIR(st.st_mode):
        raise Refused(f"{kind_of(st.st_mode)}, not a directory")


def open_regular(path: str, root_real: str) -> tuple[BinaryIO, os.stat_result]:
    """Open a regular file inside the cache for reading, with its ``fstat``; else :class:`Refused`.

    ``FileNotFoundError`` passes through (a file replaced or removed between listing and opening).
    """
    st = os.lstat(path)
    if not inside(path, root_real):
        raise Refused("a symlink to outside the cache, not followed")
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0)
    if not stat.S_ISLNK(st.st_mode):
        if not stat.S_ISREG(st.st_mode):
            raise Refused(f"{kind_of(st.st_mode)}, not a regular file")
        flags |= getattr(os, "O_NOFOLLOW", 0)  # swapped for a symlink since lstat: fail, not follow
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Refused(f"{kind_of(st.st_mode)}, not a regular file")
        return os.fdopen(fd, "rb"), st
    except BaseException:
        os.close(fd)
        raise


def read_capped(path: str, root_real: str, limit: int, what: str = "file") -> bytes:
    """The whole of a regular file inside the cache, refused when it is larger than ``limit``."""
    handle, st = open_regular(path, root_real)
    with handle:
        if st.st_size > limit:
            raise Refused(_too_large(what, st.st_size, limit))
        data = _read_upto(handle, st.st_size, limit)
    if len(data) > limit:
        raise Refused(_too_large(what, len(data), limit))
    return data


def _read_upto(handle: BinaryIO, expected: int, limit: int) -> bytes:
    """At most ``limit + 1`` bytes, read in pieces: ``read(n)`` reserves ``n`` bytes up front."""
    chunks = [handle.read(expected + 1)]
    total = len(chunks[0])
    while total > expected and total <= limit:  # it grew since fstat
        chunk = handle.read(min(_CHUNK, limit + 1 - total))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)


def _too_large(what: str, size: int, limit: int) -> str:
    return f"unreadable {what}, too large ({human_bytes(size)}; the monitor reads at most {human_bytes(limit)})"


def write_regular(path: str, data: bytes) -> None:
    """Replace the contents of a regular file (creating it), never writing into a FIFO, device or symlink.

    Writing to a FIFO blocks until someone reads it; non-blocking it fails or is refused instead.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISREG(st.st_mode):
            raise Refused(f"{os.path.basename(path)} is {kind_of(st.st_mode)}, not a regular file")
    flags = os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NOCTTY", 0)
    fd = os.open(path, flags, 0o644)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped in since lstat
            raise Refused(f"{os.path.basename(path)} is not a regular file")
        os.ftruncate(fd, 0)
        os.write(fd, data)
    finally:
        os.close(fd)
