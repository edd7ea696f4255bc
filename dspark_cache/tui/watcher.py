"""The watcher thread: scans the cache off the UI thread and posts each snapshot to the app.

Reading a cache can be slow (a huge file, a shared filesystem), so :meth:`CacheWatcher.run` runs
as a Textual thread worker: it calls :meth:`~dspark_cache.tui.scan.CacheScanner.scan` every
period, or at once when asked, and hands the immutable
:class:`~dspark_cache.tui.snapshot.Snapshot` to the UI thread with ``post_message`` (the model of
Textualize/toolong's watcher thread). Only this thread touches the cache, the stop request
included; the UI thread only renders what it is posted.
"""

from __future__ import annotations

import threading
from typing import Callable

from textual.message import Message

from dspark_cache.tui.snapshot import Snapshot
from dspark_cache.tui.scan import CacheScanner


class SnapshotScanned(Message):
    """A fresh snapshot; it answers every refresh request up to ``ticket``."""

    def __init__(self, snapshot: Snapshot, ticket: int) -> None:
        super().__init__()
        self.snapshot = snapshot
        self.ticket = ticket


class StopRequested(Message):
    """The stop request was written (``refused`` is None) or why it could not be; a snapshot follows."""

    def __init__(self, refused: str | None) -> None:
        super().__init__()
        self.refused = refused


class CacheWatcher:
    """Scans every ``every`` seconds and when :meth:`request` asks; :meth:`run` is the thread's body."""

    def __init__(self, scanner: CacheScanner, every: float, post: Callable[[Message], object]) -> None:
        self.scanner = scanner
        self.every = every
        self.post = post
        self._wake = threading.Condition()
        self._asked = 1  # the first scan is asked for from the start
        self._answered = 0
        self._stop_asked = False  # the user asked for the producer to stop: write the request first
        self._stop_writing = False  # taken by the thread, not written yet
        self._stopped = False

    def request(self, stop_producer: bool = False) -> int:
        """Ask for a scan now (after writing the stop request, with ``stop_producer``); returns the
        ticket that the snapshot of that scan will carry (or a later one)."""
        with self._wake:
            self._asked += 1
            self._stop_asked |= stop_producer
            self._wake.notify_all()
            return self._asked

    def stop(self, grace: float = 2.0) -> None:
        """Make :meth:`run` return once the scan in progress, if any, is done.

        A stop request asked for but not yet written is waited for, up to ``grace`` seconds: the
        user who presses ``s`` then ``q`` expects the producer to stop (the thread may not outlive
        the app). Without one pending this returns at once.
        """
        with self._wake:
            self._stopped = True
            self._wake.notify_all()
            self._wake.wait_for(lambda: not (self._stop_asked or self._stop_writing), timeout=grace)

    def run(self) -> None:
        """Scan and post snapshots until :meth:`stop` (run on a worker thread, never the UI thread)."""
        while True:
            ticket, stop_producer, stopped = self._next()
            if stop_producer:  # written even when the app is ending: the user pressed the key before
                self.post(StopRequested(self._write_stop_request()))
            if stopped:
                return
            self.post(SnapshotScanned(self.scanner.scan(), ticket))

    def _write_stop_request(self) -> str | None:
        """Write the stop request; None, or why not. Whoever waits in :meth:`stop` is woken after."""
        try:
            return self.scanner.request_stop()
        finally:
            with self._wake:
                self._stop_writing = False
                self._wake.notify_all()

    def _next(self) -> tuple[int, bool, bool]:
        """Wait for a request, the end of the period or :meth:`stop`: the requests the next scan
        answers, whether to write the stop request first, and whether to end after that."""
        with self._wake:
            self._wake.wait_for(lambda: self._stopped or self._asked > self._answered, timeout=self.every)
            self._answered, stop_producer, self._stop_asked = self._asked, self._stop_asked, False
            self._stop_writing = stop_producer
            return self._answered, stop_producer, self._stopped
