"""Read input rows from JSONL / JSON / Parquet files, directories of them, ``save_to_disk``
directories, or HF dataset ids: finding what ``--input-data`` is, and :class:`InputSource`, which
yields its selected rows in a fixed order.

Every row carries its location (``file:line`` or ``file row N``) so that any error names it.
Row indices count every row, valid or not, so sample ids do not depend on the invalid-row
policy: sample id = 0-based position of the row in the selected input.

``--split`` means the same for every input (Hugging Face's slice syntax, see ``split``). The
slice is taken after the rows are shuffled with ``--shuffle-seed``. Parquet, ``save_to_disk``
directories and hub ids are always shuffled (as NeMo does); JSON/JSONL files only when ``--split``
is given, because NeMo reads them in file order and sample ids must then match NeMo's. A plain
file has one split, ``train``.

The pieces live in their own modules, importing one way: ``rows`` (RawRow, InvalidRow,
InputError, the nesting check) <- ``split`` (``--split``) and ``jsonl`` (JSONL lines and their
index) <- ``parts`` (a file or dataset read in order or by position) <- this module. Callers
import each name from the module that defines it.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import logging
import os
from typing import Any, Callable, Iterator

import numpy as np

from dspark_cache.producer.hub import HUB_TIMEOUT_S, OFFLINE, HubRefusal, ask_hub, first_line
from dspark_cache.producer.inputs.jsonl import LineIndex
from dspark_cache.producer.inputs.parts import ArrowPart, Handles, JsonlPart, JsonPart, ParquetWhere, Part
from dspark_cache.producer.inputs.rows import InputError, RawRow, check_input_file, open_input
from dspark_cache.producer.inputs.split import SplitSpec, check_split_name, parse_split

log = logging.getLogger(__name__)

JSON_SUFFIXES = (".jsonl", ".ndjson", ".json")
MAX_ROW_BYTES = 1 << 28  # default --max-row-bytes (256 MiB)
PARQUET_SUFFIXES = (".parquet",)
_BLOCK = 1 << 14  # selected positions resolved to their file per numpy call


# --- what --input-data is --------------------------------------------------------------------

def _looks_like_hub_id(path: str) -> bool:
    return "/" in path and not os.path.exists(path) and all(path.split("/"))


def _is_saved_dataset(path: str) -> bool:
    """A ``save_to_disk`` directory: a DatasetDict (dataset_dict.json) or a Dataset (state + info)."""
    has = lambda name: os.path.isfile(os.path.join(path, name))  # noqa: E731
    return os.path.isdir(path) and (
        has("dataset_dict.json") or (has("state.json") and has("dataset_info.json"))
    )


def _read_json(file: str) -> Any:
    try:
        with io.TextIOWrapper(open_input(file), encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(
            f"{file}: unreadable ({exc}); is this a complete datasets.save_to_disk directory?"
        ) from exc


def _saved_split(path: str, split: str | None, spec: SplitSpec | None) -> tuple[str, bool]:
    """The split to read of a ``save_to_disk`` directory and whether it is a DatasetDict."""
    dict_file = os.path.join(path, "dataset_dict.json")
    if os.path.isfile(dict_file):
        names = [str(n) for n in _read_json(dict_file).get("splits", [])]
        if spec is None and "train" not in names:
            raise InputError(f"{path} has no 'train' split (it has {', '.join(map(repr, names))}); "
                             f"choose one with --split, e.g. --split {names[0] if names else 'train'}")
        check_split_name(split, spec, names, f"the DatasetDict {path}")
        return spec.name if spec else "train", True
    own = _read_json(os.path.join(path, "state.json")).get("_split")
    names = ["train"] + ([str(own)] if own and str(own) != "train" else [])
    check_split_name(split, spec, names, f"the Dataset {path}")
    return spec.name if spec else "train", False


def _saved_files(path: str) -> list[str]:
    """A ``save_to_disk`` directory's data and metadata files, sorted; datasets' ``cache-*`` files
    (written next to the data by map/shuffle) are not the data."""
    found = []
    for root, dirs, names in os.walk(path):
        dirs.sort()
        found += [os.path.join(root, n) for n in sorted(names)
                  if n.endswith((".arrow", ".json")) and not n.startswith("cache-")]
    for file in found:
        check_input_file(file)
    return found


def _data_files(path: str) -> list[str]:
    """The data files of a file or directory input, each checked to be a regular file before any is opened."""
    if os.path.isdir(path):
        files = sorted(
            os.path.join(path, n) for n in os.listdir(path) if n.endswith(JSON_SUFFIXES + PARQUET_SUFFIXES)
        )
        if not files:
            raise InputError(
                f"input directory {path} holds no data files (*.jsonl, *.json, *.parquet) and is not a "
                "datasets.save_to_disk directory; point --input-data at a file or a directory of them"
            )
    else:
        files = [path]
    for file in files:
        check_input_file(file)
    if not path.endswith(JSON_SUFFIXES + PARQUET_SUFFIXES) and not os.path.isdir(path):
        raise InputError(
            f"input file {path} is not a kind of file dspark-produce reads: it reads JSONL (.jsonl, .ndjson: one "
            "JSON object with 'messages' or 'conversations' per line), JSON (.json) and Parquet (.parquet) files, "
            "directories of them, datasets.save_to_disk directories and hub dataset ids; convert the file to one of "
            "these (or rename it if it already is one)"
        )
    return files


# --- the input -------------------------------------------------------------------------------

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
        # checked before datasets maps them
        self.saved_files = _saved_files(self.path) if self.is_saved else []
        if self.files:
            check_split_name(split, self.spec, ["train"], f"{self.path} (plain files have one split)")
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
        files = self.saved_files if self.is_saved else self.files
        for file in files:
            name = os.path.relpath(file, self.path) if self.is_saved else os.path.basename(file)
            digest.update(name.encode() + b"\0")
            with open_input(file) as handle:
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

    def empty_split(self) -> str | None:
        """Why a ``--split`` slice selects no row (it lies past the input's rows), or None. For the
        error message of an input that gave no rows: the rows are counted only then."""
        if self.spec is None or self.spec.whole:
            return None
        total = sum(len(part) for part in self._parts())
        lo, hi = self.spec.bounds(total)
        if hi > lo:
            return None
        return (
            f"--split {self.split!r} selects none of the {total} rows of {self.path}: choose a slice within "
            f"them (e.g. {self.spec.name}[:{max(total // 2, 1)}]) or check --input-data"
        )

    def _selection(self, parts: list[Part]) -> tuple[np.ndarray, np.ndarray]:
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

    def _selected_rows(self, parts: list[Part], keep: Callable[[int], bool] | None) -> Iterator[RawRow]:
        starts, chosen = self._selection(parts)
        handles = Handles()
        try:
            for first in range(0, len(chosen), _BLOCK):
                block = chosen[first:first + _BLOCK]
                owners = np.searchsorted(starts, block, side="right") - 1
                for offset, (pos, owner) in enumerate(zip(block.tolist(), owners.tolist())):
                    if keep is None or keep(first + offset):
                        yield parts[owner].row_at(first + offset, pos - int(starts[owner]), handles)
        finally:
            handles.close()

    def _parts(self) -> list[Part]:
        if self.is_hub:
            where = lambda pos: f"{self.path}[{self.split_name}] row {pos}"  # noqa: E731
            return [ArrowPart(self._dataset(self._load_hub), where)]
        if self.is_saved:
            return [ArrowPart(self._dataset(self._load_saved), self._saved_where)]
        parts: list[Part] = []
        for file in self.files:
            if file.endswith((".jsonl", ".ndjson")):
                parts.append(JsonlPart(file, self.max_row_bytes, self._line_indexes))
            elif file.endswith(".json"):
                parts.append(JsonPart(file))
        parquet = [f for f in self.files if f.endswith(PARQUET_SUFFIXES)]
        if parquet:  # one dataset, after the JSON files: row positions run through the parts in order
            load = lambda hf: hf.load_dataset("parquet", data_files=parquet, split="train")  # noqa: E731
            parts.append(ArrowPart(self._dataset(load), ParquetWhere(parquet)))
        return parts

    def _saved_where(self, pos: int) -> str:
        return (
            f"{self.path}[{self.split_name}] row {pos}" if self.is_dataset_dict else f"{self.path} row {pos}"
        )

    def _load_hub(self, datasets: Any) -> Any:
        """The hub dataset, its revision asked once: unreachable, it is loaded from the local cache or
        refused in one line (datasets alone retries every file it looks up)."""
        try:
            info, why = ask_hub(lambda api: api.dataset_info(self.path, timeout=HUB_TIMEOUT_S))
        except HubRefusal as exc:
            raise InputError(f"--input-data {self.path!r} on {exc}; check the dataset id") from exc
        try:
            loaded = datasets.load_dataset(self.path, split=self.split_name,
                                           revision=None if info is None else info.sha)
        except Exception as exc:
            if info is not None:
                raise
            raise InputError(f"--input-data {self.path!r} is not in the local Hugging Face cache and {why}: "
                             "download it where the hub is reachable (hf download --repo-type dataset "
                             f"{self.path}), or pass a local file or directory ({first_line(exc)})") from exc
        if info is None and why != OFFLINE:
            log.warning("--input-data %s: %s; using its cached copy", self.path, why)
        return loaded

    def _load_saved(self, datasets: Any) -> Any:
        loaded = datasets.load_from_disk(self.path)
        return loaded[self.split_name] if self.is_dataset_dict else loaded

    def _dataset(self, load: Callable[[Any], Any]) -> Any:
        """The input's ``datasets.Dataset`` (memory-mapped; loaded once, kept for later ``rows()``)."""
        if "dataset" not in self._datasets:
            try:
                import datasets
            except ImportError as exc:  # pragma: no cover - datasets is a dependency
                raise InputError(
                    "reading Parquet, save_to_disk or hub datasets needs the 'datasets' package"
                ) from exc
            try:
                loaded = load(datasets)
            except InputError:
                raise
            except Exception as exc:
                raise InputError(f"cannot load dataset {self.path!r} (split {self.split_name!r}): {exc}; "
                                 "check --input-data and --split") from exc
            # A format set before save_to_disk (torch, numpy) would hand rows over as tensors.
            self._datasets["dataset"] = loaded.with_format(None)
        return self._datasets["dataset"]
