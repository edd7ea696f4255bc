"""The shard map: one cell per shard, or per bucket of shards when there are thousands."""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable

from rich.text import Text
from textual.widgets import Static

from dspark_cache.tui.display import integer
from dspark_cache.tui.snapshot import Snapshot
from dspark_cache.tui.widgets import VIEW

# state -> (glyph, style); a bucket shows its most urgent state, in this order
STATES = {
    "failed": ("✖", "bold red"),
    "writing": ("▒", "yellow"),
    "pending": ("·", "grey50"),
    "published": ("█", "green"),
}
URGENCY = ("failed", "writing", "pending", "published")
MAX_CELLS = 800


def shard_map(total: int, published: Collection[int], writing: Collection[int], failed: Collection[int],
              cells: int = MAX_CELLS) -> tuple[list[str], int, dict[str, int]]:
    """``(cell states, shards per cell, count per state)`` for shards ``0..total-1``.

    Work and memory follow the shards that have files, never ``total``: a manifest may plan a
    billion shards, and pending is whatever is left in each cell.
    """
    total = max(0, total)
    placed = _placed(total, published, writing, failed)
    per = max(1, -(-total // cells))
    size = -(-total // per)
    marks: list[Counter] = [Counter() for _ in range(size)]
    for shard, state in placed.items():
        marks[shard // per][state] += 1
    states = [_cell_state(m, min(per, total - i * per)) for i, m in enumerate(marks)]
    counts = Counter(placed.values())
    counts["pending"] = total - len(placed)
    return states, per, {s: counts[s] for s in URGENCY}


def _placed(total: int, published: Iterable[int], writing: Iterable[int],
            failed: Iterable[int]) -> dict[int, str]:
    """The state of every shard that is not pending; published wins over an earlier failure."""
    placed = {s: "writing" for s in writing if 0 <= s < total}
    placed.update({s: "failed" for s in failed if 0 <= s < total})
    placed.update({s: "published" for s in published if 0 <= s < total})
    return placed


def _cell_state(marks: Counter, shards: int) -> str:
    if sum(marks.values()) < shards:
        marks = marks + Counter(pending=1)
    return min(marks, key=URGENCY.index)


def bucketed(states: list[str], cells: int) -> tuple[list[str], int]:
    """At most ``cells`` cells for an explicit list of shard states (each cell its most urgent state)."""
    by_state = {s: [i for i, x in enumerate(states) if x == s] for s in ("published", "writing", "failed")}
    out, per, _ = shard_map(len(states), by_state["published"], by_state["writing"], by_state["failed"], cells)
    return out, per


class ShardMap(Static):
    """Counts per shard state, then one cell per shard (or bucket of shards)."""

    DEFAULT_CLASSES = VIEW
    DEFAULT_CSS = "ShardMap { height: auto; max-height: 14; border: round $primary; padding: 0 1; }"

    def show(self, snap: Snapshot) -> None:
        total = snap.manifest.num_shards if snap.manifest else 0
        if total <= 0:
            self.update("no shards planned yet")
            return
        cells, per, counts = shard_map(total, snap.published, snap.writing, snap.failed)
        text = Text()
        text.append(f"{integer(counts['published'])} published  {integer(counts['writing'])} writing  "
                    f"{integer(counts['pending'])} pending  {integer(counts['failed'])} failed"
                    + (f"   (one cell = {integer(per)} shards)" if per > 1 else "") + "\n")
        for state in cells:
            glyph, style = STATES[state]
            text.append(glyph, style=style)
        self.update(text)
