"""What reading the input yields: a :class:`RawRow` (a value, or why the row is invalid, and where
it is), :class:`InputError` for an input unusable as a whole, and the nesting check every row gets.

Hostile rows are invalid rows like any other, never a crash: a row nested deeper than
``MAX_NESTING`` levels (anywhere, used or not) is refused before anything recurses over it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dspark_cache.producer.messages import InvalidRow

MAX_NESTING = 100  # a chat row needs ~10 levels; tool schemas a few dozen


class InputError(Exception):
    """The input as a whole is unusable (missing, empty, unreadable, or no such split)."""


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
