"""Everything the monitor shows, read from files only (cheaply, incrementally, never torch).

The cache directory is the interface: the manifest (identity and plan), shard index files
(what is published), ``.partial`` files (what is being written), per-rank status heartbeats,
and the append-only event logs. Reading only files makes the monitor work on a live run, a
finished cache, a shared filesystem and across producer restarts alike.

Every file is read with format's readers (:mod:`dspark_cache.format.files`, ``status``,
``schema``), confined to the cache by :class:`~dspark_cache.tui.reading.CacheReader`: what they
refuse is skipped with a warning, every read is bounded, and nothing is kept per planned shard,
so a hostile or corrupt cache cannot hang the monitor or grow it without bound.

:class:`CacheScanner` runs on the monitor's watcher thread (:mod:`~dspark_cache.tui.watcher`),
never on the UI thread, so a slow read delays the next snapshot but never freezes the screen.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections import deque
from dataclasses import replace
from types import MappingProxyType
from typing import Callable

import msgspec

from dspark_cache.format.errors import CacheError
from dspark_cache.format.manifest import ManifestDecodeError, read_manifest
from dspark_cache.format.paths import CachePaths
from dspark_cache.format.schema import Manifest, RankStatus, decode_shard_index
from dspark_cache.format.status import STALE_AFTER_S, partial_is_written, rank_is_live, read_rank_status
from dspark_cache.format.validate import MAX_INDEX_BYTES, manifest_problems
from dspark_cache.tui.eventfeed import EventFeed, failed_shards
from dspark_cache.tui.rates import RateTracker
from dspark_cache.tui.reading import CacheReader, reason
from dspark_cache.tui.snapshot import ShardSummary, Snapshot, Throughput
from dspark_cache.tui.stop import request_stop, stop_note

_DIGITS = re.compile(r"[0-9]+")


class CacheScanner:
    """Reads a cache directory; each :meth:`scan` reads only what changed since the last one.

    It keeps state between scans (decoded shard indexes, log positions, recent events, the
    ranks' heartbeats for their rates, the throughput history), so only one thread may call it
    (the watcher thread).
    """

    #: What the snapshots name (the directory; a cache on object storage: its URL), whether it is
    #: remote, and how long a working rank's heartbeat may be silent before it is STALE.
    shown: str
    remote = False
    patience = STALE_AFTER_S

    def __init__(self, path: str, clock: Callable[[], float] = time.time,
                 disk_free: Callable[[str], int | None] | None = None, history: int = 120) -> None:
        self.paths = CachePaths(path)
        self.shown = path
        self.clock = clock
        self.disk_free = disk_free or _free_bytes
        self.reader = CacheReader(path)
        self.events = EventFeed(self.paths.events_dir, self.reader)
        self.rates = RateTracker()
        self._indexes: dict[int, ShardSummary] = {}
        self._history: deque[Throughput] = deque(maxlen=history)
        self._manifest_key: tuple[int, int, int] | None = None
        self._manifest: tuple[Manifest | None, str | None, tuple[str, ...]] = (None, None, ())

    def scan(self) -> Snapshot:
        """A snapshot of the directory now, with the throughput history of the scans so far."""
        now, root = self.clock(), self.paths.root
        if not os.path.isdir(root):
            not_dir = f"{root} is not a directory" if os.path.exists(root) else None
            return Snapshot(now=now, path=self.shown, exists=not_dir is not None, manifest_error=not_dir,
                            remote=self.remote, patience=self.patience)
        self.reader.start_scan()
        snap = self._read(now)
        tokens, written = snap.tokens_per_s, snap.bytes_per_s
        if tokens is not None and written is not None:  # a live rank, measured
            self._history.append(Throughput(now, tokens, written))
        return replace(snap, history=tuple(self._history))

    def request_stop(self) -> str | None:
        """Write the stop request the producer checks between shards; None, or why it could not.

        Refused unless some rank is live now: a stop request left in a finished cache stops no
        one (the snapshot on screen may be a refresh old, so the heartbeats are read again).
        """
        now = self.clock()
        statuses = self._read_statuses()
        if not any(rank_is_live(status, now, self.patience, processes=True) for status in statuses):
            return "no producer is running here (no rank has a fresh heartbeat), so there is nothing to stop"
        return self._write_stop(stop_note(now))

    def _write_stop(self, note: bytes) -> str | None:
        """Write the stop request; None, or why it could not be written."""
        return request_stop(self.paths, note)

    def close(self) -> None:
        """Let go of what the scanner holds (nothing, for a directory read in place)."""

    def _read(self, now: float) -> Snapshot:
        """Everything but the history, read from the files."""
        manifest, manifest_error, manifest_warnings = self._read_manifest()
        published, partials = self._read_shards()
        ranks = tuple(self._read_statuses())
        writing = frozenset(s for s, mtime in partials.items()
                            if partial_is_written(s, mtime, ranks, now, self.patience))
        events = self.events.read()
        return Snapshot(
            now=now,
            path=self.shown,
            manifest=manifest,
            manifest_error=manifest_error,
            published=MappingProxyType(published),
            writing=writing,
            abandoned=frozenset(partials) - writing,
            failed=failed_shards(events),
            ranks=ranks,
            rates=self.rates.observe(ranks),
            events=events,
            disk_free=None if self.remote else self.disk_free(self.paths.root),
            stop_requested=os.path.exists(self.paths.stop_request),
            warnings=manifest_warnings + tuple(self.reader.warnings),
            remote=self.remote,
            patience=self.patience,
        )

    def _read_manifest(self) -> tuple[Manifest | None, str | None, tuple[str, ...]]:
        """The manifest, or why it cannot be shown, and its problems; read again only when it changes."""
        try:
            st = os.stat(self.paths.manifest)
        except FileNotFoundError:
            self._manifest_key = None
            return None, None, ()
        except OSError as exc:
            return None, f"{self.paths.manifest}: {exc.strerror or exc}", ()
        key = (st.st_mtime_ns, st.st_size, st.st_ino)
        if key != self._manifest_key:
            self._manifest = self._decode_manifest()
            self._manifest_key = key
        return self._manifest

    def _decode_manifest(self) -> tuple[Manifest | None, str | None, tuple[str, ...]]:
        """Read and decode the manifest; fields out of range are warned about, still shown."""
        where = self.paths.manifest
        try:
            manifest = read_manifest(self.paths.root, missing_ok=True, allow_incomplete=True, checked=False,
                                     within=self.reader.root_real)
        except ManifestDecodeError as exc:  # garbage, or a NeMo or older dspark format: says which
            return None, str(exc), ()
        except (CacheError, OSError) as exc:
            return None, f"{where}: {reason(exc, 'manifest')}", ()
        problems = list(manifest_problems(manifest)) if manifest is not None else []
        if problems:  # shown anyway (out-of-range numbers get placeholders), with each problem
            rel = os.path.relpath(where, self.paths.root)
            return manifest, None, tuple(f"{rel}: {problem}" for problem in problems)
        return manifest, None, ()

    def _read_shards(self) -> tuple[dict[int, ShardSummary], dict[int, float]]:
        """Published shards (a copy) and the ``.partial`` files; none while ``shards/`` is unusable."""
        if not self.reader.dir_ok(self.paths.shards_dir):
            return {}, {}
        return self._read_indexes(), self._partials()

    def _read_indexes(self) -> dict[int, ShardSummary]:
        """Summaries of the published shards: new index files are read, removed ones forgotten."""
        present = set(self.paths.indexed_shard_ids())
        for gone in set(self._indexes) - present:  # --overwrite or repair removed it
            del self._indexes[gone]
        for shard_id in sorted(present - set(self._indexes)):
            data = self.reader.read(self.paths.shard_index(shard_id), MAX_INDEX_BYTES, "shard index")
            try:
                if data is not None:
                    self._indexes[shard_id] = ShardSummary.of(decode_shard_index(data))
            except msgspec.DecodeError:
                continue  # mid-replace: next scan
        return dict(self._indexes)

    def _partials(self) -> dict[int, float]:
        """Shard id -> modification time of the ``.partial`` files named exactly as the producer names them."""
        out = {}
        for path in self.paths.partial_files():
            digits = _DIGITS.search(os.path.basename(path))
            if digits and self.paths.shard_partial(int(digits.group())) == path:
                try:
                    # metadata only: a FIFO is never opened
                    out[int(digits.group())] = os.lstat(path).st_mtime
                except OSError:
                    continue  # published or deleted since the listing
        return out

    def _read_statuses(self) -> list[RankStatus]:
        """Every readable ``status/rank-N.json``, in rank order (a file mid-replace is skipped)."""
        out = []
        for name in self.reader.listing(self.paths.status_dir):
            if not name.endswith(".json"):
                continue
            path = os.path.join(self.paths.status_dir, name)
            try:
                out.append(read_rank_status(path, self.reader.root_real))
            except FileNotFoundError:
                continue
            except (CacheError, OSError) as exc:
                self.reader.skip(path, exc, "status")
            except msgspec.DecodeError:
                continue
        return out


def _free_bytes(path: str) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None
