"""Opening cache files safely: regular files only, never a FIFO, device, socket or directory.

A FIFO or a symlink to ``/dev/zero`` where a shard or index belongs would otherwise hang a
reader or feed it bytes forever. Files are opened non-blocking (opening a FIFO for reading
never waits), checked with ``fstat`` and only then read, with a size cap where the content is
held in memory.
"""

from __future__ import annotations

import os
import stat

from dspark_cache.format.errors import CacheError


class NotARegularFileError(CacheError):
    """A cache path exists but is not a regular file."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str) -> int:
    """A read-only descriptor of ``path``, which must be a regular file (symlinks to one are fine).

    Raises ``FileNotFoundError`` when it is missing and :class:`NotARegularFileError` otherwise.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except IsADirectoryError as exc:
        raise NotARegularFileError(f"{path} is a directory, not a file of the cache; remove it and rerun "
                                   "dspark-produce (or dspark-verify --repair)") from exc
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise NotARegularFileError(f"{path} is {_kind(info.st_mode)}, not a regular file; a cache holds plain files "
                                   "only: remove it and rerun dspark-produce (or dspark-verify --repair)")
    os.set_blocking(fd, True)
    return fd


def regular_size(path: str) -> int:
    """Size in bytes of ``path``, which must be a regular file."""
    info = os.stat(path)
    if not stat.S_ISREG(info.st_mode):
        raise NotARegularFileError(f"{path} is {_kind(info.st_mode)}, not a regular file; remove it and rerun "
                                   "dspark-produce (or dspark-verify --repair)")
    return info.st_size


def read_regular(path: str, max_bytes: int) -> bytes:
    """The whole content of a small regular file, refusing one larger than ``max_bytes``."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise CacheError(f"{path} is {size} bytes, more than the {max_bytes} such a file can honestly hold; "
                             "it is damaged or not part of a cache: remove it and rerun dspark-produce")
        chunks, left = [], max_bytes + 1
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > max_bytes:  # grew while being read
            raise CacheError(f"{path} grew past {max_bytes} bytes while being read; is something writing it?")
        return data
    finally:
        os.close(fd)
