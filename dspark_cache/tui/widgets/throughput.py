"""Throughput over time: tokens/s and MB/s sparklines with current values."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Sparkline, Static

from dspark_cache.tui.display import as_float, human_bytes, human_count
from dspark_cache.tui.snapshot import Snapshot
from dspark_cache.tui.widgets import VIEW

MAX_RATE = 1e300  # a whole history of these still sums to a finite number


class ThroughputChart(Vertical):
    """Tokens/s and bytes/s of the live ranks, now, at peak, and as sparklines over the history."""

    DEFAULT_CLASSES = VIEW
    DEFAULT_CSS = """
    ThroughputChart { height: 8; border: round $primary; padding: 0 1; }
    ThroughputChart Sparkline { height: 2; }
    """

    def compose(self) -> ComposeResult:
        yield Static(id="tok-label")
        yield Sparkline([], id="tok-line")
        yield Static(id="mb-label")
        yield Sparkline([], id="mb-line")

    def show(self, snap: Snapshot) -> None:
        tokens = [h.tokens_per_s for h in snap.history]
        mbs = [h.bytes_per_s for h in snap.history]
        self.query_one("#tok-label", Static).update(
            f"tokens/s now {human_count(tokens[-1]) if tokens else '-'}   "
            f"peak {human_count(peak(tokens)) if tokens else '-'}")
        self.query_one("#mb-label", Static).update(
            f"written/s now {human_bytes(mbs[-1]) if mbs else '-'}   peak {human_bytes(peak(mbs)) if mbs else '-'}")
        # No history (a finished or idle cache) draws nothing rather than a misleading full bar.
        self.query_one("#tok-line", Sparkline).data = [plottable(v) for v in tokens]
        self.query_one("#mb-line", Sparkline).data = [plottable(v) for v in mbs]


def peak(rates: list[float]) -> float | None:
    """The largest rate that is a number (NaN would make ``max`` depend on the order)."""
    return max((v for v in rates if as_float(v) is not None), default=None)


def plottable(rate: float) -> float:
    """A rate the sparkline can scale: negative or NaN is 0, infinity the largest float that sums safely."""
    value = as_float(rate)
    return 0.0 if value is None or value < 0 else min(value, MAX_RATE)
