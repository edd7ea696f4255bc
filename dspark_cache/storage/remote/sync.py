"""The producer's small files, from its staging directory to object storage, at a rate that costs little.

The producer writes its heartbeat (``status/rank-N.json``), its event log, the saved plan and the
target weights into the staging directory as it does into a local cache. A :class:`StagingSync`
thread in each producer process puts them under the cache's prefix, so that any machine can monitor
or resume the run:

* its own heartbeat, when it changed, at most once every ``interval`` seconds (default 5: one PUT a
  rank every few seconds);
* its own event log as *segments* (objects cannot be appended to): ``events/rank-N.jsonl.K``, each
  rewritten while it grows and left alone once it holds ``SEGMENT_BYTES`` (cut at a line's end);
  a reader concatenates them in order;
* the job's leader also puts the plan's files and the target weights once each is written;
* the leader, and each process whose staging directory is not the leader's (another node), brings
  a stop request (``control/stop``, what ``dspark-monitor`` writes) into its staging directory,
  where the producer looks for it.

:meth:`StagingSync.stop` pushes one last time. A file is put again only when its size or
modification time changed; the store's version each file put is recorded in ``copies`` (beside the
staging directory's files, so that every process of the node, and a later run, knows it).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable, Iterator

from dspark_cache.format.atomic import atomic_write_bytes
from dspark_cache.format.errors import CacheError
from dspark_cache.format.paths import CachePaths
from dspark_cache.storage.remote.copies import LocalCopies
from dspark_cache.storage.remote.store import ObjectInfo, ObjectStore

log = logging.getLogger(__name__)

INTERVAL = 5.0
ENV_SYNC_INTERVAL = "DSPARK_SYNC_INTERVAL"
SEGMENT_BYTES = 1 << 20
# A segment holds SEGMENT_BYTES, or one event line longer than that; readers take no more of one.
MAX_SEGMENT_BYTES = 64 << 20
MAX_STOP_BYTES = 1 << 16  # a stop request is a short note


def _stamp(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_size, st.st_mtime_ns


def sync_interval() -> float:
    """Seconds between a producer's puts of its heartbeat (``DSPARK_SYNC_INTERVAL``, default 5): polling
    the store more often sees nothing new."""
    try:
        return max(0.05, float(os.environ.get(ENV_SYNC_INTERVAL, INTERVAL)))
    except ValueError:
        return INTERVAL


def segment_starts(sizes: list[int]) -> list[int]:
    """Where each of a log's segments begins in the whole log, from the segments' sizes."""
    starts, at = [], 0
    for size in sizes:
        starts.append(at)
        at += size
    return starts


class StagingSync:
    """Pushes one producer process's small files (``rank``'s; ``leader``: the job's too)."""

    def __init__(self, store: ObjectStore, paths: CachePaths, rank: int, copies: LocalCopies,
                 holds: Callable[[], bool] = lambda: True, interval: float | None = None) -> None:
        """``holds``: whether this process may still write the job's files (false once its lease is lost:
        another producer's heartbeats and logs are not overwritten)."""
        self.store, self.paths, self.rank, self.copies, self.holds = store, paths, rank, copies, holds
        self.leader = self.pull_stop = False
        self.interval = interval if interval is not None else sync_interval()
        # relative path -> (size, mtime_ns) last put or brought down
        self._put: dict[str, tuple[int, int]] = {}
        self._segment = 0  # the event log's open segment
        self._segment_start = 0  # where it begins in the local log
        self._lock = threading.Lock()  # one push at a time (the thread's and a forced one)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def mark(self, path: str) -> None:
        """``path`` is the same on the store as here (brought down): no need to put it."""
        stamp = _stamp(path)
        if stamp is not None:
            self._put[self.paths.relative(path)] = stamp

    def forget(self) -> None:
        """The store's files of ours were deleted (``--overwrite``): everything goes up again, logs from the start."""
        with self._lock:
            self._put.clear()
            self._segment = self._segment_start = 0

    def start(self, *, leader: bool, pull_stop: bool) -> None:
        """Push this process's files from now on (``leader``: the job's too); ``pull_stop``: bring a stop
        request down into this staging directory."""
        self.leader, self.pull_stop = leader, pull_stop
        self._resume_events()
        self._thread = threading.Thread(target=self._run, name="dspark-sync", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.push()
            except CacheError as exc:  # a heartbeat missed is not a failed run: try again next time
                log.warning(
                    "could not bring the producer's files to %s (%s); retrying in %.0f s",
                    self.store.url,
                    exc,
                    self.interval,
                )

    def stop(self) -> None:
        """Stop the thread and push what changed since its last turn."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        try:
            self.push()
        except CacheError as exc:
            log.warning("could not bring the producer's last files to %s (%s)", self.store.url, exc)

    # -- one turn -----------------------------------------------------------------------------

    def push(self) -> None:
        if not self.holds():
            return
        with self._lock:
            self._put_changed(self.paths.status(self.rank))
            self._push_events()
            if self.leader:
                for path in self._job_files():
                    self._put_changed(path)
            if self.pull_stop:
                self._pull_stop()

    def push_files(self, paths: list[str]) -> None:
        """Put these files now where they changed (before the manifest that names them)."""
        with self._lock:
            for path in paths:
                self._put_changed(path)

    def _job_files(self) -> Iterator[str]:
        """The saved plan's files (its header last: a reader checks the others against it) and the weights."""
        try:
            names = sorted(os.listdir(self.paths.plan_dir))
        except FileNotFoundError:
            names = []
        header = os.path.basename(self.paths.plan_header)
        files = [
            os.path.join(self.paths.plan_dir, n)
            for n in names
            if n.endswith((".npy", ".json")) and n != header
        ]
        yield from files
        if header in names:
            yield self.paths.plan_header
        yield self.paths.target_weights

    def _put_changed(self, path: str) -> None:
        stamp = _stamp(path)
        relative = self.paths.relative(path)
        if stamp is None or self._put.get(relative) == stamp:
            return
        if stamp[0] > 64 << 20:
            etag = self.store.upload(relative, path)
        else:
            with open(path, "rb") as handle:
                data = handle.read()
            etag = self.store.put(relative, data)
        self._put[relative] = stamp
        self.copies.record(relative, ObjectInfo(stamp[0], etag, 0.0))

    # -- the event log in segments ------------------------------------------------------------

    def _resume_events(self) -> None:
        """Continue the segments already on the store: the local log is theirs concatenated (the leader
        brought them down), or longer (this staging directory wrote them)."""
        segments = self._segments()
        if segments:
            self._segment = max(segments)
            self._segment_start = segment_starts([segments[k] for k in sorted(segments)])[-1]

    def _segments(self) -> dict[int, int]:
        found: dict[int, int] = {}
        for name, info in self.store.list(self.paths.relative(self.paths.events_dir)).items():
            seg = self.paths.events_segment_of(name)
            if seg is not None and seg[0] == self.rank:
                found[seg[1]] = info.size
        return found

    def _push_events(self) -> None:
        path = self.paths.events(self.rank)
        stamp = _stamp(path)
        relative = self.paths.relative(path)
        if stamp is None or self._put.get(relative) == stamp:
            return
        with open(path, "rb") as handle:
            handle.seek(self._segment_start)
            tail = handle.read()
        tail = tail[: tail.rfind(b"\n") + 1]  # whole lines only: the rest comes next turn
        while tail:
            cut = len(tail)
            if cut > SEGMENT_BYTES:  # full: close this segment at a line's end, go on in the next
                cut = tail.rfind(b"\n", 0, SEGMENT_BYTES) + 1 or tail.find(b"\n") + 1
            name = self.paths.relative(self.paths.events_segment(self.rank, self._segment))
            self.store.put(name, tail[:cut])
            if cut < len(tail) or cut >= SEGMENT_BYTES:
                self._segment += 1
                self._segment_start += cut
            tail = tail[cut:]
        self._put[relative] = stamp

    # -- what comes down ----------------------------------------------------------------------

    def _pull_stop(self) -> None:
        """A stop request on the store becomes one in the staging directory (the producer checks there)."""
        relative = self.paths.relative(self.paths.stop_request)
        if os.path.exists(self.paths.stop_request):
            return
        got = self.store.get(relative, limit=MAX_STOP_BYTES)
        if got is not None:
            os.makedirs(self.paths.control_dir, exist_ok=True)
            atomic_write_bytes(self.paths.stop_request, got[0][:MAX_STOP_BYTES])
