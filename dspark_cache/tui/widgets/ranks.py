"""Per-rank table: phase, the shards in flight, this run's shards, measured rate, memory, heartbeat age
(stale ranks highlighted).

Counts of finished work are not repeated here: samples and tokens done come from the published
shard indexes only (the progress panel), since a rank's own counts also hold what it computed but
has not published yet. A rank's shards are those of its run: published by it / assigned to it.
Memory is the target's weights the rank holds (a slice under ``--tp-size``) and the device memory
it has allocated (CUDA only); ``-`` where the producer measured none.

A row is never cut at the right: the last error is clipped to the room the other columns leave
(the events panel holds it whole), and where the wide columns do not fit (the compact layout of an
80x24 terminal, or a narrow table) the compact ones are shown: the two memory figures merged into
one, without the host, the bytes in flight and the shard in flight (the shard map shows which
shards are being written); where even those do not fit, without the memory. Counts of shards and
rank numbers above 9999 are shown as ``12.3k``, so that a huge run's row still fits.
"""

from __future__ import annotations

from typing import Callable

from rich.text import Text
from textual.widgets import DataTable

from dspark_cache.format.schema import RankPhase, RankStatus
from dspark_cache.format.status import ACTIVE_PHASES
from dspark_cache.tui.display import (
    clip, human_bytes, human_count, human_duration, integer, short_bytes, short_count,
)
from dspark_cache.tui.rates import RankRate
from dspark_cache.tui.snapshot import Snapshot
from dspark_cache.tui.widgets import SHOWS_SNAPSHOT

COLUMNS = ("rank", "phase", "shard", "host/pid", "run shards", "tok/s", "inflight", "weights", "device mem",
           "heartbeat", "last error")
# 80 cells
COMPACT_COLUMNS = ("rank", "phase", "run shards", "tok/s", "weights/mem", "heartbeat", "last error")
# when even those do not fit
NARROW_COLUMNS = ("rank", "phase", "run shards", "tok/s", "heartbeat", "last error")
LAYOUTS = (COLUMNS, COMPACT_COLUMNS, NARROW_COLUMNS)  # the first whose row fits is shown
PHASE_CHARS = max(len(phase) for phase in RankPhase.ALL)  # a phase no producer writes is clipped to these
ERROR = "last error"
ERROR_CHARS, MIN_ERROR_CHARS = 60, 12  # the last error shown: at most, and at least however narrow the table


class RankTable(DataTable):
    """One row per rank status file; fewer columns when :attr:`compact` or when the others do not fit."""

    DEFAULT_CLASSES = SHOWS_SNAPSHOT
    DEFAULT_CSS = "RankTable { height: auto; border: round $primary; }"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.compact = False
        self.can_focus = False  # the keys scroll the page, which holds the whole table
        self._snap: Snapshot | None = None  # the one on screen, shown again to fit a new width

    def on_mount(self) -> None:
        self.cursor_type = "none"

    def on_resize(self) -> None:
        if self._snap is not None:
            self.show(self._snap)

    def show(self, snap: Snapshot) -> None:
        self._snap = snap
        rows = [row(status, rate, snap) for status, rate in snap.rank_rates()]
        room = self.scrollable_content_region.width  # 0 before the first layout: nothing to fit yet
        layouts = LAYOUTS[1:] if self.compact else LAYOUTS
        least = self._width(MIN_ERROR_CHARS)
        columns = next(
            (c for c in layouts if not room or self._others_width(c, rows) + least <= room), layouts[-1]
        )
        self.clear(columns=True)  # a column keeps its widest cell until cleared: size them to these rows
        self.add_columns(*columns)
        others = self._others_width(columns, rows) + self._width(0)
        limit = max(MIN_ERROR_CHARS, room - others) if room else ERROR_CHARS
        for cells in rows:
            cells[ERROR] = Text(clip(cells[ERROR].plain, limit), style=cells[ERROR].style)
            self.add_row(*(cells[name] for name in columns))

    def _width(self, content: int) -> int:
        """Cells a column takes whose widest cell (or label) is ``content`` cells."""
        return content + 2 * self.cell_padding

    def _others_width(self, columns: tuple[str, ...], rows: list[dict[str, Text]]) -> int:
        """Cells the columns other than the last error take, as the table sizes them."""
        return sum(self._width(max([len(name)] + [cells[name].cell_len for cells in rows]))
                   for name in columns if name != ERROR)


def row(r: RankStatus, rate: RankRate | None, snap: Snapshot) -> dict[str, Text]:
    """One rank's cells by column; every cell is plain Text, so a file's brackets are never read as markup."""
    stale = snap.is_stale(r)
    style = "bold red" if stale or r.phase == "failed" else ("green" if r.phase == "finished" else "")
    active = r.phase in ACTIVE_PHASES
    return {
        "rank": Text(rank_label(r), style=style),
        "phase": Text("STALE" if stale else clip(r.phase, PHASE_CHARS), style=style),
        "shard": Text(in_flight(r)),
        "host/pid": Text(f"{clip(r.host, 40)}/{integer(r.pid)}"),
        "run shards": Text(f"{short_count(r.shards_done)}/{short_count(r.shards_owned)}"),
        "tok/s": Text(human_count(rate.tokens_per_s) if rate is not None and not stale else "-"),
        "inflight": Text(human_bytes(r.inflight_bytes) if active else "-"),
        "weights": Text(measured(r.weight_bytes, human_bytes)),
        "device mem": Text(measured(r.device_memory_bytes, human_bytes)),
        "weights/mem": Text(memory_pair(r)),
        "heartbeat": Text(f"{human_duration(snap.now - r.updated_at)} ago", style=style),
        ERROR: Text(clip(r.last_error, ERROR_CHARS), style="red"),  # clipped again to the room left
    }


SHARDS_SHOWN = 3  # shards in flight named in a row; more lanes than that: how many more


def in_flight(r: RankStatus) -> str:
    """The shards a working rank writes now, ``20,21,22`` (its writer lanes' and any whose last batches
    still wait for their writer), ``20,21,22 +5`` for more. An older producer's heartbeat names only the shard its device computes, and a failed
    rank's the shard it failed on: that one, then."""
    working = r.writing if r.phase in ACTIVE_PHASES else []
    shards = working or ([] if r.shard is None else [r.shard])
    if not shards:
        return "-"
    shown = ",".join(integer(s) for s in shards[:SHARDS_SHOWN])
    return shown + (f" +{len(shards) - SHARDS_SHOWN}" if len(shards) > SHARDS_SHOWN else "")


def measured(n: int | None, fmt: Callable[[int], str]) -> str:
    """``n`` bytes by ``fmt``, or ``-`` where the producer measured nothing (a CPU run, an older producer)."""
    return "-" if n is None else fmt(n)


def memory_pair(r: RankStatus) -> str:
    """``weights/device`` in a narrow cell: ``16.4G/19.0G``; one ``-`` where neither was measured."""
    if r.weight_bytes is None and r.device_memory_bytes is None:
        return "-"
    return f"{measured(r.weight_bytes, short_bytes)}/{measured(r.device_memory_bytes, short_bytes)}"


def rank_label(r: RankStatus) -> str:
    """The rank, and under ``--tp-size``/``--ep-size`` its model-parallel group: ``2 g1 w`` writes
    group 1's shards, ``3 g1`` computes them with it (and writes nothing)."""
    if r.group is None:
        return short_count(r.rank)
    writer = r.group_size > 0 and r.rank % r.group_size == 0
    return f"{short_count(r.rank)} g{short_count(r.group)}{' w' if writer else ''}"
