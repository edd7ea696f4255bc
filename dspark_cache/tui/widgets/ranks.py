"""Per-rank table: state, shard, this run's shards, measured rate, heartbeat age (stale ranks highlighted).

Counts of finished work are not repeated here: samples and tokens done come from the published
shard indexes only (the progress panel), since a rank's own counts also hold what it computed but
has not published yet. A rank's shards are those of its run: published by it / assigned to it.
"""

from __future__ import annotations

from rich.text import Text
from textual.widgets import DataTable

from dspark_cache.format.schema import RankStatus
from dspark_cache.format.status import ACTIVE_RANK_STATES
from dspark_cache.tui.display import clip, human_bytes, human_count, human_duration, integer
from dspark_cache.tui.rates import RankRate
from dspark_cache.tui.snapshot import Snapshot
from dspark_cache.tui.widgets import VIEW

COLUMNS = ("rank", "state", "shard", "host/pid", "run shards", "tok/s", "inflight", "heartbeat", "last error")
COMPACT_COLUMNS = ("rank", "state", "shard", "run shards", "tok/s", "heartbeat", "last error")  # fits 80 cells


class RankTable(DataTable):
    """One row per rank status file; fewer columns when :attr:`compact`."""

    DEFAULT_CLASSES = VIEW
    DEFAULT_CSS = "RankTable { height: auto; border: round $primary; }"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.compact = False
        self.can_focus = False  # the keys scroll the page, which holds the whole table
        self._shown: tuple[str, ...] = ()

    def on_mount(self) -> None:
        self.cursor_type = "none"

    def show(self, snap: Snapshot) -> None:
        columns = COMPACT_COLUMNS if self.compact else COLUMNS
        if columns != self._shown:
            self.clear(columns=True)
            self.add_columns(*columns)
            self._shown = columns
        else:
            self.clear()
        for status, rate in snap.rank_rates():
            cells = row(status, rate, snap)
            self.add_row(*(cells[name] for name in columns))


def row(r: RankStatus, rate: RankRate | None, snap: Snapshot) -> dict[str, Text]:
    """One rank's cells by column; every cell is plain Text, so a file's brackets are never read as markup."""
    stale = snap.is_stale(r)
    style = "bold red" if stale or r.state == "failed" else ("green" if r.state == "finished" else "")
    active = r.state in ACTIVE_RANK_STATES
    return {
        "rank": Text(rank_label(r), style=style), "state": Text("STALE" if stale else clip(r.state, 16), style=style),
        "shard": Text("-" if r.shard is None else integer(r.shard)),
        "host/pid": Text(f"{clip(r.host, 40)}/{integer(r.pid)}"),
        "run shards": Text(f"{integer(r.shards_done)}/{integer(r.shards_owned)}"),
        "tok/s": Text(human_count(rate.tokens_per_s) if rate is not None and not stale else "-"),
        "inflight": Text(human_bytes(r.inflight_bytes) if active else "-"),
        "heartbeat": Text(f"{human_duration(snap.now - r.updated_at)} ago", style=style),
        "last error": Text(clip(r.last_error, 60), style="red"),
    }


def rank_label(r: RankStatus) -> str:
    """The rank, and under ``--tp-size``/``--ep-size`` its model-parallel group: ``2 g1 w`` writes
    group 1's shards, ``3 g1`` computes them with it (and writes nothing)."""
    if r.group is None:
        return integer(r.rank)
    writer = r.group_size > 0 and r.rank % r.group_size == 0
    return f"{integer(r.rank)} g{integer(r.group)}{' w' if writer else ''}"
