"""Graceful stop: SIGINT/SIGTERM or the monitor's stop file end the run at a shard boundary."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

from dspark_cache.format.paths import CachePaths

log = logging.getLogger(__name__)

DEATH_NOTICE_S = 2.0  # how long after the first a parent-death signal may come again (see StopFlag)


def _dying(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie, or gone) although it may still be our parent:
    a process killed with several threads stays our parent, through its other threads, until the
    last of them has exited. False where there is no ``/proc`` to tell."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read()
    except FileNotFoundError:
        return os.path.isdir("/proc/self")  # gone, where /proc would show it
    except OSError:
        return False
    fields = stat.rpartition(b")")[2].split()  # the command name may hold spaces and parentheses
    return bool(fields) and fields[0] in (b"Z", b"X")


class StopFlag:
    """Callable: True once a stop was requested. A second signal aborts at once."""

    def __init__(self, paths: CachePaths) -> None:
        self.paths = paths
        self.event = threading.Event()
        self.reason = ""
        self._parent = os.getppid()
        self._first_at = 0.0
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        self._parent = os.getppid()
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def uninstall(self) -> None:
        """Give the handlers back (the producer may run inside a longer-lived process)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self.event.is_set():  # the second signal: abandon the shard in flight
            if self._repeated_death_notice():
                return
            raise KeyboardInterrupt
        self._first_at = time.monotonic()
        self.reason = signal.Signals(signum).name
        log.warning("%s received: finishing the shard in flight, then stopping (send again to abort now)", self.reason)
        self.event.set()

    def _repeated_death_notice(self) -> bool:
        """The kernel's parent-death signal (``format.lifetime``) comes again each time the dying
        parent's next thread exits and we are handed to it. That is one stop, not a second signal
        asking to abort. While we are handed from thread to thread our parent's pid stays the same,
        and this handler may run late (the main thread in a long call): a repeat is a death notice
        when the parent is dying or gone, or when it comes within moments of the first."""
        return _dying(self._parent) or (os.getppid() != self._parent
                                        and time.monotonic() - self._first_at < DEATH_NOTICE_S)

    def __call__(self) -> bool:
        if not self.event.is_set() and os.path.isfile(self.paths.stop_request):  # a file, as the monitor writes
            self.reason = "stop requested by the monitor"
            log.warning("stop requested by the monitor: finishing the shard in flight, then stopping")
            self.event.set()
        return self.event.is_set()
