"""The monitor's one write: the stop request the producer checks between shards (:func:`stop_note`
its bytes, here and on object storage).

Writing is never done into something the cache does not own: ``control/`` must be a directory
inside the cache, and the request file, if there, a regular file. A FIFO would block a writer
until someone reads it (forever); opened non-blocking it fails or is refused instead, and a
symlink is not followed.
"""

from __future__ import annotations

import os
import stat

from dspark_cache.format.errors import CacheError
from dspark_cache.format.files import OUTSIDE, NotARegularFileError, check_directory, kind_of
from dspark_cache.format.paths import CachePaths


def stop_note(now: float) -> bytes:
    """What a stop request holds (the producer only checks that it is there): who asked, and when."""
    return f"requested by dspark-monitor at {now:.0f}\n".encode()


def request_stop(paths: CachePaths, note: bytes) -> str | None:
    """Ask the producer to finish the shards in flight and exit, resumable; None once asked.

    Otherwise why the request could not be written safely: its directory leads out of the
    cache, or the request file is a FIFO, a device or a symlink, or the write failed.
    """
    try:
        os.makedirs(paths.control_dir, exist_ok=True)
        check_directory(paths.control_dir, os.path.realpath(paths.root))
        write_regular(paths.stop_request, note)
    except NotARegularFileError as exc:
        return exc.reason if exc.reason == OUTSIDE else f"{os.path.basename(exc.path)} is {exc.reason}"
    except (CacheError, OSError) as exc:
        return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return None


def write_regular(path: str, data: bytes) -> None:
    """Replace the contents of a regular file (creating it), never writing into a FIFO, device or symlink."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISREG(st.st_mode):
            raise NotARegularFileError(path, f"{kind_of(st.st_mode)}, not a regular file")
    flags = os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC
    fd = os.open(path, flags, 0o644)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped in since lstat
            raise NotARegularFileError(path, "not a regular file")
        os.ftruncate(fd, 0)
        os.write(fd, data)
    finally:
        os.close(fd)
