"""Disk: written so far, projected total from the plan, free space, and whether the rest fits."""

from __future__ import annotations

from textual.widgets import Static

from dspark_cache.tui.display import human_bytes
from dspark_cache.tui.snapshot import Snapshot
from dspark_cache.tui.widgets import VIEW


class DiskPanel(Static):
    """Bytes written, projected and free; a warning when the rest of the plan will not fit."""

    DEFAULT_CLASSES = VIEW
    DEFAULT_CSS = "DiskPanel { height: auto; border: round $primary; padding: 0 1; }"

    def show(self, snap: Snapshot) -> None:
        m = snap.manifest
        if m is None:
            self.update(f"free {human_bytes(snap.disk_free)}")
            return
        written = snap.bytes_done
        rest = max(0, m.planned_bytes - written)
        line = (f"written {human_bytes(written)} of {human_bytes(m.planned_bytes)} projected   "
                f"free {human_bytes(snap.disk_free)}")
        if not snap.complete and snap.disk_free is not None and rest > snap.disk_free:
            line += f"\n[b red]the rest ({human_bytes(rest)}) will not fit: free space before the disk fills[/]"
        self.update(line)
