"""Throughput over time: tokens/s and MB/s sparklines with current values."""

from __future__ import annotations

from typing import Callable

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Sparkline

from dspark_cache.tui.display import as_float, human_bytes, human_count
from dspark_cache.tui.fit import Para, piece
from dspark_cache.tui.snapshot import Snapshot
from dspark_cache.tui.widgets import SHOWS_SNAPSHOT
from dspark_cache.tui.widgets.fitted import Fitted

MAX_RATE = 1e300  # a whole history of these still sums to a finite number


class ThroughputChart(Vertical):
    """Tokens/s and bytes/s of the live ranks, now, at peak, and as sparklines over the history;
    with no rank live, the newest run's average (:func:`~dspark_cache.tui.rates.run_average`)."""

    DEFAULT_CLASSES = SHOWS_SNAPSHOT
    DEFAULT_CSS = """
    ThroughputChart { height: 8; border: round $primary; padding: 0 1; }
    ThroughputChart Sparkline { height: 2; }
    """

    def compose(self) -> ComposeResult:
        yield Fitted(id="tok-label")
        yield Sparkline([], id="tok-line")
        yield Fitted(id="mb-label")
        yield Sparkline([], id="mb-line")

    def show(self, snap: Snapshot) -> None:
        tokens = [h.tokens_per_s for h in snap.history]
        written = [h.bytes_per_s for h in snap.history]
        tok, mb = rate_labels(snap)
        self.query_one("#tok-label", Fitted).show_paras([tok])
        self.query_one("#mb-label", Fitted).show_paras([mb])
        self.query_one("#tok-line", Sparkline).data = series(tokens)
        self.query_one("#mb-line", Sparkline).data = series(written)


def series(rates: list[float]) -> list[float]:
    """What a sparkline draws: textual draws one point as a solid block and none as a flat baseline, so a
    history of under two points (a run just begun, a finished or idle cache) is drawn as the baseline."""
    return [plottable(v) for v in rates] if len(rates) >= 2 else []


def rate_labels(snap: Snapshot) -> tuple[Para, Para]:
    """The tokens/s and written/s lines: now, the run's average with no rank live, and the peak."""
    # "now" is this scan's live rate, never the history's last entry: once no rank is live
    # there is no current rate, and the newest run's average is shown instead.
    average = None if snap.live_ranks else snap.run_average()
    return (label("tokens/s", snap.tokens_per_s, average.tokens_per_s if average else None,
                  [h.tokens_per_s for h in snap.history], human_count),
            label("written/s", snap.bytes_per_s, average.bytes_per_s if average else None,
                  [h.bytes_per_s for h in snap.history], human_bytes))


def label(what: str, now: float | None, average: float | None, history: list[float],
          fmt: Callable[[float | None], str]) -> Para:
    """``tokens/s now 1.2k   peak 1.6k``, with the last run's average in place of a rate when none is live."""
    parts = [piece(f"{what} now {'-' if now is None else fmt(now)}")]
    if average is not None:
        parts.append(piece(f"run avg {fmt(average)}"))
    if history:
        parts.append(piece(f"peak {fmt(peak(history))}"))
    return Para(parts, "   ")


def peak(rates: list[float]) -> float | None:
    """The largest rate that is a number (NaN would make ``max`` depend on the order)."""
    return max((v for v in rates if as_float(v) is not None), default=None)


def plottable(rate: float) -> float:
    """A rate the sparkline can scale: negative or NaN is 0, infinity the largest float that sums safely."""
    value = as_float(rate)
    return 0.0 if value is None or value < 0 else min(value, MAX_RATE)
