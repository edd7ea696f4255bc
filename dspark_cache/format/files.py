"""Opening cache files safely: regular files only, never a FIFO, device, socket or directory.

A FIFO or a symlink to ``/dev/zero`` where a shard or index belongs would otherwise hang a
reader or feed it bytes forever. A path is checked with ``lstat`` before it is opened (a device
is never opened at all), opened non-blocking (opening a FIFO for reading never waits), checked
again with ``fstat`` (it may have been swapped in between) and only then read, with a size cap
where the content is held in memory. Readers that must not leave the cache (the monitor) pass
``within``: a symlink that resolves outside that directory is refused, not followed.
"""

from __future__ import annotations

import os
import stat

from dspark_cache.format.errors import CacheError

OUTSIDE = "a symlink to outside the cache, not followed"


class NotARegularFileError(CacheError):
    """A cache path exists but is not a regular file (or is a symlink leading out of the cache)."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path} is {reason}; a cache holds plain files only: remove it and rerun "
                         "dspark-produce (or dspark-verify --repair)")
        self.path = path
        self.reason = reason  # short, for a one-line warning: "a FIFO, not a regular file"


class FileTooLargeError(CacheError):
    """A file held in memory is larger than such a file can honestly be."""

    def __init__(self, path: str, size: int, limit: int) -> None:
        super().__init__(f"{path} is {size} bytes, more than the {limit} such a file can honestly hold; "
                         "it is damaged or not part of a cache: remove it and rerun dspark-produce")
        self.path, self.size, self.limit = path, size, limit


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symlink"))


def kind_of(mode: int) -> str:
    """What a file that is not regular is, in words."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _refuse(path: str, mode: int, what: str = "a regular file") -> NotARegularFileError:
    return NotARegularFileError(path, f"{kind_of(mode)}, not {what}")


def inside(path: str, within: str) -> bool:
    """Whether ``path``, all symlinks resolved, lies in the directory ``within`` (already resolved)."""
    try:
        return os.path.commonpath([os.path.realpath(path), within]) == within
    except ValueError:  # different drives: never inside
        return False


def check_directory(path: str, within: str | None = None) -> None:
    """Refuse a cache subdirectory that is not a directory (or, with ``within``, leads out of it).

    ``FileNotFoundError`` passes through (not created yet).
    """
    st = os.stat(path)
    if within is not None and not inside(path, within):
        raise NotARegularFileError(path, OUTSIDE)
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(path, st.st_mode, "a directory")


def open_regular(path: str, within: str | None = None) -> int:
    """A read-only descriptor of ``path``, which must be a regular file (symlinks to one are fine,
    unless they lead out of ``within``).

    Raises ``FileNotFoundError`` when it is missing and :class:`NotARegularFileError` otherwise.
    """
    st = os.lstat(path)
    if within is not None and not inside(path, within):
        raise NotARegularFileError(path, OUTSIDE)
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
    if not stat.S_ISLNK(st.st_mode):
        if not stat.S_ISREG(st.st_mode):
            raise _refuse(path, st.st_mode)
        flags |= os.O_NOFOLLOW  # swapped for a symlink since lstat: fail rather than follow
    fd = os.open(path, flags)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise _refuse(path, info.st_mode)
    os.set_blocking(fd, True)
    return fd


def regular_size(path: str) -> int:
    """Size in bytes of ``path``, which must be a regular file."""
    info = os.stat(path)
    if not stat.S_ISREG(info.st_mode):
        raise _refuse(path, info.st_mode)
    return info.st_size


def read_regular(path: str, max_bytes: int, within: str | None = None) -> bytes:
    """The whole content of a small regular file, refusing one larger than ``max_bytes``."""
    fd = open_regular(path, within)
    try:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise FileTooLargeError(path, size, max_bytes)
        # One byte more than fstat said notices growth; read(n) reserves n bytes up front, so
        # a file that keeps growing is read in pieces, never with one huge reservation.
        chunks, left, want = [], max_bytes + 1, size + 1
        while left > 0 and (chunk := os.read(fd, min(left, want))):
            chunks.append(chunk)
            left, want = left - len(chunk), 1 << 20
        data = b"".join(chunks)
        if len(data) > max_bytes:  # grew while being read
            raise FileTooLargeError(path, len(data), max_bytes)
        return data
    finally:
        os.close(fd)
