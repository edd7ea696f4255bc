"""Everything the monitor shows, read from files only (cheaply, incrementally, never torch).

The cache directory is the interface: the manifest (identity and plan), shard index files
(what is published), ``.partial`` files (what is being written), per-rank status heartbeats,
and the append-only event logs. Reading only files makes the monitor work on a live run, a
finished cache, a shared filesystem and across producer restarts alike.

Nothing in the directory is trusted: files that are not regular files inside the cache are
skipped with a warning (see :mod:`~dspark_cache.tui.safe_io`), every read is bounded, and
nothing is kept per planned shard, so a hostile or corrupt cache cannot hang the monitor or
grow it without bound.

:class:`CacheWatcher` runs on the monitor's watcher thread (:mod:`~dspark_cache.tui.poller`),
never on the UI thread, so a slow read delays the next snapshot but never freezes the screen.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Callable

import msgspec

from dspark_cache.format.paths import CachePaths
from dspark_cache.format.schema import Event, Manifest, RankStatus, ShardIndex, decode_manifest, decode_shard_index
from dspark_cache.format.status import ACTIVE_RANK_STATES
from dspark_cache.tui.display import as_float, clip
from dspark_cache.tui.safe_io import Refused, check_dir, open_regular, read_capped, write_regular
from dspark_cache.tui.tail import LogTail

STALE_AFTER = 10.0  # seconds without a heartbeat before a rank that says it is active looks stuck
MANIFEST_LIMIT = 64 << 20  # a real manifest, even listing many skipped rows, is far smaller
INDEX_LIMIT = 64 << 20  # a shard index lists its samples: tens of bytes each
STATUS_LIMIT = 1 << 20  # a heartbeat is a few hundred bytes
MAX_EVENTS = 500  # events kept in memory, newest last
EVENT_TEXT = 500  # characters of an event's kind and message kept (a line may be 256 KiB)
_DIGITS = re.compile(r"[0-9]+")


@dataclass(frozen=True)
class Throughput:
    """The summed rate of the live ranks at one poll."""

    time: float
    tokens_per_s: float
    bytes_per_s: float


@dataclass(frozen=True)
class ShardSummary:
    """What the monitor needs of a published shard's index (its sample list is not kept)."""

    samples: int  # planned samples covered: stored plus dropped as non-finite
    tokens: int
    bytes: int

    @classmethod
    def of(cls, index: ShardIndex) -> ShardSummary:
        """The summary of a decoded ``shard-N.idx``."""
        return cls(index.num_samples + len(index.nonfinite), sum(e.length for e in index.samples),
                   index.tar_bytes)


@dataclass(frozen=True)
class Snapshot:
    """One view of a cache directory at time ``now``, immutable once made.

    The watcher thread makes it and the UI thread renders it, so nothing in it is shared with
    the watcher's own state: the collections are tuples, frozensets and a read-only mapping, and
    the decoded structs in them are never modified after a poll returns them.
    """

    now: float
    path: str
    exists: bool = True
    manifest: Manifest | None = None
    manifest_error: str | None = None
    published: Mapping[int, ShardSummary] = field(default_factory=lambda: MappingProxyType({}))
    writing: frozenset[int] = frozenset()
    failed: frozenset[int] = frozenset()
    ranks: tuple[RankStatus, ...] = ()
    events: tuple[Event, ...] = ()  # newest last
    history: tuple[Throughput, ...] = ()  # oldest first
    disk_free: int | None = None
    stop_requested: bool = False
    warnings: tuple[str, ...] = ()  # files skipped this poll, and why

    @property
    def is_cache(self) -> bool:
        return self.manifest is not None

    @property
    def complete(self) -> bool:
        return bool(self.manifest and self.manifest.complete)

    @property
    def live_ranks(self) -> list[RankStatus]:
        return [r for r in self.ranks if r.state in ACTIVE_RANK_STATES and not self.is_stale(r)]

    def is_stale(self, status: RankStatus) -> bool:
        return status.state in ACTIVE_RANK_STATES and self.now - status.updated_at > STALE_AFTER

    @property
    def samples_done(self) -> int:
        return sum(s.samples for s in self.published.values())

    @property
    def tokens_done(self) -> int:
        return sum(s.tokens for s in self.published.values())

    @property
    def bytes_done(self) -> int:
        return sum(s.bytes for s in self.published.values())

    @property
    def tokens_per_s(self) -> float:
        return sum(r.tokens_per_s for r in self.live_ranks)

    @property
    def bytes_per_s(self) -> float:
        return sum(r.bytes_per_s for r in self.live_ranks)

    def eta_seconds(self) -> float | None:
        """Seconds left at the current rate; inf for a vanishing rate, None when unknown."""
        if not self.manifest or self.complete:
            return None
        rate = as_float(self.tokens_per_s)
        left = as_float(self.manifest.planned_tokens - self.tokens_done)
        if rate is None or rate <= 0 or left is None:
            return None
        return max(0.0, left) / rate

    def stage_totals(self) -> dict[str, float]:
        totals: dict[str, float] = {}
        for r in self.ranks:
            for stage, seconds in r.stage_seconds.items():
                totals[stage] = totals.get(stage, 0.0) + seconds
        return totals


class CacheWatcher:
    """Reads a cache directory; each :meth:`poll` reads only what changed since the last one.

    It keeps state between polls (decoded shard indexes, log positions, recent events, the
    throughput history), so only one thread may poll it (the watcher thread); :meth:`request_stop`
    keeps no state and may be called from any thread.
    """

    def __init__(self, path: str, clock: Callable[[], float] = time.time,
                 disk_free: Callable[[str], int | None] | None = None, history: int = 120) -> None:
        self.paths = CachePaths(path)
        self.clock = clock
        self.disk_free = disk_free or _free_bytes
        self._root_real = os.path.realpath(path)
        self._indexes: dict[int, ShardSummary] = {}
        self._tails: dict[str, LogTail] = {}
        self._events: deque[Event] = deque(maxlen=MAX_EVENTS)
        self._history: deque[Throughput] = deque(maxlen=history)
        self._manifest_key: tuple[int, int, int] | None = None
        self._manifest: tuple[Manifest | None, str | None] = (None, None)

    def poll(self) -> Snapshot:
        """A snapshot of the directory now, with the throughput history of the polls so far."""
        now, root = self.clock(), self.paths.root
        if not os.path.isdir(root):
            return Snapshot(now=now, path=root, exists=False)
        self._root_real = os.path.realpath(root)  # the root itself may be a symlink
        snap = self._read(now)
        if snap.live_ranks:
            self._history.append(Throughput(now, snap.tokens_per_s, snap.bytes_per_s))
        return replace(snap, history=tuple(self._history))

    def _read(self, now: float) -> Snapshot:
        """Everything but the history, read from the files."""
        warn: list[str] = []
        manifest, manifest_error = self._read_manifest()
        published, writing = self._read_shards(warn)
        ranks = tuple(self._read_statuses(warn))
        events = tuple(self._read_events(warn))
        return Snapshot(
            now=now, path=self.paths.root, manifest=manifest, manifest_error=manifest_error,
            published=MappingProxyType(published), writing=frozenset(writing), failed=_failed_shards(events),
            ranks=ranks, events=events, disk_free=self.disk_free(self.paths.root),
            stop_requested=os.path.exists(self.paths.stop_request), warnings=tuple(warn),
        )

    def request_stop(self) -> None:
        """Ask the producer to finish the shard in flight and exit, resumable.

        Raises :class:`Refused` or ``OSError`` when the request cannot be written safely (its
        directory leads out of the cache, or the request file is a FIFO, a device or a symlink).
        """
        control = self.paths.control_dir
        os.makedirs(control, exist_ok=True)
        check_dir(control, os.path.realpath(self.paths.root))
        write_regular(self.paths.stop_request, f"requested by dspark-monitor at {self.clock():.0f}\n".encode())

    def _read_manifest(self) -> tuple[Manifest | None, str | None]:
        """The manifest, or why it cannot be shown; read again only when the file changes."""
        try:
            st = os.stat(self.paths.manifest)
        except FileNotFoundError:
            self._manifest_key = None
            return None, None
        except OSError as exc:
            return None, f"{self.paths.manifest}: {exc.strerror or exc}"
        key = (st.st_mtime_ns, st.st_size, st.st_ino)
        if key != self._manifest_key:
            self._manifest = self._decode_manifest()
            self._manifest_key = key
        return self._manifest

    def _decode_manifest(self) -> tuple[Manifest | None, str | None]:
        where = self.paths.manifest
        try:
            data = read_capped(where, self._root_real, MANIFEST_LIMIT, "manifest")
            return decode_manifest(data, where), None
        except Refused as exc:
            return None, f"{where}: {exc}"
        except OSError as exc:
            return None, f"{where}: {exc.strerror or exc}"
        except msgspec.DecodeError as exc:  # garbage, or a NeMo or older dspark layout: says which
            return None, str(exc)

    def _read_shards(self, warn: list[str]) -> tuple[dict[int, ShardSummary], set[int]]:
        """Published shards (a copy) and shards being written; none while ``shards/`` is unusable."""
        if not self._dir_ok(self.paths.shards_dir, warn):
            return {}, set()
        return self._read_indexes(warn), self._partials()

    def _read_indexes(self, warn: list[str]) -> dict[int, ShardSummary]:
        """Summaries of the published shards: new index files are read, removed ones forgotten."""
        present = set(self.paths.indexed_shard_ids())
        for gone in set(self._indexes) - present:  # --overwrite or repair removed it
            del self._indexes[gone]
        for shard_id in sorted(present - set(self._indexes)):
            data = self._read_file(self.paths.shard_index(shard_id), INDEX_LIMIT, "shard index", warn)
            try:
                if data is not None:
                    self._indexes[shard_id] = ShardSummary.of(decode_shard_index(data))
            except msgspec.DecodeError:
                continue  # mid-replace: next poll
        return dict(self._indexes)

    def _partials(self) -> set[int]:
        """Shards being written: ``.partial`` files named exactly as the producer names them."""
        out = set()
        for path in self.paths.partial_files():
            digits = _DIGITS.search(os.path.basename(path))
            if digits and self.paths.shard_partial(int(digits.group())) == path:
                out.add(int(digits.group()))
        return out

    def _read_statuses(self, warn: list[str]) -> list[RankStatus]:
        """Every readable ``status/rank-N.json``, in rank order (a file mid-replace is skipped)."""
        out = []
        for name in self._listing(self.paths.status_dir, warn):
            if not name.endswith(".json"):
                continue
            data = self._read_file(os.path.join(self.paths.status_dir, name), STATUS_LIMIT, "status", warn)
            try:
                if data is not None:
                    out.append(msgspec.json.decode(data, type=RankStatus))
            except msgspec.DecodeError:
                continue
        return out

    def _read_events(self, warn: list[str]) -> list[Event]:
        """The newest events (at most ``MAX_EVENTS``), with the new lines of every log read from a bounded tail."""
        names = self._listing(self.paths.events_dir, warn)
        for gone in set(self._tails) - set(names):
            del self._tails[gone]
        fresh: list[Event] = []
        for name in names:
            lines = self._tail_lines(name, warn)
            fresh = sorted(fresh + _decode_events(lines[-MAX_EVENTS:]), key=lambda e: e.time)[-MAX_EVENTS:]
        self._events.extend(fresh)
        return list(self._events)

    def _tail_lines(self, name: str, warn: list[str]) -> list[bytes]:
        """The complete lines added to ``events/name`` since the last poll (see :class:`LogTail`)."""
        path = os.path.join(self.paths.events_dir, name)
        try:
            handle, st = open_regular(path, self._root_real)
            with handle:
                return self._tails.setdefault(name, LogTail()).read(handle, st)
        except FileNotFoundError:
            return []
        except (Refused, OSError) as exc:
            warn.append(f"skipped {self._relative(path)}: {_reason(exc)}")
            return []

    def _listing(self, directory: str, warn: list[str]) -> list[str]:
        """Sorted names in a cache subdirectory; none when it is missing or not a directory of the cache."""
        if not self._dir_ok(directory, warn):
            return []
        try:
            return sorted(os.listdir(directory))
        except OSError as exc:
            warn.append(f"skipped {self._relative(directory)}/: {_reason(exc)}")
            return []

    def _dir_ok(self, directory: str, warn: list[str]) -> bool:
        """Whether a cache subdirectory exists and may be read (a refusal is warned about)."""
        try:
            check_dir(directory, self._root_real)
        except FileNotFoundError:
            return False
        except (Refused, OSError) as exc:
            warn.append(f"skipped {self._relative(directory)}/: {_reason(exc)}")
            return False
        return True

    def _read_file(self, path: str, limit: int, what: str, warn: list[str]) -> bytes | None:
        """A whole small file, or None (gone: silently; refused or unreadable: with a warning)."""
        try:
            return read_capped(path, self._root_real, limit, what)
        except FileNotFoundError:
            return None
        except (Refused, OSError) as exc:
            warn.append(f"skipped {self._relative(path)}: {_reason(exc)}")
            return None

    def _relative(self, path: str) -> str:
        return os.path.relpath(path, self.paths.root)


def _failed_shards(events: tuple[Event, ...]) -> frozenset[int]:
    """Shards an error event names (the event kept only a real integer shard id)."""
    return frozenset(e.data["shard"] for e in events if e.kind == "error" and "shard" in e.data)


def _decode_events(lines: list[bytes]) -> list[Event]:
    """The valid events among ``lines``, trimmed to what the monitor shows (a line may be huge)."""
    out = []
    for line in lines:
        try:
            event = msgspec.json.decode(line, type=Event)
        except msgspec.DecodeError:
            continue
        shard = event.data.get("shard")
        data = {"shard": shard} if type(shard) is int else {}  # only a real shard id can mark a shard failed
        out.append(Event(time=event.time, rank=event.rank, kind=clip(event.kind, EVENT_TEXT),
                         message=clip(event.message, EVENT_TEXT), data=data))
    return out


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    return str(exc)


def _free_bytes(path: str) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None
