"""How one sample's payload maps onto its batch row: a segment table, computed once per length.

Each tensor of the sample's data section becomes a segment of the batch program
(:mod:`.fill`): the hidden states are read straight into the batch row (and their final-state
columns copied out, when the final state is stored inside them), token ids and the loss mask
are widened to int64, and alignment fill is read and dropped. Placement depends on the length
alone (``format.sample.place_tensors``, the same rule the writer uses), so the table is cached.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from dspark_cache.format.geometry import SampleShape
from dspark_cache.format.sample import HIDDEN, INPUT_IDS, LAST_HIDDEN, LOSS_MASK, place_tensors

from dspark_cache.loader.records import SEG_COPY, SEG_COPY_COLS, SEG_WIDEN_I32, SEG_WIDEN_U8, segment, segments

# Batch buffers a segment writes to, by index (the program's first buffers, in this order).
BUFFERS = (HIDDEN, LAST_HIDDEN, INPUT_IDS, LOSS_MASK)
_BUF = {name: i for i, name in enumerate(BUFFERS)}


@dataclass(frozen=True)
class RowTemplate:
    """A sample's segments with offsets relative to its data section and to its batch row."""

    data_size: int  # bytes of the data section (the payload minus its header)
    segs: np.ndarray  # [n] records.SEGMENT
    # place()'s lookups, taken from segs once (it runs for every sample of every batch).
    _bufs: np.ndarray = field(init=False, repr=False, compare=False)
    _cols: np.ndarray = field(init=False, repr=False, compare=False)
    _col_bufs: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        cols = np.flatnonzero(self.segs["kind"] == SEG_COPY_COLS)
        object.__setattr__(self, "_bufs", self.segs["buf"].astype(np.intp))
        object.__setattr__(self, "_cols", cols)
        object.__setattr__(self, "_col_bufs", self.segs["col_buf"][cols].astype(np.intp))

    def place(self, header: int, row_base: np.ndarray) -> np.ndarray:
        """The segments made absolute: payload offsets after ``header``, buffer offsets at the
        row (``row_base[buf]`` bytes into each buffer)."""
        segs = self.segs.copy()
        base = np.asarray(row_base).astype(np.uint64)
        segs["src_off"] += np.uint64(header)
        segs["off"] += base[self._bufs]
        if len(self._cols):
            segs["col_dst"][self._cols] += base[self._col_bufs]
        return segs


@lru_cache(maxsize=16384)
def row_template(length: int, shape: SampleShape) -> RowTemplate:
    """The segments of a ``length``-token sample of ``shape`` (``shape.stores_last``: the final
    state is its own tensor, else the last ``hidden_size`` columns of the hidden states)."""
    hidden_dim, hidden_size, item, stores_last = shape.hidden_dim, shape.hidden_size, shape.itemsize, shape.stores_last
    rows = []
    placed = place_tensors(shape.specs(length))
    for name, start, end in placed:
        size = end - start
        if name == HIDDEN and not stores_last:  # the final state is the last hidden_size columns
            rows.append(segment(SEG_COPY_COLS, start, size, _BUF[HIDDEN], 0, row_bytes=hidden_dim * item,
                                col_off=(hidden_dim - hidden_size) * item, col_bytes=hidden_size * item,
                                col_buf=_BUF[LAST_HIDDEN]))
        elif name in (HIDDEN, LAST_HIDDEN):
            rows.append(segment(SEG_COPY, start, size, _BUF[name], 0))
        elif name == INPUT_IDS:
            rows.append(segment(SEG_WIDEN_I32, start, size, _BUF[name], 0))
        elif name == LOSS_MASK:
            rows.append(segment(SEG_WIDEN_U8, start, size, _BUF[name], 0))
        # alignment fill (__padN__) is read and dropped
    segs = segments(rows)
    segs = segs[segs["len"] > 0]  # a zero-token sample has empty tensors: nothing to read
    segs.setflags(write=False)
    return RowTemplate(placed[-1][2] if placed else 0, segs)
