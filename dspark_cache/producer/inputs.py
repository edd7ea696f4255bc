"""Read input rows from JSONL / JSON / Parquet files, directories of them, or HF dataset ids.

Every row carries its location (``file:line`` or ``file row N``) so that any error names it.
Row indices count every row, valid or not, so sample ids do not depend on the invalid-row
policy: sample id = 0-based index of the row in the input.

Hostile rows are invalid rows like any other, never a crash: a JSONL line longer than
``max_row_bytes`` is skipped without being read into memory, and a row nested deeper than
``MAX_NESTING`` levels (anywhere, used or not) is refused before anything recurses over it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from typing import Any, Iterator

from dspark_cache.producer.messages import InvalidRow

JSON_SUFFIXES = (".jsonl", ".ndjson", ".json")
MAX_ROW_BYTES = 1 << 28  # default --max-row-bytes (256 MiB)
MAX_NESTING = 100  # a chat row needs ~10 levels; tool schemas a few dozen
PARQUET_SUFFIXES = (".parquet",)
_SLICE = re.compile(r"^(\w+)\[(\d*):(\d*)\]$")


class InputError(Exception):
    """The input as a whole is unusable (missing, empty, unreadable)."""


@dataclass(frozen=True)
class RawRow:
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


def _nesting_error(limit: int = MAX_NESTING) -> InvalidRow:
    return InvalidRow("nested too deeply", f"the row nests lists/objects more than {limit} levels deep")


def _checked(index: int, where: str, value: Any) -> RawRow:
    if isinstance(value, (dict, list)) and _too_deep(value):
        return RawRow(index, where, error=_nesting_error())
    return RawRow(index, where, value)


def _looks_like_hub_id(path: str) -> bool:
    return "/" in path and not os.path.exists(path) and all(path.split("/"))


def _data_files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    if os.path.isdir(path):
        files = sorted(
            os.path.join(path, n) for n in os.listdir(path) if n.endswith(JSON_SUFFIXES + PARQUET_SUFFIXES)
        )
        if not files:
            raise InputError(
                f"input directory {path} holds no data files (*.jsonl, *.json, *.parquet); "
                "point --input-data at a file or a directory of them"
            )
        return files
    raise InputError(f"input file {path} does not exist; check --input-data")


def _split_slice(split: str | None) -> tuple[str, slice | None]:
    if not split:
        return "train", None
    m = _SLICE.match(split)
    if not m:
        return split, None
    a, b = (int(x) if x else None for x in m.group(2, 3))
    return m.group(1), slice(a, b)


class InputSource:
    """The rows of ``--input-data`` in a fixed order, with a content hash for the manifest."""

    def __init__(self, path: str, split: str | None = None, shuffle_seed: int | None = 42,
                 max_row_bytes: int = MAX_ROW_BYTES) -> None:
        self.path = str(path)
        self.max_row_bytes = max_row_bytes
        self.split = split
        self.shuffle_seed = shuffle_seed
        self.is_hub = _looks_like_hub_id(self.path)
        self.files = [] if self.is_hub else _data_files(self.path)

    def content_sha256(self) -> str:
        """Hash of the input bytes (or of the hub dataset's fingerprint and split)."""
        digest = hashlib.sha256()
        if self.is_hub:
            digest.update(f"{self.path}|{self.split}|{self.shuffle_seed}".encode())
            return digest.hexdigest()
        for file in self.files:
            digest.update(os.path.basename(file).encode() + b"\0")
            with open(file, "rb") as handle:
                while chunk := handle.read(1 << 22):
                    digest.update(chunk)
        return digest.hexdigest()

    def rows(self) -> Iterator[RawRow]:
        counter = iter(range(1 << 62))
        if self.is_hub:
            yield from self._hf_rows(counter, None)
            return
        parquet = [f for f in self.files if f.endswith(PARQUET_SUFFIXES)]
        for file in self.files:
            if file.endswith((".jsonl", ".ndjson")):
                yield from self._jsonl_rows(file, counter)
            elif file.endswith(".json"):
                yield from self._json_rows(file, counter)
        if parquet:
            yield from self._hf_rows(counter, parquet)

    def _read_line(self, handle) -> bytes | int:
        """The next line, or the size of a line over ``max_row_bytes`` (skipped unread); b"" at the end."""
        limit = self.max_row_bytes
        raw = handle.readline(limit + 1)
        if len(raw) <= limit or raw.endswith(b"\n"):
            return raw
        size = len(raw)
        del raw
        while chunk := handle.readline(1 << 20):
            size += len(chunk)
            if chunk.endswith(b"\n"):
                break
        return size

    def _jsonl_rows(self, file: str, counter: Iterator[int]) -> Iterator[RawRow]:
        # Nothing of a line but its parsed value stays referenced while the row is processed.
        with open(file, "rb") as handle:
            line_no = 0
            while (raw := self._read_line(handle)) != b"":
                line_no += 1
                where = f"{file}:{line_no}"
                if isinstance(raw, int):
                    yield RawRow(next(counter), where, error=InvalidRow(
                        "row too long", f"the row is {raw} bytes, over --max-row-bytes {self.max_row_bytes}"))
                    continue
                if not raw.strip():
                    continue
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    yield RawRow(next(counter), where, error=InvalidRow("invalid UTF-8", f"invalid UTF-8 ({exc.reason} at byte {exc.start})"))
                    continue
                finally:
                    del raw
                try:
                    value = json.loads(text)
                except json.JSONDecodeError as exc:
                    yield RawRow(next(counter), where, error=InvalidRow("malformed JSON", f"malformed JSON ({exc.msg} at column {exc.colno})"))
                    continue
                except RecursionError:
                    yield RawRow(next(counter), where, error=_nesting_error())
                    continue
                finally:
                    del text
                row = _checked(next(counter), where, value)
                del value
                yield row

    def _json_rows(self, file: str, counter: Iterator[int]) -> Iterator[RawRow]:
        try:
            with open(file, encoding="utf-8") as handle:
                data = json.load(handle)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InputError(f"{file}: not a valid JSON document ({exc}); use JSONL for one row per line") from exc
        except RecursionError:
            raise InputError(f"{file}: a JSON document nested too deeply to read; use JSONL (one row per line), "
                             "where such a row is reported and can be skipped") from None
        rows = data if isinstance(data, list) else [data]
        for i, value in enumerate(rows):
            yield _checked(next(counter), f"{file} row {i}", value)

    def _hf_rows(self, counter: Iterator[int], parquet: list[str] | None) -> Iterator[RawRow]:
        """Parquet files and hub ids go through ``datasets``: shuffle the base split, then slice."""
        try:
            import datasets
        except ImportError as exc:  # pragma: no cover - datasets is a dependency
            raise InputError("reading Parquet or hub datasets needs the 'datasets' package") from exc
        base, cut = _split_slice(self.split)
        try:
            if parquet:
                ds = datasets.load_dataset("parquet", data_files=parquet, split="train")
            else:
                ds = datasets.load_dataset(self.path, split=base)
        except Exception as exc:
            raise InputError(f"cannot load dataset {self.path!r} (split {base!r}): {exc}") from exc
        if self.shuffle_seed is not None:
            ds = ds.shuffle(seed=self.shuffle_seed)
        positions = range(len(ds))[cut] if cut else range(len(ds))
        name = ", ".join(parquet) if parquet else f"{self.path}[{base}]"
        for pos in positions:
            yield _checked(next(counter), f"{name} row {pos}", ds[pos])
