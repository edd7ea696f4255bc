"""A cache on object storage as a monitor sees it: :class:`MonitorCopy`, a local directory that follows
the store.

``dspark-monitor`` reads a cache directory's small files (manifest, shard indexes, heartbeats, event
logs, the stop request) and never a tar. For a cache at ``s3://bucket/prefix`` this copy keeps a
local directory, :attr:`MonitorCopy.root`, holding exactly those files as the store holds them, so
the monitor's directory reader works on it unchanged:

* :meth:`MonitorCopy.refresh` brings them down at a bounded cost: a HEAD of the manifest, one LIST
  of each of ``shards/``, ``status/`` and ``events/`` (one request per 1000 objects), a HEAD of the
  stop request, and a GET only of an object whose size or ETag changed since it was copied (an
  index is fetched once; a heartbeat each time its rank re-puts it). Tars are never read. What is
  gone from the store is removed here.
* a rank's event log is stored as segments (``events/rank-N.jsonl.K``, the last rewritten while it
  grows); here it is one file that only grows while the run's log grows (:mod:`.eventlog`).
* :meth:`MonitorCopy.request_stop` puts the stop request (``control/stop``) on the store, where the
  producer's sync thread brings it into its staging directory.

Layout: ``<local_cache_dir>/monitor/<scheme>/<store>/<bucket>/<prefix>/`` (next to the readers' copies,
never one of them; ``<store>``: the endpoint or account, :func:`.localdir.store_key`), with ``.monitor/``
its bookkeeping as every node-local copy keeps it (:func:`.localdir.replica_dirs`: what each file was
copied from, so that a monitor started again fetches nothing that did not change; the downloads in
progress), plus what was followed of each segmented log (``copied.json``). A file found there is shown
only once authenticated (:class:`.copies.LocalCopies`), in a directory only this user may write
(:func:`.localdir.own_directory`). A second monitor of the same cache on the node takes a private
directory beside it instead (removed by :meth:`MonitorCopy.close`).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
import tempfile
from collections import Counter
from typing import Any, Iterator

from dspark_cache.format.paths import MANIFEST, CachePaths
from dspark_cache.format.status import MAX_STATUS_BYTES
from dspark_cache.format.validate import MAX_INDEX_BYTES, MAX_MANIFEST_BYTES
from dspark_cache.storage.backing import StorageOptions
from dspark_cache.storage.remote.copies import LocalCopies
from dspark_cache.storage.remote.localdir import (local_copy_dir, own_directory, own_replica_dirs, private,
                                                 write_private)
from dspark_cache.storage.remote.node import DaemonThreads, hold_lock
from dspark_cache.storage.remote.store import ObjectInfo, ObjectStore
from dspark_cache.storage.remote.sync import MAX_STOP_BYTES, sync_interval
from dspark_cache.storage.remote.url import RemoteURL
from dspark_cache.tui.remote.eventlog import LogCopy, Refused, SegmentedLogs

log = logging.getLogger(__name__)

# bytes of a log's newest segments fetched at the first look (the monitor's tail window)
EVENTS_TAIL = 256 * 1024
MAX_LOG_BYTES = 64 << 20  # a whole (unsegmented) log: what a cache written locally, then uploaded, holds
_GET_THREADS = 8  # index GETs in flight at once (a first look at a cache of thousands of shards)
_RECORDS = ".monitor"
_DIGITS = re.compile(r"[0-9]+")


def default_copy_dir(url: RemoteURL, storage: StorageOptions) -> tuple[str, str]:
    """``(base, directory)``: ``<--local-cache-dir>/monitor/<scheme>/<store>/<bucket>/<prefix>``."""
    return local_copy_dir("monitor", url, storage.storage_options, storage.local_cache_dir)


class MonitorCopy:
    """The monitor's local copy of the small files of the cache at ``url`` (see the module's docstring).

    ``refresh()`` brings it up to date (it raises a one-line :class:`CacheError`: a missing bucket,
    refused credentials, a store that does not answer); ``request_stop(note)`` asks the producer to
    stop; ``requests`` counts the requests made, by kind (``list``, ``head``, ``get``, ``put``);
    ``warnings`` says what the last refresh refused to copy. One thread at a time (the monitor's
    watcher thread).
    """

    def __init__(
        self, url: str, storage: StorageOptions | None = None, *, events_tail: int = EVENTS_TAIL
    ) -> None:
        storage = (storage or StorageOptions()).resolved()
        self.url = RemoteURL.parse(url)
        self.remote = str(self.url)
        self.store = ObjectStore(self.url, storage.storage_options)
        self.poll = sync_interval()
        self.requests: Counter[str] = Counter()
        self.warnings: list[str] = []
        self.found = False  # whether the last refresh found any object of a cache under the prefix
        self._private = False
        base, self.root = default_copy_dir(self.url, storage)
        own_directory(os.path.join(self.root, _RECORDS), base, what="monitor's copy")
        self._held = hold_lock(
            os.path.join(self._records_dir(self.root), "monitor.held"), fcntl.LOCK_EX | fcntl.LOCK_NB
        )
        if self._held is None:  # another monitor of this cache on this node: a directory of our own
            self.root = tempfile.mkdtemp(prefix=f"{os.path.basename(self.root) or self.url.bucket}.",
                                         dir=os.path.dirname(self.root))
            self._private = True
        self.paths = CachePaths(self.root)
        for directory in (self.paths.shards_dir, self.paths.status_dir, self.paths.events_dir,
                          self.paths.control_dir):
            own_directory(directory, self.root, what="monitor's copy")
        own_replica_dirs(os.path.join(self.root, _RECORDS), self.root, what="monitor's copy")
        self.copies = LocalCopies(self.store, self.root, os.path.join(self.root, _RECORDS))
        self.copies.temporaries.clean()  # an earlier monitor's downloads, cut short
        self.logs = SegmentedLogs(self.paths, self._get, self.store.name, events_tail)
        self._saved: str | None = None
        # started at the first refresh with several objects to fetch
        self._threads: DaemonThreads | None = None
        self._load_records()

    def __repr__(self) -> str:
        return f"MonitorCopy({self.remote!r} at {self.root!r})"

    # -- requests, counted --------------------------------------------------------------------

    def _list(self, relative_dir: str) -> dict[str, ObjectInfo]:
        self.requests["list"] += 1
        return self.store.list(relative_dir)

    def _head(self, relative: str) -> ObjectInfo | None:
        self.requests["head"] += 1
        return self.store.head(relative)

    def _get(self, relative: str, limit: int) -> tuple[bytes, ObjectInfo] | None:
        self.requests["get"] += 1
        return self.store.get(relative, limit)

    # -- one refresh --------------------------------------------------------------------------

    def refresh(self) -> None:
        """Bring the local copy up to date with the store (see the module's docstring for its requests)."""
        self.warnings = []
        try:
            manifest = self._copy_small(MANIFEST, self._head(MANIFEST), MAX_MANIFEST_BYTES)
            shards = self._refresh_shards()
            status = self._refresh_status()
            events = self._refresh_events()
            self._copy_small(self.paths.relative(self.paths.stop_request),
                             self._head(self.paths.relative(self.paths.stop_request)), MAX_STOP_BYTES)
            self.found = manifest or bool(shards or status or events)
        finally:
            self._save_records()

    def check(self) -> None:
        """Whether the store answers for this cache (one LIST): a missing bucket or refused credentials
        raise here, in one line, before anything else is read."""
        self._list(self.paths.relative(self.paths.status_dir))

    def _copy_small(self, relative: str, info: ObjectInfo | None, limit: int) -> bool:
        """Make the local copy of a small object the store's (``info``: as listed; ``None``: not there).
        Whether the store has it."""
        if info is None:
            self.copies.remove(relative)
            return False
        if self.copies.unchanged(relative, info):
            return True
        got = self._get(relative, limit)
        if got is None:  # deleted since it was listed
            self.copies.remove(relative)
            return False
        self.copies.write(relative, *got)  # bytes past a reader's limit are kept: its check refuses them
        return True

    def _sweep(self, directory: str, keep: set[str]) -> None:
        """Remove the files of a local directory the store no longer has (everything here is a copy)."""
        for name in os.listdir(directory):
            if name not in keep:
                path = os.path.join(directory, name)
                if os.path.isfile(path) or os.path.islink(path):
                    self.copies.remove(self.paths.relative(path))

    def _copy_changed(self, directory: str, listed: dict[str, ObjectInfo], limit: int) -> set[str]:
        """Copy the listed small objects of a local directory that changed since they were copied, several
        at once (a first look at thousands of shards, hundreds of ranks' heartbeats); the rest of the
        directory removed. The names the store still has."""
        relative_dir = self.paths.relative(directory)
        kept = set(listed)
        wanted = [name for name, info in sorted(listed.items())
                  if not self.copies.unchanged(f"{relative_dir}/{name}", info)]
        self.requests["get"] += len(wanted)  # counted here: the transfer threads only fetch
        fetched: Iterator[tuple[str, tuple[bytes, ObjectInfo] | None]]
        if len(wanted) > 1:
            if self._threads is None:
                self._threads = DaemonThreads(_GET_THREADS, "dspark-monitor")
            futures = [
                (name, self._threads.submit(self.store.get, f"{relative_dir}/{name}", limit))
                for name in wanted
            ]
            fetched = ((name, future.result()) for name, future in futures)
        else:
            fetched = ((name, self.store.get(f"{relative_dir}/{name}", limit)) for name in wanted)
        for name, got in fetched:
            if got is None:
                kept.discard(name)  # deleted since the listing
            else:
                self.copies.write(f"{relative_dir}/{name}", *got)
        self._sweep(directory, kept)
        return kept

    def _refresh_shards(self) -> dict[str, ObjectInfo]:
        """The indexes (never the tars): new or changed ones fetched; unpublished ones removed."""
        listing = self._list(self.paths.relative(self.paths.shards_dir))
        indexes = {
            name: info
            for name, info in listing.items()
            if (self.paths.shard_file(name) or (0, ""))[1] == "idx"
        }
        self._copy_changed(self.paths.shards_dir, indexes, MAX_INDEX_BYTES)
        return listing

    def _refresh_status(self) -> dict[str, ObjectInfo]:
        """Every rank's heartbeat, fetched when its rank put it again; a heartbeat gone is removed."""
        listing = self._list(self.paths.relative(self.paths.status_dir))
        heartbeats = {}
        for name, info in listing.items():
            digits = _DIGITS.search(name)
            if digits is not None and os.path.basename(self.paths.status(int(digits.group()))) == name:
                heartbeats[name] = info  # only the names the producer gives its heartbeats
        self._copy_changed(self.paths.status_dir, heartbeats, MAX_STATUS_BYTES)
        return listing

    # -- event logs ---------------------------------------------------------------------------

    def _refresh_events(self) -> dict[str, ObjectInfo]:
        """Each rank's log from its segments (or a whole log object, where a cache was uploaded as it is)."""
        events_dir = self.paths.relative(self.paths.events_dir)
        listing = self._list(events_dir)
        segments: dict[int, dict[int, ObjectInfo]] = {}
        whole: dict[int, ObjectInfo] = {}
        for name, info in listing.items():
            found = self.paths.events_segment_of(name)
            if found is not None:
                segments.setdefault(found[0], {})[found[1]] = info
                continue
            digits = _DIGITS.search(name)
            if digits is not None and os.path.basename(self.paths.events(int(digits.group()))) == name:
                whole[int(digits.group())] = info
        kept = set()
        for rank in sorted(set(segments) | set(whole)):
            relative = self.paths.relative(self.paths.events(rank))
            try:
                if rank in segments:
                    self.copies.record(relative, None)  # followed from segments: not a copy of one object
                    self.logs.follow(rank, segments[rank])
                else:
                    self._copy_whole_log(rank, whole[rank])
            except Refused as exc:
                self.warnings.append(str(exc))
                self.logs.copies.pop(rank, None)
                self.copies.remove(relative)
                continue
            kept.add(os.path.basename(self.paths.events(rank)))
        for rank in set(self.logs.copies) - set(segments):
            del self.logs.copies[rank]
        self._sweep(self.paths.events_dir, kept)
        return listing

    def _copy_whole_log(self, rank: int, info: ObjectInfo) -> None:
        """A log stored whole (a cache written locally, then uploaded): copied once per version, streamed
        to disk."""
        relative = self.paths.relative(self.paths.events(rank))
        self.logs.copies.pop(rank, None)
        if self.copies.unchanged(relative, info):
            return
        if info.size > MAX_LOG_BYTES:
            raise Refused(
                f"{self.store.name(relative)} is over {MAX_LOG_BYTES >> 20} MiB: rank {rank}'s events "
                "are not shown"
            )
        try:
            self.requests["get"] += 1
            self.copies.download(relative, expected=MAX_LOG_BYTES)
        except FileNotFoundError:
            self.copies.remove(relative)

    # -- the stop request ---------------------------------------------------------------------

    def request_stop(self, note: bytes) -> None:
        """Put the stop request on the store (the producer's leader brings it down within its sync interval);
        the local copy shows it at once."""
        relative = self.paths.relative(self.paths.stop_request)
        self.requests["put"] += 1
        etag = self.store.put(relative, note)
        self.copies.write(relative, note, ObjectInfo(len(note), etag, 0.0))
        self._save_records()

    # -- what was copied from what ------------------------------------------------------------

    @staticmethod
    def _records_dir(root: str) -> str:
        directory = os.path.join(root, _RECORDS)
        os.makedirs(directory, exist_ok=True)
        return directory

    def _records_file(self) -> str:
        return os.path.join(self._records_dir(self.root), "copied.json")

    def _load_records(self) -> None:
        """What an earlier monitor followed of each segmented log, where the local file is still as it left
        it (the copies of single objects have their records in ``seen``)."""
        try:
            with open(self._records_file(), encoding="utf-8") as handle:
                # others may have rewritten it: no word of it holds
                if not private(os.fstat(handle.fileno())):
                    return
                records = json.load(handle)
            if records.get("url") != self.remote:
                return
            for rank, entry in records["logs"].items():
                known = LogCopy(
                    int(entry["first"]), {int(k): (int(s), str(e)) for k, (s, e) in entry["parts"].items()}
                )
                path = self.paths.events(int(rank))
                # the very file the last monitor left (a file put in its place is no copy of the store's)
                if _identity(path) == (int(entry["inode"]), int(entry["ctime_ns"])) \
                        and os.path.getsize(path) == known.size():
                    self.logs.copies[int(rank)] = known
        except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError):
            self.logs.copies = {}  # unreadable: every segmented log is fetched again once

    def _save_records(self) -> None:
        records: dict[str, Any] = {
            "url": self.remote,
            "logs": {str(rank): {"first": known.first,
                                 "parts": {str(k): list(v) for k, v in sorted(known.parts.items())},
                                 **_identity_of(self.paths.events(rank))}
                     for rank, known in sorted(self.logs.copies.items())}}
        text = json.dumps(records, sort_keys=True)
        if text != self._saved:
            try:
                write_private(self._records_file(), text.encode())
                self._saved = text
            except OSError as exc:  # the next monitor fetches again: never a reason to stop this one
                log.debug("could not record the monitor's copies in %s: %s", self.root, exc)

    def close(self) -> None:
        """Let go of the directory (a private one is removed) and of the transfer threads."""
        if self._threads is not None:
            self._threads.close()
            self._threads = None
        if self._held is not None:
            os.close(self._held)
            self._held = None
        if self._private:
            shutil.rmtree(self.root, ignore_errors=True)
            self._private = False


def _identity_of(path: str) -> dict[str, int]:
    """:func:`_identity` as the records file holds it (-1: no file)."""
    inode, ctime_ns = _identity(path) or (-1, -1)
    return {"inode": inode, "ctime_ns": ctime_ns}


def _identity(path: str) -> tuple[int, int] | None:
    """The file's inode and ctime (changed by any write or replacement), ``None`` where it is gone."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_ctime_ns
