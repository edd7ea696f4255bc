"""What the processes of one node share a remote cache's local copy with: file locks, the download threads.

``hold_lock`` is an ``flock`` on a file (created), blocking or not; ``process_alive`` says whether
a process of this host still runs (the lease's dead holder); ``release_all`` closes a mirror's held locks (its
finalizer); :class:`DaemonThreads` runs downloads and uploads on daemon threads.
"""

from __future__ import annotations

import errno
import fcntl
import os
import queue
import threading
from concurrent.futures import Future
from typing import Callable


def hold_lock(path: str, how: int) -> int | None:
    """A descriptor holding ``how`` on ``path`` (created), or ``None`` where ``LOCK_NB`` found it held."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, how)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return None
        raise
    return fd


def release_all(in_use: dict[int, tuple[int, int]]) -> None:
    for fd, _ in in_use.values():
        try:
            os.close(fd)
        except OSError:
            pass
    in_use.clear()


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class DaemonThreads:
    """Transfer threads. Daemon threads, so that neither ``close()`` nor the interpreter's exit waits
    for a store that stopped answering (a download cut short leaves only its temporary, named by its
    pid, under ``.mirror/tmp``; an upload cut short publishes nothing)."""

    def __init__(self, threads: int, name: str = "dspark-mirror") -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        for n in range(threads):
            threading.Thread(target=self._work, name=f"{name}-{n}", daemon=True).start()
        self._threads = threads

    def submit(self, call: Callable[..., object], *args: object) -> Future:
        future: Future = Future()
        self._queue.put((future, call, args))
        return future

    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            future, call, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(call(*args))
            except BaseException as exc:  # noqa: BLE001  (handed to whoever waits on the shard)
                future.set_exception(exc)

    def close(self) -> None:
        for _ in range(self._threads):
            self._queue.put(None)
