"""Everything the monitor shows, read from files only (cheaply, incrementally, never torch).

The cache directory is the interface: the manifest (identity and plan), shard index files
(what is published), ``.partial`` files (what is being written), per-rank status heartbeats,
and the append-only event logs. Reading only files makes the monitor work on a live run, a
finished cache, a shared filesystem and across producer restarts alike.
"""

from __future__ import annotations

import os
import shutil
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import msgspec

from dspark_cache.format.paths import PARTIAL_SUFFIX, CachePaths
from dspark_cache.format.schema import Event, Manifest, RankStatus, ShardIndex, decode_manifest, decode_shard_index
from dspark_cache.format.status import ACTIVE_RANK_STATES, read_rank_statuses

STALE_AFTER = 10.0  # seconds without a heartbeat before a rank that says it is active looks stuck


@dataclass
class Throughput:
    time: float
    tokens_per_s: float
    bytes_per_s: float


@dataclass
class Snapshot:
    """One consistent view of a cache directory at time ``now``."""

    now: float
    path: str
    exists: bool = True
    manifest: Manifest | None = None
    manifest_error: str | None = None
    published: dict[int, ShardIndex] = field(default_factory=dict)
    writing: set[int] = field(default_factory=set)
    failed: set[int] = field(default_factory=set)
    ranks: list[RankStatus] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    history: list[Throughput] = field(default_factory=list)
    disk_free: int | None = None
    stop_requested: bool = False

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
        return sum(i.num_samples + len(i.nonfinite) for i in self.published.values())

    @property
    def tokens_done(self) -> int:
        return sum(e.length for i in self.published.values() for e in i.samples)

    @property
    def bytes_done(self) -> int:
        return sum(i.tar_bytes for i in self.published.values())

    @property
    def tokens_per_s(self) -> float:
        return sum(r.tokens_per_s for r in self.live_ranks)

    @property
    def bytes_per_s(self) -> float:
        return sum(r.bytes_per_s for r in self.live_ranks)

    def eta_seconds(self) -> float | None:
        if not self.manifest or self.complete:
            return None
        rate = self.tokens_per_s
        left = self.manifest.planned_tokens - self.tokens_done
        return left / rate if rate > 0 else None

    def stage_totals(self) -> dict[str, float]:
        totals: dict[str, float] = {}
        for r in self.ranks:
            for stage, seconds in r.stage_seconds.items():
                totals[stage] = totals.get(stage, 0.0) + seconds
        return totals


class CacheWatcher:
    """Polls a cache directory; each :meth:`poll` reads only what changed since the last one."""

    def __init__(self, path: str, clock: Callable[[], float] = time.time,
                 disk_free: Callable[[str], int | None] | None = None, history: int = 120) -> None:
        self.paths = CachePaths(path)
        self.clock = clock
        self.disk_free = disk_free or _free_bytes
        self._indexes: dict[int, ShardIndex] = {}
        self._event_offsets: dict[str, int] = {}
        self._events: deque[Event] = deque(maxlen=500)
        self._history: deque[Throughput] = deque(maxlen=history)
        self._manifest_key: tuple[float, int] | None = None
        self._manifest: Manifest | None = None

    def poll(self) -> Snapshot:
        snap = Snapshot(now=self.clock(), path=self.paths.root, exists=os.path.isdir(self.paths.root))
        if not snap.exists:
            return snap
        snap.manifest, snap.manifest_error = self._read_manifest()
        snap.published = self._read_indexes()
        snap.writing = self._partials()
        snap.ranks = read_rank_statuses(self.paths)
        snap.events = self._read_events()
        snap.failed = {e.data.get("shard") for e in snap.events if e.kind == "error" and "shard" in e.data}
        snap.disk_free = self.disk_free(self.paths.root)
        snap.stop_requested = os.path.exists(self.paths.stop_request)
        if snap.live_ranks:
            self._history.append(Throughput(snap.now, snap.tokens_per_s, snap.bytes_per_s))
        snap.history = list(self._history)
        return snap

    def request_stop(self) -> None:
        """Ask the producer to finish the shard in flight and exit, resumable."""
        os.makedirs(os.path.dirname(self.paths.stop_request), exist_ok=True)
        with open(self.paths.stop_request, "w") as handle:
            handle.write(f"requested by dspark-monitor at {self.clock():.0f}\n")

    def _read_manifest(self) -> tuple[Manifest | None, str | None]:
        try:
            st = os.stat(self.paths.manifest)
        except FileNotFoundError:
            return None, None
        key = (st.st_mtime, st.st_size)
        if key != self._manifest_key:
            try:
                with open(self.paths.manifest, "rb") as handle:
                    self._manifest = decode_manifest(handle.read(), self.paths.manifest)
            except (OSError, msgspec.DecodeError) as exc:
                return None, str(exc)
            self._manifest_key = key
        return self._manifest, None

    def _read_indexes(self) -> dict[int, ShardIndex]:
        present = set(self.paths.indexed_shard_ids())
        for gone in set(self._indexes) - present:  # --overwrite or repair removed it
            del self._indexes[gone]
        for shard_id in present - set(self._indexes):
            try:
                with open(self.paths.shard_index(shard_id), "rb") as handle:
                    self._indexes[shard_id] = decode_shard_index(handle.read())
            except (OSError, msgspec.DecodeError):
                continue  # mid-replace: next poll
        return dict(self._indexes)

    def _partials(self) -> set[int]:
        out = set()
        for path in self.paths.partial_files():
            name = os.path.basename(path)
            if name.startswith("shard-") and name.endswith(".tar" + PARTIAL_SUFFIX):
                out.add(int(name[6:12]))
        return out

    def _read_events(self) -> list[Event]:
        try:
            names = sorted(os.listdir(self.paths.events_dir))
        except FileNotFoundError:
            return list(self._events)
        fresh: list[Event] = []
        for name in names:
            path = os.path.join(self.paths.events_dir, name)
            offset = self._event_offsets.get(name, 0)
            try:
                with open(path, "rb") as handle:
                    handle.seek(offset)
                    data = handle.read()
            except OSError:
                continue
            end = data.rfind(b"\n") + 1  # a line cut by a crash is skipped until it is whole
            for line in data[:end].splitlines():
                try:
                    fresh.append(msgspec.json.decode(line, type=Event))
                except msgspec.DecodeError:
                    continue
            self._event_offsets[name] = offset + end
        self._events.extend(sorted(fresh, key=lambda e: e.time))
        return list(self._events)


def _free_bytes(path: str) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None
