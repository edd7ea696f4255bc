"""Reading a batch whose rows come from several caches, in one batch program per storage layout.

A mixture's batch is checked out once (:mod:`.memory`); its rows are grouped by their source's
layout (bf16, FP8 dequantised as read, a subset of layers...), and each group is filled by one
:class:`~.reader.BatchReader` program over the group's sources seen as one cache
(:class:`JoinedCaches`: global shard ids), in place: rows are still read straight into the batch,
once, checksummed as a single cache's are. Sources of one storage layout (the common case) thus
cost one program per batch, as a single cache does. The layouts' readers share this reader's
threads and per-thread scratch; their own pools and memory stay unused.
"""

from __future__ import annotations

import bisect
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from dspark_cache.format.errors import CorruptShardError
from dspark_cache.format.sample import HIDDEN_SCALE, LAST_HIDDEN_SCALE
from dspark_cache.format.schema import ShardIndex
from dspark_cache.loader.memory import BatchMemory, page_aligned_zeros
from dspark_cache.loader.order import RankBatch
from dspark_cache.loader.reader import BatchLayout, BatchReader, PendingBatch, Row, batch_fields
from dspark_cache.storage.cache import CacheDir, FileIdentity


class JoinedCaches:
    """A mixture's caches as one, by global shard id (source ``s``'s shard ``k`` is ``bases[s] + k``):
    what a :class:`~.reader.BatchReader` asks of its cache, each call passed on to the source's."""

    def __init__(self, caches: list[CacheDir], bases: list[int]) -> None:
        self.caches, self.bases = caches, bases
        self.paths = self  # paths.shard_tar(shard), as CachePaths answers it

    def locate(self, shard_id: int) -> tuple[int, int]:
        """``(source, its shard id)`` of a global shard id."""
        source = bisect.bisect_right(self.bases, shard_id) - 1
        return source, shard_id - self.bases[source]

    def _by_source(self, shard_ids: set[int]) -> dict[int, set[int]]:
        out: dict[int, set[int]] = {}
        for shard_id in shard_ids:
            source, shard = self.locate(shard_id)
            out.setdefault(source, set()).add(shard)
        return out

    def require(self, shard_id: int) -> ShardIndex:
        source, shard = self.locate(shard_id)
        return self.caches[source].require(shard)

    def identity(self, shard_id: int) -> FileIdentity:
        source, shard = self.locate(shard_id)
        return self.caches[source].identity(shard)

    def shard_tar(self, shard_id: int) -> str | os.PathLike:
        source, shard = self.locate(shard_id)
        return self.caches[source].paths.shard_tar(shard)

    def pin(self, shard_ids: set[int]) -> dict[int, int]:
        fds: dict[int, int] = {}
        done: list[tuple[int, set[int]]] = []
        try:
            for source, shards in self._by_source(shard_ids).items():
                pinned = self.caches[source].pin(shards)
                done.append((source, shards))
                fds.update({self.bases[source] + shard: fd for shard, fd in pinned.items()})
        except BaseException:
            for source, shards in done:
                self.caches[source].unpin(shards)
            raise
        return fds

    def unpin(self, shard_ids: set[int]) -> None:
        for source, shards in self._by_source(shard_ids).items():
            self.caches[source].unpin(shards)


class MixtureReader:
    """Turns a rank's batches over global shard ids into tensors, plus ``source_ids`` ``[B]``
    beside ``sample_ids``."""

    def __init__(
        self,
        caches: list[CacheDir],
        layouts: list[BatchLayout],
        bases: list[int],
        *,
        batch_size: int,
        num_threads: int,
        pad_to: str,
        pin_memory: bool,
        nemo_keys_only: bool,
        keep: int,
        verify_mode: str = "once",
        native: bool | None = None,
    ) -> None:
        self.joined = JoinedCaches(caches, bases)
        self.pad_to, self.layouts = pad_to, layouts
        self.raw_scales = layouts[0].raw_scales  # the same for every source (one dtype handed out)
        self.extras = not nemo_keys_only
        distinct = list(dict.fromkeys(layouts))  # sources of one storage layout share a program
        self.group = [distinct.index(layout) for layout in layouts]
        joined: CacheDir = self.joined  # type: ignore[assignment]  # what a BatchReader asks of it
        self.parts = [BatchReader(joined, layout, batch_size=batch_size, num_threads=1, pad_to=pad_to,
                                  pin_memory=pin_memory, nemo_keys_only=nemo_keys_only,
                                  verify_mode=verify_mode, native=native, keep=0) for layout in distinct]
        self.pool = ThreadPoolExecutor(max(1, num_threads), thread_name_prefix="dspark-read")
        self._local = threading.local()
        for part in self.parts:
            part.share_thread_buffers(self._local)
        self._scratch_bytes = max(part.scratch_bytes() for part in self.parts)
        slots = batch_size * max(lay.seq_length for lay in layouts)
        self.memory = BatchMemory(batch_fields(layouts, nemo_keys_only), slots, pinned=pin_memory, keep=keep)

    def locate(self, shard_id: int) -> tuple[int, int]:
        """``(source, its shard id)`` of a global shard id."""
        return self.joined.locate(shard_id)

    def submit(self, batch: RankBatch) -> PendingBatch:
        groups: dict[int, list[Row]] = {}
        lengths, sample_ids, source_ids = [], [], []
        for row, ref in enumerate(batch.refs):
            source, _ = self.locate(ref.shard_id)
            entry = self.joined.require(ref.shard_id).samples[ref.entry]
            seq_length = self.layouts[source].seq_length
            if entry.length > seq_length:
                raise CorruptShardError(self.joined.shard_tar(ref.shard_id), f"{entry.length} tokens, more "
                                        f"than the manifest's seq_length {seq_length}", entry.sample_id)
            groups.setdefault(self.group[source], []).append((row, ref.shard_id, ref.entry, entry))
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
        for group, rows in groups.items():
            self.parts[group].fill_rows(slab, zero, buffers, rows)
            zero = []  # the stale pads are cleared once, by the first program
        if not self.raw_scales:
            scales = (HIDDEN_SCALE, LAST_HIDDEN_SCALE)
            buffers = {name: t for name, t in buffers.items() if name not in scales}
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
            part.close()  # its (unused) pool and memory; the caches are their owner's to close
