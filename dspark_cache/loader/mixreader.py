"""Reading a batch whose rows come from several caches: each source fills its own rows.

A mixture's batch is checked out once (:mod:`.memory`) and every source's
:class:`~.reader.BatchReader` runs its batch program over that source's rows of it, in place,
with its own layout (bf16, FP8 dequantised as read, a subset of layers): the rows are still read
straight into the batch, once, checksummed as a single cache's are. The sources' readers share
this reader's threads and per-thread scratch; their own pools and memory stay unused.
"""

from __future__ import annotations

import bisect
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from dspark_cache.format.errors import CorruptShardError
from dspark_cache.format.sample import HIDDEN_SCALE, LAST_HIDDEN_SCALE
from dspark_cache.loader.memory import BatchMemory, page_aligned_zeros
from dspark_cache.loader.order import RankBatch
from dspark_cache.loader.reader import BatchReader, PendingBatch, Row, batch_fields


class MixtureReader:
    """Turns a rank's batches over global shard ids (source ``s``'s shard ``k`` is ``bases[s] + k``)
    into tensors, plus ``source_ids`` ``[B]`` beside ``sample_ids``."""

    def __init__(self, parts: list[BatchReader], bases: list[int], *, batch_size: int, num_threads: int,
                 pin_memory: bool, nemo_keys_only: bool, keep: int) -> None:
        self.parts, self.bases = parts, bases
        self.pad_to = parts[0].pad_to
        self.layouts = [part.layout for part in parts]
        self.raw_scales = self.layouts[0].raw_scales  # the same for every source (one dtype handed out)
        self.extras = not nemo_keys_only
        self.pool = ThreadPoolExecutor(max(1, num_threads), thread_name_prefix="dspark-read")
        self._local = threading.local()
        for part in parts:
            part.share_thread_buffers(self._local)
        self._scratch_bytes = max(part.scratch_bytes() for part in parts)
        slots = batch_size * max(lay.seq_length for lay in self.layouts)
        self.memory = BatchMemory(batch_fields(self.layouts, nemo_keys_only), slots, pinned=pin_memory, keep=keep)

    def locate(self, shard_id: int) -> tuple[int, int]:
        """``(source, its shard id)`` of a global shard id."""
        source = bisect.bisect_right(self.bases, shard_id) - 1
        return source, shard_id - self.bases[source]

    def submit(self, batch: RankBatch) -> PendingBatch:
        groups: dict[int, list[Row]] = {}
        lengths, sample_ids, source_ids = [], [], []
        for row, ref in enumerate(batch.refs):
            source, shard = self.locate(ref.shard_id)
            part = self.parts[source]
            entry = part.cache.require(shard).samples[ref.entry]
            if entry.length > part.layout.seq_length:
                raise CorruptShardError(part.cache.paths.shard_tar(shard), f"{entry.length} tokens, more than the "
                                        f"manifest's seq_length {part.layout.seq_length}", entry.sample_id)
            groups.setdefault(source, []).append((row, shard, ref.entry, entry))
            lengths.append(entry.length)
            sample_ids.append(entry.sample_id)
            source_ids.append(source)
        width = self.layouts[0].seq_length if self.pad_to == "seq_length" else max(lengths)
        stream = torch.cuda.current_stream() if self.memory.pinned else None
        return PendingBatch(self.pool.submit(self._read, groups, lengths, width, stream, batch.repeat,
                                             sample_ids, source_ids))

    def _read(self, groups: dict[int, list[Row]], lengths: list[int], width: int,
              stream: "torch.cuda.Stream | None", repeat: tuple[bool, ...], sample_ids: list[int],
              source_ids: list[int]) -> dict[str, torch.Tensor]:
        """On a reader thread: check out memory, let each source fill its rows, add the extras."""
        scratch = getattr(self._local, "scratch", None)
        if scratch is None or scratch.nbytes < self._scratch_bytes:  # one per thread, for every source's rows
            self._local.scratch = page_aligned_zeros(self._scratch_bytes)
        slab, buffers, zero = self.memory.checkout(len(lengths), width, lengths, stream)
        for source, rows in groups.items():
            self.parts[source].fill_rows(slab, zero, buffers, rows)
            zero = []  # the stale pads are cleared once, by the first program
        if not self.raw_scales:
            buffers = {name: t for name, t in buffers.items() if name not in (HIDDEN_SCALE, LAST_HIDDEN_SCALE)}
        if not self.extras:
            return buffers
        extra = {"sample_ids": torch.tensor(sample_ids, dtype=torch.int64),
                 "source_ids": torch.tensor(source_ids, dtype=torch.int64),
                 "is_repeat": torch.tensor(repeat, dtype=torch.bool)}
        if self.memory.pinned:  # else their non_blocking copies to the GPU would be synchronous
            extra = {name: t.pin_memory() for name, t in extra.items()}
        return {**buffers, **extra}

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.memory.release()
        for part in self.parts:
            part.close()
