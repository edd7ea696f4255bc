"""How one sample's payload maps onto its batch row: a segment table, computed once per length.

Each tensor of the sample's data section becomes a segment of the batch program
(:mod:`.fill`): the hidden states are read straight into the batch row (and their final-state
columns copied out, when the final state is stored inside them), token ids and the loss mask
are widened to int64, and alignment fill is read and dropped. Placement depends on the length
alone (``format.sample.place_tensors``, the same rule the writer uses), so the table is cached.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from dspark_cache.format.sample import HIDDEN, INPUT_IDS, LAST_HIDDEN, LOSS_MASK, place_tensors, sample_specs

# Segment kinds and the columns of a segment row (shared with csrc/batch_fill.c).
SEG_COPY, SEG_COPY_COLS, SEG_WIDEN_I32, SEG_WIDEN_U8 = 1, 2, 3, 4
SEG_COLUMNS = 10  # kind, src_off, len, buf, off, row_bytes, col_off, col_bytes, col_buf, col_dst
# Batch buffers a segment writes to, by index (the program's first buffers, in this order).
BUFFERS = (HIDDEN, LAST_HIDDEN, INPUT_IDS, LOSS_MASK)
_BUF = {name: i for i, name in enumerate(BUFFERS)}


@dataclass(frozen=True)
class RowTemplate:
    """A sample's segments with offsets relative to its data section and to its batch row."""

    data_size: int  # bytes of the data section (the payload minus its header)
    segs: np.ndarray  # [n, SEG_COLUMNS] int64

    def place(self, header: int, row_base: np.ndarray) -> np.ndarray:
        """The segments made absolute: payload offsets after ``header``, buffer offsets at the
        row (``row_base[buf]`` bytes into each buffer)."""
        segs = self.segs.copy()
        segs[:, 1] += header
        segs[:, 4] += row_base[segs[:, 3]]
        cols = segs[:, 0] == SEG_COPY_COLS
        segs[cols, 9] += row_base[segs[cols, 8]]
        return segs


@lru_cache(maxsize=16384)
def row_template(length: int, hidden_dim: int, hidden_size: int, dtype: torch.dtype, store_last: bool) -> RowTemplate:
    """The segments of a ``length``-token sample (``store_last``: the final state is its own tensor)."""
    item = dtype.itemsize
    rows = []
    placed = place_tensors(sample_specs(length, hidden_dim, hidden_size, dtype, store_last))
    for name, start, end in placed:
        size = end - start
        if name == HIDDEN and not store_last:  # the final state is the last hidden_size columns
            rows.append((SEG_COPY_COLS, start, size, _BUF[HIDDEN], 0, hidden_dim * item,
                         (hidden_dim - hidden_size) * item, hidden_size * item, _BUF[LAST_HIDDEN], 0))
        elif name in (HIDDEN, LAST_HIDDEN):
            rows.append((SEG_COPY, start, size, _BUF[name], 0, 0, 0, 0, 0, 0))
        elif name == INPUT_IDS:
            rows.append((SEG_WIDEN_I32, start, size, _BUF[name], 0, 0, 0, 0, 0, 0))
        elif name == LOSS_MASK:
            rows.append((SEG_WIDEN_U8, start, size, _BUF[name], 0, 0, 0, 0, 0, 0))
        # alignment fill (__padN__) is read and dropped
    segs = np.array(rows, dtype=np.int64).reshape(-1, SEG_COLUMNS)
    segs = segs[segs[:, 2] > 0]  # a zero-token sample has empty tensors: nothing to read
    segs.setflags(write=False)
    return RowTemplate(placed[-1][2] if placed else 0, segs)
