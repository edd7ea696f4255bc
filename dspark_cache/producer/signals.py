"""Graceful stop: SIGINT/SIGTERM or the monitor's stop file end the run at a shard boundary."""

from __future__ import annotations

import logging
import os
import signal
import threading

from dspark_cache.format.paths import CachePaths

log = logging.getLogger(__name__)


class StopFlag:
    """Callable: True once a stop was requested. A second signal aborts at once."""

    def __init__(self, paths: CachePaths) -> None:
        self.paths = paths
        self.event = threading.Event()
        self.reason = ""
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def uninstall(self) -> None:
        """Give the handlers back (the producer may run inside a longer-lived process)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self.event.is_set():  # the second signal: abandon the shard in flight
            raise KeyboardInterrupt
        self.reason = signal.Signals(signum).name
        log.warning("%s received: finishing the shard in flight, then stopping (send again to abort now)", self.reason)
        self.event.set()

    def __call__(self) -> bool:
        if not self.event.is_set() and os.path.exists(self.paths.stop_request):
            self.reason = "stop requested by the monitor"
            log.warning("stop requested by the monitor: finishing the shard in flight, then stopping")
            self.event.set()
        return self.event.is_set()
