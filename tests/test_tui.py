"""The monitor, driven by Textual's pilot, on hand-made states and on real producer runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading

import pytest
from rich.text import Text

import dspark_cache
from dspark_cache.tui.app import MonitorApp
from dspark_cache.tui.cli import main as monitor_main
from dspark_cache.tui.widgets.shardmap import bucketed
from dspark_cache.verify import verify_cache
from tests import tui_states
from tests.conftest import produce_args
from tests.proc import producer_cmd, published, run, start, wait_for

SNAP_ROOT = os.path.join(tempfile.gettempdir(), "dspark-monitor-snapshot")  # fixed: paths are on screen


@pytest.fixture(scope="module")
def long_data(tmp_path_factory) -> str:
    """Enough rows (one shard each) that a producer is still running when a test stops it."""
    from dspark_cache.embedded.data import write_sample_data

    return write_sample_data(str(tmp_path_factory.mktemp("long") / "rows.jsonl"), num_rows=400, seed=11)


def plain(widget) -> str:
    content = widget.content
    return content.plain if isinstance(content, Text) else Text.from_markup(str(content)).plain


def app_for(root: str, free: int = 10**12) -> MonitorApp:
    return MonitorApp(root, refresh=3600, clock=lambda: tui_states.NOW, disk_free=lambda _: free)


@pytest.mark.anyio
async def test_live_run_stale_rank_failed_shard_and_full_disk(tmp_path):
    root = tui_states.live_run(str(tmp_path / "c"))
    app = app_for(root, free=500_000_000)
    async with app.run_test(size=(140, 60)) as pilot:
        await app.first_snapshot()
        header = plain(app.query_one("#header"))
        assert "Qwen/Qwen3-8B" in header and "[1, 10, 18, 26, 35]" in header and "ranks: 2" in header
        progress = plain(app.query_one("#progress-text"))
        assert "shards 22/60" in progress and "samples 220/600" in progress and "ETA" in progress
        ranks = app.query_one("#ranks")
        assert ranks.row_count == 2
        assert "STALE" in str(ranks.get_row_at(1)[1]) and "STALE" not in str(ranks.get_row_at(0)[1])
        shards = plain(app.query_one("#shards"))
        assert "22 published  2 writing  35 pending  1 failed" in shards
        assert "will not fit" in plain(app.query_one("#disk"))
        events = plain(app.query_one("#events"))
        assert "disk full while writing shard 23" in events and "non-finite" in events
        await pilot.press("question_mark")
        await pilot.pause()
        assert app.screen.__class__.__name__ == "HelpScreen"
        await pilot.press("escape")
        await pilot.press("s")
        await app.refreshed()
        assert os.path.exists(os.path.join(root, "control", "stop"))
        assert "stop requested" in plain(app.query_one("#notice"))


@pytest.mark.anyio
async def test_finished_cache_shows_summary(small_cache):
    app = MonitorApp(small_cache, refresh=3600)
    async with app.run_test(size=(140, 60)):
        await app.first_snapshot()
        m = dspark_cache.open_cache(small_cache).manifest
        text = plain(app.query_one("#progress-text"))
        assert text.startswith("complete") and f"{m.num_samples} samples" in text and f"{m.num_shards} shards" in text
        assert f"{m.num_shards} published" in plain(app.query_one("#shards"))
        assert "finished" in str(app.query_one("#ranks").get_row_at(0)[1])
        assert "cache complete" in plain(app.query_one("#events"))
        assert "will not fit" not in plain(app.query_one("#disk"))


@pytest.mark.anyio
async def test_empty_directory_waits_for_a_producer(tmp_path):
    app = app_for(str(tmp_path))
    async with app.run_test(size=(120, 40)) as pilot:
        await app.first_snapshot()
        assert "not a dspark cache yet" in plain(app.query_one("#header"))
        assert plain(app.query_one("#shards")) == "no shards planned yet"
        await pilot.press("s")  # nothing to stop: no file is written
        await pilot.pause()
        assert not os.path.exists(os.path.join(tmp_path, "control"))


@pytest.mark.anyio
async def test_a_slow_read_never_freezes_the_screen(tmp_path):
    root = tui_states.live_run(str(tmp_path / "c"))
    release, readers = threading.Event(), []

    def slow_disk_free(_: str) -> int:  # stands for any read that hangs: a shared filesystem, a huge file
        readers.append(threading.get_ident())
        release.wait(60)
        return 10**12

    app = MonitorApp(root, refresh=3600, clock=lambda: tui_states.NOW, disk_free=slow_disk_free)
    try:
        async with app.run_test(size=(140, 60)) as pilot:
            await pilot.press("question_mark")  # answered while the watcher thread is stuck
            await pilot.pause()
            assert app.screen.__class__.__name__ == "HelpScreen" and app.snapshot is None
            await pilot.press("escape")
            release.set()
            await app.refreshed()
            assert "22 published" in plain(app.query_one("#shards"))
    finally:
        release.set()
    assert readers and threading.get_ident() not in readers


def test_missing_directory_is_a_clear_message(tmp_path, capsys):
    assert monitor_main([str(tmp_path / "nope")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_stale_is_formats_liveness_rule():
    """The monitor marks a rank STALE by format's rule, the one a waiting producer rank uses too."""
    from dspark_cache.format.status import STALE_AFTER_S, rank_is_live, rank_is_stale

    now = tui_states.NOW
    fresh, silent = (tui_states.status(0, 1, "running", age) for age in (STALE_AFTER_S, STALE_AFTER_S + 0.1))
    done = tui_states.status(0, 1, "finished", 10 * STALE_AFTER_S)
    assert rank_is_live(fresh, now) and not rank_is_stale(fresh, now)
    assert rank_is_stale(silent, now) and not rank_is_live(silent, now) and rank_is_live(silent, now, timeout=300)
    assert not rank_is_live(done, now) and not rank_is_stale(done, now)  # a finished rank is neither


def test_thousands_of_shards_stay_readable():
    states = ["published"] * 5000 + ["writing"] + ["pending"] * 4999
    cells, per = bucketed(states, 800)
    assert len(cells) <= 800 and per == 13
    assert "writing" in cells  # one shard in flight is never averaged away


async def first_snapshot(pilot) -> None:
    """Before a screenshot: wait until the watcher thread's snapshot is on screen."""
    await pilot.app.first_snapshot()


def test_snapshot_live_run(snap_compare):
    tui_states.live_run(SNAP_ROOT)
    assert snap_compare(app_for(SNAP_ROOT, free=500_000_000), terminal_size=(140, 60), run_before=first_snapshot)


def test_snapshot_finished(snap_compare):
    tui_states.build(SNAP_ROOT, num_shards=12, published=list(range(12)), complete=True,
                     ranks=[tui_states.status(0, 1, "finished", 60.0, shards_done=12, shards_owned=12)],
                     events=[tui_states.event(0, 60, "finished", "cache complete", samples=120)])
    assert snap_compare(app_for(SNAP_ROOT), terminal_size=(140, 60), run_before=first_snapshot)


def test_monitor_imports_no_torch():
    code = "import sys, dspark_cache.tui.app, dspark_cache.tui.cli; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


@pytest.mark.anyio
async def test_s_key_stops_a_real_producer_which_then_resumes(embedded, long_data, tmp_path):
    out = str(tmp_path / "cache")
    args = produce_args(embedded.stock, long_data, out, "--seq-length", "256", "--shard-size", "1",
                        "--batch-size", "1")
    producer = start(producer_cmd(*args))
    try:
        wait_for(lambda: published(out) >= 2)
        # Freeze the producer mid-run so it cannot finish before the key is pressed, however
        # slow the monitor is to start on a loaded machine.
        os.killpg(producer.pid, signal.SIGSTOP)
        app = MonitorApp(out, refresh=0.2)
        async with app.run_test(size=(140, 60)) as pilot:
            snap = await app.first_snapshot()
            assert snap.is_cache and snap.ranks[0].state == "running"
            await pilot.press("s")
            await pilot.pause()
        os.killpg(producer.pid, signal.SIGCONT)
        _, err = producer.communicate(timeout=120)
    finally:
        if producer.poll() is None:
            os.killpg(producer.pid, signal.SIGKILL)
    assert producer.returncode == 3, err
    assert "stop requested by the monitor" in err
    report = verify_cache(out)
    assert not report.complete and not report.corrupt and report.missing
    again = run(producer_cmd(*args))  # the stop request does not outlive the run it stopped
    assert again.returncode == 0, again.stderr
    assert verify_cache(out).ok


@pytest.mark.anyio
async def test_foreground_monitor_quits_by_stopping_its_producer(embedded, long_data, tmp_path):
    """``dspark-produce --tui``: the monitor owns the child producer; q stops it gracefully."""
    from dspark_cache.tui.foreground import ForegroundMonitor

    out = str(tmp_path / "cache")
    args = produce_args(embedded.stock, long_data, out, "--seq-length", "256", "--shard-size", "1",
                        "--batch-size", "1")
    log = tmp_path / "produce.log"
    with open(log, "wb") as handle:
        child = subprocess.Popen([sys.executable, "-m", "dspark_cache.producer.cli", *args], stdout=handle,
                                 stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: published(out) >= 1)
            os.kill(child.pid, signal.SIGSTOP)  # still mid-run when q is pressed, however slow the start
            app = ForegroundMonitor(out, child, str(log))
            async with app.run_test(size=(140, 60)) as pilot:
                assert (await app.first_snapshot()).ranks[0].state == "running"
                await pilot.press("q")  # SIGTERM stays pending until the child runs again
            os.kill(child.pid, signal.SIGCONT)
            assert child.wait(timeout=120) == 3
        finally:
            if child.poll() is None:
                child.kill()
    assert "rerun the same command to resume" in log.read_text()
    assert not verify_cache(out).corrupt


def test_tui_flag_is_refused_cleanly_on_bad_arguments(capsys):
    from dspark_cache.cli import produce

    with pytest.raises(SystemExit) as exit_info:
        produce(["--tui", "--input-data", "x"])
    assert exit_info.value.code == 2 and "--target-model" in capsys.readouterr().err


@pytest.mark.anyio
async def test_no_cache_file_is_touched_on_the_ui_thread(tmp_path):
    """Opening, listing and creating files under the cache (the stop request included) happen on
    the watcher thread only; the UI thread renders what it is posted."""
    root = tui_states.live_run(str(tmp_path / "c"))
    seen: list[tuple[str, int]] = []

    def hook(event: str, args: tuple) -> None:  # audit hooks cannot be removed: only record this root
        if event in ("open", "os.listdir", "os.scandir", "os.mkdir") and args and str(args[0]).startswith(root):
            seen.append((event, threading.get_ident()))

    sys.addaudithook(hook)
    app = app_for(root)
    async with app.run_test(size=(140, 60)) as pilot:
        await app.first_snapshot()
        await pilot.press("s")
        await app.refreshed()
    assert os.path.exists(os.path.join(root, "control", "stop"))
    assert {event for event, _ in seen} >= {"open", "os.listdir", "os.mkdir"}
    assert threading.get_ident() not in {thread for _, thread in seen}
