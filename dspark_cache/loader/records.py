"""The records of a batch program, named once for Python and for ``csrc/batch_fill.c``.

A program is three arrays of little-endian uint64 records that the C filler reads as the structs
``op_t``, ``segment_t`` and ``pick_t`` (same fields, same order, 64, 144 and 40 bytes): :data:`OP`,
:data:`SEGMENT` and :data:`PICK` are those layouts as numpy structured dtypes, so Python reads and
writes them by field name (``segs["off"]``), and :class:`OpRecord`, :class:`SegmentRecord` and
:class:`PickRecord` name the fields of one record in the Python filler's loops. :data:`FILL_ABI`
names this layout; the native library reports the one it was built with.

An op is one of (unused fields are 0):

* ``OP_ZERO``: zero ``count`` bytes at ``offset`` of buffer ``target``;
* ``OP_FILL_I64``: write ``value`` (two's complement) into ``count`` int64 slots at ``offset``
  of buffer ``target``;
* ``OP_SAMPLE``: read the ``count``-byte payload at file ``offset`` of descriptor ``target``
  through segments ``seg_first .. seg_first + seg_count``; with ``check`` 1, hash every byte as
  it is read and fail with ``RC_CHECKSUM`` unless the payload's xxh3-64 is ``value``;
* ``OP_SAMPLE_MEM``: the same, the payload being the ``count`` bytes at ``offset`` of buffer ``target``
  (a compressed sample, decoded there by the reader thread).

A segment says where a byte range of the payload goes: ``len`` bytes from payload offset
``src_off`` to ``off`` of buffer ``buf``, as they are (``SEG_COPY``), as they are plus the
``col_bytes`` bytes at ``col_off`` of each ``row_bytes`` row copied to ``col_dst`` of buffer
``col_buf`` (``SEG_COPY_COLS``), or widened to int64 from int32 (``SEG_WIDEN_I32``) or uint8
(``SEG_WIDEN_U8``), every widened value then checked to lie in ``[0, limit)`` (``limit`` 0:
unchecked; the reader sets the token rule's bounds, ``format.validate.token_problem``), or
dequantised (``SEG_DEQUANT``): ``row_bytes`` float8 codes (``fp8_kind``) per row, each ``group``
of them times one float32 scale read from ``scale_off`` of buffer ``scale_buf`` (row after row),
written as ``out_size``-byte floats (2: bf16, 4: float32), and ``col_*`` then count output bytes.
Payload bytes outside every segment are read and dropped.

A segment with ``pick_count`` > 0 (``SEG_PICK``, or ``SEG_DEQUANT``) hands out only parts of each
``row_bytes`` row: picks ``pick_first .. pick_first + pick_count`` of the program's pick table
(:data:`PICK`), each ``len`` bytes at ``src`` of a stored row to ``dst`` of the row's place in
``buf`` at ``off`` (``to_col`` 0) or in ``col_buf`` at ``col_dst`` (``to_col`` 1), rows ``stride``
bytes apart there. That is how training takes a subset of a cache's layers, in its own order (a
layer's columns per pick) plus the final state's columns. For ``SEG_DEQUANT``, ``src`` and ``len``
count stored codes and cover whole groups, ``dst`` and ``stride`` output bytes.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

OP_ZERO, OP_FILL_I64, OP_SAMPLE, OP_SAMPLE_MEM = 1, 2, 3, 4
SEG_COPY, SEG_COPY_COLS, SEG_WIDEN_I32, SEG_WIDEN_U8, SEG_DEQUANT, SEG_PICK = 1, 2, 3, 4, 5, 6
# SEG_DEQUANT's fp8_kind, by the format's dtype code.
FP8_KINDS = {"F8_E4M3": 1, "F8_E5M2": 2}

_U64 = "<u8"


class OpRecord(NamedTuple):
    """One op, as the Python filler reads it (field order = :data:`OP` = ``op_t``)."""

    kind: int
    target: int  # buffer index (OP_SAMPLE_MEM's too), or the file descriptor of OP_SAMPLE
    offset: int  # byte offset in the buffer, or in the file
    count: int  # bytes (ZERO, SAMPLE) or int64 slots (FILL_I64)
    value: int  # FILL_I64's value, as uint64; SAMPLE's xxh3-64 when ``check``
    seg_first: int
    seg_count: int
    check: int  # SAMPLE: 1 to hash the payload while reading it


class SegmentRecord(NamedTuple):
    """One segment, as the Python filler reads it (field order = :data:`SEGMENT` = ``segment_t``)."""

    kind: int
    src_off: int  # payload offset of the first byte
    len: int  # payload bytes
    buf: int
    off: int  # byte offset in ``buf``
    row_bytes: int  # SEG_COPY_COLS, SEG_PICK: bytes per stored row; SEG_DEQUANT: codes per row
    col_off: int  # ... the columns' offset within a row
    col_bytes: int  # ... and their width
    col_buf: int  # ... copied to this buffer
    col_dst: int  # ... at this byte offset, one row after the other
    scale_buf: int  # SEG_DEQUANT: the buffer holding the scales
    scale_off: int  # ... their byte offset (float32, ``row_bytes / group`` per row)
    group: int  # ... codes per scale
    out_size: int  # ... bytes per output value: 2 (bf16) or 4 (float32)
    fp8_kind: int  # ... the codes' format (FP8_KINDS)
    limit: int  # SEG_WIDEN_*: every value must lie in [0, limit) (0: unchecked), else RC_BAD_TOKEN
    pick_first: int  # SEG_PICK, SEG_DEQUANT: the first of this segment's picks
    pick_count: int  # ... and how many (0: the whole row)


class PickRecord(NamedTuple):
    """One pick: a byte range of every stored row, handed out (field order = :data:`PICK` = ``pick_t``)."""

    src: int  # offset in the stored row
    len: int  # bytes (SEG_DEQUANT: codes) taken
    to_col: int  # 0: to the segment's buf/off, 1: to its col_buf/col_dst
    dst: int  # offset in the destination row
    stride: int  # bytes from one destination row to the next


FILL_ABI = 3  # csrc/batch_fill.c's dspark_fill_abi(): bumped with any change to these records
OP = np.dtype([(name, _U64) for name in OpRecord._fields])
SEGMENT = np.dtype([(name, _U64) for name in SegmentRecord._fields])
PICK = np.dtype([(name, _U64) for name in PickRecord._fields])
# sizeof(op_t), segment_t, pick_t
assert OP.itemsize == 64 and SEGMENT.itemsize == 144 and PICK.itemsize == 40


def segment(kind: int, src_off: int, length: int, buf: int, off: int, *, row_bytes: int = 0, col_off: int = 0,
            col_bytes: int = 0, col_buf: int = 0, col_dst: int = 0, scale_buf: int = 0, scale_off: int = 0,
            group: int = 0, out_size: int = 0, fp8_kind: int = 0, limit: int = 0, pick_first: int = 0,
            pick_count: int = 0) -> tuple[int, ...]:
    """One segment's fields in :data:`SEGMENT` order (for ``np.array([...], dtype=SEGMENT)``)."""
    return tuple(
        SegmentRecord(
            kind,
            src_off,
            length,
            buf,
            off,
            row_bytes,
            col_off,
            col_bytes,
            col_buf,
            col_dst,
            scale_buf,
            scale_off,
            group,
            out_size,
            fp8_kind,
            limit,
            pick_first,
            pick_count,
        )
    )


def segment_table(rows: list[tuple[int, ...]]) -> np.ndarray:
    """A segment table from :func:`segment` tuples."""
    return np.array(rows, dtype=SEGMENT)


# A field's column in an as_table() view, by name.
OP_COLUMN = {name: i for i, name in enumerate(OP.names)}
SEGMENT_COLUMN = {name: i for i, name in enumerate(SEGMENT.names)}


def as_table(records: np.ndarray) -> np.ndarray:
    """Records (:data:`OP`, :data:`SEGMENT` or :data:`PICK`) as a ``[n, fields]`` uint64 view, whose
    columns are the fields in order (:data:`OP_COLUMN`, :data:`SEGMENT_COLUMN`): plain arrays, which
    numpy joins and computes on without the per-field work that record arrays cost."""
    records = np.ascontiguousarray(records)
    return records.view(np.uint64).reshape(len(records), records.dtype.itemsize // 8)  # also when empty


def pick_table(rows: list[PickRecord]) -> np.ndarray:
    """A pick table from :class:`PickRecord` s (read-only: layouts share it)."""
    table = np.array([tuple(r) for r in rows], dtype=PICK) if rows else np.zeros(0, PICK)
    table.setflags(write=False)
    return table
