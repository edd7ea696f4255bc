"""Per-rank table: state, shard, progress, rate, heartbeat age (stale ranks highlighted)."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import DataTable

from dspark_cache.format.schema import RankStatus
from dspark_cache.format.status import ACTIVE_RANK_STATES
from dspark_cache.tui.display import clip, human_bytes, human_count, human_duration, integer
from dspark_cache.tui.snapshot import Snapshot
from dspark_cache.tui.widgets import VIEW

COLUMNS = ("rank", "state", "shard", "host/pid", "shards", "samples", "tok/s", "inflight", "heartbeat", "last error")


class RankTable(DataTable):
    """One row per rank status file."""

    DEFAULT_CLASSES = VIEW
    DEFAULT_CSS = "RankTable { height: auto; max-height: 12; border: round $primary; }"

    def on_mount(self) -> None:
        self.cursor_type = "none"
        self.add_columns(*COLUMNS)

    def show(self, snap: Snapshot) -> None:
        self.clear()
        for r in snap.ranks:
            self.add_row(*row(r, snap))


def row(r: RankStatus, snap: Snapshot) -> list[Text]:
    """One rank's cells; every cell is plain Text, so a file's brackets are never read as markup."""
    stale = snap.is_stale(r)
    style = "bold red" if stale or r.state == "failed" else ("green" if r.state == "finished" else "")
    active = r.state in ACTIVE_RANK_STATES
    return [
        Text(integer(r.rank), style=style), Text("STALE" if stale else clip(r.state, 16), style=style),
        Text("-" if r.shard is None else integer(r.shard)),
        Text(f"{clip(r.host, 40)}/{integer(r.pid)}"),
        Text(f"{integer(r.shards_done)}/{integer(r.shards_owned)}"), Text(human_count(r.samples_done)),
        Text(human_count(r.tokens_per_s) if active else "-"),
        Text(human_bytes(r.inflight_bytes) if active else "-"),
        Text(f"{human_duration(snap.now - r.updated_at)} ago", style=style),
        Text(clip(r.last_error, 60), style="red"),
    ]
