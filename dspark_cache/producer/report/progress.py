"""The producer's progress: a live bar on a terminal, periodic log lines everywhere else.

Two users: the planner counts rows and samples with :func:`counter` (total known or not), and
the compute stage reports tokens, samples and shards with :class:`ProgressLog`. Both draw a
`tqdm <https://tqdm.github.io>`_ bar (rate, ETA when the total is known) on stderr when bars
are on, and otherwise log an INFO line at most every :data:`LOG_INTERVAL_S` seconds plus one
at the end, so a job's log file and the monitor's ``--tui`` child (stderr is a log file there)
get lines, never carriage-return bars.

Bars are on when :func:`set_progress` says so (``--no-progress`` sets False), or, by default,
when stderr is a terminal; only rank 0 (env ``RANK``) ever draws one, so torchrun's ranks do not
draw over each other. While a bar is shown, console log records go through ``tqdm.write`` so
they print above the bar instead of breaking it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from typing import Any, ContextManager, Iterator

log = logging.getLogger("dspark_cache.progress")

LOG_INTERVAL_S = 10.0  # without a bar: one line at most this often (a job log, not a flood)
FALLBACK_COLUMNS, FALLBACK_ROWS = 100, 24  # a bar's size on a terminal that reports none
BAR_REFRESH_S = 0.5  # a bar redraws at most this often (a redraw per batch would cost a syscall each)

_enabled: bool | None = None  # None: auto (a bar when stderr is a terminal)


def set_progress(enabled: bool | None) -> None:
    """Bars on (True), off (False, log lines only), or auto (None: a bar when stderr is a terminal)."""
    global _enabled
    _enabled = enabled


def bars_on() -> bool:
    """Whether this process draws bars now: rank 0 only, then the setting, then whether stderr is a TTY."""
    if int(os.environ.get("RANK", "0")) != 0:
        return False
    if _enabled is not None:
        return _enabled
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


def format_duration(seconds: float) -> str:
    """``1h02m`` or ``3m07s``: an ETA to the minute or second, not to the microsecond."""
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def _new_bar(desc: str, unit: str, total: int | None, unit_scale: bool = False, initial: int = 0) -> Any:
    """A tqdm bar on the current stderr; imported here, so ``--help`` and planning without a bar skip it."""
    from tqdm import tqdm

    # A pty with no size (``script``, some CI runners, ssh without a window) reports 0 columns or
    # rows, and tqdm then draws empty lines: follow the terminal's size only when it has one.
    columns, rows = _terminal_size()
    sized = columns > 0 and rows > 0
    # The unit's leading space: "120 rows/s", not tqdm's "120rows/s".
    return tqdm(
        total=total,
        desc=desc,
        unit=f" {unit}",
        unit_scale=unit_scale,
        initial=initial,
        file=sys.stderr,
        dynamic_ncols=sized,
        ncols=None if sized else columns or FALLBACK_COLUMNS,
        nrows=None if sized else rows or FALLBACK_ROWS,
        mininterval=BAR_REFRESH_S,
        leave=True,
        disable=False,
    )


def _terminal_size() -> tuple[int, int]:
    """stderr's terminal size (columns, rows); zeros when it has none."""
    try:
        size = os.get_terminal_size(sys.stderr.fileno())
    except (AttributeError, OSError, ValueError):  # not a real file (a test's stream), or no terminal
        return 0, 0
    return size.columns, size.lines


@contextlib.contextmanager
def _logs_above_bar() -> Iterator[None]:
    """Route the root logger's console handlers through ``tqdm.write`` while a bar is shown."""
    from tqdm.contrib.logging import logging_redirect_tqdm

    with logging_redirect_tqdm():
        yield


class _Throttle:
    """True at most once every ``interval`` seconds: the pace of the log lines that replace a bar."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.started = self._last = time.monotonic()

    def due(self) -> bool:
        now = time.monotonic()
        if now - self._last < self.interval:
            return False
        self._last = now
        return True

    def elapsed(self) -> float:
        return max(time.monotonic() - self.started, 1e-9)


class Counter:
    """A count of ``unit`` things with an optional ``total`` (which may be set later).

    With a bar, each :meth:`update` advances it; without one, an INFO line is logged at most
    every :data:`LOG_INTERVAL_S` seconds and once when the counter closes.
    """

    def __init__(self, desc: str, unit: str, total: int | None = None, bar: Any = None) -> None:
        self.desc, self.unit = desc, unit
        self.n = 0
        self._total = total
        self._bar = bar
        self._clock = _Throttle(LOG_INTERVAL_S)
        self._note = ""

    @property
    def total(self) -> int | None:
        """How many there will be, when known (ETA and percentage need it)."""
        return self._total

    @total.setter
    def total(self, value: int | None) -> None:
        self._total = value
        if self._bar is not None:
            self._bar.total = value
            self._bar.refresh()

    def note(self, text: str) -> None:
        """A few words drawn after the count (the bar's postfix, the log line's tail), e.g. a second rate."""
        self._note = text
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)

    def update(self, n: int = 1) -> None:
        """Count ``n`` more."""
        self.n += n
        if self._bar is not None:
            self._bar.update(n)
        elif self._clock.due():
            log.info("%s", self.line())

    def line(self, final: bool = False) -> str:
        """The log line: count (of total), rate, and the ETA when the total is known (the time taken when final)."""
        rate = self.n / self._clock.elapsed()
        done = f"{self.n}/{self._total}" if self._total is not None else f"{self.n}"
        tail = ""
        if final:
            tail = f" in {format_duration(self._clock.elapsed())}"
        elif self._total is not None and rate > 0:
            tail = f", ETA {format_duration((self._total - self.n) / rate)}"
        note = f", {self._note}" if self._note else ""
        return f"{self.desc}: {done} {self.unit}, {rate:.0f} {self.unit}/s{note}{tail}"

    def close(self) -> None:
        """End the bar (left on screen), or log the final line."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        else:
            log.info("%s", self.line(final=True))


@contextlib.contextmanager
def _counting(desc: str, unit: str, total: int | None) -> Iterator[Counter]:
    if not bars_on():
        c = Counter(desc, unit, total)
        try:
            yield c
        finally:
            c.close()
        return
    c = Counter(desc, unit, total, _new_bar(desc, unit, total))
    try:
        with _logs_above_bar():
            yield c
    finally:
        c.close()


def counter(desc: str, unit: str, total: int | None = None) -> ContextManager[Counter]:
    """Count ``unit`` things under ``desc``: a bar (rate, ETA when ``total`` is known) or log lines.

    ``with counter("tokenising", "rows") as c: ...; c.update(); c.total = n``
    """
    return _counting(desc, unit, total)


class ProgressLog:
    """The compute stage's progress: tokens (with rate and ETA), samples and shards.

    A bar when bars are on; otherwise a log line at most every ``interval`` seconds and one at
    :meth:`close`. ``update`` takes this run's running totals (not increments), as the pipeline
    counts them. What earlier runs published (``done_*``, a resume) is counted as done from the
    start, so the counts and the percentage are the job's; the rate and the ETA are this run's own.
    """

    def __init__(self, total_tokens: int, total_samples: int, interval: float = 10.0, *, done_tokens: int = 0,
                 done_samples: int = 0, done_shards: int = 0) -> None:
        self.total_tokens = max(total_tokens, 1)
        self.total_samples = total_samples
        self.done = (done_tokens, done_samples, done_shards)
        self._clock = _Throttle(interval)
        self._last: tuple[int, int, int, int] = (0, 0, 0, 0)
        self._bar: Any = None
        self._redirect: contextlib.ExitStack | None = None
        self._closed = False
        if bars_on():
            # tqdm leaves its ``initial`` out of the rate: the rate stays this run's.
            self._bar = _new_bar("computing", "tok", self.total_tokens, unit_scale=True, initial=done_tokens)
            self._redirect = contextlib.ExitStack()
            self._redirect.enter_context(_logs_above_bar())

    def update(self, tokens: int, samples: int, shards_done: int, shards_total: int) -> None:
        """This run's tokens and samples computed so far, and its shards published of those it owns."""
        self._last = (tokens, samples, shards_done, shards_total)
        if self._bar is not None:
            self._bar.set_postfix_str(self._postfix(), refresh=False)
            # tqdm counts increments; the pipeline gives totals
            self._bar.update(self.done[0] + tokens - self._bar.n)
        elif self._clock.due():
            log.info("%s", self.line())

    def shards_published(self, shards_done: int, shards_total: int) -> None:
        """A shard landed (the writer thread calls this): counted now, drawn with the next update or close."""
        tokens, samples, _, _ = self._last
        self._last = (tokens, samples, shards_done, shards_total)

    def _counts(self) -> tuple[int, int, int, int]:
        """The job's tokens and samples done, shards published and shards planned, earlier runs' included."""
        tokens, samples, shards_done, shards_total = self._last
        done_tokens, done_samples, done_shards = self.done
        return (
            done_tokens + tokens,
            done_samples + samples,
            done_shards + shards_done,
            done_shards + shards_total,
        )

    def _postfix(self) -> str:
        _, samples, shards_done, shards_total = self._counts()
        return f"{samples}/{self.total_samples} samples, {shards_done}/{shards_total} shards"

    def line(self, final: bool = False) -> str:
        """The log line: samples, share of tokens, shards, this run's rate, ETA (the time taken when final)."""
        tokens, samples, shards_done, shards_total = self._counts()
        elapsed = self._clock.elapsed()
        rate = self._last[0] / elapsed
        if final:
            tail = f" in {format_duration(elapsed)}"
        else:
            tail = f", ETA {format_duration((self.total_tokens - tokens) / rate) if rate else '?'}"
        return (f"{samples}/{self.total_samples} samples, {100 * tokens / self.total_tokens:.1f}% of tokens, "
                f"{shards_done}/{shards_total} shards, {rate:.0f} tokens/s{tail}")

    def close(self) -> None:
        """End the bar (left on screen) and give the log handlers back, or log the final line. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._bar is None:
            log.info("computed %s", self.line(final=True))
            return
        self._bar.set_postfix_str(self._postfix(), refresh=False)  # the last shard lands after the last batch
        self._bar.close()
        if self._redirect is not None:
            self._redirect.close()
