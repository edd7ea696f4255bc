"""``dspark-monitor`` without a terminal (a job script's log, a pipe) or with ``--once``: one plain report.

A full-screen app writing into a file would never end (no one can press ``q``) and fill the file
with escape codes, so without a terminal the monitor prints what its panels show as plain lines,
from the same widgets (:mod:`dspark_cache.tui.widgets`), and exits with a code a script can test.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from typing import Callable, TextIO

from dspark_cache.cli.conventions import EXIT_ERROR, EXIT_NOT_A_CACHE, EXIT_OK
from dspark_cache.format.schema import RankPhase
from dspark_cache.format.status import HEARTBEAT_EVERY_S
from dspark_cache.tui.display import clip, clock_time
from dspark_cache.tui.fit import Para, fit
from dspark_cache.tui.rates import MIN_SPAN_S
from dspark_cache.tui.scan import CacheScanner
from dspark_cache.tui.snapshot import Snapshot
from dspark_cache.tui.widgets.disk import disk
from dspark_cache.tui.widgets.events import event_lines
from dspark_cache.tui.widgets.header import header
from dspark_cache.tui.widgets.progress import progress
from dspark_cache.tui.widgets.ranks import COLUMNS, ERROR, row
from dspark_cache.tui.widgets.shardmap import shard_counts, shard_map, shard_phases
from dspark_cache.tui.widgets.throughput import rate_labels
from dspark_cache.tui.widgets.warnings import warning_lines

# A live run's rate needs heartbeats over MIN_SPAN_S: a one-shot report waits that long for it, no longer.
MEASURE_S = MIN_SPAN_S + 2 * HEARTBEAT_EVERY_S
RECENT_EVENTS = 8
RECENT_ERRORS = 5
FAILED_PHASES = (RankPhase.FAILED, RankPhase.INCOMPLETE)


def has_terminal() -> bool:
    """Whether the full-screen app can run: keys come in and the screen goes out through a terminal."""
    return all(stream is not None and stream.isatty() for stream in (sys.stdin, sys.stdout))


def measured_snapshot(scanner: CacheScanner, every: float, sleep: Callable[[float], None] = time.sleep,
                      measure: float = MEASURE_S) -> Snapshot:
    """A snapshot; while a rank is running, scanned again every ``every`` s for up to ``measure`` s
    until its rate is measured (a finished or dead cache is reported at once)."""
    snap = scanner.scan()
    deadline = time.monotonic() + measure
    while (snap.tokens_per_s is None and any(r.phase == RankPhase.RUNNING for r in snap.live_ranks)
           and time.monotonic() < deadline):
        sleep(max(0.0, min(every, deadline - time.monotonic())))
        snap = scanner.scan()
    return snap


def lines(snap: Snapshot) -> list[str]:
    """The report: what each panel of the app shows, one section a line (or a few), no width limit."""
    out = [f"dspark-monitor report at {clock_time(snap.now)} UTC"]
    out += _flat(header(snap))
    if snap.warnings:
        out += _flat(warning_lines(snap.warnings))
    if snap.manifest is None:
        return out
    out += ["progress: " + text for text in _flat([progress(snap)])]
    out += ["rates: " + "; ".join(_flat(rate_labels(snap)))]
    out += ["disk: " + "; ".join(_flat(disk(snap)))]
    if snap.manifest.num_shards > 0:
        _, per, counts = shard_map(snap.manifest.num_shards, shard_phases(snap))
        out += ["shards: " + text for text in _flat([shard_counts(counts, per)])]
    out += ["ranks:" if snap.ranks else "ranks: no status file yet"]
    for status, rate in snap.rank_rates():
        cells = row(status, rate, snap)
        shown = [f"{name} {cells[name].plain}" for name in COLUMNS if name != ERROR]
        if status.last_error:
            shown.append(f"last error: {clip(status.last_error, 1000)}")
        out.append("  " + ", ".join(shown))
    recent = snap.events[-RECENT_EVENTS:]
    out += ["events (newest last):" if recent else "events: none yet"] + [
        "  " + t for t in _flat(event_lines(recent))
    ]
    errors = [e for e in snap.events if e.kind == "error"][-RECENT_ERRORS:]
    if errors:
        out += ["errors (newest last):"] + ["  " + t for t in _flat(event_lines(errors))]
    advice = next_step(snap)
    if advice:
        out.append(f"next: {advice}")
    return out


def _flat(paras: Iterable[Para]) -> list[str]:
    return fit(paras, None).plain.splitlines()


def broken_ranks(snap: Snapshot) -> list[str]:
    """Why the run needs attention: ranks that failed, or claim to work but have fallen silent."""
    out = []
    for status in snap.ranks:
        if status.phase in FAILED_PHASES:
            out.append(f"rank {status.rank} {clip(status.phase, 16)}")
        elif snap.is_dead(status):
            out.append(f"rank {status.rank} died (its process {status.pid} on this host is gone)")
        elif snap.is_stale(status):
            out.append(f"rank {status.rank} silent (STALE heartbeat)")
    return out


def next_step(snap: Snapshot) -> str | None:
    """What to do now, for a cache that is not complete and has no live producer or a broken rank."""
    if snap.manifest is None or snap.complete:
        return None
    broken = broken_ranks(snap)
    if broken:
        return (f"{', '.join(broken)}: once no rank runs, rerun the same dspark-produce command to resume "
                "(published shards are kept)")
    if not snap.live_ranks:
        return "no producer is running: rerun the same dspark-produce command to resume"
    return None


def exit_code(snap: Snapshot) -> int:
    """0 for a complete or healthy cache (or none yet), 1 when a rank failed or fell silent before the
    cache completed, 2 when the directory is not a cache the monitor can show."""
    if snap.manifest_error is not None:
        return EXIT_NOT_A_CACHE
    if not snap.complete and broken_ranks(snap):
        return EXIT_ERROR
    return EXIT_OK


def print_report(
    path: str, every: float, out: TextIO | None = None, scanner: CacheScanner | None = None
) -> int:
    """Print one report of the cache at ``path`` (or of what ``scanner`` scans: a cache on object
    storage) and return the exit code (see :func:`exit_code`)."""
    scanner = scanner or CacheScanner(path)
    # A remote rank's heartbeats arrive a refresh apart: two of them must span MIN_SPAN_S.
    measure = MIN_SPAN_S + 2 * every if scanner.remote else MEASURE_S
    snap = measured_snapshot(scanner, every, measure=measure)
    print("\n".join(lines(snap)), file=out or sys.stdout, flush=True)
    return exit_code(snap)
