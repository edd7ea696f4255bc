"""The shard map: one cell per shard, or per bucket of shards when there are thousands."""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Mapping

from rich.text import Text

from dspark_cache.tui.display import integer
from dspark_cache.tui.fit import Para, piece
from dspark_cache.tui.snapshot import Snapshot
from dspark_cache.tui.widgets import SHOWS_SNAPSHOT
from dspark_cache.tui.widgets.fitted import Fitted

# phase -> (glyph, style); a bucket shows its most urgent phase, in this order
PHASES = {
    "failed": ("✖", "bold red"),
    "abandoned": ("░", "red"),  # a .partial no live rank writes (format.status.partial_is_written)
    "writing": ("▒", "yellow"),
    "pending": ("·", "grey50"),
    "published": ("█", "green"),
}
URGENCY = tuple(PHASES)
PLACED = ("writing", "abandoned", "failed", "published")  # of a shard in several, the last one named wins
MAX_CELLS = 800


def shard_map(total: int, by_phase: Mapping[str, Collection[int]],
              cells: int = MAX_CELLS) -> tuple[list[str], int, dict[str, int]]:
    """``(cell phases, shards per cell, count per phase)`` for shards ``0..total-1``; ``by_phase``
    names the shards that are not pending.

    Work and memory follow the shards that have files, never ``total``: a manifest may plan a
    billion shards, and pending is whatever is left in each cell.
    """
    total = max(0, total)
    placed = _placed(total, by_phase)
    per = max(1, -(-total // cells))
    size = -(-total // per)
    marks: list[Counter] = [Counter() for _ in range(size)]
    for shard, phase in placed.items():
        marks[shard // per][phase] += 1
    phases = [_cell_phase(m, min(per, total - i * per)) for i, m in enumerate(marks)]
    counts = Counter(placed.values())
    counts["pending"] = total - len(placed)
    return phases, per, {s: counts[s] for s in URGENCY}


def _placed(total: int, by_phase: Mapping[str, Iterable[int]]) -> dict[int, str]:
    """The phase of every shard that is not pending; published wins over an earlier failure."""
    placed: dict[int, str] = {}
    for phase in PLACED:
        placed.update({s: phase for s in by_phase.get(phase, ()) if 0 <= s < total})
    return placed


def _cell_phase(marks: Counter, shards: int) -> str:
    if sum(marks.values()) < shards:
        marks = marks + Counter(pending=1)
    return min(marks, key=URGENCY.index)


class ShardMap(Fitted):
    """Counts per shard phase, then one cell per shard (or bucket of shards)."""

    DEFAULT_CLASSES = SHOWS_SNAPSHOT
    DEFAULT_CSS = "ShardMap { height: auto; max-height: 14; border: round $primary; padding: 0 1; }"

    def show(self, snap: Snapshot) -> None:
        total = snap.manifest.num_shards if snap.manifest else 0
        if total <= 0:
            self.show_paras([Para([piece("no shards planned yet")])])
            return
        cells, per, counts = shard_map(total, shard_phases(snap))
        grid = Para([Text(PHASES[phase][0], style=PHASES[phase][1]) for phase in cells], "")
        self.show_paras([shard_counts(counts, per), grid])


def shard_phases(snap: Snapshot) -> dict[str, Collection[int]]:
    """The shards of ``snap`` that are not pending, by phase."""
    return {
        "published": snap.published,
        "writing": snap.writing,
        "abandoned": snap.abandoned,
        "failed": snap.failed,
    }


def shard_counts(counts: dict[str, int], per: int) -> Para:
    """``22 published  1 writing  35 pending  1 failed``; abandoned ones only when there are some."""
    pieces = [
        piece(f"{integer(counts['published'])} published"),
        piece(f"{integer(counts['writing'])} writing"),
    ]
    if counts["abandoned"]:
        pieces.append(piece(f"{integer(counts['abandoned'])} abandoned (rerun resumes)", "red"))
    pieces += [piece(f"{integer(counts['pending'])} pending"), piece(f"{integer(counts['failed'])} failed")]
    if per > 1:
        pieces.append(piece(f"(one cell = {integer(per)} shards)"))
    return Para(pieces)
