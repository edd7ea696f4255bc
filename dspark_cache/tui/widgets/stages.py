"""Where the time goes: waiting for data, device, copy, backpressure, writing (all ranks)."""

from __future__ import annotations

from textual.widgets import Static

from dspark_cache.tui.watcher import Snapshot

LABELS = {"data": "data", "device": "device", "copy": "copy", "backpressure": "waiting on writer",
          "write": "write (overlapped)"}


class StageBreakdown(Static):
    DEFAULT_CSS = "StageBreakdown { height: auto; border: round $primary; padding: 0 1; }"

    def show(self, snap: Snapshot) -> None:
        totals = snap.stage_totals()
        if not totals:
            self.update("stage times: none yet")
            return
        scale = max(totals.values()) or 1.0
        lines = []
        for key, label in LABELS.items():
            seconds = totals.get(key, 0.0)
            bar = "█" * int(24 * seconds / scale)
            lines.append(f"{label:>18} {bar:<24} {seconds:8.1f} s")
        self.update("\n".join(lines))
