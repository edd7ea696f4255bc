"""Graceful stop: SIGINT/SIGTERM, the monitor's stop file, or our parent's death end the run at a
shard boundary."""

from __future__ import annotations

import logging
import os
import signal
import threading

from dspark_cache.cli.lifetime import PARENT_DEATH_SIGNAL
from dspark_cache.format.paths import CachePaths

log = logging.getLogger(__name__)


class StopFlag:
    """Callable: True once a stop was requested. A second SIGINT/SIGTERM, after a first one or the
    monitor's request, aborts at once.

    The kernel's notice that our parent died (:data:`PARENT_DEATH_SIGNAL`, asked for by the torchrun
    entry and by ``dspark-produce --tui`` for its child) is a signal of its own because it comes
    again each time one of a killed parent's threads exits and we are handed to the next, whenever
    this handler gets to run: counted as SIGTERMs, those repeats aborted the shard in flight. It
    stops the run, and never aborts it."""

    def __init__(self, paths: CachePaths) -> None:
        self.paths = paths
        self.event = threading.Event()
        self.reason = ""
        self._asked = False  # a signal or the monitor asked: the next signal aborts
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._on_signal)
        self._previous[PARENT_DEATH_SIGNAL] = signal.signal(PARENT_DEATH_SIGNAL, self._on_parent_death)

    def uninstall(self) -> None:
        """Give the handlers back (the producer may run inside a longer-lived process)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self._asked:  # the second signal: abandon the shards in flight
            raise KeyboardInterrupt
        self._asked = True
        if not self.event.is_set():
            self.reason = signal.Signals(signum).name
        log.warning("%s received: finishing the shards in flight, then stopping (send again to abort now)",
                    signal.Signals(signum).name)
        self.event.set()

    def _on_parent_death(self, _signum: int, _frame: object) -> None:
        if self.event.is_set():
            return
        self.reason = "parent process died"
        log.warning("our parent process (torchrun's agent, or the monitor) died: finishing the shards in "
                    "flight, then stopping")
        self.event.set()

    def __call__(self) -> bool:
        # a file, as the monitor writes
        if not self.event.is_set() and os.path.isfile(self.paths.stop_request):
            self.reason = "stop requested by the monitor"
            self._asked = True
            log.warning("stop requested by the monitor: finishing the shards in flight, then stopping")
            self.event.set()
        return self.event.is_set()
