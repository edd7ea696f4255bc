"""The monitor application: a watcher thread reads the cache, the UI thread renders its snapshots."""

from __future__ import annotations

import asyncio
import time
from typing import Callable, cast

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.widgets import Footer, Static

from dspark_cache.tui.help import HelpScreen
from dspark_cache.tui.poller import Poller, SnapshotPolled, StopRequested
from dspark_cache.tui.snapshot import Snapshot
from dspark_cache.tui.watcher import CacheWatcher
from dspark_cache.tui.widgets import VIEW, SnapshotView
from dspark_cache.tui.widgets.disk import DiskPanel
from dspark_cache.tui.widgets.events import EventLog
from dspark_cache.tui.widgets.header import RunHeader
from dspark_cache.tui.widgets.progress import OverallProgress
from dspark_cache.tui.widgets.ranks import RankTable
from dspark_cache.tui.widgets.shardmap import ShardMap
from dspark_cache.tui.widgets.stages import StageBreakdown
from dspark_cache.tui.widgets.throughput import ThroughputChart
from dspark_cache.tui.widgets.warnings import FileWarnings

STOP_NOTICE = "[yellow]stop requested: the producer finishes the shard in flight, then exits[/]"


class MonitorApp(App[None]):
    """``dspark-monitor``: everything about a run at a glance.

    A :class:`~dspark_cache.tui.poller.Poller` on a thread worker reads the cache every
    ``refresh`` seconds and posts a :class:`SnapshotPolled`; the UI thread reads and writes no
    cache file (the stop request is written by the watcher thread too), it renders the snapshot
    in every widget of the class :data:`~dspark_cache.tui.widgets.VIEW`.
    """

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
        self.poller = Poller(self.watcher, refresh, self.post_message)
        self.snapshot: Snapshot | None = None  # the one on screen
        self._shown_ticket = 0  # the refresh requests the snapshot on screen answers
        self._shown = asyncio.Event()  # set, and replaced, whenever a snapshot is rendered

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
        """Start the watcher thread; its first snapshot is read at once."""
        self.run_worker(self.poller.run, name="cache watcher", thread=True)

    def on_unmount(self) -> None:
        """End the watcher thread after the poll in progress, if any."""
        self.poller.stop()  # else the thread would wait out its period before the app can end

    def on_snapshot_polled(self, message: SnapshotPolled) -> None:
        """Render a snapshot posted by the watcher thread, then wake whoever awaits it."""
        self.snapshot = message.snapshot
        self.show_snapshot(message.snapshot)
        self._shown_ticket = message.ticket
        self._shown.set()
        self._shown = asyncio.Event()

    def show_snapshot(self, snap: Snapshot) -> None:
        """Render ``snap`` in every view, and the stop notice (on the UI thread: no file is read)."""
        for view in self.query(f".{VIEW}"):
            cast(SnapshotView, view).show(snap)
        self.query_one("#notice", Static).update(STOP_NOTICE if snap.stop_requested and snap.live_ranks else "")

    def refresh_view(self) -> None:
        """Ask the watcher thread for a snapshot now rather than at the end of its period."""
        self.poller.request()

    async def first_snapshot(self) -> Snapshot:
        """The first snapshot, once it is rendered (for tests and scripts)."""
        while self.snapshot is None:
            await self._shown.wait()
        return self.snapshot

    async def refreshed(self) -> Snapshot:
        """Ask for a snapshot now and return it once it is rendered (for tests and scripts)."""
        ticket = self.poller.request()
        while self._shown_ticket < ticket:
            await self._shown.wait()
        assert self.snapshot is not None
        return self.snapshot

    def action_request_stop(self) -> None:
        """``s``: have the watcher thread write the stop request the producer checks between shards."""
        if self.snapshot is None or not self.snapshot.is_cache:
            self.notify("nothing to stop: no producer writes here", severity="warning")
            return
        self.poller.request(stop_producer=True)

    def on_stop_requested(self, message: StopRequested) -> None:
        """Say whether the stop request was written (the snapshot that follows shows the notice)."""
        if message.refused is not None:
            self.notify(f"could not ask the producer to stop: {message.refused}", severity="error", markup=False)
        else:
            self.notify("asked the producer to stop after the shard in flight (rerun dspark-produce to resume)")

    def action_help(self) -> None:
        """``?``: the help screen."""
        self.push_screen(HelpScreen())
