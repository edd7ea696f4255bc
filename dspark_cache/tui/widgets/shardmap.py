"""The shard map: one cell per shard, or per bucket of shards when there are thousands."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from dspark_cache.tui.watcher import Snapshot

# state -> (glyph, style); a bucket shows its most urgent state, in this order
STATES = {
    "failed": ("✖", "bold red"),
    "writing": ("▒", "yellow"),
    "pending": ("·", "grey50"),
    "published": ("█", "green"),
}
URGENCY = ("failed", "writing", "pending", "published")
MAX_CELLS = 800


def shard_states(snap: Snapshot) -> list[str]:
    total = snap.manifest.num_shards if snap.manifest else 0
    failed = snap.failed - set(snap.published)
    out = []
    for shard in range(total):
        if shard in failed:
            out.append("failed")
        elif shard in snap.published:
            out.append("published")
        elif shard in snap.writing:
            out.append("writing")
        else:
            out.append("pending")
    return out


def bucketed(states: list[str], cells: int) -> tuple[list[str], int]:
    """At most ``cells`` cells; each shows the most urgent state of the shards it covers."""
    per = max(1, -(-len(states) // cells))
    buckets = [states[i : i + per] for i in range(0, len(states), per)]
    return [min(b, key=URGENCY.index) for b in buckets], per


class ShardMap(Static):
    DEFAULT_CSS = "ShardMap { height: auto; max-height: 14; border: round $primary; padding: 0 1; }"

    def show(self, snap: Snapshot) -> None:
        states = shard_states(snap)
        if not states:
            self.update("no shards planned yet")
            return
        cells, per = bucketed(states, MAX_CELLS)
        counts = {s: states.count(s) for s in URGENCY}
        text = Text()
        text.append(f"{counts['published']} published  {counts['writing']} writing  {counts['pending']} pending  "
                    f"{counts['failed']} failed" + (f"   (one cell = {per} shards)" if per > 1 else "") + "\n")
        for state in cells:
            glyph, style = STATES[state]
            text.append(glyph, style=style)
        self.update(text)
