"""The input as runs of consecutive rows ("parts"): a JSONL file, a JSON document, or a
``datasets.Dataset`` (Parquet files, a ``save_to_disk`` directory or a hub split). Each part is
read in order (streamed) or row by row at any position (after a shuffle or slice).
"""

from __future__ import annotations

import io
import itertools
import json
import logging
from bisect import bisect_right
from typing import Any, BinaryIO, Callable, Iterator

from dspark_cache.producer.inputs.jsonl import LineIndex, line_row, read_line, scan_lines
from dspark_cache.producer.inputs.rows import InputError, RawRow, checked_row, open_input

log = logging.getLogger(__name__)

_MAX_OPEN = 64  # JSONL files kept open while rows are read out of order


class Handles:
    """Binary handles of the JSONL files read out of order, at most ``_MAX_OPEN`` open at once."""

    def __init__(self) -> None:
        self._open: dict[str, BinaryIO] = {}

    def get(self, file: str) -> BinaryIO:
        """An open handle of ``file``, closing the least recently used one when too many are open."""
        handle = self._open.pop(file, None)
        if handle is None:
            if len(self._open) >= _MAX_OPEN:
                self._open.pop(next(iter(self._open))).close()  # the least recently used
            handle = open_input(file)
        self._open[file] = handle
        return handle

    def close(self) -> None:
        """Close every handle."""
        for handle in self._open.values():
            handle.close()
        self._open.clear()


class Part:
    """One run of consecutive rows of the input (a file, or one dataset), read in order or by position."""

    def __len__(self) -> int:
        raise NotImplementedError

    def row_at(self, index: int, local: int, handles: Handles) -> RawRow:
        """Row ``local`` of this part (0-based in the part's own order), given sample index ``index``."""
        raise NotImplementedError

    def stream(self, counter: Iterator[int], keep: Callable[[int], bool] | None) -> Iterator[RawRow]:
        """Every row in order, indices drawn from ``counter``; rows ``keep`` rejects are not built."""
        for local in range(len(self)):
            index = next(counter)
            if keep is None or keep(index):
                yield self.row_at(index, local, None)


class JsonlPart(Part):
    """A JSONL file; its line index is built on first use and kept in the shared ``indexes``."""

    def __init__(self, file: str, limit: int, indexes: dict[str, LineIndex]) -> None:
        self.file, self.limit, self._indexes = file, limit, indexes

    @property
    def lines(self) -> LineIndex:
        """The file's line index (scanned once)."""
        if self.file not in self._indexes:
            self._indexes[self.file] = scan_lines(self.file)
            log.debug("indexed %d rows of %s", len(self._indexes[self.file].offsets), self.file)
        return self._indexes[self.file]

    def __len__(self) -> int:
        return len(self.lines.offsets)

    def row_at(self, index: int, local: int, handles: Handles) -> RawRow:
        handle = handles.get(self.file)
        handle.seek(int(self.lines.offsets[local]))
        box = [read_line(handle, self.limit)]
        return line_row(box, index, f"{self.file}:{self.lines.line_no(local)}", self.limit)

    def stream(self, counter: Iterator[int], keep: Callable[[int], bool] | None) -> Iterator[RawRow]:
        # Nothing of a line but its parsed value stays referenced while the row is processed;
        # a line whose index ``keep`` rejects is only counted, never decoded.
        with open_input(self.file) as handle:
            line_no = 0
            while (raw := read_line(handle, self.limit)) != b"":
                line_no += 1
                if isinstance(raw, bytes) and raw.isspace():
                    continue
                index = next(counter)
                if keep is not None and not keep(index):
                    continue
                box = [raw]
                del raw
                yield line_row(box, index, f"{self.file}:{line_no}", self.limit)


class JsonPart(Part):
    """A JSON document: a list of rows or one row. It is parsed whole, so it lives for one ``rows()``."""

    def __init__(self, file: str) -> None:
        self.file = file
        self._rows: list | None = None

    def _load(self) -> list:
        if self._rows is None:
            try:
                with io.TextIOWrapper(open_input(self.file), encoding="utf-8") as handle:
                    data = json.load(handle)
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise InputError(f"{self.file}: not a valid JSON document ({exc}); use JSONL for one row per "
                                 "line") from exc
            except RecursionError:
                raise InputError(
                    f"{self.file}: a JSON document nested too deeply to read; use JSONL (one row per "
                    "line), where such a row is reported and can be skipped"
                ) from None
            self._rows = data if isinstance(data, list) else [data]
        return self._rows

    def __len__(self) -> int:
        return len(self._load())

    def row_at(self, index: int, local: int, handles: Handles) -> RawRow:
        return checked_row(index, f"{self.file} row {local}", self._load()[local])

    def stream(self, counter: Iterator[int], keep: Callable[[int], bool] | None) -> Iterator[RawRow]:
        yield from super().stream(counter, keep)
        self._rows = None  # read in order, the document is not needed again


class ArrowPart(Part):
    """A ``datasets.Dataset`` (Parquet files, a ``save_to_disk`` directory or a hub split)."""

    def __init__(self, dataset: Any, where: Callable[[int], str]) -> None:
        self.dataset, self.where = dataset, where

    def __len__(self) -> int:
        return len(self.dataset)

    def row_at(self, index: int, local: int, handles: Handles) -> RawRow:
        return checked_row(index, self.where(local), self.dataset[local])


class ParquetWhere:
    """``file row N`` for a position in Parquet files loaded as one dataset (row counts from metadata)."""

    def __init__(self, files: list[str]) -> None:
        self.files = files
        self._starts: list[int] | None = None

    def __call__(self, pos: int) -> str:
        if self._starts is None:
            import pyarrow.parquet as pq

            counts = [pq.ParquetFile(f).metadata.num_rows for f in self.files]
            self._starts = [0, *itertools.accumulate(counts)][:-1]
        i = bisect_right(self._starts, pos) - 1
        return f"{self.files[i]} row {pos - self._starts[i]}"
