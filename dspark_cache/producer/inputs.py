"""Read input rows from JSONL / JSON / Parquet files, directories of them, ``save_to_disk``
directories, or HF dataset ids.

Every row carries its location (``file:line`` or ``file row N``) so that any error names it.
Row indices count every row, valid or not, so sample ids do not depend on the invalid-row
policy: sample id = 0-based position of the row in the selected input.

``--split`` means the same for every input (Hugging Face's slice syntax): ``name``,
``name[a:b]`` (negative bounds count from the end), ``name[a%:b%]``. The slice is taken after
the rows are shuffled with ``--shuffle-seed``. Parquet, ``save_to_disk`` directories and hub ids
are always shuffled (as NeMo does); JSON/JSONL files only when ``--split`` is given, because
NeMo reads them in file order and sample ids must then match NeMo's. A plain file has one split,
``train``.

Hostile rows are invalid rows like any other, never a crash: a JSONL line longer than
``max_row_bytes`` is skipped without being read into memory, and a row nested deeper than
``MAX_NESTING`` levels (anywhere, used or not) is refused before anything recurses over it.
A shuffled or sliced JSONL file is never held in memory, only two int64 per row (its byte
offset, found by a fast scan, and the permutation); lines are read by offset in the selected order.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import re
from bisect import bisect_right
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Iterator

import numpy as np

from dspark_cache.producer.messages import InvalidRow

log = logging.getLogger(__name__)

JSON_SUFFIXES = (".jsonl", ".ndjson", ".json")
MAX_ROW_BYTES = 1 << 28  # default --max-row-bytes (256 MiB)
MAX_NESTING = 100  # a chat row needs ~10 levels; tool schemas a few dozen
PARQUET_SUFFIXES = (".parquet",)
SPLIT_FORMS = ("NAME, NAME[a:b] (rows; either bound may be left out, negative counts from the end) "
               "or NAME[a%:b%] (percent), e.g. 'train', 'train[:1000]', 'train[-500:]', 'train[10%:20%]'")
_SPLIT = re.compile(r"^(?P<name>\w+)(?:\[(?:(?P<a>-?\d+)(?P<ap>%)?)?:(?:(?P<b>-?\d+)(?P<bp>%)?)?\])?$")
_SCAN_CHUNK = 1 << 23  # bytes per read of the line scan (its temporaries are ~2 bytes per byte)
_BLOCK = 1 << 14  # selected positions resolved to their file per numpy call
_MAX_OPEN = 64  # JSONL files kept open while rows are read out of order
# Bytes that bytes.strip() removes: a line of only these is blank (not a row).
_TEXT_BYTE = np.ones(256, dtype=np.uint8)
_TEXT_BYTE[list(b" \t\n\r\x0b\x0c")] = 0


class InputError(Exception):
    """The input as a whole is unusable (missing, empty, unreadable, or no such split)."""


@dataclass(frozen=True)
class RawRow:
    index: int
    where: str
    value: Any = None
    error: InvalidRow | None = None


# --- --split ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class SplitSpec:
    """A parsed ``--split``: a split's name and an optional slice of it (taken after the shuffle)."""

    name: str
    start: int | None = None
    stop: int | None = None
    percent: bool = False

    @property
    def whole(self) -> bool:
        """True when the split is selected entirely (no slice)."""
        return self.start is None and self.stop is None

    def bounds(self, n: int) -> tuple[int, int]:
        """The ``[start, stop)`` positions this selects of ``n`` rows, as ``datasets`` computes them."""
        return self._bound(self.start, 0, n), self._bound(self.stop, n, n)

    def _bound(self, value: int | None, default: int, n: int) -> int:
        if value is None:
            return default
        if self.percent:
            value = int(round(value * n / 100))  # datasets' default "closest" rounding
        if value < 0:
            value = max(n + value, 0)
        return min(value, n)


def parse_split(split: str | None) -> SplitSpec | None:
    """``--split`` as a :class:`SplitSpec` (None when not given); :class:`InputError` when malformed."""
    if split is None:
        return None
    m = _SPLIT.match(split)
    if not m:
        one = re.match(r"^(\w+)\[(-?\d+)\]$", split)  # HF has no single-row form; say how to write it
        stop = int(one[2]) + 1 if one else 0
        hint = f"; for that one row pass '{one[1]}[{one[2]}:{stop or ''}]'" if one else ""
        raise InputError(f"--split {split!r} is not a split{hint}; pass {SPLIT_FORMS}")
    a, b, a_pct, b_pct = m.group("a", "b", "ap", "bp")
    percent = bool(a_pct or b_pct)
    if percent and ((a is not None and not a_pct) or (b is not None and not b_pct)):
        raise InputError(f"--split {split!r} mixes a percentage and a row count; write both bounds the "
                         f"same way, e.g. '{m['name']}[10%:20%]' or '{m['name']}[100:200]'")
    start, stop = (int(x) if x is not None else None for x in (a, b))
    if percent and any(abs(v) > 100 for v in (start, stop) if v is not None):
        raise InputError(f"--split {split!r}: a percentage bound lies between -100% and 100%")
    return SplitSpec(m["name"], start, stop, percent)


def _check_split_name(split: str | None, spec: SplitSpec | None, names: list[str], what: str) -> None:
    if spec is not None and spec.name not in names:
        have = ", ".join(repr(n) for n in names)
        instead = names[0] + split[len(spec.name):] if split else names[0]  # the same slice of a split it has
        raise InputError(f"--split {split!r}: {what} has no split {spec.name!r} (it has {have}); "
                         f"pass one of those, e.g. --split '{instead}'")


# --- rows ------------------------------------------------------------------------------------

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


def _read_line(handle: BinaryIO, limit: int) -> bytes | int:
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


def _line_row(box: list, index: int, where: str, limit: int) -> RawRow:
    """Parse one JSONL line into a row. The line comes in a one-item list that is emptied here,
    so that its bytes are freed before the parsed value is built (peak: text + value)."""
    raw = box.pop()
    if isinstance(raw, int):
        return RawRow(index, where, error=InvalidRow(
            "row too long", f"the row is {raw} bytes, over --max-row-bytes {limit}"))
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return RawRow(index, where, error=InvalidRow("invalid UTF-8", f"invalid UTF-8 ({exc.reason} at byte {exc.start})"))
    finally:
        del raw
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return RawRow(index, where, error=InvalidRow("malformed JSON", f"malformed JSON ({exc.msg} at column {exc.colno})"))
    except RecursionError:
        return RawRow(index, where, error=_nesting_error())
    finally:
        del text
    return _checked(index, where, value)


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
    with open(file, "rb") as handle:
        while chunk := handle.read(_SCAN_CHUNK):
            data = np.frombuffer(chunk, dtype=np.uint8)
            text = _TEXT_BYTE[data]
            ends = np.flatnonzero(data == 10)
            if len(ends):
                # Each segment runs to and includes its newline; the first continues the last chunk's line.
                flags = np.maximum.reduceat(text[:ends[-1] + 1], np.concatenate(([0], ends[:-1] + 1))).astype(bool)
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


class _Handles:
    """Binary handles of the JSONL files read out of order, at most ``_MAX_OPEN`` open at once."""

    def __init__(self) -> None:
        self._open: dict[str, BinaryIO] = {}

    def get(self, file: str) -> BinaryIO:
        handle = self._open.pop(file, None)
        if handle is None:
            if len(self._open) >= _MAX_OPEN:
                self._open.pop(next(iter(self._open))).close()  # the least recently used
            handle = open(file, "rb")
        self._open[file] = handle
        return handle

    def close(self) -> None:
        for handle in self._open.values():
            handle.close()
        self._open.clear()


class _Part:
    """One run of consecutive rows of the input (a file, or one dataset), read in order or by position."""

    def __len__(self) -> int:
        raise NotImplementedError

    def row_at(self, index: int, local: int, handles: _Handles) -> RawRow:
        """Row ``local`` of this part (0-based in the part's own order), given sample index ``index``."""
        raise NotImplementedError

    def stream(self, counter: Iterator[int], keep: Callable[[int], bool] | None) -> Iterator[RawRow]:
        """Every row in order, indices drawn from ``counter``; rows ``keep`` rejects are not built."""
        for local in range(len(self)):
            index = next(counter)
            if keep is None or keep(index):
                yield self.row_at(index, local, None)


class _JsonlPart(_Part):
    def __init__(self, file: str, limit: int, indexes: dict[str, LineIndex]) -> None:
        self.file, self.limit, self._indexes = file, limit, indexes

    @property
    def lines(self) -> LineIndex:
        if self.file not in self._indexes:
            self._indexes[self.file] = scan_lines(self.file)
            log.debug("indexed %d rows of %s", len(self._indexes[self.file].offsets), self.file)
        return self._indexes[self.file]

    def __len__(self) -> int:
        return len(self.lines.offsets)

    def row_at(self, index: int, local: int, handles: _Handles) -> RawRow:
        handle = handles.get(self.file)
        handle.seek(int(self.lines.offsets[local]))
        box = [_read_line(handle, self.limit)]
        return _line_row(box, index, f"{self.file}:{self.lines.line_no(local)}", self.limit)

    def stream(self, counter: Iterator[int], keep: Callable[[int], bool] | None) -> Iterator[RawRow]:
        # Nothing of a line but its parsed value stays referenced while the row is processed;
        # a line whose index ``keep`` rejects is only counted, never decoded.
        with open(self.file, "rb") as handle:
            line_no = 0
            while (raw := _read_line(handle, self.limit)) != b"":
                line_no += 1
                if isinstance(raw, bytes) and raw.isspace():
                    continue
                index = next(counter)
                if keep is not None and not keep(index):
                    continue
                box = [raw]
                del raw
                yield _line_row(box, index, f"{self.file}:{line_no}", self.limit)


class _JsonPart(_Part):
    """A JSON document: a list of rows or one row. It is parsed whole, so it lives for one ``rows()``."""

    def __init__(self, file: str) -> None:
        self.file = file
        self._rows: list | None = None

    def _load(self) -> list:
        if self._rows is None:
            try:
                with open(self.file, encoding="utf-8") as handle:
                    data = json.load(handle)
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise InputError(f"{self.file}: not a valid JSON document ({exc}); use JSONL for one row per line") from exc
            except RecursionError:
                raise InputError(f"{self.file}: a JSON document nested too deeply to read; use JSONL (one row per "
                                 "line), where such a row is reported and can be skipped") from None
            self._rows = data if isinstance(data, list) else [data]
        return self._rows

    def __len__(self) -> int:
        return len(self._load())

    def row_at(self, index: int, local: int, handles: _Handles) -> RawRow:
        return _checked(index, f"{self.file} row {local}", self._load()[local])

    def stream(self, counter: Iterator[int], keep: Callable[[int], bool] | None) -> Iterator[RawRow]:
        yield from super().stream(counter, keep)
        self._rows = None  # read in order, the document is not needed again


class _ArrowPart(_Part):
    """A ``datasets.Dataset`` (Parquet files, a ``save_to_disk`` directory or a hub split)."""

    def __init__(self, dataset: Any, where: Callable[[int], str]) -> None:
        self.dataset, self.where = dataset, where

    def __len__(self) -> int:
        return len(self.dataset)

    def row_at(self, index: int, local: int, handles: _Handles) -> RawRow:
        return _checked(index, self.where(local), self.dataset[local])


class _ParquetWhere:
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


# --- the input -------------------------------------------------------------------------------

def _looks_like_hub_id(path: str) -> bool:
    return "/" in path and not os.path.exists(path) and all(path.split("/"))


def _is_saved_dataset(path: str) -> bool:
    """A ``save_to_disk`` directory: a DatasetDict (dataset_dict.json) or a Dataset (state + info)."""
    has = lambda name: os.path.isfile(os.path.join(path, name))  # noqa: E731
    return os.path.isdir(path) and (has("dataset_dict.json") or (has("state.json") and has("dataset_info.json")))


def _read_json(file: str) -> Any:
    try:
        with open(file, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{file}: unreadable ({exc}); is this a complete datasets.save_to_disk directory?") from exc


def _saved_split(path: str, split: str | None, spec: SplitSpec | None) -> tuple[str, bool]:
    """The split to read of a ``save_to_disk`` directory and whether it is a DatasetDict."""
    dict_file = os.path.join(path, "dataset_dict.json")
    if os.path.isfile(dict_file):
        names = [str(n) for n in _read_json(dict_file).get("splits", [])]
        if spec is None and "train" not in names:
            raise InputError(f"{path} has no 'train' split (it has {', '.join(map(repr, names))}); "
                             f"choose one with --split, e.g. --split {names[0] if names else 'train'}")
        _check_split_name(split, spec, names, f"the DatasetDict {path}")
        return spec.name if spec else "train", True
    own = _read_json(os.path.join(path, "state.json")).get("_split")
    names = ["train"] + ([str(own)] if own and str(own) != "train" else [])
    _check_split_name(split, spec, names, f"the Dataset {path}")
    return spec.name if spec else "train", False


def _saved_files(path: str) -> list[str]:
    """A ``save_to_disk`` directory's data and metadata files, sorted; datasets' ``cache-*`` files
    (written next to the data by map/shuffle) are not the data."""
    found = []
    for root, dirs, names in os.walk(path):
        dirs.sort()
        found += [os.path.join(root, n) for n in sorted(names)
                  if n.endswith((".arrow", ".json")) and not n.startswith("cache-")]
    return found


def _data_files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    if os.path.isdir(path):
        files = sorted(
            os.path.join(path, n) for n in os.listdir(path) if n.endswith(JSON_SUFFIXES + PARQUET_SUFFIXES)
        )
        if not files:
            raise InputError(
                f"input directory {path} holds no data files (*.jsonl, *.json, *.parquet) and is not a "
                "datasets.save_to_disk directory; point --input-data at a file or a directory of them"
            )
        return files
    raise InputError(f"input file {path} does not exist; check --input-data")


class InputSource:
    """The rows of ``--input-data`` in a fixed order, with a content hash for the manifest.

    Raises :class:`InputError` at once for a malformed ``--split`` or a split name a local input
    does not have (a hub id's split names are checked when it loads).
    """

    def __init__(self, path: str, split: str | None = None, shuffle_seed: int | None = 42,
                 max_row_bytes: int = MAX_ROW_BYTES) -> None:
        self.path = str(path)
        self.max_row_bytes = max_row_bytes
        self.split = split
        self.spec = parse_split(split)
        if shuffle_seed is not None and shuffle_seed < 0:
            raise InputError(f"--shuffle-seed {shuffle_seed} is negative; pass a seed >= 0")
        self.shuffle_seed = shuffle_seed
        self.is_hub = _looks_like_hub_id(self.path)
        self.is_saved = not self.is_hub and _is_saved_dataset(self.path)
        self.split_name, self.is_dataset_dict = "train", False
        if self.is_saved:
            self.split_name, self.is_dataset_dict = _saved_split(self.path, split, self.spec)
        elif self.is_hub:
            self.split_name = self.spec.name if self.spec else "train"
        self.files = [] if self.is_hub or self.is_saved else _data_files(self.path)
        if self.files:
            _check_split_name(split, self.spec, ["train"], f"{self.path} (plain files have one split)")
        self._line_indexes: dict[str, LineIndex] = {}
        self._datasets: dict[str, Any] = {}

    @property
    def shuffled(self) -> bool:
        """Whether the rows are shuffled with ``shuffle_seed`` before the split's slice.

        Always for Parquet, ``save_to_disk`` directories and hub ids (as NeMo); for JSON/JSONL
        only when ``--split`` is given (NeMo reads those in file order, ignoring ``--split``).
        """
        if self.shuffle_seed is None:
            return False
        has_arrow = self.is_hub or self.is_saved or any(f.endswith(PARQUET_SUFFIXES) for f in self.files)
        return has_arrow or self.spec is not None

    def content_sha256(self) -> str:
        """Hash of the input bytes (or of the hub dataset's id, split and seed)."""
        digest = hashlib.sha256()
        if self.is_hub:
            digest.update(f"{self.path}|{self.split}|{self.shuffle_seed}".encode())
            return digest.hexdigest()
        files = _saved_files(self.path) if self.is_saved else self.files
        for file in files:
            name = os.path.relpath(file, self.path) if self.is_saved else os.path.basename(file)
            digest.update(name.encode() + b"\0")
            with open(file, "rb") as handle:
                while chunk := handle.read(1 << 22):
                    digest.update(chunk)
        return digest.hexdigest()

    def rows(self, keep: Callable[[int], bool] | None = None) -> Iterator[RawRow]:
        """The selected rows in order; ``keep(index)`` False drops a row unbuilt (a JSONL line is
        only counted, not decoded), so that ranks can each take a share. Indices never change."""
        parts = self._parts()
        if not self.shuffled and (self.spec is None or self.spec.whole):
            counter = itertools.count()
            for part in parts:
                yield from part.stream(counter, keep)
            return
        yield from self._selected_rows(parts, keep)

    def count_hint(self) -> int | None:
        """How many rows ``rows()`` yields (before ``keep``) when that is known without parsing
        rows: Parquet, ``save_to_disk`` and hub inputs, and JSONL read shuffled or sliced (its
        line index is built here and kept for ``rows()``). None for JSON documents, or JSONL read
        in file order."""
        in_order = not self.shuffled and (self.spec is None or self.spec.whole)
        if any(f.endswith(".json") or (in_order and f.endswith((".jsonl", ".ndjson"))) for f in self.files):
            return None
        total = sum(len(part) for part in self._parts())
        lo, hi = self.spec.bounds(total) if self.spec else (0, total)
        return max(hi - lo, 0)

    def _selection(self, parts: list[_Part]) -> tuple[np.ndarray, np.ndarray]:
        """Each part's first global position, and the selected global positions in output order."""
        starts = np.cumsum([0, *(len(p) for p in parts)], dtype=np.int64)
        total = int(starts[-1])
        lo, hi = self.spec.bounds(total) if self.spec else (0, total)
        if not self.shuffled:
            return starts, np.arange(lo, max(hi, lo), dtype=np.int64)
        # The permutation datasets' Dataset.shuffle(seed) draws, so every input kind agrees with it.
        order = np.random.default_rng(self.shuffle_seed).permutation(total)
        log.info("input: %d rows shuffled with seed %d; split %s selects %d", total, self.shuffle_seed,
                 self.split or "(whole)", max(hi - lo, 0))
        return starts, order[lo:hi]

    def _selected_rows(self, parts: list[_Part], keep: Callable[[int], bool] | None) -> Iterator[RawRow]:
        starts, chosen = self._selection(parts)
        handles = _Handles()
        try:
            for first in range(0, len(chosen), _BLOCK):
                block = chosen[first:first + _BLOCK]
                owners = np.searchsorted(starts, block, side="right") - 1
                for offset, (pos, owner) in enumerate(zip(block.tolist(), owners.tolist())):
                    if keep is None or keep(first + offset):
                        yield parts[owner].row_at(first + offset, pos - int(starts[owner]), handles)
        finally:
            handles.close()

    def _parts(self) -> list[_Part]:
        if self.is_hub:
            where = lambda pos: f"{self.path}[{self.split_name}] row {pos}"  # noqa: E731
            return [_ArrowPart(self._dataset(lambda hf: hf.load_dataset(self.path, split=self.split_name)), where)]
        if self.is_saved:
            return [_ArrowPart(self._dataset(self._load_saved), self._saved_where)]
        parts: list[_Part] = []
        for file in self.files:
            if file.endswith((".jsonl", ".ndjson")):
                parts.append(_JsonlPart(file, self.max_row_bytes, self._line_indexes))
            elif file.endswith(".json"):
                parts.append(_JsonPart(file))
        parquet = [f for f in self.files if f.endswith(PARQUET_SUFFIXES)]
        if parquet:  # one dataset after the JSON files, as before
            load = lambda hf: hf.load_dataset("parquet", data_files=parquet, split="train")  # noqa: E731
            parts.append(_ArrowPart(self._dataset(load), _ParquetWhere(parquet)))
        return parts

    def _saved_where(self, pos: int) -> str:
        return f"{self.path}[{self.split_name}] row {pos}" if self.is_dataset_dict else f"{self.path} row {pos}"

    def _load_saved(self, datasets: Any) -> Any:
        loaded = datasets.load_from_disk(self.path)
        return loaded[self.split_name] if self.is_dataset_dict else loaded

    def _dataset(self, load: Callable[[Any], Any]) -> Any:
        """The input's ``datasets.Dataset`` (memory-mapped; loaded once, kept for later ``rows()``)."""
        if "dataset" not in self._datasets:
            try:
                import datasets
            except ImportError as exc:  # pragma: no cover - datasets is a dependency
                raise InputError("reading Parquet, save_to_disk or hub datasets needs the 'datasets' package") from exc
            try:
                loaded = load(datasets)
            except Exception as exc:
                raise InputError(f"cannot load dataset {self.path!r} (split {self.split_name!r}): {exc}; "
                                 "check --input-data and --split") from exc
            # A format set before save_to_disk (torch, numpy) would hand rows over as tensors.
            self._datasets["dataset"] = loaded.with_format(None)
        return self._datasets["dataset"]
