"""Per-rank table: state, shard, progress, rate, heartbeat age (stale ranks highlighted)."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import DataTable

from dspark_cache.format.status import ACTIVE_RANK_STATES
from dspark_cache.tui.format import human_bytes, human_count, human_duration
from dspark_cache.tui.watcher import Snapshot

COLUMNS = ("rank", "state", "shard", "host/pid", "shards", "samples", "tok/s", "inflight", "heartbeat", "last error")


class RankTable(DataTable):
    DEFAULT_CSS = "RankTable { height: auto; max-height: 12; border: round $primary; }"

    def on_mount(self) -> None:
        self.cursor_type = "none"
        self.add_columns(*COLUMNS)

    def show(self, snap: Snapshot) -> None:
        self.clear()
        for r in snap.ranks:
            age = snap.now - r.updated_at
            stale = snap.is_stale(r)
            style = "bold red" if stale or r.state == "failed" else ("green" if r.state == "finished" else "")
            state = "STALE" if stale else r.state
            self.add_row(
                Text(str(r.rank), style=style), Text(state, style=style), "-" if r.shard is None else str(r.shard),
                f"{r.host}/{r.pid}",
                f"{r.shards_done}/{r.shards_owned}", human_count(r.samples_done),
                human_count(r.tokens_per_s) if r.state in ACTIVE_RANK_STATES else "-",
                human_bytes(r.inflight_bytes) if r.state in ACTIVE_RANK_STATES else "-", Text(f"{human_duration(age)} ago", style=style),
                Text((r.last_error or "")[:60], style="red"),
            )
