"""Human-readable numbers and strings for the monitor, safe for whatever a file holds.

Every value shown comes from files anyone may have written: numbers can be negative, infinite,
not a number, or integers far beyond a float. None of that may raise or flood the screen, so
each formatter maps it to a short placeholder instead.
"""

from __future__ import annotations

import math
import time

from textual.content import Content

UNKNOWN = "?"  # not a number, or a time that no calendar shows
INVALID = "—"  # negative where only a count or size makes sense
INFINITE = "∞"
MAX_DURATION = 1000 * 86400.0  # beyond this a duration is shown as a bound, not a number of days
MAX_INT_DIGITS = 15  # longer integers are shown scaled (a file may hold thousands of digits)


def as_float(n: float | int | None) -> float | None:
    """``n`` as a float, or None when it is missing or not a number; huge integers become inf."""
    if n is None:
        return None
    try:
        value = float(n)
    except (OverflowError, TypeError, ValueError):
        if isinstance(n, int):  # more digits than a float holds
            return math.inf if n > 0 else -math.inf
        return None
    return None if math.isnan(value) else value


def _placeholder(value: float | None) -> str | None:
    """The placeholder for a value no count, size or duration can be; None for a real one."""
    if value is None:
        return UNKNOWN
    if value < 0:
        return INVALID
    return INFINITE if math.isinf(value) else None


def _scaled(n: float | int | None, units: tuple[str, ...], step: float, fmt: str) -> str:
    value = as_float(n)
    placeholder = _placeholder(value)
    if placeholder is not None:
        return placeholder
    for unit in units:
        if value < step or unit == units[-1]:
            break
        value /= step
    if value >= step:
        return f">999{units[-1]}"
    return fmt.format(value, unit)


def human_bytes(n: float | int | None) -> str:
    """Decimal bytes: ``512 B``, ``40.0 MB``; placeholders for what no size can be."""
    value = as_float(n)
    if value is not None and 0 <= value < 1000:
        return f"{value:.0f} B"
    return _scaled(n, ("B", " KB", " MB", " GB", " TB", " PB"), 1000, "{:.1f}{}")


def short_bytes(n: float | int | None) -> str:
    """Decimal bytes without a space or a ``B`` after the prefix, for a narrow column: ``512B``, ``1.1G``."""
    value = as_float(n)
    if value is not None and 0 <= value < 1000:
        return f"{value:.0f}B"
    return _scaled(n, ("B", "K", "M", "G", "T", "P"), 1000, "{:.1f}{}")


def human_count(n: float | int | None) -> str:
    """A count or rate: ``950``, ``20.0k``, ``1.2G``; placeholders for what no count can be."""
    value = as_float(n)
    if value is not None and 0 <= value < 1000:
        return f"{value:.0f}"
    return _scaled(n, ("", "k", "M", "G", "T"), 1000, "{:.1f}{}")


def integer(n: int | None) -> str:
    """An exact integer (a rank, a shard, a layer count), short enough to fit a column."""
    if n is None:
        return UNKNOWN
    if n < 0:
        return INVALID
    if n < 10**MAX_INT_DIGITS:
        return str(n)
    return human_count(n)


def short_count(n: int | None) -> str:
    """A count in at most 6 cells, for a narrow column: exact below 10000, else ``12.3k``, ``1.0M``."""
    return integer(n) if n is None or n < 10**4 else human_count(n)


def human_duration(seconds: float | int | None) -> str:
    """``3m05s``, ``2h10m``, ``4d03h``; capped at 999 days, ``∞`` for never."""
    value = as_float(seconds)
    placeholder = _placeholder(value)
    if placeholder is not None:
        return placeholder
    if value >= MAX_DURATION:
        return ">999d"
    d, rem = divmod(int(value), 86400)
    h, rem = divmod(rem, 3600)
    m, s = divmod(rem, 60)
    if d:
        return f"{d}d{h:02d}h"
    if h:
        return f"{h}h{m:02d}m"
    return f"{m}m{s:02d}s"


def clock_time(timestamp: float | None) -> str:
    """UTC ``HH:MM:SS`` of a Unix time, or ``?`` when it lies outside what the platform can show."""
    value = as_float(timestamp)
    if value is None or value < 0 or math.isinf(value):
        return UNKNOWN
    try:
        return time.strftime("%H:%M:%S", time.gmtime(value))
    except (OverflowError, OSError, ValueError):
        return UNKNOWN


def clip(text: str | None, limit: int) -> str:
    """At most ``limit`` characters on one line (a file may hold megabytes or newlines)."""
    text = (text or "").replace("\n", " ").replace("\r", " ")
    return text if len(text) <= limit else text[: max(0, limit - 1)] + "…"


def markup(template: str, **values: object) -> Content:
    """Textual markup whose ``$name`` placeholders take ``values`` as plain text.

    Strings from files (a model name, a path, an error) may hold brackets or ``$``: spliced
    into markup they would restyle the line or fail to parse, so they never are.
    """
    return Content.from_markup(template, **{k: str(v) for k, v in values.items()})
