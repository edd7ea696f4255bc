"""Where the time goes: data, device, copy, backpressure, the writer's wait for copies, writing (all ranks)."""

from __future__ import annotations

import math

from textual.widgets import Static

from dspark_cache.tui.display import human_duration
from dspark_cache.tui.snapshot import Snapshot
from dspark_cache.tui.widgets import SHOWS_SNAPSHOT

# On CUDA, device and copy are GPU time from CUDA events; wait is the writer waiting for a copy.
LABELS = {"data": "data", "device": "device", "copy": "copy", "backpressure": "waiting on writer",
          "wait": "writer waits on copy", "write": "write (overlapped)"}
BAR = 24
LABEL_WIDTH = max(len(label) for label in LABELS.values())
PLAIN_SECONDS = 1e6  # up to here seconds are shown as such; beyond, as a capped duration


class StageBreakdown(Static):
    """Seconds per stage, summed over ranks, as bars scaled to the largest."""

    DEFAULT_CLASSES = SHOWS_SNAPSHOT
    DEFAULT_CSS = "StageBreakdown { height: auto; border: round $primary; padding: 0 1; }"

    def show(self, snap: Snapshot) -> None:
        totals = snap.stage_totals()
        if not totals:
            self.update("stage times: none yet")
            return
        shown = {key: totals.get(key, 0.0) for key in LABELS}
        # Bars are scaled to the largest sane total: one infinite or NaN total must not blank the rest.
        scale = max((s for s in shown.values() if _sane(s)), default=0.0) or 1.0
        lines = [f"{label:>{LABEL_WIDTH}} {bar(shown[key], scale):<{BAR}} {seconds(shown[key]):>10}"
                 for key, label in LABELS.items()]
        self.update("\n".join(lines))


def _sane(value: float) -> bool:
    return math.isfinite(value) and value >= 0


def bar(value: float, scale: float) -> str:
    """A bar ``value / scale`` of full width; full for an infinite total, empty for nonsense."""
    if value == math.inf:
        return "█" * BAR
    return "█" * int(BAR * min(1.0, value / scale)) if _sane(value) else ""


def seconds(value: float) -> str:
    """``12.5 s``, or a capped duration (or placeholder) for what does not fit."""
    return f"{value:.1f} s" if _sane(value) and value < PLAIN_SECONDS else human_duration(value)
