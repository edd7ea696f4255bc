"""Read each sample once, by offset, straight into its row of a batch buffer.

A sample's ``target_hidden_states`` lie contiguously in the shard, page-aligned, exactly as a
batch row wants them, so ``preadv`` scatters the header into a scratch buffer and the hidden
states into the batch (pinned memory where CUDA exists): the only host copy. The checksum is
computed over the same buffers, in file order, chunk by chunk (:mod:`.rowplan`). Reader
threads release the GIL in ``preadv``, hashing and numpy copies, so a few of them keep the
disk or page cache busy. Batch memory comes from :mod:`.memory` (recycled, zeroed only where
needed).
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from dspark_cache.format.errors import CorruptShardError
from dspark_cache.format.layers import final_state_in_ids
from dspark_cache.format.sample import CACHE_DTYPES, HIDDEN, INPUT_IDS, LAST_HIDDEN, LOSS_MASK
from dspark_cache.format.schema import Manifest, SampleEntry
from dspark_cache.loader.catalog import ShardCatalog
from dspark_cache.loader.memory import ID_FIELDS, BatchMemory, Field, Slab, as_numpy
from dspark_cache.loader.planner import RankBatch
from dspark_cache.loader.rowplan import RowPlan, row_plan


@dataclass(frozen=True)
class BatchLayout:
    """Shapes of a batch, from the manifest."""

    seq_length: int
    hidden_dim: int
    hidden_size: int
    dtype: torch.dtype
    final_in_hidden: bool
    pad_token_id: int

    @classmethod
    def from_manifest(cls, m: Manifest) -> "BatchLayout":
        return cls(m.seq_length, m.target_hidden_dim, m.hidden_size, CACHE_DTYPES[m.dtype],
                   final_state_in_ids(m.target_layer_ids, m.num_hidden_layers), m.pad_token_id)

    def plan(self, length: int) -> RowPlan:
        """How a sample of ``length`` tokens is read (cached per length)."""
        return row_plan(length, self.hidden_dim, self.hidden_size, self.dtype, not self.final_in_hidden)


class PendingBatch:
    """A batch whose samples are being read by the pool; ``result()`` waits and returns it."""

    def __init__(self, buffers: dict[str, torch.Tensor], future: Future, extra: dict[str, torch.Tensor]) -> None:
        self.buffers, self.future, self.extra = buffers, future, extra

    def result(self) -> dict[str, torch.Tensor]:
        self.future.result()  # re-raises a checksum or read error, naming shard and sample
        return {**self.buffers, **self.extra}


class BatchReader:
    """Turns a rank's batch plan into tensors with NeMo's keys (plus our extras)."""

    def __init__(self, catalog: ShardCatalog, layout: BatchLayout, *, batch_size: int, num_threads: int,
                 pad_to: str, pin_memory: bool, nemo_keys_only: bool = False, keep: int = 4) -> None:
        if pad_to not in ("seq_length", "longest"):
            raise ValueError(f"pad_to must be 'seq_length' or 'longest', not {pad_to!r}")
        self.catalog = catalog
        self.layout = layout
        self.pad_to = pad_to
        self.pool = ThreadPoolExecutor(max(1, num_threads), thread_name_prefix="dspark-read")
        ids = ID_FIELDS if not nemo_keys_only else tuple(f for f in ID_FIELDS if f != "attention_mask")
        fields = (Field(HIDDEN, layout.hidden_dim, layout.dtype, True),
                  Field(LAST_HIDDEN, layout.hidden_size, layout.dtype, True),
                  *(Field(name, 1, torch.int64, False) for name in ids))
        self.extras = not nemo_keys_only
        self.memory = BatchMemory(fields, batch_size * layout.seq_length, pinned=pin_memory, keep=keep)

    def submit(self, batch: RankBatch) -> PendingBatch:
        entries = [self.catalog.require(ref.shard_id).samples[ref.entry] for ref in batch.refs]
        lengths = [e.length for e in entries]
        width = self.layout.seq_length if self.pad_to == "seq_length" else max(lengths)
        for ref, entry in zip(batch.refs, entries):
            if entry.length > self.layout.seq_length:
                raise CorruptShardError(self.catalog.paths.shard_tar(ref.shard_id),
                                        f"{entry.length} tokens, more than the manifest's seq_length "
                                        f"{self.layout.seq_length}", entry.sample_id)
        slab = self.memory.take(len(entries), width)
        buffers = slab.views(len(entries), width)
        zero = slab.claim(width, lengths)
        extra: dict[str, torch.Tensor] = {}
        if self.extras:
            extra = {
                "sample_ids": torch.tensor([e.sample_id for e in entries], dtype=torch.int64),
                "is_repeat": torch.tensor(batch.repeat, dtype=torch.bool),
            }
        # One task per batch: threads work on different (prefetched) batches, and a batch costs
        # one hand-over between threads instead of one per sample.
        rows = [(row, ref.shard_id, entry) for row, (ref, entry) in enumerate(zip(batch.refs, entries))]
        return PendingBatch(buffers, self.pool.submit(self._fill, slab, zero, buffers, rows), extra)

    def _fill(self, slab: Slab, zero: list[tuple[int, int]], buffers: dict[str, torch.Tensor],
              rows: list[tuple[int, int, SampleEntry]]) -> None:
        slab.zero(zero)
        arrays = {name: as_numpy(t) for name, t in buffers.items()}
        for row, shard_id, entry in rows:
            self._read_row(arrays, row, shard_id, entry)

    def _read_row(self, arrays: dict[str, np.ndarray], row: int, shard_id: int, entry: SampleEntry) -> None:
        lay = self.layout
        n = entry.length
        plan = lay.plan(n)
        header = entry.size - plan.data_size
        if header < 8:
            raise CorruptShardError(self.catalog.paths.shard_tar(shard_id),
                                    f"the index gives {entry.size} bytes for {n} tokens", entry.sample_id)
        hidden, last = arrays[HIDDEN][row], arrays[LAST_HIDDEN][row]
        ids, mask = np.empty(n, dtype=np.int32), np.empty(n, dtype=np.uint8)
        whole = {INPUT_IDS: ids, LOSS_MASK: mask}
        by_rows = {HIDDEN: hidden, LAST_HIDDEN: last}
        final = slice(lay.hidden_dim - lay.hidden_size, lay.hidden_dim)
        fd = self.catalog.fd(shard_id)
        hasher = xxhash.xxh3_64()
        offset = entry.offset
        views = [memoryview(bytearray(header))]
        for group in plan.groups:
            for name, lo, hi, _ in group:
                field = by_rows.get(name)
                if field is not None:
                    views.append(memoryview(field[lo:hi]))
                else:
                    views.append(memoryview(whole[name]) if name in whole else memoryview(bytearray(hi)))
            want = sum(view.nbytes for view in views)
            got = os.preadv(fd, views, offset)
            if got != want:
                raise CorruptShardError(self.catalog.paths.shard_tar(shard_id),
                                        f"short read ({offset - entry.offset + got} of {entry.size} bytes)",
                                        entry.sample_id)
            offset += got
            for view in views:
                hasher.update(view)
            if lay.final_in_hidden:  # copy the final state while the chunk is in the CPU cache
                for name, lo, hi, _ in group:
                    if name == HIDDEN:
                        last[lo:hi] = hidden[lo:hi, final]
            views = []
        if hasher.intdigest() != entry.xxh3:
            raise CorruptShardError(self.catalog.paths.shard_tar(shard_id), "checksum mismatch", entry.sample_id)
        # Pad slots of the row fields were zeroed by _fill; the per-token fields are rewritten.
        for name, head, pad in (("input_ids", ids, lay.pad_token_id), ("loss_mask", mask, 0), ("attention_mask", 1, 0)):
            out = arrays.get(name)
            if out is not None:
                out[row, :n] = head
                out[row, n:] = pad

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
