"""The monitor application: polls the cache directory and refreshes one widget per concern."""

from __future__ import annotations

import time
from typing import Callable

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.widgets import Footer, Static

from dspark_cache.tui.help import HelpScreen
from dspark_cache.tui.safe_io import Refused
from dspark_cache.tui.watcher import CacheWatcher, Snapshot
from dspark_cache.tui.widgets.disk import DiskPanel
from dspark_cache.tui.widgets.events import EventLog
from dspark_cache.tui.widgets.header import RunHeader
from dspark_cache.tui.widgets.progress import OverallProgress
from dspark_cache.tui.widgets.ranks import RankTable
from dspark_cache.tui.widgets.shardmap import ShardMap
from dspark_cache.tui.widgets.stages import StageBreakdown
from dspark_cache.tui.widgets.throughput import ThroughputChart
from dspark_cache.tui.widgets.warnings import FileWarnings


class MonitorApp(App[None]):
    """``dspark-monitor``: everything about a run at a glance."""

    TITLE = "dspark-monitor"
    BINDINGS = [
        Binding("q", "quit", "quit"),
        Binding("s", "request_stop", "stop producer"),
        Binding("question_mark", "help", "help"),
    ]
    CSS = """
    #middle { height: auto; }
    #middle > * { width: 1fr; }
    #notice { height: auto; padding: 0 1; }
    """

    def __init__(self, path: str, refresh: float = 1.0, clock: Callable[[], float] = time.time,
                 disk_free: Callable[[str], int | None] | None = None) -> None:
        super().__init__()
        self.watcher = CacheWatcher(path, clock=clock, disk_free=disk_free)
        self.refresh_seconds = refresh
        self.snapshot: Snapshot | None = None

    def compose(self) -> ComposeResult:
        yield RunHeader(id="header")
        yield FileWarnings(id="warnings")
        with VerticalScroll():
            yield OverallProgress(id="progress")
            with Horizontal(id="middle"):
                yield ThroughputChart(id="throughput")
                yield DiskPanel(id="disk")
            yield RankTable(id="ranks")
            yield ShardMap(id="shards")
            yield StageBreakdown(id="stages")
            yield EventLog(id="events")
            yield Static(id="notice")
        yield Footer()

    def on_mount(self) -> None:
        self.refresh_view()
        self.set_interval(self.refresh_seconds, self.refresh_view)

    def refresh_view(self) -> None:
        snap = self.snapshot = self.watcher.poll()
        for widget in (RunHeader, FileWarnings, OverallProgress, ThroughputChart, DiskPanel, RankTable, ShardMap,
                       StageBreakdown, EventLog):
            self.query_one(widget).show(snap)
        notice = ""
        if snap.stop_requested and snap.live_ranks:
            notice = "[yellow]stop requested: the producer finishes the shard in flight, then exits[/]"
        self.query_one("#notice", Static).update(notice)

    def action_request_stop(self) -> None:
        if self.snapshot is None or not self.snapshot.is_cache:
            self.notify("nothing to stop: no producer writes here", severity="warning")
            return
        try:
            self.watcher.request_stop()
        except (OSError, Refused) as exc:
            self.notify(f"could not ask the producer to stop: {exc}", severity="error", markup=False)
            return
        self.notify("asked the producer to stop after the shard in flight (rerun dspark-produce to resume)")
        self.refresh_view()

    def action_help(self) -> None:
        self.push_screen(HelpScreen())
