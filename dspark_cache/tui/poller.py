"""The watcher thread: reads the cache off the UI thread and posts each snapshot to the app.

Reading a cache can be slow (a huge file, a shared filesystem), so :meth:`Poller.run` runs as a
Textual thread worker: it calls :meth:`~dspark_cache.tui.watcher.CacheWatcher.poll` every
period, or at once when asked, and hands the immutable
:class:`~dspark_cache.tui.watcher.Snapshot` to the UI thread with ``post_message`` (the model of
Textualize/toolong's watcher thread). Only this thread touches the watcher's state; the UI
thread only renders what it is posted.
"""

from __future__ import annotations

import threading
from typing import Callable

from textual.message import Message

from dspark_cache.tui.watcher import CacheWatcher, Snapshot


class SnapshotPolled(Message):
    """A fresh snapshot; it answers every refresh request up to ``ticket``."""

    def __init__(self, snapshot: Snapshot, ticket: int) -> None:
        super().__init__()
        self.snapshot = snapshot
        self.ticket = ticket


class Poller:
    """Polls every ``every`` seconds and when :meth:`request` asks; :meth:`run` is the thread's body."""

    def __init__(self, watcher: CacheWatcher, every: float, post: Callable[[Message], object]) -> None:
        self.watcher = watcher
        self.every = every
        self.post = post
        self._wake = threading.Condition()
        self._asked = 1  # the first poll is asked for from the start
        self._answered = 0
        self._stopped = False

    def request(self) -> int:
        """Ask for a poll now; returns the ticket that the snapshot of that poll will carry (or a later one)."""
        with self._wake:
            self._asked += 1
            self._wake.notify()
            return self._asked

    def stop(self) -> None:
        """Make :meth:`run` return once the poll in progress, if any, is done."""
        with self._wake:
            self._stopped = True
            self._wake.notify()

    def run(self) -> None:
        """Poll and post snapshots until :meth:`stop` (run on a worker thread, never the UI thread)."""
        while (ticket := self._next_ticket()) is not None:
            self.post(SnapshotPolled(self.watcher.poll(), ticket))

    def _next_ticket(self) -> int | None:
        """Wait for a request or the end of the period: the requests the next poll answers, or None once stopped."""
        with self._wake:
            self._wake.wait_for(lambda: self._stopped or self._asked > self._answered, timeout=self.every)
            if self._stopped:
                return None
            self._answered = self._asked
            return self._answered
