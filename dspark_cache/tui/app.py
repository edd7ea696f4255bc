"""The monitor application: a watcher thread scans the cache, the UI thread renders its snapshots."""

from __future__ import annotations

import asyncio
import time
from typing import Callable, cast

from textual import events
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.css.query import NoMatches
from textual.widgets import Footer

from dspark_cache.tui.fit import Para, words
from dspark_cache.tui.help import HelpScreen
from dspark_cache.tui.scan import CacheScanner
from dspark_cache.tui.snapshot import Snapshot
from dspark_cache.tui.watcher import CacheWatcher, SnapshotScanned, StopRequested
from dspark_cache.tui.widgets import SHOWS_SNAPSHOT, ShowsSnapshot
from dspark_cache.tui.widgets.disk import DiskPanel
from dspark_cache.tui.widgets.events import EventLog
from dspark_cache.tui.widgets.fitted import Fitted
from dspark_cache.tui.widgets.header import RunHeader
from dspark_cache.tui.widgets.progress import OverallProgress
from dspark_cache.tui.widgets.ranks import RankTable
from dspark_cache.tui.widgets.shardmap import ShardMap
from dspark_cache.tui.widgets.stages import StageBreakdown
from dspark_cache.tui.widgets.throughput import ThroughputChart
from dspark_cache.tui.widgets.warnings import FileWarnings

STOP_NOTICE = Para(words("stop requested: the producer finishes the shards in flight, then exits", "yellow"),
                   " ")
COMPACT = "-compact"  # the app's class below COMPACT_BELOW cells: panels lose their side borders
COMPACT_BELOW = (100, 32)  # (width, height): an 80x24 terminal is compact
TITLES = {"progress": "progress", "throughput": "throughput", "disk": "disk", "ranks": "ranks",
          "shards": "shards", "stages": "where the time goes", "events": "events"}


class MonitorApp(App[None]):
    """``dspark-monitor``: everything about a run at a glance.

    A :class:`~dspark_cache.tui.watcher.CacheWatcher` on a thread worker scans the cache every
    ``refresh`` seconds and posts a :class:`SnapshotScanned`; the UI thread reads and writes no
    cache file (the stop request is written by the watcher thread too), it renders the snapshot
    in every widget of the class :data:`~dspark_cache.tui.widgets.SHOWS_SNAPSHOT`.

    Everything below the header scrolls (arrows, page keys, the mouse); below
    :data:`COMPACT_BELOW` the panels keep only a titled top rule and the rank table its
    essential columns, so that an 80x24 terminal shows the progress, rates and ranks at once.
    ``s`` is offered only while some rank is live.
    """

    TITLE = "dspark-monitor"
    BINDINGS = [
        Binding("q", "quit", "quit"),
        Binding("s", "request_stop", "stop producer"),
        Binding("question_mark", "help", "help"),
    ]
    QUIT_HELP = "quit (the producer keeps running)"  # the help screen's line for q
    CSS = """
    #middle { height: auto; }
    #middle > * { width: 1fr; }
    #notice { height: auto; padding: 0 1; }
    MonitorApp.-compact #body > .shows-snapshot, MonitorApp.-compact #middle > .shows-snapshot {
        border: none; border-top: solid $primary; padding: 0 1;
    }
    MonitorApp.-compact #ranks { padding: 0; }
    MonitorApp.-compact ThroughputChart { height: auto; }
    MonitorApp.-compact ThroughputChart Sparkline { height: 1; }
    """

    def __init__(
        self,
        path: str,
        refresh: float = 1.0,
        clock: Callable[[], float] = time.time,
        disk_free: Callable[[str], int | None] | None = None,
        *,
        scanner: CacheScanner | None = None,
    ) -> None:
        """Watch the directory ``path``; or, given a ``scanner`` (a cache on object storage:
        ``tui.remote.RemoteScanner``), what it scans (``path`` is then only a name)."""
        super().__init__()
        self.scanner = scanner or CacheScanner(path, clock=clock, disk_free=disk_free)
        self.watcher = CacheWatcher(self.scanner, refresh, self.post_message)
        self.snapshot: Snapshot | None = None  # the one on screen
        self._shown_ticket = 0  # the refresh requests the snapshot on screen answers
        self._shown = asyncio.Event()  # set, and replaced, whenever a snapshot is rendered

    def compose(self) -> ComposeResult:
        yield RunHeader(id="header")
        yield FileWarnings(id="warnings")
        with VerticalScroll(id="body"):
            yield OverallProgress(id="progress")
            with Horizontal(id="middle"):
                yield ThroughputChart(id="throughput")
                yield DiskPanel(id="disk")
            yield RankTable(id="ranks")
            yield ShardMap(id="shards")
            yield StageBreakdown(id="stages")
            yield EventLog(id="events")
        yield Fitted(id="notice")  # below the scrolled panels: always in view
        yield Footer()

    def on_mount(self) -> None:
        """Title the panels, fit the layout to the terminal, start the watcher thread (its first
        snapshot is read at once)."""
        for name, title in TITLES.items():
            self.query_one(f"#{name}").border_title = title
        self.fit_layout(self.size.width, self.size.height)
        self.query_one("#body").focus()  # the arrows and page keys scroll from the start
        self.run_worker(self.watcher.run, name="cache watcher", thread=True)

    def on_resize(self, event: events.Resize) -> None:
        """Compact below :data:`COMPACT_BELOW`, wide above."""
        self.fit_layout(event.size.width, event.size.height)

    def fit_layout(self, width: int, height: int) -> None:
        """Set the compact class for this size, and render the snapshot on screen again in it."""
        compact = width < COMPACT_BELOW[0] or height < COMPACT_BELOW[1]
        if compact == self.has_class(COMPACT):
            return
        self.set_class(compact, COMPACT)
        self.query_one("#ranks", RankTable).compact = compact
        if self.snapshot is not None:
            self.show_snapshot(self.snapshot)

    def on_unmount(self) -> None:
        """End the watcher thread after the scan in progress, if any."""
        self.watcher.stop()  # else the thread would wait out its period before the app can end

    def on_snapshot_scanned(self, message: SnapshotScanned) -> None:
        """Render a snapshot posted by the watcher thread, then wake whoever awaits it."""
        self.snapshot = message.snapshot
        self.show_snapshot(message.snapshot)
        self.refresh_bindings()  # s is offered only while a rank is live
        self._shown_ticket = message.ticket
        self._shown.set()
        self._shown = asyncio.Event()

    def show_snapshot(self, snap: Snapshot) -> None:
        """Render ``snap`` in every widget that shows one, and the stop notice (on the UI thread: no file
        is read)."""
        for widget in self.query(f".{SHOWS_SNAPSHOT}"):
            try:
                cast(ShowsSnapshot, widget).show(snap)
            except NoMatches:  # its parts are still mounting (or already gone): the next snapshot shows it
                continue
        self.show_notice(STOP_NOTICE if snap.stop_requested and snap.live_ranks else None)

    def show_notice(self, text: Para | None) -> None:
        """The line above the footer; hidden when None."""
        try:
            notice = self.query_one("#notice", Fitted)
        except NoMatches:  # a snapshot that lands while the app ends: its screen is already gone
            return
        notice.show_paras([text] if text is not None else [])
        notice.display = text is not None

    async def first_snapshot(self) -> Snapshot:
        """The first snapshot, once it is rendered (for tests and scripts)."""
        while self.snapshot is None:
            await self._shown.wait()
        return self.snapshot

    async def refreshed(self) -> Snapshot:
        """Ask for a snapshot now and return it once it is rendered (for tests and scripts)."""
        ticket = self.watcher.request()
        while self._shown_ticket < ticket:
            await self._shown.wait()
        assert self.snapshot is not None
        return self.snapshot

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """``s`` is offered (shown and bound) only while the snapshot on screen has a live rank."""
        if action == "request_stop":
            return self.snapshot is not None and self.snapshot.can_stop
        return True

    def action_request_stop(self) -> None:
        """``s``: have the watcher thread write the stop request the producer checks between shards
        (it checks again that a rank is live: the snapshot on screen may be a refresh old)."""
        if self.snapshot is None or not self.snapshot.can_stop:
            self.notify("nothing to stop: no producer is running here", severity="warning")
            return
        self.watcher.request(stop_producer=True)

    def on_stop_requested(self, message: StopRequested) -> None:
        """Say whether the stop request was written (the snapshot that follows shows the notice)."""
        if message.refused is not None:
            self.notify(
                f"could not ask the producer to stop: {message.refused}", severity="error", markup=False
            )
        else:
            self.notify("asked the producer to stop after the shards in flight "
                        "(rerun dspark-produce to resume)")

    def action_help(self) -> None:
        """``?``: the help screen."""
        self.push_screen(HelpScreen(self.QUIT_HELP))
