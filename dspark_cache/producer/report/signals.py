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
        parent's next thread exits and we are handed to it: within moments, and with our parent gone.
        That is one stop, not a second signal asking to abort."""
        return os.getppid() != self._parent and time.monotonic() - self._first_at < DEATH_NOTICE_S

    def __call__(self) -> bool:
        if not self.event.is_set() and os.path.isfile(self.paths.stop_request):  # a file, as the monitor writes
            self.reason = "stop requested by the monitor"
            log.warning("stop requested by the monitor: finishing the shard in flight, then stopping")
            self.event.set()
        return self.event.is_set()
