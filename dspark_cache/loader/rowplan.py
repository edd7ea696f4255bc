"""How one sample's bytes are read: in file order, in chunks small enough to hash while hot.

A sample is read with a few ``preadv`` calls of about ``CHUNK`` bytes rather than one: each
chunk is hashed (and its final-state columns copied) while it is still in the CPU cache,
instead of after the whole sample has gone out to DRAM, which would read every byte from DRAM
twice more. The plan depends on the sample's length only (placement never depends on the
header), so it is computed once per length.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from dspark_cache.format.sample import HIDDEN, LAST_HIDDEN, place_tensors, sample_specs

# Bytes per read: a chunk must still be in the (1-2 MiB) L2 cache when it is hashed.
CHUNK = 1 << 20
ROW_FIELDS = (HIDDEN, LAST_HIDDEN)  # [tokens, dim] tensors, read in whole token rows

# (name, lo, hi, nbytes): token rows lo:hi of a row field; bytes 0:hi of anything else.
Segment = tuple[str, int, int, int]


@dataclass(frozen=True)
class RowPlan:
    """The reads of a sample's data section (the header, first, is sized per sample)."""

    data_size: int
    groups: tuple[tuple[Segment, ...], ...]


@lru_cache(maxsize=16384)
def row_plan(length: int, hidden_dim: int, hidden_size: int, dtype: torch.dtype, store_last: bool) -> RowPlan:
    placed = place_tensors(sample_specs(length, hidden_dim, hidden_size, dtype, store_last))
    segments: list[Segment] = []
    for name, start, end in placed:
        if name in ROW_FIELDS:
            if length:
                row_bytes = (end - start) // length
                step = max(1, CHUNK // row_bytes)
                segments += [(name, lo, min(length, lo + step), (min(length, lo + step) - lo) * row_bytes)
                             for lo in range(0, length, step)]
        else:
            segments.append((name, 0, end - start, end - start))
    groups: list[tuple[Segment, ...]] = []
    group: list[Segment] = []
    size = 0
    for segment in segments:
        if group and size + segment[3] > CHUNK:
            groups.append(tuple(group))
            group, size = [], 0
        group.append(segment)
        size += segment[3]
    if group:
        groups.append(tuple(group))
    return RowPlan(placed[-1][2] if placed else 0, tuple(groups))
