"""One writer per cache directory: an ``flock`` on ``control/lock`` (held through ``output.CacheOutput``).

A producer job's rank 0 (or a ``dspark-convert``) takes the lock exclusively before it reads its
input, records its host, pid and run id in the lock file, and keeps it exclusive while it
prepares (and, with ``--overwrite``, clears) the directory. A job of several ranks then
downgrades it to shared, and every other rank takes it shared as soon as rank 0's set-up is
done, so the lock is held until the last rank of the job exits, even when rank 0 dies first. Another producer's rank 0 (``--overwrite`` included) cannot
take it exclusively while any rank of the job lives: it exits at once, naming the holder.

The kernel drops an flock when the process holding it dies, SIGKILL included, so a lock file
left behind never blocks a rerun; the file itself is never deleted (deleting a lock file that
someone may be waiting on breaks the lock). Processes forked by a rank (tokenisation workers)
close their copy, so only the rank itself holds the lock.

Limit: an flock is only as global as the filesystem makes it. On a local disk, NFS (v4, or v3
with lockd, where Linux emulates flock with whole-file locks) and Lustre mounted with
``-o flock`` every node sees it. Where flock is node-local (Lustre ``-o localflock``, some FUSE
or NFS ``nolock`` mounts), it only stops producers started on a node that runs a rank of the
live job. Where the filesystem has no locks at all, the producer warns and runs unlocked.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import stat
import time
from typing import Callable

from dspark_cache.format.errors import CacheError
from dspark_cache.format.paths import CachePaths

log = logging.getLogger(__name__)

_held: set[int] = set()  # descriptors holding a lock in this process
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class CacheLockedError(CacheError):
    """Another producer job holds the output directory."""


def _close_in_child() -> None:
    for fd in list(_held):
        try:
            os.close(fd)
        except OSError:
            pass
    _held.clear()


os.register_at_fork(after_in_child=_close_in_child)


class LockFileError(CacheError):
    """``control/lock`` is not a regular file (a directory, FIFO, device or symlink)."""


def _not_a_lock_file(path: str) -> LockFileError:
    return LockFileError(
        f"{path} is not a regular file; it is the cache's lock file. Remove it (no producer can be "
        "holding it), or choose another --output-dir"
    )


def check_lock_file(path: str) -> None:
    """Refuse a lock path that exists and is not a regular file (checked before it is opened)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        raise _not_a_lock_file(path)


def _open(path: str) -> int:
    """The lock file, opened only when it is a regular file: never a symlink followed (O_NOFOLLOW), nor a FIFO
    or device opened (checked first, and again on what was opened, O_NONBLOCK meanwhile, so nothing blocks)."""
    check_lock_file(path)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o644)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):  # swapped in since the check
            raise _not_a_lock_file(path) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _not_a_lock_file(path)
    return fd


def _read_holder(fd: int) -> dict | None:
    """The holder's record; retried briefly, since a new holder rewrites it just after locking."""
    for _ in range(10):
        try:
            record = json.loads(os.pread(fd, 65536, 0) or b"null")
        except (OSError, ValueError, RecursionError):  # JSON nested past the parser's depth: a bad record
            record = None
        if isinstance(record, dict):
            return record
        time.sleep(0.05)
    return None


def describe_holder(record: dict | None) -> str:
    if record is None:
        return "holder unknown: the lock file is empty or not a holder's record"
    try:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(record.get("started_at", 0))))
        world = int(record.get("world_size", 1))
    except (TypeError, ValueError, OverflowError, OSError):
        when, world = "?", 1
    # a dspark-regenerate output's lock has none
    run = f", run {record['run_id']}" if record.get("run_id") else ""
    text = f"pid {record.get('pid')} on host {record.get('host')}{run}, started {when}"
    if world > 1:
        text = f"rank 0 of a {world}-rank job: {text}; every rank of that job holds the lock until it exits"
    return text


class DirectoryLock:
    """A held flock on the cache's lock file; ``release`` (or process death) frees it."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self.fd: int | None = fd
        _held.add(fd)

    def share(self) -> None:
        """Exclusive -> shared, so that the job's other ranks can hold it too."""
        assert self.fd is not None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError as exc:  # another process got in while the lock was converted
            raise CacheLockedError(
                f"lost the lock on {self.path} to another producer "
                f"({describe_holder(_read_holder(self.fd))}); rerun when it is done"
            ) from exc

    def remove(self) -> None:
        """Delete the lock file, then release it (a failed dry run that created it). A process that
        opened the file meanwhile sees, once it holds it, that it is no longer the file there, and
        opens the path again (:func:`_still_there`)."""
        if self.fd is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        self.release()

    def release(self) -> None:
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        _held.discard(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def _still_there(path: str, fd: int) -> bool:
    """Whether the locked file is still the one at ``path`` (its last holder may have removed it)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    here = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (here.st_dev, here.st_ino)


def _flock(path: str, fd: int, mode: int) -> bool:
    """True when locked; False when the filesystem has no locks (warned); raises when held."""
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        raise
    except OSError as exc:
        if exc.errno not in _NO_LOCKS:
            raise
        log.warning("cannot lock %s (%s): this filesystem has no file locks, so nothing stops a second "
                    "producer on this --output-dir; make sure only one runs", path, exc.strerror)
        return False


def hold_exclusive(path: str, record: dict, refusal: Callable[[str], CacheError]) -> DirectoryLock | None:
    """Take ``path``'s flock exclusively and write ``record`` (who holds it) into it; ``refusal(holder)``
    is raised when another process holds it. None: the filesystem has no locks (warned). Any writer that
    needs one process per output uses this (a cache directory, ``dspark-regenerate``'s output file)."""
    fd = _open(path)
    try:
        if not _flock(path, fd, fcntl.LOCK_EX):
            os.close(fd)
            return None
    except BlockingIOError:
        holder = describe_holder(_read_holder(fd))
        os.close(fd)
        raise refusal(holder) from None
    except BaseException:
        os.close(fd)
        raise
    if not _still_there(path, fd):
        os.close(fd)
        return hold_exclusive(path, record, refusal)
    record = {"host": socket.gethostname(), "pid": os.getpid(), **record, "started_at": time.time()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode() + b"\n", 0)
    return DirectoryLock(path, fd)


def lock_exclusive(
    paths: CachePaths, run_id: str, world_size: int, overwrite: bool = False
) -> DirectoryLock | None:
    """Rank 0: take the directory (its ``control/`` must exist) or raise naming who holds it."""
    what = "--overwrite refused: it does not stop a live run, and " if overwrite else ""

    def refusal(holder: str) -> CacheError:
        return CacheLockedError(
            f"{what}{paths.root} is in use by another dspark-produce run ({holder}). Two producers on one "
            f"--output-dir would redo and overwrite each other's work. Wait for that run to finish, or stop it "
            f"(press s in dspark-monitor {paths.root}, or kill -TERM its pid on its host), then rerun; for a "
            f"separate cache choose another --output-dir"
        )

    return hold_exclusive(paths.lock, {"run_id": run_id, "world_size": world_size}, refusal)


def lock_shared(paths: CachePaths) -> DirectoryLock | None:
    """Every other rank of a job, after rank 0 has prepared the directory and shared the lock."""
    fd = _open(paths.lock)
    try:
        if not _flock(paths.lock, fd, fcntl.LOCK_SH):
            os.close(fd)
            return None
    except BlockingIOError:
        holder = describe_holder(_read_holder(fd))
        os.close(fd)
        raise CacheLockedError(f"{paths.root} was taken by another dspark-produce run ({holder}) before this "
                               "rank could join its job's lock; rerun when that run is done") from None
    except BaseException:
        os.close(fd)
        raise
    if not _still_there(paths.lock, fd):
        os.close(fd)
        return lock_shared(paths)
    return DirectoryLock(paths.lock, fd)
