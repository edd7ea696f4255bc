"""The monitor, driven by Textual's pilot, on hand-made states and on real producer runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest

import dspark_cache
from dspark_cache.format.paths import CachePaths
from dspark_cache.tui.app import MonitorApp
from dspark_cache.cli import monitor as monitor_main
from dspark_cache.tui.rates import RateTracker
from dspark_cache.tui.scan import CacheScanner
from dspark_cache.tui.widgets.shardmap import PLACED, shard_map
from dspark_cache.verify import verify_cache
from tests.support import tui_states
from tests.support.monitor import app_for, plain
from tests.support.produce import produce_args
from tests.support.proc import producer_cmd, published, run, start, wait_for
from tests.support import warm

SNAP_ROOT = os.path.join(tempfile.gettempdir(), "dspark-monitor-snapshot")  # fixed: paths are on screen


@pytest.mark.anyio
async def test_live_run_stale_rank_failed_shard_and_full_disk(tmp_path):
    root = tui_states.live_run(str(tmp_path / "c"))
    app = app_for(root, free=500_000_000)
    async with app.run_test(size=(140, 60)) as pilot:
        await app.first_snapshot()
        header = plain(app.query_one("#header"))
        assert "Qwen/Qwen3-8B" in header and "[1, 10, 18, 26, 35]" in header and "ranks: 2" in header
        progress = plain(app.query_one("#progress-text"))
        assert "shards 22/60" in progress and "samples 220/600" in progress and "ETA ?" in progress
        ranks = app.query_one("#ranks")
        assert ranks.row_count == 2
        assert "STALE" in str(ranks.get_row_at(1)[1]) and "STALE" not in str(ranks.get_row_at(0)[1])
        tui_states.next_heartbeat(root)
        await app.refreshed()
        assert "1.5k tok/s  ETA 8m26s" in plain(app.query_one("#progress-text"))
        shards = plain(app.query_one("#shards"))
        # Rank 1 is STALE: its shard's .partial has no live writer
        assert "22 published  1 writing  1 abandoned (rerun resumes)  35 pending  1 failed" in shards
        assert "will not fit" in plain(app.query_one("#disk"))
        events = plain(app.query_one("#events"))
        assert "disk full while writing shard 23" in events and "non-finite" in events
        await pilot.press("question_mark")
        await pilot.pause()
        assert app.screen.__class__.__name__ == "HelpScreen"
        await pilot.press("escape")
        await pilot.press("s")
        await app.refreshed()
        assert os.path.exists(CachePaths(root).stop_request)
        assert "stop requested" in plain(app.query_one("#notice"))


@pytest.mark.anyio
async def test_finished_cache_shows_summary(small_cache):
    app = MonitorApp(small_cache, refresh=3600)
    async with app.run_test(size=(140, 60)):
        snap = await app.first_snapshot()
        m = dspark_cache.open_cache(small_cache).manifest
        text = plain(app.query_one("#progress-text"))
        assert (
            text.startswith("complete")
            and f"{m.num_samples} samples" in text
            and f"{m.num_shards} shards" in text
        )
        assert f"{m.num_shards} published" in plain(app.query_one("#shards"))
        assert "finished" in str(app.query_one("#ranks").get_row_at(0)[1])
        assert "cache complete" in plain(app.query_one("#events"))
        assert "will not fit" not in plain(app.query_one("#disk"))
        # No rate "now" on a finished cache: the run's average, from what the real run wrote.
        status = snap.ranks[0]
        average = status.bytes_written / (status.updated_at - status.started_at)
        assert snap.run_average().bytes_per_s == pytest.approx(average)
        assert plain(app.query_one("#tok-label")).startswith("tokens/s now -   run avg ")
        assert not app.check_action("request_stop", ())


@pytest.mark.anyio
async def test_empty_directory_waits_for_a_producer(tmp_path):
    app = app_for(str(tmp_path))
    async with app.run_test(size=(120, 40)) as pilot:
        await app.first_snapshot()
        assert "not a dspark cache yet" in plain(app.query_one("#header"))
        assert plain(app.query_one("#shards")) == "no shards planned yet"
        await pilot.press("s")  # nothing to stop: no file is written
        await pilot.pause()
        assert not os.path.exists(CachePaths(str(tmp_path)).control_dir)


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


def test_missing_directory_exits_2_only_with_no_wait(tmp_path, capsys, monkeypatch):
    # without one: tests/test_tui_report.py
    monkeypatch.setattr("dspark_cache.tui.report.has_terminal", lambda: True)
    assert monitor_main([str(tmp_path / "nope"), "--no-wait"]) == 2
    assert "nope does not exist" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert monitor_main([str(tmp_path / "file")]) == 2  # waiting would not help
    assert "is not a directory" in capsys.readouterr().err
    started = []
    monkeypatch.setattr(MonitorApp, "run", lambda app: started.append(app.scanner.paths.root))
    assert monitor_main([str(tmp_path / "later")]) == 0  # without --no-wait the monitor starts and waits
    assert started == [str(tmp_path / "later")]


@pytest.mark.anyio
async def test_a_directory_not_there_yet_is_waited_for(tmp_path):
    root = str(tmp_path / "later")
    app = app_for(root)
    async with app.run_test(size=(80, 24)):
        await app.first_snapshot()
        assert "does not exist yet; waiting for it to appear" in " ".join(
            plain(app.query_one("#header")).split()
        )
        tui_states.live_run(root)
        await app.refreshed()
        assert "Qwen/Qwen3-8B" in plain(app.query_one("#header"))
        assert "shards 22/60" in plain(app.query_one("#progress-text"))


def test_stale_is_formats_liveness_rule():
    """The monitor marks a rank STALE by format's rule, the one a waiting producer rank uses too."""
    from dspark_cache.format.status import STALE_AFTER_S, rank_is_live, rank_is_stale

    now = tui_states.NOW
    fresh, silent = (tui_states.status(0, 1, "running", age) for age in (STALE_AFTER_S, STALE_AFTER_S + 0.1))
    done = tui_states.status(0, 1, "finished", 10 * STALE_AFTER_S)
    assert rank_is_live(fresh, now) and not rank_is_stale(fresh, now)
    assert (
        rank_is_stale(silent, now)
        and not rank_is_live(silent, now)
        and rank_is_live(silent, now, timeout=300)
    )
    assert not rank_is_live(done, now) and not rank_is_stale(done, now)  # a finished rank is neither


def test_thousands_of_shards_stay_readable():
    states = ["published"] * 5000 + ["writing"] + ["pending"] * 4999
    cells, per, _ = shard_map(
        len(states), {s: [i for i, x in enumerate(states) if x == s] for s in PLACED}, 800
    )
    assert len(cells) <= 800 and per == 13
    assert "writing" in cells  # one shard in flight is never averaged away


async def first_snapshot(pilot) -> None:
    """Before a screenshot: wait until the watcher thread's snapshot is on screen."""
    await pilot.app.first_snapshot()


async def measured(pilot) -> None:
    """Before a screenshot of :func:`tui_states.live_run`: rank 0's next heartbeat, measured and shown."""
    await pilot.app.first_snapshot()
    tui_states.next_heartbeat(SNAP_ROOT)
    await pilot.app.refreshed()


def test_snapshot_live_run(snap_compare):
    tui_states.live_run(SNAP_ROOT)
    assert snap_compare(app_for(SNAP_ROOT, free=500_000_000), terminal_size=(140, 60), run_before=measured)


def test_snapshot_live_run_80x24(snap_compare):
    """The compact layout: progress, rates, disk and every rank column fit an 80x24 terminal."""
    tui_states.live_run(SNAP_ROOT)
    assert snap_compare(app_for(SNAP_ROOT, free=500_000_000), terminal_size=(80, 24), run_before=measured)


def test_snapshot_finished(snap_compare):
    tui_states.finished(SNAP_ROOT)
    assert snap_compare(app_for(SNAP_ROOT), terminal_size=(140, 60), run_before=first_snapshot)


@pytest.mark.anyio
async def test_80x24_shows_whole_rank_rows_and_scrolls_to_every_panel(tmp_path):
    root = tui_states.live_run(str(tmp_path / "c"))
    app = app_for(root)
    async with app.run_test(size=(80, 24)) as pilot:
        await app.first_snapshot()
        await pilot.pause()
        ranks, body = app.query_one("#ranks"), app.query_one("#body")
        labels = [str(c.label) for c in ranks.ordered_columns]
        assert "heartbeat" in labels and "last error" in labels
        assert ranks.virtual_size.width <= ranks.size.width  # no column cut off at the right
        for shown in (ranks, app.query_one("#progress"), app.query_one("#throughput")):
            assert body.region.contains_region(shown.region)  # in view without scrolling
        events = app.query_one("#events")
        assert not body.region.contains_region(events.region)  # below the fold at first
        await pilot.press("end")  # the scrolled panels have the focus from the start
        await pilot.pause()
        assert body.region.contains_region(events.region)
        await pilot.press("home", "question_mark")
        await pilot.pause()
        help_box = app.screen.query_one("VerticalScroll")
        assert help_box.region.width <= 80 and help_box.virtual_size.width <= help_box.size.width


def rank_cells(app: MonitorApp, rank: int) -> dict[str, str]:
    """One row of the rank table as shown, by column label."""
    ranks = app.query_one("#ranks")
    return dict(zip((str(c.label) for c in ranks.ordered_columns), (str(c) for c in ranks.get_row_at(rank))))


def whole_rows(app: MonitorApp) -> bool:
    ranks = app.query_one("#ranks")
    return 0 < ranks.virtual_size.width <= ranks.size.width


@pytest.mark.anyio
async def test_rank_memory_is_shown_whole_in_every_layout(tmp_path):
    """Each tensor-parallel rank's slice of the weights and its device memory; a CPU run's device
    memory is '-'. A rank's long error never pushes a row past the table, however narrow."""
    root = tui_states.tensor_parallel_run(str(tmp_path / "c"))
    app = app_for(root)
    async with app.run_test(size=(140, 60)) as pilot:
        await app.first_snapshot()
        await pilot.pause()
        shown = [rank_cells(app, r) for r in range(4)]
        assert [(c["rank"], c["weights"], c["device mem"]) for c in shown] == [
            ("0 g0 w", "8.2 GB", "9.5 GB"), ("1 g0", "8.2 GB", "9.6 GB"), ("2 g1 w", "8.2 GB", "9.7 GB"),
            ("3 g1", "8.2 GB", "9.8 GB")]
        error = shown[3]["last error"]
        assert error.startswith("CUDA out of memory. Tried") and error.endswith("…") and whole_rows(app)
        await pilot.resize_terminal(104, 40)  # the wide layout, too narrow for the wide rank columns
        await pilot.pause()
        assert "host/pid" not in rank_cells(app, 0) and rank_cells(app, 0)["weights/mem"] == "8.2G/9.5G"
        assert whole_rows(app)
        await pilot.resize_terminal(80, 24)
        await pilot.pause()
        assert [rank_cells(app, r)["weights/mem"] for r in range(4)] == [
            "8.2G/9.5G",
            "8.2G/9.6G",
            "8.2G/9.7G",
            "8.2G/9.8G",
        ]
        assert rank_cells(app, 3)["last error"].startswith("CUDA out") and whole_rows(app)
        tui_states.finished(root)  # a run on CPU: weights measured, no device memory
        await app.refreshed()
        assert rank_cells(app, 0)["weights/mem"] == "16.4G/-" and whole_rows(app)
        await pilot.resize_terminal(140, 60)
        await pilot.pause()
        assert (rank_cells(app, 0)["weights"], rank_cells(app, 0)["device mem"]) == ("16.4 GB", "-")


@pytest.mark.anyio
async def test_ranks_show_the_shards_their_writer_lanes_hold(tmp_path):
    """Each rank's shards in flight (one per writer lane), not only its device's; a lane's .partial
    that has not grown for a while is still being written while its rank says so."""
    root = tui_states.writer_lanes_run(str(tmp_path / "c"))
    app = app_for(root)
    async with app.run_test(size=(140, 60)):
        await app.first_snapshot()
        assert [rank_cells(app, r)["shard"] for r in range(4)] == ["30,31,32", "40,41,42 +2", "50", "55"]
        shards = plain(app.query_one("#shards"))
        assert "9 writing" in shards and "abandoned" not in shards, shards


def beat(state: str, second: float, tokens: int, written: int = 0, run: str = "r2"):
    """Rank 0's heartbeat written ``second`` seconds into a run, as the producer's StatusReporter writes it."""
    return tui_states.status(0, 1, state, 100 - second, run_id=run, tokens_done=tokens,
                             bytes_written=written, tokens_per_s=tui_states.INFLATED_RATE)


def test_rates_count_only_work_of_the_live_run():
    """The heartbeats compute.py writes on a resume: 0 before the first batch, then the resumed
    shards' tokens plus this run's; the rate is this run's work only, whatever the rate field says."""
    base = 1_000_000  # tokens of shards published by an earlier run
    tracker = RateTracker(window=10.0)
    for state, at, tokens in (("loading", 0, 0), ("running", 1, 0), ("running", 2, base)):
        assert tracker.observe([beat(state, at, tokens)]) == (None,)  # nothing of this run measured yet
    # a burst, 4 s: too short
    assert tracker.observe([beat("running", 6, base + 4_000, 8_000_000)]) == (None,)
    (rate,) = tracker.observe([beat("running", 7, base + 5_000, 10_000_000)])
    assert rate.tokens_per_s == rate.average_tokens_per_s == 1_000.0 and rate.bytes_per_s == 2_000_000.0
    for second in range(8, 30):  # steady 1k tokens/s, then 3k tokens/s in the last 10 s
        tokens = base + 5_000 + 1_000 * (min(second, 20) - 7) + 3_000 * max(0, second - 20)
        (rate,) = tracker.observe([beat("running", second, tokens, 10_000_000)])
    assert rate.tokens_per_s == pytest.approx(2_800.0)  # over the last 10 s
    assert rate.average_tokens_per_s == pytest.approx(45_000 / 27)  # since the first heartbeat with work
    finished = tracker.observe([beat("finished", 31, 5 * base)])  # the plan's total, set at the end
    assert finished == (None,)
    assert tracker.observe([beat("running", 40, 5 * base, run="r3")]) == (None,)  # the next run starts over
    assert tracker.observe([beat("running", 35, 6 * base, run="r3")]) == (None,)  # a clock set back: too


@pytest.mark.anyio
async def test_rates_after_a_resume_and_on_the_finished_screen(tmp_path):
    root = tui_states.live_run(str(tmp_path / "c"))  # rank 0 counts 200k resumed tokens, claims 53.7k tok/s
    app = app_for(root)
    async with app.run_test(size=(140, 60)):
        await app.first_snapshot()
        assert "tok/s measuring…  ETA ?" in plain(app.query_one("#progress-text"))
        assert str(app.query_one("#ranks").get_row_at(0)[5]) == "-"
        tui_states.next_heartbeat(root)
        snap = await app.refreshed()
        assert snap.tokens_per_s == tui_states.LIVE_TOKENS / tui_states.LIVE_GAP_S  # 1.5k, not 53.7k
        assert plain(app.query_one("#tok-label")) == "tokens/s now 1.5k   peak 1.5k"
        assert str(app.query_one("#ranks").get_row_at(0)[5]) == "1.5k"
        tui_states.finished(root)  # the run completes
        snap = await app.refreshed()
        label = plain(app.query_one("#tok-label"))
        assert snap.tokens_per_s is None and label.startswith("tokens/s now -   run avg 82   peak 1.5k")
        written = plain(app.query_one("#mb-label"))
        assert written.startswith("written/s now -   run avg 163.3 KB")  # 480 MB over 2940 s


@pytest.mark.anyio
async def test_one_count_of_samples_on_screen(tmp_path):
    """Rank 0 has appended samples it has not published: only the published ones are counted, once."""
    root = tui_states.live_run(str(tmp_path / "c"))
    tui_states.write_status(root, tui_states.live_rank0(0.5, 1, 1))
    app = app_for(root)
    async with app.run_test(size=(140, 60)):
        snap = await app.first_snapshot()
        assert snap.ranks[0].samples_done != snap.samples_done == 220
        assert "samples 220/600" in plain(app.query_one("#progress-text"))
        ranks = app.query_one("#ranks")
        labels = [str(c.label) for c in ranks.ordered_columns]
        assert "samples" not in labels and "run shards" in labels
        assert str(ranks.get_row_at(0)[labels.index("run shards")]) == "2/20"


@pytest.mark.anyio
async def test_stop_is_offered_only_while_a_rank_is_live(tmp_path):
    root = tui_states.finished(str(tmp_path / "c"))
    app = app_for(root)
    async with app.run_test(size=(140, 60)) as pilot:
        await app.first_snapshot()
        footer = " ".join(str(b.binding.description) for b in app.screen.active_bindings.values()
                          if app.check_action(b.binding.action, ()))
        assert "help" in footer and "stop producer" not in footer
        await pilot.press("s")
        await app.refreshed()
        assert not os.path.exists(CachePaths(root).control_dir)
    stale = tui_states.live_run(str(tmp_path / "stale"))  # a producer that died: every heartbeat old
    tui_states.write_status(stale, tui_states.status(0, 2, "running", 60.0))
    scanner = CacheScanner(stale, clock=lambda: tui_states.NOW)
    assert not scanner.scan().can_stop
    assert "no producer is running" in scanner.request_stop()  # the watcher thread checks again
    assert not os.path.exists(CachePaths(stale).stop_request)


@pytest.mark.anyio
async def test_foreground_q_asks_before_stopping_the_producer(tmp_path):
    """``--tui``: q while the producer runs asks; n keeps it running, y stops it (SIGTERM) and quits."""
    from dspark_cache.tui.confirm import ConfirmStop
    from dspark_cache.tui.foreground import ForegroundMonitor

    root = tui_states.live_run(str(tmp_path / "c"))
    code = ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(3)); "
            "print('ready', flush=True); time.sleep(120)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "ready\n"
        app = ForegroundMonitor(root, child, str(tmp_path / "produce.log"))
        async with app.run_test(size=(80, 24)) as pilot:
            await app.first_snapshot()
            await pilot.press("question_mark")
            await pilot.pause()
            assert "asks first" in plain(app.screen.query_one("Static"))
            await pilot.press("escape", "q")
            await pilot.pause()
            assert isinstance(app.screen, ConfirmStop) and child.poll() is None
            await pilot.press("n")
            await pilot.pause()
            assert not isinstance(app.screen, ConfirmStop) and app.is_running and child.poll() is None
            await pilot.press("q", "y")
        assert child.wait(timeout=30) == 3
    finally:
        if child.poll() is None:
            child.kill()


def test_monitor_imports_no_torch():
    code = "import sys, dspark_cache.tui.app, dspark_cache.tui.cli; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


@pytest.mark.slow
@pytest.mark.anyio
async def test_s_key_stops_a_real_producer_which_then_resumes(embedded, tmp_path):
    out = str(tmp_path / "cache")
    args = produce_args(embedded.stock, embedded.data, out, "--seq-length", "256", "--shard-size", "1",
                        "--batch-size", "1")
    producer = start(producer_cmd(*args))
    try:
        wait_for(lambda: published(out) >= 2)
        # Freeze the producer mid-run so it cannot finish before the key is pressed, however
        # slow the monitor is to start on a loaded machine.
        os.killpg(producer.pid, signal.SIGSTOP)
        frozen = time.time()  # the monitor's clock stops with the producer: its heartbeat stays fresh
        app = MonitorApp(out, refresh=0.2, clock=lambda: frozen)
        async with app.run_test(size=(140, 60)) as pilot:
            snap = await app.first_snapshot()
            assert snap.manifest is not None and snap.ranks[0].phase == "running"
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


@pytest.mark.slow
@pytest.mark.anyio
async def test_foreground_monitor_quits_by_stopping_its_producer(embedded, tmp_path):
    """``dspark-produce --tui``: the monitor owns the child producer; q stops it gracefully."""
    from dspark_cache.tui.foreground import ForegroundMonitor

    out = str(tmp_path / "cache")
    args = produce_args(embedded.stock, embedded.data, out, "--seq-length", "256", "--shard-size", "1",
                        "--batch-size", "1")
    log = tmp_path / "produce.log"
    with open(log, "wb") as handle:
        child = warm.popen([sys.executable, "-m", "dspark_cache.producer", *args], stdout=handle,
                           stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: published(out) >= 1)
            os.kill(child.pid, signal.SIGSTOP)  # still mid-run when q is pressed, however slow the start
            app = ForegroundMonitor(out, child, str(log))
            async with app.run_test(size=(140, 60)) as pilot:
                assert (await app.first_snapshot()).ranks[0].phase == "running"
                await pilot.press("q", "y")  # asked, then SIGTERM: pending until the child runs again
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
        if (
            event in ("open", "os.listdir", "os.scandir", "os.mkdir")
            and args
            and str(args[0]).startswith(root)
        ):
            seen.append((event, threading.get_ident()))

    sys.addaudithook(hook)
    app = app_for(root)
    async with app.run_test(size=(140, 60)) as pilot:
        await app.first_snapshot()
        await pilot.press("s")
        await app.refreshed()
    assert os.path.exists(CachePaths(root).stop_request)
    assert {event for event, _ in seen} >= {"open", "os.listdir", "os.mkdir"}
    assert threading.get_ident() not in {thread for _, thread in seen}


@pytest.mark.anyio
async def test_a_rate_of_one_point_is_a_flat_baseline_not_a_solid_bar(tmp_path):
    """Issue 41, item 16: textual draws a one-point series as full blocks, a run just begun looked maxed out."""
    from textual.widgets import Sparkline

    root = tui_states.live_run(str(tmp_path / "c"))
    app = app_for(root)
    async with app.run_test(size=(140, 60)):
        await app.first_snapshot()
        tui_states.next_heartbeat(root)  # the first measured rate: one point of history
        await app.refreshed()
        assert len(app.snapshot.history) == 1
        for line in ("#tok-line", "#mb-line"):
            chart = app.query_one(line, Sparkline)
            drawn = "".join(
                segment.text for strip in chart.render_lines(chart.region.reset_offset) for segment in strip
            )
            assert "█" not in drawn and "▁" in drawn, (line, drawn)
