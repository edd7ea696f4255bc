"""Files the monitor skipped this refresh (a FIFO, a device, a symlink out of the cache, too large),
and the problems of a damaged manifest."""

from __future__ import annotations

from dspark_cache.tui.display import clip
from dspark_cache.tui.fit import Para, piece, words
from dspark_cache.tui.snapshot import Snapshot
from dspark_cache.tui.widgets import SHOWS_SNAPSHOT
from dspark_cache.tui.widgets.fitted import Fitted

MAX_SHOWN = 5  # a directory full of junk must not push the other panels off screen


class FileWarnings(Fitted):
    """The files skipped by the last scan, and why; hidden when there are none."""

    DEFAULT_CLASSES = SHOWS_SNAPSHOT
    DEFAULT_CSS = "FileWarnings { height: auto; padding: 0 1; color: $warning; }"

    def show(self, snap: Snapshot) -> None:
        # Hidden when there is nothing to say: a healthy cache spends no line on an empty panel.
        self.display = bool(snap.warnings)
        self.show_paras(warning_lines(snap.warnings))


def warning_lines(warnings: tuple[str, ...]) -> list[Para]:
    """The first :data:`MAX_SHOWN` warnings, each ``⚠ skipped path: why``, and how many more."""
    out = [Para([piece("⚠"), *words(clip(w, 200))], " ", 2) for w in warnings[:MAX_SHOWN]]
    if len(warnings) > MAX_SHOWN:
        out.append(Para(words(f"... and {len(warnings) - MAX_SHOWN} more skipped files"), " "))
    return out
