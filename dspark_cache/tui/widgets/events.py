"""Recent events, newest last; warnings in yellow, errors in red."""

from __future__ import annotations

from collections.abc import Iterable

from dspark_cache.format.schema import Event
from dspark_cache.tui.display import clip, clock_time, integer
from dspark_cache.tui.fit import Para, piece, words
from dspark_cache.tui.snapshot import Snapshot
from dspark_cache.tui.widgets import SHOWS_SNAPSHOT
from dspark_cache.tui.widgets.fitted import Fitted

STYLES = {"error": "bold red", "warning": "yellow", "finished": "bold green", "stopped": "yellow",
          "resumed": "cyan", "skipped_row": "grey50"}
KIND_WIDTH = 15  # the longest kind the producer writes, so that the messages line up


class EventLog(Fitted):
    """The newest ``rows`` events; a long message goes on below its start, never under the times."""

    DEFAULT_CLASSES = SHOWS_SNAPSHOT
    DEFAULT_CSS = "EventLog { height: auto; max-height: 12; border: round $primary; padding: 0 1; }"

    def __init__(self, *args, rows: int = 8, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rows = rows

    def show(self, snap: Snapshot) -> None:
        recent = snap.events[-self.rows :]
        self.show_paras(event_lines(recent) if recent else [Para([piece("no events yet")])])


def event_lines(events: Iterable[Event]) -> list[Para]:
    """One paragraph per event: its time, rank and kind, then its message word by word."""
    out = []
    for e in events:
        style = STYLES.get(e.kind, "")
        head = [piece(clock_time(e.time), style), piece(f"r{integer(e.rank)}", style),
                piece(f"{clip(e.kind, 24):<{KIND_WIDTH}}", style)]
        indent = sum(p.cell_len + 1 for p in head)
        out.append(Para([*head, *words(clip(e.message, 300), style)], " ", indent))
    return out
