"""Disk: written so far, projected total from the plan, free space, and whether the rest fits (a
compressed cache's total projected from the bytes a token its published shards take)."""

from __future__ import annotations

from dspark_cache.tui.display import human_bytes
from dspark_cache.tui.fit import Para, piece, words
from dspark_cache.tui.snapshot import Snapshot
from dspark_cache.tui.widgets import SHOWS_SNAPSHOT
from dspark_cache.tui.widgets.fitted import Fitted


class DiskPanel(Fitted):
    """Bytes written, projected and free; a warning when the rest of the plan will not fit."""

    DEFAULT_CLASSES = SHOWS_SNAPSHOT
    DEFAULT_CSS = "DiskPanel { height: auto; border: round $primary; padding: 0 1; }"

    def show(self, snap: Snapshot) -> None:
        self.show_paras(disk(snap))


def disk(snap: Snapshot) -> list[Para]:
    """Written of projected, free space, and a warning when the rest of the plan will not fit (a cache
    on object storage: stored, with no local disk to fill)."""
    free = piece("on object storage") if snap.remote else piece(f"free {human_bytes(snap.disk_free)}")
    m = snap.manifest
    if m is None:
        return [Para([free])]
    written = snap.bytes_done
    projected = m.planned_bytes
    if m.compression != "none" and snap.tokens_done:
        # The plan's bytes are the samples' uncompressed size: a compressed cache takes what its shards
        # so far take a token, times the planned tokens (the plan's bytes until a shard is published).
        projected = round(written / snap.tokens_done * m.planned_tokens)
    rest = max(0, projected - written)
    planned = human_bytes(projected) if m.compression == "none" else f"~{human_bytes(projected)}"
    stored = "stored" if snap.remote else "written"  # from the published shards' indexes
    out = [
        Para([piece(f"{stored} {human_bytes(written)}"), piece(f"of {planned} projected")], " "),
        Para([free]),
    ]
    if not snap.complete and snap.disk_free is not None and rest > snap.disk_free:
        out.append(Para(words("the rest ($rest) will not fit: free space before the disk fills", "bold red",
                              rest=human_bytes(rest)), " "))
    return out
