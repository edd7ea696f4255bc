"""The monitor at 80x24 never breaks a value across lines, and a killed run's ``.partial`` is not "writing"."""

from __future__ import annotations

import os
import signal
import time

import pytest
from rich.cells import cell_len
from rich.text import Text

from dspark_cache.format.paths import CachePaths
from dspark_cache.tui.app import MonitorApp
from dspark_cache.tui.fit import Para, fit, piece, words
from dspark_cache.tui.report import lines
from dspark_cache.tui.scan import CacheScanner
from dspark_cache.tui.widgets.fitted import Fitted
from tests.support import tui_states
from tests.support.produce import produce_args
from tests.support.proc import producer_cmd, run


def test_lines_break_only_between_pieces_and_long_pieces_keep_both_ends():
    path = CachePaths("/data/" + "very-long-directory/" * 6).shard_tar(42)
    para = Para(
        [piece("written 880.0 MB"), piece("of 2.4 GB projected"), *words("at $path now", path=path)], " "
    )
    shown = fit([para], 30).plain.splitlines()
    assert shown[:2] == ["written 880.0 MB", "of 2.4 GB projected at"]
    assert shown[2].startswith("/data/very-lon") and shown[2].endswith("000042.tar") and "…" in shown[2]
    assert shown[3] == "now" and all(cell_len(line) <= 30 for line in shown)
    wide = fit([Para([piece("模型" * 30)])], 21).plain  # two cells a character
    assert cell_len(wide) <= 21 and wide.startswith("模型模型") and "…" in wide
    hanging = fit([Para([piece("07:45:00"), *words("one two three four five six")], " ", 9)], 20).plain
    assert hanging.splitlines() == ["07:45:00 one two", "         three four", "         five six"]
    assert fit([Para([piece("x" * 50)])], None).plain == "x" * 50  # no width: one line, whole


async def screen_rows(app: MonitorApp, pilot) -> list[str]:
    """Every row the screen shows, from the top of the scrolled panels to their end."""
    rows: list[str] = []
    await pilot.press("home")
    for _ in range(8):
        await pilot.pause()
        rows += [strip.text for strip in app.screen._compositor.render_strips()]
        await pilot.press("pagedown")
    return rows


@pytest.mark.anyio
async def test_80x24_fits_every_value_of_a_huge_run_on_one_line(tmp_path):
    root = tui_states.huge_run(str(tmp_path / ("cache-" + "y" * 150)))
    app = MonitorApp(root, refresh=3600, clock=lambda: tui_states.NOW, disk_free=lambda _: 500_000_000)
    async with app.run_test(size=(80, 24)) as pilot:
        await app.first_snapshot()
        await pilot.pause()
        for widget in app.query(Fitted):  # laid out to its own width: Textual never wraps (or folds) a line
            if widget.display and widget.content_region.width:
                content = widget.content
                shown = content.plain if isinstance(content, Text) else str(content)
                assert all(cell_len(line) <= widget.content_region.width for line in shown.splitlines()), (
                    widget.id
                )
        rows = await screen_rows(app, pilot)
        for value in (
            "samples 10/987654321000",
            "tokens 20.0k/1.0T",
            "shards 1/9876543",
            "ETA ?",
            "written 40.0 MB",
            "of 2.0 PB projected",
            "the rest (2.0 PB)",
            "bf16 cache / bf16 compute",
            "00064.jsonl",
            "9876540 pending",
            "3d00h ago",
            "123.5k/1.2M",
        ):
            assert any(value in row for row in rows), value
        header = [row for row in rows if "meta-llama/" in row][0]
        # the long name shortened, not wrapped
        assert "…" in header and "(qwen3, 36 layers, H=4096)" in header
        ranks = app.query_one("#ranks")
        assert 0 < ranks.virtual_size.width <= ranks.size.width  # whole rows: the narrow columns were chosen
        labels = [str(c.label) for c in ranks.ordered_columns]
        assert "last error" in labels and "heartbeat" in labels


@pytest.mark.slow
def test_a_killed_producers_partial_is_abandoned_not_writing(embedded, tmp_path):
    """A real producer SIGKILLed mid-shard: once its heartbeat is stale, its .partial has no writer."""
    out = str(tmp_path / "cache")
    args = produce_args(embedded.stock, embedded.data, out, "--seq-length", "256", "--shard-size", "3",
                        "--batch-size", "2")
    killed = run(producer_cmd(*args), env={"DSPARK_CRASH_AT": "mid_shard:2"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    partials = CachePaths(out).partial_files()
    assert len(partials) == 1
    later = time.time() + 60  # a minute after the kill: rank 0's last heartbeat says "running", on a shard
    snap = CacheScanner(out, clock=lambda: later).scan()
    assert snap.ranks[0].phase == "running" and snap.is_stale(snap.ranks[0])
    assert not snap.writing and len(snap.abandoned) == 1
    assert CachePaths(out).shard_partial(next(iter(snap.abandoned))) == partials[0]
    report = "\n".join(lines(snap))
    assert "0 writing  1 abandoned (rerun resumes)" in report
    # Its process ran on this host and is gone: said as such (a rank elsewhere would be "silent").
    assert "rank 0 died (its process" in report and "rerun the same dspark-produce command" in report
    os.utime(partials[0])  # the file just changed, but no rank is live: still nobody writing it
    assert not CacheScanner(out, clock=lambda: later).scan().writing


@pytest.mark.anyio
async def test_a_partial_is_writing_only_while_a_live_rank_writes_it(tmp_path):
    """Two ranks: rank 1 died on shard 21; rank 0 is on shard 22 while its writer finishes shard 20."""
    root = tui_states.live_run(str(tmp_path / "c"))
    paths = CachePaths(root)
    tui_states.write_status(root, tui_states.status(0, 2, "running", 1.0, shard=22))
    for shard in (20, 22):
        open(paths.shard_partial(shard), "wb").close()
    os.utime(paths.shard_partial(20), (tui_states.NOW - 2, tui_states.NOW - 2))  # appended to 2 s ago
    os.utime(paths.shard_partial(22), (tui_states.NOW - 60, tui_states.NOW - 60))  # just opened, on a slow fs
    snap = CacheScanner(root, clock=lambda: tui_states.NOW).scan()
    assert snap.writing == {20, 22} and snap.abandoned == {21}
    app = MonitorApp(root, refresh=3600, clock=lambda: tui_states.NOW + 30, disk_free=lambda _: 10**12)
    async with app.run_test(size=(80, 24)):
        await app.first_snapshot()  # 30 s on, both ranks silent: no shard has a writer
        shown = app.query_one("#shards").content.plain
        assert "0 writing  3 abandoned (rerun resumes)" in shown and "▒" not in shown


def fitted_lines(widget: Fitted) -> list[str]:
    """What a fitted widget shows, line by line, each checked against its width."""
    shown = widget.content.plain.splitlines()
    width = widget.content_region.width
    assert width and all(cell_len(line) <= width for line in shown), shown
    return shown


@pytest.mark.anyio
async def test_under_tui_the_stop_question_and_the_exit_notice_fit_80x24(tmp_path):
    import subprocess
    import sys

    from dspark_cache.tui.confirm import ConfirmStop
    from dspark_cache.tui.foreground import ForegroundMonitor

    root = tui_states.live_run(str(tmp_path / "c"))
    log = str(tmp_path / ("logs-" + "z" * 120) / "produce-20261201-120000.log")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        app = ForegroundMonitor(root, child, log)
        async with app.run_test(size=(80, 24)) as pilot:
            await app.first_snapshot()
            await pilot.press("q")
            await pilot.pause()
            assert isinstance(app.screen, ConfirmStop)
            shown = fitted_lines(app.screen.query_one("#question", Fitted))
            assert any(line.endswith("produce-20261201-120000.log") and "…" in line for line in shown)
            await pilot.press("n")
            child.kill()
            child.wait()
            await app.refreshed()
            await pilot.pause()  # shown only now: laid out to its width once it has one
            notice = fitted_lines(app.query_one("#notice", Fitted))
            assert notice[0].startswith("producer exited with code -9 (log:")
            assert any(line.endswith("produce-20261201-120000.log);") for line in notice)
            await pilot.press("q")
    finally:
        if child.poll() is None:
            child.kill()
