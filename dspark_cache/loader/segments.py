"""How one sample's payload maps onto its batch row: a segment table, computed once per length.

Each tensor of the sample's data section becomes a segment of the batch program
(:mod:`.program`): the hidden states are read straight into the batch row (and their final-state
columns copied out, when the final state is stored inside them), token ids and the loss mask
are widened to int64 and checked by the token rule as they are (ids in ``[0, vocab_size)``, mask
values 0 or 1), and alignment fill is read and dropped. Placement depends on the length
alone (``format.sample.place_tensors``, the same rule the writer uses), so the table is cached.

An FP8 sample's scales (stored first) go to their own batch buffers; its float8 rows are either
copied as they are (``out_code=None``: raw batches, scales handed out too) or dequantised into
bf16/float32 rows by the filler as they are read (``out_code`` ``"BF16"``/``"F32"``), the final
state's columns taken from the dequantised rows.

Training may take a subset of the cache's layers, in its own order (``select``: their positions
among the stored ids). The states are stored token-major (each token's row holds every captured
layer, as NeMo's batch wants them), so a subset cannot skip bytes on disk: the rows are read
through scratch, chunk by chunk, and only the chosen layers' columns (plus the final state's) are
written into the batch (picks, :data:`~.records.PICK`). Every stored byte still goes through the
sample's checksum.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np

from dspark_cache.format.geometry import SampleShape
from dspark_cache.format.sample import (
    DTYPE_SIZES, HIDDEN, HIDDEN_SCALE, INPUT_IDS, LAST_HIDDEN, LAST_HIDDEN_SCALE, LOSS_MASK, place_tensors,
)

from dspark_cache.format.validate import MASK_LIMIT
from dspark_cache.loader.records import (
    FP8_KINDS,
    SEG_COPY,
    SEG_COPY_COLS,
    SEG_DEQUANT,
    SEG_PICK,
    SEG_WIDEN_I32,
    SEG_WIDEN_U8,
    SEGMENT,
    SEGMENT_COLUMN,
    PickRecord,
    as_table,
    pick_table,
    segment,
    segment_table,
)

# Batch buffers a segment writes to, by index (the program's first buffers, in this order). The
# scale buffers exist for FP8 caches only (empty otherwise).
BUFFERS = (HIDDEN, LAST_HIDDEN, INPUT_IDS, LOSS_MASK, HIDDEN_SCALE, LAST_HIDDEN_SCALE)
_BUF = {name: i for i, name in enumerate(BUFFERS)}
_SCALE_BYTES = 4  # float32


@dataclass(frozen=True)
class RowTemplate:
    """A sample's segments with offsets relative to its data section and to its batch row."""

    data_size: int  # bytes of the data section (the payload minus its header)
    segs: np.ndarray  # [n] records.SEGMENT

    @property
    def table(self) -> np.ndarray:
        """The segments as ``[n, fields]`` uint64 (a view)."""
        return as_table(self.segs)


# A sample's first segment, completed by place_rows: its header, copied to be checked after the fill
# (buffer 0 until then, so that the row arithmetic below may treat it as any other).
_HEADER_SLOT = as_table(segment_table([segment(SEG_COPY, 0, 0, 0, 0)]))


def place_rows(templates: Sequence[RowTemplate], headers: np.ndarray, rows: np.ndarray, strides: np.ndarray,
               header_buf: int, header_stride: int) -> tuple[np.ndarray, np.ndarray]:
    """A batch's segments, made absolute: for each sample (``templates[i]``, its payload's header
    ``headers[i]`` bytes long, in batch row ``rows[i]``), a segment that copies its header to
    ``header_stride * row`` of buffer ``header_buf``, then its template's segments with payload
    offsets after the header and buffer offsets at its row (``strides[buf] * row`` bytes into each
    buffer). Returns the segments and how many each sample has.

    A fixed number of array operations per batch: a batch program of 4 rows costs 80 us to build
    this way against 140 us sample by sample (BENCHMARKS.md), time a reader thread holds the GIL.
    """
    counts = np.array([len(t.segs) + 1 for t in templates], dtype=np.int64)
    starts = np.cumsum(counts) - counts
    rows = np.asarray(rows, dtype=np.uint64)
    headers = np.asarray(headers, dtype=np.uint64)
    # Each sample's header slot, then its template's segments, as rows of uint64 fields: joining
    # record arrays promotes their dtype in Python pair by pair, and field arithmetic is slower too.
    table = np.concatenate([part for t in templates for part in (_HEADER_SLOT, t.table)])
    kind, src_off, length, buf, off, col_bytes, col_buf, col_dst, scale_buf, scale_off, pick_count = (
        table[:, SEGMENT_COLUMN[name]]
        for name in (
            "kind",
            "src_off",
            "len",
            "buf",
            "off",
            "col_bytes",
            "col_buf",
            "col_dst",
            # views: written in place
            "scale_buf",
            "scale_off",
            "pick_count",
        )
    )
    row_of = np.repeat(rows, counts)
    src_off += np.repeat(headers, counts)
    off += strides[buf] * row_of
    cols = (col_bytes > 0) | (pick_count > 0)
    if cols.any():
        col_dst[cols] += strides[col_buf[cols]] * row_of[cols]
    scaled = kind == SEG_DEQUANT
    if scaled.any():
        scale_off[scaled] += strides[scale_buf[scaled]] * row_of[scaled]
    src_off[starts], length[starts], buf[starts], off[starts] = (
        0,
        headers,
        header_buf,
        rows * np.uint64(header_stride),
    )
    return table.view(SEGMENT).reshape(-1), counts


@dataclass(frozen=True)
class LayerPicks:
    """The picks of a layer subset: one table for a batch program, and where each segment's lie in it."""

    table: np.ndarray  # records.PICK
    states: tuple[int, int]  # (first, count) for the hidden states' segment
    scales: tuple[int, int]  # ... and for raw FP8 scales' (count 0: copied whole)


NO_PICKS = LayerPicks(pick_table([]), (0, 0), (0, 0))


@lru_cache(maxsize=64)
def layer_picks(shape: SampleShape, out_code: str | None, select: tuple[int, ...] | None) -> LayerPicks:
    """The picks that hand out the layers at positions ``select`` of a ``shape`` row (``None``: all, as
    stored: no picks), each followed by the final state's columns when they lie inside the row."""
    if select is None:
        return NO_PICKS
    last = len(shape.layer_ids) - 1
    final = [] if shape.stores_last else [last]

    def picks(unit_in: int, unit_out: int) -> list[PickRecord]:
        """Per layer: ``unit_in`` stored bytes (or codes) in, ``unit_out`` bytes out."""
        out = [
            PickRecord(k * unit_in, unit_in, 0, j * unit_out, len(select) * unit_out)
            for j, k in enumerate(select)
        ]
        return out + [PickRecord(k * unit_in, unit_in, 1, 0, unit_out) for k in final]

    hidden = shape.hidden_size
    out = shape.itemsize if out_code is None else DTYPE_SIZES[out_code]
    states = picks(hidden * (1 if out_code else shape.itemsize), hidden * out)
    # Raw FP8 batches hand their scales out with the states they scale; dequantised ones keep the
    # stored scales whole, in a buffer of their own that the filler reads by stored layer.
    scales = picks(_SCALE_BYTES, _SCALE_BYTES) if shape.fp8 and out_code is None else []
    return LayerPicks(pick_table(states + scales), (0, len(states)), (len(states), len(scales)))


@lru_cache(maxsize=16384)
def row_template(length: int, shape: SampleShape, out_code: str | None = None, *, vocab_size: int,
                 select: tuple[int, ...] | None = None) -> RowTemplate:
    """The segments of a ``length``-token sample of ``shape`` (``shape.stores_last``: the final
    state is its own tensor, else the last ``hidden_size`` columns of the hidden states); its token
    ids must lie in ``[0, vocab_size)`` (the manifest's ``target_vocab_size``, at least 1).

    ``out_code`` (FP8 caches): ``None`` copies the float8 rows and their scales as stored,
    ``"BF16"``/``"F32"`` dequantises the rows into that dtype (the scales are still read first,
    into their buffers, for the filler to use). ``select``: the positions of the layers handed out
    (:func:`layer_picks`), ``None`` for all of them as stored."""
    if out_code is not None and not shape.fp8:
        raise ValueError(f"only FP8 samples are dequantised; this cache stores {shape.dtype}")
    if vocab_size < 1:  # a segment's limit 0 would leave the ids unchecked
        raise ValueError(f"vocab_size {vocab_size} is not a vocabulary size")
    rows = []
    picks = layer_picks(shape, out_code, select)
    placed = place_tensors(shape.specs(length))
    for name, start, end in placed:
        size = end - start
        if name == HIDDEN and picks.states[1]:
            rows.append(_picked_states_segment(start, size, shape, out_code, picks.states))
        elif name == HIDDEN_SCALE and picks.scales[1]:
            rows.append(
                segment(
                    SEG_PICK,
                    start,
                    size,
                    _BUF[HIDDEN_SCALE],
                    0,
                    row_bytes=len(shape.layer_ids) * _SCALE_BYTES,
                    col_buf=_BUF[LAST_HIDDEN_SCALE],
                    pick_first=picks.scales[0],
                    pick_count=picks.scales[1],
                )
            )
        elif name in (HIDDEN, LAST_HIDDEN):
            rows.append(_states_segment(name, start, size, shape, out_code))
        elif name in (HIDDEN_SCALE, LAST_HIDDEN_SCALE):
            rows.append(_scales_segment(name, start, size, shape, out_code))
        elif name == INPUT_IDS:
            rows.append(segment(SEG_WIDEN_I32, start, size, _BUF[name], 0, limit=vocab_size))
        elif name == LOSS_MASK:
            rows.append(segment(SEG_WIDEN_U8, start, size, _BUF[name], 0, limit=MASK_LIMIT))
        # alignment fill (__padN__) is read and dropped
    segs = segment_table(rows)
    segs = segs[segs["len"] > 0]  # a zero-token sample has empty tensors: nothing to read
    segs.setflags(write=False)
    return RowTemplate(placed[-1][2] if placed else 0, segs)


def _states_segment(
    name: str, start: int, size: int, shape: SampleShape, out_code: str | None
) -> tuple[int, ...]:
    """Hidden or final states into their buffer: copied, or dequantised (``out_code``); the final
    state's columns copied out of the hidden rows when it is stored inside them."""
    width = shape.hidden_dim if name == HIDDEN else shape.hidden_size
    out = shape.itemsize if out_code is None else DTYPE_SIZES[out_code]
    cols: dict[str, int] = {}
    if name == HIDDEN and not shape.stores_last:  # the final state is the last hidden_size columns
        cols = dict(col_off=(width - shape.hidden_size) * out, col_bytes=shape.hidden_size * out,
                    col_buf=_BUF[LAST_HIDDEN])
    if out_code is not None:
        scale = HIDDEN_SCALE if name == HIDDEN else LAST_HIDDEN_SCALE
        return segment(SEG_DEQUANT, start, size, _BUF[name], 0, row_bytes=width, scale_buf=_BUF[scale],
                       group=shape.hidden_size, out_size=out, fp8_kind=FP8_KINDS[shape.dtype], **cols)
    if cols:
        return segment(SEG_COPY_COLS, start, size, _BUF[name], 0, row_bytes=width * out, **cols)
    return segment(SEG_COPY, start, size, _BUF[name], 0)


def _picked_states_segment(start: int, size: int, shape: SampleShape, out_code: str | None,
                           picks: tuple[int, int]) -> tuple[int, ...]:
    """The hidden states through picks: copied (``SEG_PICK``) or dequantised per picked layer."""
    first, count = picks
    if out_code is not None:
        return segment(
            SEG_DEQUANT,
            start,
            size,
            _BUF[HIDDEN],
            0,
            row_bytes=shape.hidden_dim,
            scale_buf=_BUF[HIDDEN_SCALE],
            group=shape.hidden_size,
            out_size=DTYPE_SIZES[out_code],
            fp8_kind=FP8_KINDS[shape.dtype],
            col_buf=_BUF[LAST_HIDDEN],
            pick_first=first,
            pick_count=count,
        )
    return segment(SEG_PICK, start, size, _BUF[HIDDEN], 0, row_bytes=shape.hidden_dim * shape.itemsize,
                   col_buf=_BUF[LAST_HIDDEN], pick_first=first, pick_count=count)


def _scales_segment(
    name: str, start: int, size: int, shape: SampleShape, out_code: str | None
) -> tuple[int, ...]:
    """FP8 scales into their buffer; handed out raw with the final state's scale (the last
    layer's) copied out of the hidden ones when that state is stored inside the hidden rows."""
    if name == HIDDEN_SCALE and out_code is None and not shape.stores_last:
        layers = len(shape.layer_ids)
        return segment(
            SEG_COPY_COLS,
            start,
            size,
            _BUF[HIDDEN_SCALE],
            0,
            row_bytes=layers * _SCALE_BYTES,
            col_off=(layers - 1) * _SCALE_BYTES,
            col_bytes=_SCALE_BYTES,
            col_buf=_BUF[LAST_HIDDEN_SCALE],
        )
    return segment(SEG_COPY, start, size, _BUF[name], 0)
