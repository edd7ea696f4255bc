"""One encoding rank's share of the input, tokenised into a part of the saved plan.

Row ``i`` of the input belongs to part ``i % num_parts``: with ``torchrun`` every rank encodes
its own rows (with its own worker processes) and writes them as it goes (token ids, loss masks,
a row table), so memory does not grow with the input and no row is encoded twice. Invalid rows
are recorded, not raised: the ``--on-invalid`` policy is applied to the whole input at once
(:func:`dspark_cache.producer.plan.store.check_invalid_rows`), so one run reports them all.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from typing import Iterable

import numpy as np

from dspark_cache.format.errors import CacheError
from dspark_cache.format.paths import CachePaths
from dspark_cache.format.plan import (
    LOSS_MASK,
    PART_ROW,
    TOKEN_ID,
    ArrayRecord,
    ArrayWriter,
    InvalidRowNote,
    PartHeader,
    token_problem,
    write_header,
)
from dspark_cache.format.schema import SkippedRow
from dspark_cache.producer.encode.chat import EncodedRow
from dspark_cache.producer.encode.template import TOO_SLOW
from dspark_cache.producer.inputs.rows import InvalidRow, RawRow
from dspark_cache.storage.output import CacheOutput

log = logging.getLogger(__name__)

NO_SUPERVISED_TOKEN = "no supervised token"
OUTSIDE_VOCABULARY = "token outside the target's vocabulary"
NOTES_PER_PART = 20  # invalid rows described in full per part (all are counted and listed by reason)
_FLUSH_ROWS = 4096  # row records buffered before they are appended to the row table


class PartWriter:
    """Streams encoded rows into part ``part``'s arrays; :meth:`close` publishes its header."""

    def __init__(
        self, paths: CachePaths, part: int, num_parts: int, encode_key: str, vocab_size: int
    ) -> None:
        os.makedirs(paths.plan_dir, exist_ok=True)
        self.paths, self.part, self.num_parts, self.encode_key = paths, part, num_parts, encode_key
        self.vocab_size = vocab_size
        # This part's arrays are about to be replaced: an earlier header of it must not outlive them.
        CacheOutput(paths.root).remove([paths.plan_part_header(part)])
        self.ids = ArrayWriter(paths.plan_part(part, "ids"), TOKEN_ID)
        try:
            self.mask = ArrayWriter(paths.plan_part(part, "mask"), LOSS_MASK)
            try:
                self.table = ArrayWriter(paths.plan_part(part, "rows"), PART_ROW)
            except BaseException:
                self.mask.abandon()
                raise
        except BaseException:
            self.ids.abandon()
            raise
        self._pending: list[tuple[int, int, int, int]] = []
        self.rows = 0
        self.skipped: list[SkippedRow] = []
        self.invalid: list[InvalidRowNote] = []

    def add(self, row: RawRow, result: EncodedRow | InvalidRow) -> None:
        """One input row of this part: a sample, or a skipped row and why."""
        self.rows += 1
        if isinstance(result, InvalidRow):
            self._invalid(row, result)
            return
        loss_tokens = int(result.loss_mask.sum())
        if loss_tokens == 0:
            self.skipped.append(SkippedRow(row=row.index, reason=NO_SUPERVISED_TOKEN, where=row.where))
            return
        problem = token_problem(result.input_ids, result.loss_mask, self.vocab_size)
        if problem:  # a tokenizer larger than the target's embedding (some real checkpoints ship one)
            self._invalid(row, InvalidRow(OUTSIDE_VOCABULARY, f"{problem}; use the target's own tokenizer"))
            return
        self._pending.append((row.index, self.ids.length, len(result.input_ids), loss_tokens))
        self.ids.append(result.input_ids)
        self.mask.append(result.loss_mask)
        if len(self._pending) >= _FLUSH_ROWS:
            self._flush()

    def _invalid(self, row: RawRow, why: InvalidRow) -> None:
        self.skipped.append(SkippedRow(row=row.index, reason=why.reason, where=row.where))
        if len(self.invalid) < NOTES_PER_PART:
            self.invalid.append(InvalidRowNote(row.index, row.where, why.detail))

    def _flush(self) -> None:
        if self._pending:
            self.table.append(np.array(self._pending, dtype=PART_ROW))  # tuples in PART_ROW's field order
            self._pending.clear()

    def close(self) -> PartHeader:
        """Finish the arrays, then the header (a header on disk means a whole part)."""
        self._flush()
        arrays: dict[str, ArrayRecord] = {"ids": self.ids.close(), "mask": self.mask.close(),
                                          "rows": self.table.close()}
        header = PartHeader(
            encode_key=self.encode_key,
            part=self.part,
            num_parts=self.num_parts,
            rows=self.rows,
            tokens=arrays["ids"].length,
            arrays=arrays,
            skipped=self.skipped,
            invalid=self.invalid,
        )
        write_header(self.paths.plan_part_header(self.part), header)
        return header

    def abandon(self) -> None:
        for writer in (self.ids, self.mask, self.table):
            writer.abandon()

    def bytes_needed(self, total_rows: int | None) -> tuple[int, str]:
        """What this part takes on disk: so far, or extrapolated to ``total_rows`` rows when known."""
        so_far = self.ids.length * (TOKEN_ID.itemsize + LOSS_MASK.itemsize) + \
            (self.table.length + len(self._pending)) * PART_ROW.itemsize
        basis = (
            f"{TOKEN_ID.itemsize + LOSS_MASK.itemsize} bytes per token and {PART_ROW.itemsize} per sample; "
            f"{self.rows} rows read so far"
        )
        if total_rows and self.rows:
            return max(so_far, so_far * total_rows // self.rows), f"{basis}, of {total_rows}"
        return so_far, basis


class PlanDiskFullError(CacheError):
    """The disk filled while the saved plan was written; nothing half-written is kept or trusted."""


def plan_disk_full(paths: CachePaths, exc: OSError, needed: int, basis: str) -> PlanDiskFullError:
    """The one message for a full disk under ``plan/``: where, how much, what to do."""
    free = shutil.disk_usage(paths.plan_dir if os.path.isdir(paths.plan_dir) else paths.root).free
    return PlanDiskFullError(
        f"disk full while writing the saved plan in {paths.plan_dir} ({exc.strerror}): it needs about "
        f"{needed / 1e6:.1f} MB ({basis}) and {free / 1e6:.1f} MB is free; nothing half-written is kept. "
        "Free space, or point --output-dir at a disk with more room, then rerun the same command"
    )


LOOP_PROBE = 3  # the first rows of a part all past the render deadline: the template loops, stop now


class TemplateLoopsError(CacheError):
    """Every one of a part's first rows took the whole render deadline: the rest would too, row by row."""


def _stop_a_looping_template(firsts: list[tuple[RawRow, EncodedRow | InvalidRow]]) -> None:
    """Raise once the first ``LOOP_PROBE`` rows all ran out of render time (each costs the whole deadline:
    a dataset's worth of them would take days to be reported)."""
    timed_out = [isinstance(result, InvalidRow) and result.reason == TOO_SLOW for _, result in firsts]
    if len(firsts) == LOOP_PROBE and all(timed_out):
        first_row, first = firsts[0]
        raise TemplateLoopsError(
            f"the chat template loops: {LOOP_PROBE} of {LOOP_PROBE} rows took over the render deadline "
            f"(first: {first_row.where}: {first.detail}); fix the template (--chat-template, or the "
            "tokenizer's own), then rerun")


def encode_part(paths: CachePaths, encoded: Iterable[tuple[RawRow, EncodedRow | InvalidRow]], part: int,
                num_parts: int, encode_key: str, on_row=lambda: None, *, vocab_size: int,
                total_rows: int | None = None) -> PartHeader:
    """Write this rank's encoded rows as part ``part`` of ``num_parts``; ``on_row`` after each row.

    ``vocab_size``: the target's embedding rows (a row with another token id is invalid);
    ``total_rows``: this part's rows when known (for the space a full disk would need)."""
    writer = None
    try:
        writer = PartWriter(paths, part, num_parts, encode_key, vocab_size)
        firsts: list[tuple[RawRow, EncodedRow | InvalidRow]] = []
        for row, result in encoded:
            if len(firsts) < LOOP_PROBE:
                firsts.append((row, result))
                _stop_a_looping_template(firsts)
            writer.add(row, result)
            on_row()
        header = writer.close()
    except BaseException as exc:
        if writer is not None:
            writer.abandon()
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            needed = writer.bytes_needed(total_rows) if writer else (0, "no row read yet")
            raise plan_disk_full(paths, exc, *needed) from exc
        raise
    log.info("part %d of %d: %d rows encoded, %d samples, %d tokens", part, num_parts, header.rows,
             header.arrays["rows"].length, header.tokens)
    return header
