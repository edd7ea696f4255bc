"""One encoding rank's share of the input, tokenised into a part of the saved plan.

Row ``i`` of the input belongs to part ``i % num_parts``: with ``torchrun`` every rank encodes
its own rows (with its own worker processes) and writes them as it goes (token ids, loss masks,
a row table), so memory does not grow with the input and no row is encoded twice. Invalid rows
are recorded, not raised: the ``--on-invalid`` policy is applied to the whole input at once
(:func:`dspark_cache.producer.plan_store.check_invalid_rows`), so one run reports them all.
"""

from __future__ import annotations

import logging
import os
from typing import Iterable

import numpy as np

from dspark_cache.format.paths import CachePaths
from dspark_cache.format.plan import (
    LOSS_MASK, PART_ROW, TOKEN_ID, ArrayRecord, ArrayWriter, InvalidRowNote, PartHeader, write_header,
)
from dspark_cache.format.schema import SkippedRow
from dspark_cache.producer.chat import EncodedRow
from dspark_cache.producer.inputs import RawRow
from dspark_cache.producer.messages import InvalidRow

log = logging.getLogger(__name__)

NO_SUPERVISED_TOKEN = "no supervised token"
NOTES_PER_PART = 20  # invalid rows described in full per part (all are counted and listed by reason)
_FLUSH_ROWS = 4096  # row records buffered before they are appended to the row table


class PartWriter:
    """Streams encoded rows into part ``part``'s arrays; :meth:`close` publishes its header."""

    def __init__(self, paths: CachePaths, part: int, num_parts: int, encode_key: str) -> None:
        os.makedirs(paths.plan_dir, exist_ok=True)
        self.paths, self.part, self.num_parts, self.encode_key = paths, part, num_parts, encode_key
        self.ids = ArrayWriter(paths.plan_part(part, "ids"), TOKEN_ID)
        self.mask = ArrayWriter(paths.plan_part(part, "mask"), LOSS_MASK)
        self.table = ArrayWriter(paths.plan_part(part, "rows"), PART_ROW)
        self._pending: list[tuple[int, int, int, int]] = []
        self.rows = 0
        self.skipped: list[SkippedRow] = []
        self.invalid: list[InvalidRowNote] = []

    def add(self, row: RawRow, result: EncodedRow | InvalidRow) -> None:
        """One input row of this part: a sample, or a skipped row and why."""
        self.rows += 1
        if isinstance(result, InvalidRow):
            self.skipped.append(SkippedRow(row=row.index, reason=result.reason, where=row.where))
            if len(self.invalid) < NOTES_PER_PART:
                self.invalid.append(InvalidRowNote(row.index, row.where, result.detail))
            return
        loss_tokens = int(result.loss_mask.sum())
        if loss_tokens == 0:
            self.skipped.append(SkippedRow(row=row.index, reason=NO_SUPERVISED_TOKEN, where=row.where))
            return
        self._pending.append((row.index, self.ids.length, len(result.input_ids), loss_tokens))
        self.ids.append(result.input_ids)
        self.mask.append(result.loss_mask)
        if len(self._pending) >= _FLUSH_ROWS:
            self._flush()

    def _flush(self) -> None:
        if self._pending:
            self.table.append(np.array(self._pending, dtype=PART_ROW))  # tuples in PART_ROW's field order
            self._pending.clear()

    def close(self) -> PartHeader:
        """Finish the arrays, then the header (a header on disk means a whole part)."""
        self._flush()
        arrays: dict[str, ArrayRecord] = {"ids": self.ids.close(), "mask": self.mask.close(),
                                          "rows": self.table.close()}
        header = PartHeader(encode_key=self.encode_key, part=self.part, num_parts=self.num_parts, rows=self.rows,
                            tokens=arrays["ids"].length, arrays=arrays, skipped=self.skipped, invalid=self.invalid)
        write_header(self.paths.plan_part_header(self.part), header)
        return header

    def abandon(self) -> None:
        for writer in (self.ids, self.mask, self.table):
            writer.abandon()


def encode_part(paths: CachePaths, encoded: Iterable[tuple[RawRow, EncodedRow | InvalidRow]], part: int,
                num_parts: int, encode_key: str, on_row=lambda: None) -> PartHeader:
    """Write this rank's encoded rows as part ``part`` of ``num_parts``; ``on_row`` after each row."""
    writer = PartWriter(paths, part, num_parts, encode_key)
    try:
        for row, result in encoded:
            writer.add(row, result)
            on_row()
    except BaseException:
        writer.abandon()
        raise
    header = writer.close()
    log.info("part %d of %d: %d rows encoded, %d samples, %d tokens", part, num_parts, header.rows,
             header.arrays["rows"].length, header.tokens)
    return header
