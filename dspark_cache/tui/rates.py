"""Rates of the work a producer run does itself, measured by the monitor from successive heartbeats.

A rank's heartbeat carries cumulative counts, but after a resume ``tokens_done`` also counts the
shards earlier runs published, and it is 0 until the run's first batch: any rate taken over a
span that starts before that batch (the producer's own ``tokens_per_s`` in its first window, for
one) jumps by everything resumed. So the monitor ignores the rate fields and differences the
counts of heartbeats of one run instead: the first heartbeat that reports work is the baseline,
and only what is added after it counts. ``bytes_written`` holds this run's published bytes only.

A finished or stopped run is summarised from its last heartbeats instead: the bytes it wrote
over its wall time, and tokens at the cache's tokens per byte (its heartbeats hold no token count
of its own work: ``tokens_done`` is set to the plan's total when the cache completes).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from dspark_cache.format.schema import RankPhase, RankStatus
from dspark_cache.tui.display import as_float

RATE_WINDOW_S = 10.0  # "now" is the rate over about this much of the producer's time
# Counts move a batch at a time: over a second or two one batch reads as a burst (a measured
# resume on CPU read 5.4k tokens/s over its first 1.2 s, then ~2.2k), so no rate before this span.
MIN_SPAN_S = 5.0
MAX_BEATS = 256  # heartbeats kept per rank run (one a second), whatever the files claim


@dataclass(frozen=True)
class RankRate:
    """A running rank's rates: over the last :data:`RATE_WINDOW_S` and since it was first seen working."""

    tokens_per_s: float
    bytes_per_s: float
    average_tokens_per_s: float


@dataclass(frozen=True)
class RunAverage:
    """The newest run's work over its wall time (its heartbeats' ``started_at`` to the last one)."""

    tokens_per_s: float | None  # None when the cache's published shards give no tokens per byte
    bytes_per_s: float
    seconds: float


class _Beat(NamedTuple):
    time: float  # the producer's updated_at: differences never mix two hosts' clocks
    tokens: int
    bytes: int


class _RunBeats:
    """The working heartbeats of one rank's run: the first one (the baseline) and the recent ones."""

    def __init__(self) -> None:
        self.first: _Beat | None = None
        self.recent: deque[_Beat] = deque(maxlen=MAX_BEATS)

    def add(self, beat: _Beat, window: float) -> None:
        """Record ``beat``; one that goes back in time or counts start over from it."""
        last = self.recent[-1] if self.recent else None
        if last is not None and beat.time == last.time:
            return  # the same heartbeat read again
        if last is not None and (
            beat.time < last.time or beat.tokens < last.tokens or beat.bytes < last.bytes
        ):
            self.first = None  # not a continuation of what was seen: the counts cannot be differenced
            self.recent.clear()
        if self.first is None:
            self.first = beat
        self.recent.append(beat)
        # Keep one beat at or before the window's start, so that "now" spans the whole window.
        while len(self.recent) > 2 and self.recent[1].time <= beat.time - window:
            self.recent.popleft()

    def rate(self) -> RankRate | None:
        """The rates, once heartbeats of this run reporting work span :data:`MIN_SPAN_S`; None before."""
        if self.first is None or len(self.recent) < 2:
            return None
        oldest, newest = self.recent[0], self.recent[-1]
        if not newest.time - oldest.time >= MIN_SPAN_S:
            return None
        tokens, written = per_second(oldest, newest)
        average, _ = per_second(self.first, newest)
        if tokens is None or written is None or average is None:
            return None
        return RankRate(tokens, written, average)


def per_second(a: _Beat, b: _Beat) -> tuple[float | None, float | None]:
    """Tokens and bytes per second from beat ``a`` to ``b``; None where no finite rate exists."""
    seconds = b.time - a.time
    if not (math.isfinite(seconds) and seconds > 0):
        return None, None
    tokens, written = as_float(b.tokens - a.tokens), as_float(b.bytes - a.bytes)  # ints of any size
    return (None if tokens is None else tokens / seconds), (None if written is None else written / seconds)


def _beat(status: RankStatus) -> _Beat | None:
    """The counts of a heartbeat that reports work of the run; None for one that cannot be used."""
    if status.phase != RankPhase.RUNNING or status.tokens_done <= 0:  # 0: no batch of this run reported yet
        return None
    if not math.isfinite(status.updated_at) or status.bytes_written < 0:
        return None
    return _Beat(status.updated_at, status.tokens_done, status.bytes_written)


def _run_key(status: RankStatus) -> tuple:
    """What tells one run of a rank from the next (a restarted producer rewrites the same file)."""
    return status.rank, status.run_id, status.started_at, status.pid, status.host


class RateTracker:
    """Per-rank rates from the heartbeats of successive scans.

    State between scans: only the watcher thread may call :meth:`observe`. Runs no longer in any
    status file are forgotten, so memory follows the status files, never the length of a run.
    """

    def __init__(self, window: float = RATE_WINDOW_S) -> None:
        self.window = window
        self._runs: dict[tuple, _RunBeats] = {}

    def observe(self, statuses: Iterable[RankStatus]) -> tuple[RankRate | None, ...]:
        """The rate of each status, in order: None for a rank not running, or not measured yet."""
        seen: dict[tuple, _RunBeats] = {}
        rates = []
        for status in statuses:
            key = _run_key(status)
            beats = seen[key] = seen.get(key) or self._runs.get(key) or _RunBeats()
            beat = _beat(status)
            if beat is not None:
                beats.add(beat, self.window)
            rates.append(beats.rate() if status.phase == RankPhase.RUNNING else None)
        self._runs = seen
        return tuple(rates)


def run_average(ranks: Iterable[RankStatus], tokens_per_byte: float | None) -> RunAverage | None:
    """The newest run's average, from its ranks' last heartbeats; None without a usable one.

    The newest run is the one whose heartbeat is the most recent; its span runs from its earliest
    ``started_at`` to that heartbeat, and its work is the bytes its ranks published.
    """
    usable = [r for r in ranks if math.isfinite(r.updated_at) and math.isfinite(r.started_at)]
    if not usable:
        return None
    newest = max(usable, key=lambda r: r.updated_at)
    run = [r for r in usable if r.run_id == newest.run_id]
    seconds = newest.updated_at - min(r.started_at for r in run)
    written = as_float(sum(max(0, r.bytes_written) for r in run))
    if not (seconds > 0 and written):
        return None
    bytes_per_s = written / seconds
    return RunAverage(
        None if tokens_per_byte is None else bytes_per_s * tokens_per_byte, bytes_per_s, seconds
    )


def tokens_per_byte(tokens: int, written: int) -> float | None:
    """The published shards' tokens per byte; None when nothing (or nothing sane) is published."""
    t, b = as_float(tokens), as_float(written)
    if t is None or b is None or not (0 < b < math.inf) or not (0 <= t < math.inf):
        return None
    return t / b


def summed(values: Iterable[float | None]) -> float | None:
    """The sum of the known values; None when none is known."""
    known = [v for v in values if v is not None]
    return sum(known) if known else None

