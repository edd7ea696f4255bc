"""Throughput over time: tokens/s and MB/s sparklines with current values."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Sparkline, Static

from dspark_cache.tui.format import human_bytes, human_count
from dspark_cache.tui.watcher import Snapshot


class ThroughputChart(Vertical):
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
            f"tokens/s now {human_count(tokens[-1]) if tokens else '-'}   peak {human_count(max(tokens)) if tokens else '-'}")
        self.query_one("#mb-label", Static).update(
            f"written/s now {human_bytes(mbs[-1]) if mbs else '-'}   peak {human_bytes(max(mbs)) if mbs else '-'}")
        # No history (a finished or idle cache) draws nothing rather than a misleading full bar.
        self.query_one("#tok-line", Sparkline).data = tokens
        self.query_one("#mb-line", Sparkline).data = mbs
