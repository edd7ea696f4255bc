"""Append samples to ``shard-N.tar.partial``; publish with fsync, rename, then the index.

One :class:`ShardWriter` is one shard, written by one thread; several run side by side (the
producer's writer lanes). Its bytes go through :class:`~dspark_cache.format.tar.append.TarAppender`,
which reads each byte once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from dspark_cache.format.atomic import atomic_write_bytes, fsync_dir
from dspark_cache.format.faults import check_write_budget, crash_point
from dspark_cache.format.geometry import SampleShape
from dspark_cache.format.paths import CachePaths
from dspark_cache.format.codec import DEFAULT_LEVEL, encode_data
from dspark_cache.format.sample import COMPRESSION_KEY, DTYPE_SIZES, TensorSpec, payload_buffers
from dspark_cache.format.schema import SampleEntry, ShardIndex, encode_json
from dspark_cache.format.tar.append import Piece, TarAppender, zeros
from dspark_cache.format.tar.members import (
    END_OF_ARCHIVE,
    TAR_BLOCK,
    TarCursor,
    block_padding,
    member_header,
    member_name,
)
from dspark_cache.format.wids_index import add_shard


WRITEBACK_CHUNK = 32 << 20
_SYNC_FILE_RANGE_WRITE = 2


def _load_sync_file_range():
    """Linux's sync_file_range, to start writeback early without waiting for it."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


_sync_file_range = _load_sync_file_range()
_process_bytes = [0]  # shard bytes this process wrote (for fault injection only), by every writer thread
_process_lock = threading.Lock()


@dataclass(frozen=True)
class SampleToWrite:
    """One sample for :meth:`ShardWriter.append_samples`: ``tensors`` maps each spec's name to a
    C-contiguous buffer of its stored bytes (numpy array, memoryview, bytes; read where it lies)."""

    sample_id: int
    loss_tokens: int
    specs: list[TensorSpec]
    metadata: dict[str, str]
    tensors: Mapping[str, Any]


class ShardWriter:
    """Writes one shard. Nothing is visible to readers until :meth:`publish` returns. ``cache_id``:
    the manifest's, written into the index so that a reader can tell this cache's shards from another's.
    ``native``: the C writer (default: when built, unless ``DSPARK_NATIVE=0``); both write the same bytes."""

    def __init__(self, paths: CachePaths, shard_id: int, *, durable: bool = True, cache_id: str = "",
                 native: bool | None = None, compression_level: int = DEFAULT_LEVEL) -> None:
        self.paths = paths
        # The zstd level of samples whose metadata names a compression (format.codec); the frames
        # are made here, on the thread that writes the shard (the producer's writer lanes).
        self.compression_level = compression_level
        self.shard_id = shard_id
        self.durable = durable
        self.cache_id = cache_id
        self._partial = paths.shard_partial(shard_id)
        self._file = open(self._partial, "wb", buffering=0)
        self._appender = TarAppender(self._file.fileno(), native)
        self._cursor = TarCursor()
        self._entries: list[SampleEntry] = []
        self.bytes_written = 0
        self._writeback_from = 0

    def _write(self, pieces: list[Piece], samples: int = 0) -> list[int]:
        nbytes = sum(memoryview(p.buffer).nbytes for p in pieces)
        with _process_lock:
            _process_bytes[0] += nbytes
            total = _process_bytes[0]
        check_write_budget(total)
        hashes = self._appender.append(pieces, samples)
        self.bytes_written += nbytes
        if self.durable and _sync_file_range and self.bytes_written - self._writeback_from >= WRITEBACK_CHUNK:
            # Start writing back what we have so far: the fsync at publish then waits only for
            # the tail instead of the whole shard, which keeps the pipeline's end short.
            _sync_file_range(self._file.fileno(), self._writeback_from,
                             self.bytes_written - self._writeback_from, _SYNC_FILE_RANGE_WRITE)
            self._writeback_from = self.bytes_written
        return hashes

    def append(
        self,
        sample_id: int,
        loss_tokens: int,
        specs: list[TensorSpec],
        metadata: dict[str, str],
        tensors: Mapping[str, Any],
    ) -> SampleEntry:
        """Write one sample blob as a tar member and remember where it lies."""
        return self.append_samples([SampleToWrite(sample_id, loss_tokens, specs, metadata, tensors)])[0]

    def append_samples(self, samples: list[SampleToWrite]) -> list[SampleEntry]:
        """Write samples as tar members, in order, in one pass over their bytes (each byte read once:
        hashed for the shard and its sample, then written from where it lies)."""
        pieces: list[Piece] = []
        placed: list[tuple[SampleToWrite, int, int]] = []
        for owner, sample in enumerate(samples):
            data_offset, layout = self._cursor.lay_out(sample.specs, sample.metadata)
            if COMPRESSION_KEY in sample.metadata:
                itemsizes = {spec.name: DTYPE_SIZES[spec.dtype] for spec in sample.specs}
                data_size = layout.placed[-1][2] if layout.placed else 0
                frame = encode_data(layout.placed, itemsizes, sample.tensors, data_size,
                                    self.compression_level)
                buffers = [memoryview(layout.header), memoryview(frame)]
            else:
                buffers = payload_buffers(layout, sample.tensors, zeros)
            size = sum(b.nbytes for b in buffers)
            self._cursor.advance(size)
            pieces.append(Piece(member_header(member_name(sample.sample_id), size), -1))
            pieces += [Piece(buffer, owner) for buffer in buffers]
            pieces.append(Piece(zeros(block_padding(size)), -1))
            placed.append((sample, data_offset, size))
        hashes = self._write(pieces, len(samples))
        entries = []
        for (sample, data_offset, size), xxh3 in zip(placed, hashes):
            entry = SampleEntry(sample_id=sample.sample_id, length=sample.specs[-1].shape[0],
                                loss_tokens=sample.loss_tokens, offset=data_offset, size=size, xxh3=xxh3)
            self._entries.append(entry)
            entries.append(entry)
            crash_point("mid_shard")
        return entries

    def publish(self, nonfinite: list[int] | None = None) -> ShardIndex:
        """Seal the tar, make it durable, rename it into place, then publish its index."""
        index = self.seal(nonfinite)
        self.commit(index)
        # After the index: wids' shard list only ever names published shards (exact at completion).
        add_shard(self.paths, index)
        return index

    def seal(self, nonfinite: list[int] | None = None) -> ShardIndex:
        """Finish the tar, make it durable and rename it into place; return its index, not yet written
        (the shard is not published until :meth:`commit` writes it)."""
        self._write([Piece(zeros(END_OF_ARCHIVE), -1)])
        if self.durable:
            os.fsync(self._file.fileno())
        self._file.close()
        tar_path = self.paths.shard_tar(self.shard_id)
        os.replace(self._partial, tar_path)
        if self.durable:
            fsync_dir(self.paths.shards_dir)
        crash_point("after_rename")
        return ShardIndex(
            shard_id=self.shard_id,
            tar_bytes=self.bytes_written,
            tar_xxh3=self._appender.digest(),
            samples=self._entries,
            nonfinite=list(nonfinite or []),
            cache_id=self.cache_id,
        )

    def commit(self, index: ShardIndex) -> None:
        """Write the sealed shard's index: the commit that publishes it."""
        write_index(self.paths, index, durable=self.durable)

    def abort(self) -> None:
        """Drop the unfinished shard; a rerun recomputes it."""
        if not self._file.closed:
            self._file.close()
        try:
            os.unlink(self._partial)
        except FileNotFoundError:
            pass


def write_index(paths: CachePaths, index: ShardIndex, *, durable: bool = True) -> None:
    """Write a sealed shard's index file (the commit that publishes it in a directory)."""
    atomic_write_bytes(paths.shard_index(index.shard_id), encode_json(index), durable=durable)
    crash_point("after_index")


def predict_shard_bytes(shape: SampleShape, sample_ids: Iterable[int], lengths: Iterable[int]) -> int:
    """Exact size of the tar that :class:`ShardWriter` writes for these samples of ``shape``, in this order
    (a compressed ``shape``: the size of its samples uncompressed, which bounds what the plan needs on
    disk; what they take is known only once they are compressed).

    Members are placed as :class:`TarCursor` places them, each header taken from the shape's
    per-length template rather than laid out per sample: a plan of millions of samples is sized
    in seconds, before anything is computed.
    """
    shape = shape.uncompressed
    offset = 0
    for sample_id, length in zip(sample_ids, lengths, strict=True):
        data_offset = offset + TAR_BLOCK
        size = len(shape.header(length, sample_id, data_offset)) + shape.data_size(length)
        offset = data_offset + size + block_padding(size)
    return offset + END_OF_ARCHIVE
