"""Read each sample once, by offset, straight into its row of a preallocated batch buffer.

A sample's ``target_hidden_states`` lie contiguously in the shard, page-aligned, exactly as a
batch row wants them, so one ``preadv`` per sample scatters the header into a scratch buffer
and the hidden states into the batch (pinned memory where CUDA exists): the only host copy.
The checksum is computed over the same buffers, in file order. Reader threads release the GIL
in ``preadv`` and in hashing, so a few of them keep the disk or page cache busy.
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
from dspark_cache.format.sample import (
    CACHE_DTYPES, HIDDEN, INPUT_IDS, LAST_HIDDEN, LOSS_MASK, layout_payload, sample_metadata, sample_specs,
)
from dspark_cache.format.schema import Manifest, SampleEntry
from dspark_cache.loader.catalog import ShardCatalog
from dspark_cache.loader.planner import RankBatch

NEMO_KEYS = ("input_ids", "loss_mask", "target_hidden_states", "target_last_hidden_states")


@dataclass(frozen=True)
class BatchLayout:
    """Shapes of a batch, from the manifest."""

    seq_length: int
    hidden_dim: int
    hidden_size: int
    dtype: torch.dtype
    final_in_hidden: bool
    pad_token_id: int
    layer_ids: tuple[int, ...]
    num_layers: int

    @classmethod
    def from_manifest(cls, m: Manifest) -> "BatchLayout":
        return cls(m.seq_length, m.target_hidden_dim, m.hidden_size, CACHE_DTYPES[m.dtype],
                   final_state_in_ids(m.target_layer_ids, m.num_hidden_layers), m.pad_token_id,
                   tuple(m.target_layer_ids), m.num_hidden_layers)

    def payload(self, entry: SampleEntry):
        specs = sample_specs(entry.length, self.hidden_dim, self.hidden_size, self.dtype, not self.final_in_hidden)
        meta = sample_metadata(entry.sample_id, list(self.layer_ids), self.num_layers, self.hidden_size)
        return layout_payload(specs, meta, entry.offset)


def _bytes_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous tensor region (bf16 included)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class PendingBatch:
    """A batch whose samples are being read by the pool; ``result()`` waits and returns it."""

    def __init__(self, buffers: dict[str, torch.Tensor], futures: list[Future], extra: dict[str, torch.Tensor]) -> None:
        self.buffers, self.futures, self.extra = buffers, futures, extra

    def result(self) -> dict[str, torch.Tensor]:
        for future in self.futures:
            future.result()  # re-raises a checksum or read error, naming shard and sample
        return {**self.buffers, **self.extra}


class BatchReader:
    """Turns a rank's batch plan into tensors with NeMo's keys (plus our extras)."""

    def __init__(self, catalog: ShardCatalog, layout: BatchLayout, *, num_threads: int, pad_to: str,
                 pin_memory: bool, nemo_keys_only: bool = False, ring: int = 0) -> None:
        if pad_to not in ("seq_length", "longest"):
            raise ValueError(f"pad_to must be 'seq_length' or 'longest', not {pad_to!r}")
        self.catalog = catalog
        self.layout = layout
        self.pad_to = pad_to
        self.pin_memory = pin_memory
        self.nemo_keys_only = nemo_keys_only
        self.pool = ThreadPoolExecutor(max(1, num_threads), thread_name_prefix="dspark-read")
        # ring > 0: batch i reuses the memory of batch i - ring (no fresh pages, no page faults).
        self.ring = ring
        self._slabs: list[list[torch.Tensor | None]] = [[None] * 5 for _ in range(ring)]
        self._submitted = 0

    def _alloc(self, shape: tuple[int, ...], dtype: torch.dtype, slab: list | None, slot: int) -> torch.Tensor:
        if slab is None:
            return torch.empty(shape, dtype=dtype, pin_memory=self.pin_memory)
        count = 1
        for dim in shape:
            count *= dim
        flat = slab[slot]
        if flat is None or flat.numel() < count or flat.dtype != dtype:
            flat = slab[slot] = torch.empty(count, dtype=dtype, pin_memory=self.pin_memory)
        return flat[:count].view(shape)

    def submit(self, batch: RankBatch) -> PendingBatch:
        entries = [self.catalog.require(ref.shard_id).samples[ref.entry] for ref in batch.refs]
        lay = self.layout
        width = lay.seq_length if self.pad_to == "seq_length" else max(e.length for e in entries)
        b = len(entries)
        slab = self._slabs[self._submitted % self.ring] if self.ring else None
        self._submitted += 1
        buffers = {
            "input_ids": self._alloc((b, width), torch.int64, slab, 0),
            "loss_mask": self._alloc((b, width), torch.int64, slab, 1),
            "target_hidden_states": self._alloc((b, width, lay.hidden_dim), lay.dtype, slab, 2),
            "target_last_hidden_states": self._alloc((b, width, lay.hidden_size), lay.dtype, slab, 3),
        }
        extra: dict[str, torch.Tensor] = {}
        if not self.nemo_keys_only:
            buffers["attention_mask"] = self._alloc((b, width), torch.int64, slab, 4)
            extra = {
                "sample_ids": torch.tensor([e.sample_id for e in entries], dtype=torch.int64),
                "is_repeat": torch.tensor(batch.repeat, dtype=torch.bool),
            }
        # One task per batch: threads work on different (prefetched) batches, and a batch costs
        # one hand-over between threads instead of one per sample.
        rows = [(row, ref.shard_id, entry) for row, (ref, entry) in enumerate(zip(batch.refs, entries))]
        return PendingBatch(buffers, [self.pool.submit(self._read_rows, buffers, rows)], extra)

    def _read_rows(self, buffers: dict[str, torch.Tensor], rows: list[tuple[int, int, SampleEntry]]) -> None:
        for row, shard_id, entry in rows:
            self._read_row(buffers, row, shard_id, entry)

    def _read_row(self, buffers: dict[str, torch.Tensor], row: int, shard_id: int, entry: SampleEntry) -> None:
        lay = self.layout
        n = entry.length
        if n > buffers["input_ids"].shape[1]:
            raise ValueError(f"sample {entry.sample_id} has {n} tokens, more than the batch's {buffers['input_ids'].shape[1]}")
        hidden, last = buffers["target_hidden_states"][row], buffers["target_last_hidden_states"][row]
        payload = lay.payload(entry)
        ids = np.empty(n, dtype=np.int32)
        mask = np.empty(n, dtype=np.uint8)
        targets = {HIDDEN: _bytes_view(hidden[:n]), INPUT_IDS: memoryview(ids), LOSS_MASK: memoryview(mask)}
        if not lay.final_in_hidden:
            targets[LAST_HIDDEN] = _bytes_view(last[:n])
        iov = [memoryview(bytearray(len(payload.header)))]
        for name, start, end in payload.placed:
            iov.append(targets[name] if name in targets else memoryview(bytearray(end - start)))
        fd = self.catalog.fd(shard_id)
        path = self.catalog.paths.shard_tar(shard_id)
        got = os.preadv(fd, iov, entry.offset)
        if got != entry.size:
            raise CorruptShardError(path, f"short read ({got} of {entry.size} bytes)", entry.sample_id)
        hasher = xxhash.xxh3_64()
        for view in iov:
            hasher.update(view)
        if hasher.intdigest() != entry.xxh3:
            raise CorruptShardError(path, "checksum mismatch", entry.sample_id)
        # Zero padding (finite: NaN * 0 would poison the loss) and the small per-token fields.
        hidden[n:].zero_()
        last[n:].zero_()
        if lay.final_in_hidden:
            last[:n].copy_(hidden[:n, lay.hidden_dim - lay.hidden_size :])
        buffers["input_ids"][row, :n] = torch.from_numpy(ids)
        buffers["input_ids"][row, n:] = lay.pad_token_id
        buffers["loss_mask"][row, :n] = torch.from_numpy(mask)
        buffers["loss_mask"][row, n:] = 0
        if "attention_mask" in buffers:
            buffers["attention_mask"][row, :n] = 1
            buffers["attention_mask"][row, n:] = 0

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
