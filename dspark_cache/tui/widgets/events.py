"""Recent events, newest last; warnings in yellow, errors in red."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from dspark_cache.tui.display import clip, clock_time, integer
from dspark_cache.tui.snapshot import Snapshot
from dspark_cache.tui.widgets import VIEW

STYLES = {"error": "bold red", "warning": "yellow", "finished": "bold green", "stopped": "yellow",
          "resumed": "cyan", "skipped_row": "grey50"}


class EventLog(Static):
    """The newest ``rows`` events, one line each."""

    DEFAULT_CLASSES = VIEW
    DEFAULT_CSS = "EventLog { height: auto; max-height: 12; border: round $primary; padding: 0 1; }"

    def __init__(self, *args, rows: int = 8, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rows = rows

    def show(self, snap: Snapshot) -> None:
        recent = snap.events[-self.rows :]
        if not recent:
            self.update("no events yet")
            return
        text = Text()
        for i, e in enumerate(recent):
            text.append(f"{clock_time(e.time)} r{integer(e.rank)} {clip(e.kind, 24):<15} {clip(e.message, 300)}",
                        style=STYLES.get(e.kind, ""))
            if i < len(recent) - 1:
                text.append("\n")
        self.update(text)
