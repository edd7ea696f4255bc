"""JSONL at the byte level: reading one line with a size limit, parsing it into a row, and indexing
a file's line offsets with a fast numpy scan.

A line longer than ``max_row_bytes`` is skipped without being read into memory. A shuffled or
sliced JSONL file is never held in memory, only its :class:`LineIndex` (one int64 per row), so
that lines can be read by offset in any order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np

from dspark_cache.producer.inputs.rows import InvalidRow, RawRow, checked_row, nesting_error, open_input

_SCAN_CHUNK = 1 << 23  # bytes per read of the line scan (its temporaries are ~2 bytes per byte)
# Bytes that bytes.strip() removes: a line of only these is blank (not a row).
_TEXT_BYTE = np.ones(256, dtype=np.uint8)
_TEXT_BYTE[list(b" \t\n\r\x0b\x0c")] = 0


def read_line(handle: BinaryIO, limit: int) -> bytes | int:
    """The next line, or the size of a line over ``limit`` (skipped unread); b"" at the end.

    An over-long line of only whitespace comes back as b"\\n", blank like the line scan sees it.
    """
    raw = handle.readline(limit + 1)
    if len(raw) <= limit or raw.endswith(b"\n"):
        return raw
    size, blank = len(raw), raw.isspace()
    del raw
    while chunk := handle.readline(1 << 20):
        size += len(chunk)
        blank = blank and chunk.isspace()
        if chunk.endswith(b"\n"):
            break
    return b"\n" if blank else size


def line_row(box: list, index: int, where: str, limit: int) -> RawRow:
    """Parse one JSONL line into a row. The line comes in a one-item list that is emptied here,
    so that its bytes are freed before the parsed value is built (peak: text + value)."""
    raw = box.pop()
    if isinstance(raw, int):
        return RawRow(index, where, error=InvalidRow(
            "row too long", f"the row is {raw} bytes, over --max-row-bytes {limit}"))
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return RawRow(index, where,
                      error=InvalidRow("invalid UTF-8", f"invalid UTF-8 ({exc.reason} at byte {exc.start})"))
    finally:
        del raw
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return RawRow(index, where,
                      error=InvalidRow("malformed JSON", f"malformed JSON ({exc.msg} at column {exc.colno})"))
    except RecursionError:
        return RawRow(index, where, error=nesting_error())
    finally:
        del text
    return checked_row(index, where, value)


@dataclass(frozen=True)
class LineIndex:
    """Where a JSONL file's rows start: one int64 byte offset per non-blank line."""

    offsets: np.ndarray
    blank_rows: np.ndarray  # for each blank line, the number of rows before it (sorted)

    def line_no(self, row: int) -> int:
        """The 1-based line number of row ``row`` (blank lines hold no row but count as lines)."""
        return row + 1 + int(np.searchsorted(self.blank_rows, row, side="right"))


def scan_lines(file: str) -> LineIndex:
    """Index a JSONL file's lines with numpy (no line is decoded): row offsets and blank lines."""
    offsets, blanks = [], []
    line_start, has_text, base, rows = 0, False, 0, 0
    with open_input(file) as handle:
        while chunk := handle.read(_SCAN_CHUNK):
            data = np.frombuffer(chunk, dtype=np.uint8)
            text = _TEXT_BYTE[data]
            ends = np.flatnonzero(data == 10)
            if len(ends):
                # Each segment runs to and includes its newline; the first continues the last chunk's line.
                flags = np.maximum.reduceat(
                    text[: ends[-1] + 1], np.concatenate(([0], ends[:-1] + 1))
                ).astype(bool)
                flags[0] |= has_text
                starts = np.concatenate(([line_start], base + ends[:-1] + 1)).astype(np.int64)
                offsets.append(starts[flags])
                blanks.append(rows + np.cumsum(flags)[~flags])
                rows += int(flags.sum())
                line_start, has_text = base + int(ends[-1]) + 1, bool(text[ends[-1] + 1:].any())
            else:
                has_text = has_text or bool(text.any())
            base += len(chunk)
    if has_text:  # a last line without a newline
        offsets.append(np.array([line_start], dtype=np.int64))
    empty = np.zeros(0, dtype=np.int64)
    return LineIndex(np.concatenate([empty, *offsets]), np.concatenate([empty, *blanks]).astype(np.int64))
