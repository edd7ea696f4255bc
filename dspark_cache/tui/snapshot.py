"""What the monitor shows: one immutable snapshot of a cache directory, made on the watcher thread.

The watcher thread makes a :class:`Snapshot` and the UI thread renders it, so nothing in it is
shared with the scanner's own state: the collections are tuples, frozensets and a read-only
mapping, and the decoded structs in them are never modified after a scan returns them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from dspark_cache.format.schema import Event, Manifest, RankPhase, RankStatus, ShardIndex
from dspark_cache.format.status import STALE_AFTER_S, process_gone, rank_is_live, rank_is_stale
from dspark_cache.tui.display import as_float
from dspark_cache.tui.rates import RankRate, RunAverage, run_average, summed, tokens_per_byte


@dataclass(frozen=True)
class Throughput:
    """The summed rate of the live ranks at one scan."""

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
    """A cache directory as read at time ``now``, immutable once made.

    ``path`` is what the monitor names: the directory, or the URL of a cache on object storage
    (``remote``), whose local copy the scanner read; its heartbeats reach that copy a sync interval
    and a refresh late, so a rank is STALE only after ``patience`` seconds of silence.
    """

    now: float
    path: str
    exists: bool = True
    manifest: Manifest | None = None
    manifest_error: str | None = None
    published: Mapping[int, ShardSummary] = field(default_factory=lambda: MappingProxyType({}))
    writing: frozenset[int] = frozenset()  # a .partial with a live writer (format.status.partial_is_written)
    # a .partial no live rank writes: a killed run's, deleted on resume
    abandoned: frozenset[int] = frozenset()
    failed: frozenset[int] = frozenset()
    ranks: tuple[RankStatus, ...] = ()
    rates: tuple[RankRate | None, ...] = ()  # measured by the scanner, one per rank (see tui.rates)
    events: tuple[Event, ...] = ()  # newest last
    history: tuple[Throughput, ...] = ()  # oldest first
    disk_free: int | None = None
    stop_requested: bool = False
    warnings: tuple[str, ...] = ()  # files skipped this scan and why, and the manifest's problems
    remote: bool = False  # path is an object-store URL: no local disk to fill
    patience: float = STALE_AFTER_S  # seconds of heartbeat silence before a working rank is STALE

    @property
    def complete(self) -> bool:
        return bool(self.manifest and self.manifest.complete)

    @property
    def live_ranks(self) -> list[RankStatus]:
        """Ranks working with a fresh heartbeat (format's liveness rule, the monitor's patience)."""
        return [r for r in self.ranks if rank_is_live(r, self.now, self.patience, processes=True)]

    def is_stale(self, status: RankStatus) -> bool:
        """Whether ``status`` claims to be working but its heartbeat is too old, or its process on this host
        is gone (shown as STALE)."""
        return rank_is_stale(status, self.now, self.patience, processes=True)

    def is_dead(self, status: RankStatus) -> bool:
        """Whether ``status`` claims to be working but its process, on this host, is gone (a SIGKILL)."""
        return status.phase in RankPhase.ACTIVE and process_gone(status)

    @property
    def samples_done(self) -> int:
        return sum(s.samples for s in self.published.values())

    @property
    def tokens_done(self) -> int:
        return sum(s.tokens for s in self.published.values())

    @property
    def bytes_done(self) -> int:
        return sum(s.bytes for s in self.published.values())

    def rank_rates(self) -> list[tuple[RankStatus, RankRate | None]]:
        """Each rank with its measured rate (None: not running, or not measured yet)."""
        rates = self.rates + (None,) * (len(self.ranks) - len(self.rates))
        return list(zip(self.ranks, rates))

    def _live_rates(self) -> list[RankRate]:
        return [
            rate
            for r, rate in self.rank_rates()
            if rate is not None and rank_is_live(r, self.now, self.patience)
        ]

    @property
    def can_stop(self) -> bool:
        """Whether a producer is there to stop: some rank of it is live."""
        return bool(self.live_ranks)

    @property
    def tokens_per_s(self) -> float | None:
        """Tokens per second the live ranks compute now; None until measured (or with none live)."""
        return summed(r.tokens_per_s for r in self._live_rates())

    @property
    def bytes_per_s(self) -> float | None:
        """Bytes per second the live ranks publish now; None until measured (or with none live)."""
        return summed(r.bytes_per_s for r in self._live_rates())

    def eta_seconds(self) -> float | None:
        """Seconds left at the live ranks' average rate; inf for a vanishing rate, None when unknown."""
        if not self.manifest or self.complete:
            return None
        rate = as_float(summed(r.average_tokens_per_s for r in self._live_rates()))
        left = as_float(self.manifest.planned_tokens - self.tokens_done)
        if rate is None or rate <= 0 or left is None:
            return None
        return max(0.0, left) / rate

    def run_average(self) -> RunAverage | None:
        """The newest run's average rates, from its heartbeats and the published shards."""
        return run_average(self.ranks, tokens_per_byte(self.tokens_done, self.bytes_done))

    def stage_totals(self) -> dict[str, float]:
        """Seconds spent per pipeline stage, summed over the ranks."""
        totals: dict[str, float] = {}
        for r in self.ranks:
            for stage, seconds in r.stage_seconds.items():
                totals[stage] = totals.get(stage, 0.0) + seconds
        return totals
