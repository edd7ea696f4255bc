"""``dspark-monitor s3://bucket/prefix``: the scanner of a cache on object storage.

The store is polled, never watched: :class:`RemoteScanner` refreshes a
:class:`~dspark_cache.tui.remote.monitorcopy.MonitorCopy` (the local copy of the cache's small files,
fetched at a bounded cost: see that module) before it scans the copy as any directory, but at most
every ``every`` seconds, never more often than the producer puts its heartbeat (``max(--refresh,
DSPARK_SYNC_INTERVAL or 5 s)``); scans asked for in between read the copy again without a request.
A refresh that fails (the store is slow or unreachable for a while) becomes a warning on screen and
the copy is shown as last read.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable

from dspark_cache.format.errors import CacheError
from dspark_cache.format.status import STALE_AFTER_S
from dspark_cache.tui.display import clip, clock_time
from dspark_cache.tui.remote.monitorcopy import MonitorCopy
from dspark_cache.tui.scan import CacheScanner
from dspark_cache.tui.snapshot import Snapshot


def remote_period(copy: MonitorCopy, refresh: float) -> float:
    """Seconds between refreshes of ``copy``: ``--refresh``, but no more often than heartbeats are put."""
    return max(refresh, copy.poll)


class RemoteScanner(CacheScanner):
    """Scans the local copy of a remote cache, refreshed first from the store at most every ``every`` s.

    A heartbeat reaches the copy up to a sync interval (``copy.poll``) and a refresh (``every``) late,
    so a rank is STALE only after that much more silence than in a directory. ``refreshed``: the copy
    was just refreshed (by the caller, to report its errors as errors), so the first scan need not.
    """

    remote = True

    def __init__(
        self,
        copy: MonitorCopy,
        every: float,
        clock: Callable[[], float] = time.time,
        history: int = 120,
        *,
        refreshed: bool = False,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(copy.root, clock=clock, disk_free=lambda _: None, history=history)
        self.copy = copy
        self.every = every
        self.shown = copy.remote
        self.patience = STALE_AFTER_S + copy.poll + every
        self._monotonic = monotonic
        self._refreshed_at: float | None = monotonic() if refreshed else None
        self._problem: str | None = None
        self._closed = False

    def refresh(self, *, force: bool = False) -> None:
        """Refresh the copy from the store, unless it was refreshed less than ``every`` s ago (``force``: now)."""
        now = self._monotonic()
        if self._closed or (
            not force and self._refreshed_at is not None and now - self._refreshed_at < self.every
        ):
            return
        self._refreshed_at = now
        try:
            self.copy.refresh()
        except (CacheError, OSError) as exc:
            self._problem = (f"could not refresh from {self.copy.remote} at {clock_time(self.clock())} UTC "
                             f"(showing what was read before; trying again in {self.every:.0f} s): "
                             f"{clip(str(exc), 600)}")
        else:
            self._problem = None

    def scan(self) -> Snapshot:
        """A snapshot of the copy, refreshed first when due; the refresh's problems among its warnings."""
        self.refresh()
        snap = super().scan()
        extra = tuple(self.copy.warnings) + ((self._problem,) if self._problem else ())
        if snap.manifest_error is not None:  # named as the store names it, not as the local copy's path
            snap = replace(snap, manifest_error=snap.manifest_error.replace(self.copy.root, self.copy.remote))
        return replace(snap, warnings=snap.warnings + extra) if extra else snap

    def _write_stop(self, note: bytes) -> str | None:
        """Put the stop request on the store (the producer brings it down within its sync interval)."""
        try:
            self.copy.request_stop(note)
        except (CacheError, OSError) as exc:
            return str(exc)
        return None

    def close(self) -> None:
        """No refresh from now on; the copy lets go of its directory."""
        self._closed = True
        self.copy.close()
