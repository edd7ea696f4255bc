"""The monitor without a terminal (a job script's log, a pipe) or with ``--once``: one plain report, then exit."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import time

import pytest

from dspark_cache.cli import monitor
from dspark_cache.tui.report import exit_code, lines, measured_snapshot
from dspark_cache.tui.scan import CacheScanner
from tests.support import tui_states
from tests.support.produce import produce_args
from tests.support.proc import producer_cmd
from tests.support import warm

MONITOR = os.path.join(os.path.dirname(sys.executable), "dspark-monitor")
# a report takes about a second (at most MEASURE_S more for a live rate); the app never ends
REPORT_TIMEOUT = 60.0


def monitor_into_file(tmp_path, *args: str) -> tuple[int, str, str]:
    """``dspark-monitor ARGS > file`` with no terminal anywhere: exit code, the file, stderr."""
    out = tmp_path / "monitor.log"
    with open(out, "wb") as handle:
        proc = warm.run([MONITOR, *args], stdin=subprocess.DEVNULL, stdout=handle, stderr=subprocess.PIPE,
                        text=True, timeout=REPORT_TIMEOUT)
    return proc.returncode, out.read_text(), proc.stderr


def test_into_a_file_the_monitor_prints_one_report_and_exits(tmp_path):
    root = tui_states.finished(str(tmp_path / "c"))
    started = time.monotonic()
    code, text, err = monitor_into_file(tmp_path, root)
    assert code == 0, err
    assert time.monotonic() - started < 20
    assert "\x1b" not in text  # plain lines, no screen codes
    assert "progress: complete: 120 samples, 240.0k tokens, 12 shards, 480.0 MB (2000 B/token)" in text
    assert "shards: 12 published  0 writing  0 pending  0 failed" in text
    assert "rank 0, phase finished, shard -, host/pid node-a/1000, run shards 12/12" in text
    assert "07:59:00 r0 finished        cache complete" in text and "next:" not in text


def dead_run(root: str) -> str:
    """Two ranks a minute after they stopped: rank 0 failed (its error says why), rank 1 silent."""
    now = time.time()
    tui_states.build(root, num_shards=6, published=[0, 1], writing=[2], ranks=[
        tui_states.status(0, 2, "failed", 0, updated_at=now - 60, last_error="CUDA out of memory on shard 3"),
        tui_states.status(1, 2, "running", 0, shard=2, updated_at=now - 60)],
        events=[tui_states.event(0, 0, "error", "CUDA out of memory on shard 3", shard=3)])
    return root


def test_a_pipe_gets_the_report_and_exit_1_when_a_rank_failed_or_fell_silent(tmp_path):
    root = dead_run(str(tmp_path / "c"))
    proc = subprocess.run([MONITOR, root], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=REPORT_TIMEOUT)
    assert proc.returncode == 1, proc.stderr
    text = proc.stdout
    assert "progress: samples 20/60  tokens 40.0k/120.0k  shards 2/6  no producer running" in text
    assert "shards: 2 published  0 writing  1 abandoned (rerun resumes)  2 pending  1 failed" in text
    assert "phase failed" in text and "last error: CUDA out of memory on shard 3" in text
    # a loaded machine
    assert "rank 1, phase STALE, shard 2" in text and re.search(r"heartbeat 1m0\ds ago", text)
    assert "errors (newest last):" in text
    assert text.rstrip().endswith(
        "next: rank 0 failed, rank 1 silent (STALE heartbeat): once no rank runs, rerun the "
        "same dspark-produce command to resume (published shards are kept)"
    )


def test_without_a_terminal_a_missing_directory_is_not_waited_for(tmp_path, capsys, monkeypatch):
    code, text, err = monitor_into_file(tmp_path, str(tmp_path / "later"))
    assert code == 2 and text == ""
    assert "later does not exist" in err and "only on a terminal" in err
    started = []
    monkeypatch.setattr("dspark_cache.tui.report.has_terminal", lambda: True)
    monkeypatch.setattr(
        "dspark_cache.tui.app.MonitorApp.run", lambda app: started.append(app.scanner.paths.root)
    )
    assert monitor([str(tmp_path / "later")]) == 0  # on a terminal the app starts and waits for it
    assert started == [str(tmp_path / "later")]


def test_once_on_a_terminal_prints_the_report_and_exits(tmp_path):
    root = tui_states.finished(str(tmp_path / "c"))
    primary, secondary = pty.openpty()
    proc = warm.popen([MONITOR, root, "--once"], stdin=secondary, stdout=secondary, stderr=secondary)
    os.close(secondary)
    shown = b""
    try:
        deadline = time.monotonic() + REPORT_TIMEOUT
        poller = select.poll()  # select() refuses a descriptor numbered past 1023
        poller.register(primary, select.POLLIN)
        while time.monotonic() < deadline:
            if poller.poll(1000):
                try:
                    chunk = os.read(primary, 65536)
                except OSError:  # the child closed the terminal
                    break
                if not chunk:
                    break
                shown += chunk
            elif proc.poll() is not None:
                break
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(primary)
    text = shown.decode(errors="replace")
    assert "progress: complete: 120 samples" in text and "\x1b[?1049h" not in text  # no full-screen app


def test_a_live_runs_report_waits_for_its_measured_rate(tmp_path):
    """A running rank's rate needs two heartbeats: the report scans again (here: rank 0's next one)."""
    root = tui_states.live_run(str(tmp_path / "c"))
    waits: list[float] = []
    scanner = CacheScanner(root, clock=lambda: tui_states.NOW, disk_free=lambda _: 500_000_000)
    snap = measured_snapshot(scanner, 0.5, sleep=lambda s: (waits.append(s), tui_states.next_heartbeat(root)))
    assert waits == [0.5]
    text = "\n".join(lines(snap))
    assert "progress: samples 220/600  tokens 440.0k/1.2M  shards 22/60  1.5k tok/s  ETA 8m26s" in text
    assert "rates: tokens/s now 1.5k   peak 1.5k; written/s now 5.0 MB   peak 5.0 MB" in text
    assert "disk: written 880.0 MB of 2.4 GB projected; free 500.0 MB; the rest (1.5 GB) will not fit" in text
    assert "rank 1, phase STALE" in text and exit_code(snap) == 1


@pytest.mark.slow
def test_produce_tui_without_a_terminal_runs_the_producer_and_exits(embedded, tmp_path):
    """``dspark-produce --tui > log``: no app that no one can quit; the producer runs, its code is returned."""
    out = str(tmp_path / "cache")
    cmd = producer_cmd(*produce_args(embedded.stock, embedded.data, out, "--seq-length", "256", "--tui"))
    with open(tmp_path / "job.log", "wb") as handle:
        proc = warm.run(cmd, stdin=subprocess.DEVNULL, stdout=handle, stderr=subprocess.PIPE, timeout=300)
    text = (tmp_path / "job.log").read_text()
    assert proc.returncode == 0, proc.stderr
    assert "cache complete" in text and "(full producer log:" in text and "\x1b" not in text


@pytest.mark.slow
def test_once_right_after_a_sigkill_says_the_rank_died(embedded, tmp_path):
    """Issue 41, item 16: the heartbeat is still fresh for 10 s, but the process on this host is gone."""
    from dspark_cache.format.paths import CachePaths
    from tests.support.proc import kill_group, start, wait_for

    out = str(tmp_path / "cache")
    proc = start(
        producer_cmd(
            *produce_args(
                embedded.stock,
                embedded.data,
                out,
                "--seq-length",
                "256",
                "--shard-size",
                "1",
                "--batch-size",
                "1",
                "--writer-threads",
                "2",
            )
        )
    )
    wait_for(lambda: len(CachePaths(out).indexed_shard_ids()) >= 2 or proc.poll() is not None, poll=0.005)
    assert proc.poll() is None, "the producer finished before it could be killed"
    kill_group(proc)
    started = time.monotonic()
    code, text, err = monitor_into_file(tmp_path, out, "--once")
    assert time.monotonic() - started < 10  # within the heartbeat's patience: the process check, not its age
    assert code == 1, text + err
    assert re.search(r"next: rank 0 died \(its process \d+ on this host is gone\)", text), text
    assert "no producer running" in text and "phase STALE" in text
