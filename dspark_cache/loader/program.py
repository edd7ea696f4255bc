"""A batch program: the ops and segments that the fillers (:mod:`.fill`) run over a batch's buffers.

The reader builds one per batch (:meth:`~.reader.BatchReader._program`): zero the stale pads, read
each sample through its segments (:mod:`.segments`), fill the per-token pads. Ops are kept as plain
``[n, fields]`` uint64 tables (:func:`~.records.as_table`) and joined once, into the
:data:`~.records.OP` and :data:`~.records.SEGMENT` arrays the fillers read.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from dspark_cache.loader.records import (
    OP, OP_COLUMN, OP_FILL_I64, OP_SAMPLE, OP_SAMPLE_MEM, OP_ZERO, PICK, SEGMENT, as_table, pick_table,
)

_U64 = (1 << 64) - 1


class BatchProgram:
    """Ops and segments over ``buffers`` (flat uint8 views of the batch tensors); ``picks``: the
    :data:`~.records.PICK` table the segments' picks index (a layer subset's).

    Ops are added in groups of arrays (one call per kind of op for a whole batch: :meth:`zeros`,
    :meth:`fills`, :meth:`samples`); :meth:`zero`, :meth:`fill_int64` and :meth:`sample` add one."""

    def __init__(self, buffers: list[np.ndarray], picks: np.ndarray | None = None) -> None:
        self.buffers = buffers
        self.picks = pick_table([]) if picks is None else picks
        if self.picks.dtype != PICK:
            raise TypeError(f"picks must be records of dtype records.PICK, not {self.picks.dtype}")
        self._ops: list[np.ndarray] = []  # [n, fields] uint64 (records.as_table)
        self._segs: list[np.ndarray] = []
        self._tags: dict[int, object] = {}
        self._nops = 0
        self._nsegs = 0

    def _add(self, op: int, n: int, /, **fields: object) -> None:
        """``n`` new ops of kind ``op``, their other fields (by :data:`~.records.OP` name) from ``fields``."""
        table = np.zeros((n, len(OP.names)), dtype=np.uint64)
        table[:, OP_COLUMN["kind"]] = op
        for name, values in fields.items():
            table[:, OP_COLUMN[name]] = values
        self._ops.append(table)
        self._nops += n

    def zeros(self, bufs: Sequence[int], offsets: Sequence[int], nbytes: Sequence[int]) -> None:
        """Zero ``nbytes[i]`` bytes at ``offsets[i]`` of buffer ``bufs[i]``, for every i."""
        self._add(OP_ZERO, len(bufs), target=bufs, offset=offsets, count=nbytes)

    def fills(self, bufs: Sequence[int], offsets: Sequence[int], counts: Sequence[int],
              values: int | Sequence[int]) -> None:
        """Write ``values[i]`` (one value for all, or one each; int64 or uint64, stored as its 64 bits) into
        ``counts[i]`` int64 slots at ``offsets[i]`` of buffer ``bufs[i]``."""
        self._add(OP_FILL_I64, len(offsets), target=bufs, offset=offsets, count=counts,
                  value=[int(v) & _U64 for v in np.atleast_1d(values)])

    def samples(self, fds: Sequence[int], offsets: Sequence[int], sizes: Sequence[int], segs: np.ndarray,
                seg_counts: Sequence[int], tags: Sequence[object], xxh3: Sequence[int | None]) -> None:
        """Read payload i (``sizes[i]`` bytes at ``offsets[i]`` of ``fds[i]``) through its ``seg_counts[i]``
        segments, the next ones of ``segs`` (:data:`~.records.SEGMENT` records, absolute: payload
        offsets, buffer byte offsets); with an ``xxh3[i]`` (not None), hash it while reading and fail
        unless it matches. A failure names the op's tag."""
        self._samples(OP_SAMPLE, fds, offsets, sizes, segs, seg_counts, tags, xxh3)

    def samples_in(self, buffer: int, offsets: Sequence[int], sizes: Sequence[int], segs: np.ndarray,
                   seg_counts: Sequence[int], tags: Sequence[object]) -> None:
        """As :meth:`samples`, payload i being the ``sizes[i]`` bytes at ``offsets[i]`` of buffer ``buffer``
        (compressed samples, decoded there: their stored bytes were checked before they were decoded)."""
        self._samples(OP_SAMPLE_MEM, [buffer] * len(offsets), offsets, sizes, segs, seg_counts, tags,
                      [None] * len(offsets))

    def _samples(self, kind: int, targets: Sequence[int], offsets: Sequence[int], sizes: Sequence[int],
                 segs: np.ndarray, seg_counts: Sequence[int], tags: Sequence[object],
                 xxh3: Sequence[int | None]) -> None:
        if segs.dtype != SEGMENT:
            raise TypeError(f"segments must be records of dtype records.SEGMENT, not {segs.dtype}")
        counts = np.asarray(seg_counts, dtype=np.uint64)
        self._tags.update(zip(range(self._nops, self._nops + len(targets)), tags))
        self._add(kind, len(targets), target=targets, offset=offsets, count=sizes,
                  value=[0 if h is None else h for h in xxh3], check=[h is not None for h in xxh3],
                  seg_first=self._nsegs + np.cumsum(counts) - counts, seg_count=counts)
        self._segs.append(as_table(segs))
        self._nsegs += len(segs)

    def zero(self, buf: int, offset: int, nbytes: int) -> None:
        self.zeros([buf], [offset], [nbytes])

    def fill_int64(self, buf: int, offset: int, count: int, value: int) -> None:
        if count:
            self.fills([buf], [offset], [count], [value])

    def sample(
        self, fd: int, offset: int, size: int, segs: np.ndarray, tag: object, xxh3: int | None = None
    ) -> None:
        """One payload (:meth:`samples`)."""
        self.samples([fd], [offset], [size], segs, [len(segs)], [tag], [xxh3])

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """The ops and the segments as contiguous :data:`~.records.OP` and ``SEGMENT`` arrays."""
        ops = np.concatenate(self._ops).view(OP).reshape(-1) if self._ops else np.zeros(0, OP)
        segs = np.concatenate(self._segs).view(SEGMENT).reshape(-1) if self._segs else np.zeros(0, SEGMENT)
        return ops, segs

    def tag(self, op: int) -> object:
        return self._tags.get(op)
