"""Progress: a bar on a terminal (rank 0 only), log lines when piped or with --no-progress, and the
stopped run's summary counted from the published shards."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from dspark_cache.producer.report import progress
from tests.support.produce import write_jsonl
from tests.support import warm

BAR = re.compile(r"\d+%\|")  # tqdm's "42%|": only a drawn bar has it, never a log line


class TerminalStream(io.StringIO):
    """stderr as a terminal would look to the producer (isatty), recording what is drawn."""

    def isatty(self) -> bool:
        return True


@pytest.fixture
def tty(monkeypatch) -> TerminalStream:
    """A terminal to redirect stderr to inside a test (pytest re-installs its own stderr between phases)."""
    monkeypatch.delenv("RANK", raising=False)
    progress.set_progress(None)
    yield TerminalStream()
    progress.set_progress(None)


def _count(total_later: int) -> None:
    with progress.counter("encoding rows", "rows") as rows:
        for _ in range(total_later):
            rows.update()
        rows.total = total_later


def test_counter_draws_a_bar_on_a_terminal(tty, caplog):
    caplog.set_level(logging.INFO, "dspark_cache.progress")
    with contextlib.redirect_stderr(tty):
        _count(40)
    drawn = tty.getvalue()
    assert "encoding rows: 100%|" in drawn and "40/40" in drawn and "rows/s" in drawn, drawn
    assert not [r for r in caplog.records if r.name == "dspark_cache.progress"]  # a bar, not log lines too


def test_counter_logs_instead_when_not_a_terminal(monkeypatch, caplog):
    stream = io.StringIO()  # a pipe or a log file: isatty() is False
    monkeypatch.delenv("RANK", raising=False)
    progress.set_progress(None)
    caplog.set_level(logging.INFO, "dspark_cache.progress")
    with contextlib.redirect_stderr(stream):
        _count(40)
    assert stream.getvalue() == ""
    lines = [r.getMessage() for r in caplog.records if r.name == "dspark_cache.progress"]
    assert lines and lines[-1].startswith("encoding rows: 40/40 rows, "), lines


def test_no_progress_and_other_ranks_draw_no_bar(tty, monkeypatch, caplog):
    caplog.set_level(logging.INFO, "dspark_cache.progress")
    with contextlib.redirect_stderr(tty):
        progress.set_progress(False)  # --no-progress
        _count(5)
        progress.set_progress(None)
        monkeypatch.setenv("RANK", "1")  # torchrun's other ranks log, whatever their stderr is
        _count(6)
    assert tty.getvalue() == ""
    finals = [r.getMessage() for r in caplog.records if r.name == "dspark_cache.progress"]
    assert finals[0].startswith("encoding rows: 5/5 rows") and finals[-1].startswith(
        "encoding rows: 6/6 rows"
    )


def test_log_records_print_above_the_bar(tty):
    handler = logging.StreamHandler(tty)  # what basicConfig installs: the console, i.e. our terminal
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        with contextlib.redirect_stderr(tty), progress.counter("encoding rows", "rows", total=3) as rows:
            rows.update()
            logging.getLogger("dspark_cache.test").warning("a warning while the bar is up")
            rows.update(2)
        assert handler in root.handlers  # given back when the bar ends
    finally:
        root.removeHandler(handler)
    # tqdm.write clears the bar's line first, so the record starts a line of its own and ends it.
    assert re.search(r"(^|[\r\n])a warning while the bar is up\n", tty.getvalue()), repr(tty.getvalue())


def test_compute_bar_shows_tokens_samples_and_shards(tty):
    with contextlib.redirect_stderr(tty):
        log = progress.ProgressLog(total_tokens=9000, total_samples=30)
        log.update(3000, 10, 1, 3)
        log.update(9000, 30, 2, 3)
        log.shards_published(3, 3)  # the last shard lands after the last batch
        log.close()
        log.close()
    drawn = tty.getvalue()
    assert "computing: 100%|" in drawn and "9.00k/9.00k" in drawn, drawn
    assert drawn.rstrip().endswith("30/30 samples, 3/3 shards]"), drawn.splitlines()[-1:]


def test_compute_logs_a_final_line_without_a_bar(caplog):
    progress.set_progress(None)
    caplog.set_level(logging.INFO, "dspark_cache.progress")
    with contextlib.redirect_stderr(io.StringIO()):
        log = progress.ProgressLog(total_tokens=100, total_samples=4, interval=3600.0)
        log.update(50, 2, 0, 2)  # within the interval: no line yet
        log.update(100, 4, 2, 2)
        log.close()
        log.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "dspark_cache.progress"]
    assert len(lines) == 1 and lines[0].startswith("computed 4/4 samples, 100.0% of tokens, 2/2 shards"), (
        lines
    )


# -- the real command, in real processes ----------------------------------------------------------


def _env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    }
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _produce(target: str, data: str, out: str, *extra: str) -> list[str]:
    # --num-workers 0: no tokenising pool, so these runs stay light on a shared machine
    return [sys.executable, "-m", "dspark_cache.producer", "--target-model", target, "--input-data", data,
            "--output-dir", out, "--device", "cpu", "--seq-length", "512", "--num-workers", "0", *extra]


def run_on_terminal(argv: list[str], timeout: float = 600) -> tuple[int, str]:
    """Run ``argv`` with stdout and stderr on a pseudo-terminal; returns the exit code and what it drew."""
    master, slave = os.openpty()
    proc = warm.popen(argv, _env(), stdin=subprocess.DEVNULL, stdout=slave, stderr=slave)
    os.close(slave)
    chunks: list[bytes] = []

    def pump() -> None:  # read while it runs: a full pty buffer would block the producer
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer has closed the terminal
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=timeout)
    finally:
        proc.kill()
        reader.join(timeout=30)
        os.close(master)
    return code, b"".join(chunks).decode("utf-8", errors="replace")


@pytest.fixture(scope="module")
def few_rows(embedded, tmp_path_factory) -> str:
    with open(embedded.data, encoding="utf-8") as handle:
        rows = handle.read().splitlines()[:8]
    return write_jsonl(tmp_path_factory.mktemp("rows") / "few.jsonl", rows)


def test_bars_on_a_terminal(embedded, few_rows, tmp_path):
    code, drawn = run_on_terminal(_produce(embedded.stock, few_rows, str(tmp_path / "out")))
    assert code == 0, drawn
    # planning: a count (of a total, when the planner knows it) and a rate
    assert re.search(r"encoding rows: (8 rows|100%\|[^\r\n]*8/8) \[[^\]]*rows/s\]", drawn), drawn
    assert re.search(r"computing: 100%\|[^\]]*tok/s, 8/8 samples, 1/1 shards\]", drawn), drawn
    assert "cache complete: " in drawn


def test_no_progress_on_a_terminal_logs_instead(embedded, few_rows, tmp_path):
    code, drawn = run_on_terminal(_produce(embedded.stock, few_rows, str(tmp_path / "out"), "--no-progress"))
    assert code == 0, drawn
    assert not BAR.search(drawn), drawn
    assert "INFO dspark_cache.progress: computed " in drawn and "cache complete: " in drawn, drawn


def test_stopped_run_counts_published_shards_and_pipes_no_bar(embedded, tmp_path):
    """SIGTERM after the first shard: exit 3, the summary counts what is on disk, piped stderr has log lines only."""
    from dspark_cache.storage.cache import CacheDir
    from dspark_cache.format.paths import CachePaths

    out = str(tmp_path / "out")
    paths = CachePaths(out)
    argv = _produce(embedded.stock, embedded.data, out, "--shard-size", "2", "--batch-size", "2")
    with open(tmp_path / "stdout", "w+") as stdout, open(tmp_path / "stderr", "w+") as stderr:
        proc = warm.popen(argv, _env(), stdout=stdout, stderr=stderr)
        try:
            deadline = time.monotonic() + 600  # a guard against a hang, not a speed check
            while not paths.indexed_shard_ids() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)  # finish the shard in flight, then stop
            code = proc.wait(timeout=600)
        finally:
            proc.kill()
        stdout.seek(0)
        stderr.seek(0)
        said, logged = stdout.read(), stderr.read()
    assert code == 3, said + logged
    match = re.search(
        r"cache incomplete: (\d+) of (\d+) shards, (\d+) of (\d+) samples, (\d+) of (\d+) tokens", said
    )
    assert match, said
    shards, planned_shards, samples, planned_samples, tokens, planned_tokens = map(int, match.groups())
    with CacheDir(out, allow_incomplete=True) as cache:
        indexes = cache.load_all()
    assert shards == len(indexes) and 0 < shards < planned_shards
    assert samples == sum(i.num_samples for i in indexes) < planned_samples
    assert tokens == sum(e.length for i in indexes for e in i.samples) < planned_tokens
    assert not BAR.search(logged) and "\r" not in logged, logged
    assert "INFO dspark_cache.progress: computed " in logged, logged


def test_a_resumed_run_counts_the_whole_job_at_this_runs_rate(monkeypatch, caplog, tty):
    """Earlier runs' 20 samples in 2 shards count as done; the rate (and so the ETA) is this run's own."""
    clock = [1000.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    progress.set_progress(False)
    caplog.set_level(logging.INFO, "dspark_cache.progress")
    log = progress.ProgressLog(total_tokens=9000, total_samples=30, interval=5.0, done_tokens=6000,
                               done_samples=20, done_shards=2)
    clock[0] += 10.0
    log.update(1500, 5, 0, 1)  # 1500 tokens in 10 s: 150 tokens/s, 1500 left: 10 s
    clock[0] += 10.0
    log.update(3000, 10, 0, 1)
    log.shards_published(1, 1)
    log.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "dspark_cache.progress"]
    assert lines == ["25/30 samples, 83.3% of tokens, 2/3 shards, 150 tokens/s, ETA 0m10s",
                     "30/30 samples, 100.0% of tokens, 2/3 shards, 150 tokens/s, ETA 0m00s",
                     "computed 30/30 samples, 100.0% of tokens, 3/3 shards, 150 tokens/s in 0m20s"], lines
    with contextlib.redirect_stderr(tty):  # the bar starts at the job's done share, its rate this run's
        progress.set_progress(True)
        bar = progress.ProgressLog(total_tokens=9000, total_samples=30, done_tokens=6000, done_samples=20,
                                   done_shards=2)
        bar.update(3000, 10, 1, 1)
        bar.close()
    drawn = tty.getvalue()
    assert "computing: 100%|" in drawn and drawn.rstrip().endswith("30/30 samples, 3/3 shards]"), drawn
    assert "computing:  67%|" in drawn and "6.00k/9.00k" in drawn, drawn  # where the resumed job starts
