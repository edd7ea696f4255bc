"""What reading the input yields: a :class:`RawRow` (a value, or why the row is invalid, and where
it is), :class:`InvalidRow` for a row that cannot become a sample (reading finds the first ones:
malformed JSON, invalid UTF-8, nesting; encoding the rest), :class:`InputError` for an input
unusable as a whole, and the nesting check every row gets.

Hostile rows are invalid rows like any other, never a crash: a row nested deeper than
``MAX_NESTING`` levels (anywhere, used or not) is refused before anything recurses over it.
Input files are opened only through :func:`open_input`: a FIFO or device named as (or inside)
``--input-data`` is refused, never opened in a way that could block or read forever.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from typing import Any, BinaryIO

from dspark_cache.format.files import NotARegularFileError, kind_of, open_regular

MAX_NESTING = 100  # a chat row needs ~10 levels; tool schemas a few dozen


class InvalidRow(ValueError):
    """A row that cannot become a sample; ``reason`` is a short, countable category."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail

    def __reduce__(self) -> tuple[type[InvalidRow], tuple[str, str]]:
        # Rows cross to tokenisation workers: keep both fields on the way.
        return (InvalidRow, (self.reason, self.detail))


class InputError(Exception):
    """The input as a whole is unusable (missing, empty, unreadable, or no such split)."""


def _not_regular(file: str, what: str) -> InputError:
    return InputError(f"input file {file} is {what}; --input-data reads regular files only (a FIFO or device "
                      "would block or never end): copy the data into a file and point --input-data at it")


def check_input_file(file: str) -> None:
    """Refuse an input path that is not a regular file (a symlink to one is fine), before anything opens it."""
    try:
        mode = os.stat(file).st_mode
    except FileNotFoundError:
        raise InputError(
            f"input file {file} does not exist (or is a broken symlink); check --input-data"
        ) from None
    except OSError as exc:
        raise InputError(f"input file {file} cannot be read ({exc.strerror}); check --input-data") from None
    if not stat.S_ISREG(mode):
        raise _not_regular(file, f"{kind_of(mode)}, not a regular file")


def open_input(file: str) -> BinaryIO:
    """``file`` opened for binary reading; it must still be a regular file (it may have been swapped since listed)."""
    try:
        fd = open_regular(file)
    except FileNotFoundError:
        raise InputError(f"input file {file} disappeared while being read; check --input-data") from None
    except NotARegularFileError as exc:
        raise _not_regular(file, exc.reason) from None
    return os.fdopen(fd, "rb")


@dataclass(frozen=True)
class RawRow:
    """One input row: its sample index, its location (``file:line`` or ``file row N``), and either
    its parsed value or the reason it is invalid."""

    index: int
    where: str
    value: Any = None
    error: InvalidRow | None = None


def _too_deep(value: Any, limit: int = MAX_NESTING) -> bool:
    """True when lists/objects nest more than ``limit`` levels (checked without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def nesting_error(limit: int = MAX_NESTING) -> InvalidRow:
    """The invalid-row reason for a row nested more than ``limit`` levels deep."""
    return InvalidRow("nested too deeply", f"the row nests lists/objects more than {limit} levels deep")


def checked_row(index: int, where: str, value: Any) -> RawRow:
    """``value`` as a row, or as an invalid row when it nests too deeply."""
    if isinstance(value, (dict, list)) and _too_deep(value):
        return RawRow(index, where, error=nesting_error())
    return RawRow(index, where, value)
