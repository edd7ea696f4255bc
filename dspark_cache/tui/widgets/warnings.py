"""Files the monitor skipped this refresh (a FIFO, a device, a symlink out of the cache, too large),
and the problems of a damaged manifest."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from dspark_cache.tui.display import clip
from dspark_cache.tui.snapshot import Snapshot
from dspark_cache.tui.widgets import VIEW

MAX_SHOWN = 5  # a directory full of junk must not push the rest of the view off screen


class FileWarnings(Static):
    """The files skipped by the last poll, and why; hidden when there are none."""

    DEFAULT_CLASSES = VIEW
    DEFAULT_CSS = "FileWarnings { height: auto; padding: 0 1; color: $warning; }"

    def show(self, snap: Snapshot) -> None:
        # Hidden when there is nothing to say, so that a healthy cache looks exactly as before.
        self.display = bool(snap.warnings)
        lines = [clip(w, 200) for w in snap.warnings[:MAX_SHOWN]]
        if len(snap.warnings) > MAX_SHOWN:
            lines.append(f"... and {len(snap.warnings) - MAX_SHOWN} more skipped files")
        self.update(Text("\n".join(f"⚠ {line}" for line in lines)))
