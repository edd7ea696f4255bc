"""Read published shards by offset from their index, verifying every byte returned."""

from __future__ import annotations

import os

import msgspec
import numpy as np
import xxhash

from dspark_cache.format.codec import decode_blob
from dspark_cache.format.errors import CacheError, CorruptShardError
from dspark_cache.format.files import open_regular, read_regular, regular_size
from dspark_cache.format.geometry import SampleShape
from dspark_cache.format.paths import CachePaths
from dspark_cache.format.sample import (
    INPUT_IDS, LOSS_MASK, NUMPY_DTYPES, StoredTensor, assemble_sample, decode_payload, place_tensors,
)
from dspark_cache.format.schema import Manifest, SampleEntry, ShardIndex, decode_shard_index
from dspark_cache.format.validate import (
    MAX_INDEX_BYTES, check_cache_id, check_fp8_sample, check_header, check_index, check_token_values,
)

_HASH_CHUNK = 8 << 20


def load_shard_index(paths: CachePaths, shard_id: int, manifest: Manifest | None = None, *,
                     tar_size: int | None = None) -> ShardIndex:
    """Load a shard's index and check that its tar is a regular file of exactly the indexed size.

    With the cache's ``manifest``, every entry is also checked against its geometry and the tar's
    real layout (:func:`~dspark_cache.format.validate.check_index`), so nothing read through
    the index can land outside its sample, and the index must be this cache's
    (:class:`~dspark_cache.format.validate.ForeignShardError` otherwise). ``tar_size``: the tar's
    size where it is not a local file yet (a remote cache's listing); -1 where it is not there.
    """
    idx_path = paths.shard_index(shard_id)
    try:
        index = decode_shard_index(read_regular(idx_path, MAX_INDEX_BYTES))
    except msgspec.DecodeError as exc:
        raise CorruptShardError(idx_path, f"unreadable index ({exc})") from exc
    except CacheError as exc:
        raise CorruptShardError(idx_path, str(exc)) from exc
    except FileNotFoundError as exc:  # listed a moment ago: removed since, or a dangling symlink
        raise CorruptShardError(idx_path, "the index vanished or is a dangling link") from exc
    tar_path = paths.shard_tar(shard_id)
    try:
        if tar_size is not None and tar_size < 0:
            raise FileNotFoundError(tar_path)
        size = regular_size(tar_path) if tar_size is None else tar_size
    except FileNotFoundError as exc:
        raise CorruptShardError(tar_path, "the tar is missing although its index exists") from exc
    except CacheError as exc:
        raise CorruptShardError(tar_path, str(exc)) from exc
    if size != index.tar_bytes:
        raise CorruptShardError(tar_path, f"size {size} bytes, index says {index.tar_bytes} (truncated?)")
    if manifest is not None:
        check_index(index, shard_id, SampleShape.from_manifest(manifest), manifest.seq_length, idx_path)
        check_cache_id(index, manifest.cache_id, idx_path)
    return index


class ShardReader:
    """Random access to the samples of one published shard."""

    def __init__(self, paths: CachePaths, shard_id: int, index: ShardIndex | None = None,
                 shape: SampleShape | None = None, vocab_size: int | None = None) -> None:
        """``shape`` (the cache's geometry) makes every sample's header checked against its entry;
        ``vocab_size`` (the manifest's ``target_vocab_size``) bounds its token ids (without it: ``>= 0``)."""
        self.index = index if index is not None else load_shard_index(paths, shard_id)
        self.path = paths.shard_tar(shard_id)
        self.shape = shape
        self.vocab_size = vocab_size
        try:
            self._fd = open_regular(self.path)
        except CacheError as exc:
            raise CorruptShardError(self.path, str(exc)) from exc

    def fileno(self) -> int:
        """The open tar's descriptor (``CacheDir.check_opened`` checks it is still the indexed file)."""
        return self._fd

    def close(self, _close=os.close) -> None:  # bound now: at interpreter exit the module's os may be gone
        if self._fd >= 0:
            _close(self._fd)
            self._fd = -1

    def __del__(self) -> None:  # a plain int closes with nothing: a dropped reader must not keep its file
        if getattr(self, "_fd", -1) >= 0:  # __init__ may have failed before opening it
            self.close()

    def __enter__(self) -> "ShardReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read_blob(self, entry: SampleEntry, into: bytearray | None = None) -> bytearray:
        """Read a sample's blob once and verify its checksum; a mismatch raises, naming it."""
        blob = into if into is not None and len(into) == entry.size else bytearray(entry.size)
        got = os.preadv(self._fd, [blob], entry.offset)
        if got != entry.size:
            raise CorruptShardError(self.path, f"short read ({got} of {entry.size} bytes)", entry.sample_id)
        if xxhash.xxh3_64_intdigest(blob) != entry.xxh3:
            raise CorruptShardError(self.path, "checksum mismatch", entry.sample_id)
        return blob

    def read_sample(self, entry: SampleEntry) -> dict[str, StoredTensor]:
        """NeMo's unpadded per-sample tensors for one index entry, as numpy views tagged with their
        dtype code (``loader.tensors.sample_to_torch`` makes them torch tensors)."""
        blob = self.read_blob(entry)
        if self.shape is not None:
            header = self.shape.header_size(entry.length, entry.sample_id, entry.offset, entry.size)
            check_header(memoryview(blob)[:header], entry, self.shape, self.path)
        try:  # a compressed sample is decoded here, bounded by its shape (without one, by its header)
            blob = decode_blob(blob) if self.shape is None else self.shape.decode(blob, entry.length)
            tensors, metadata = decode_payload(blob)
            sample = assemble_sample(tensors, metadata)
        except (ValueError, KeyError, TypeError, RuntimeError, UnicodeDecodeError, OverflowError) as exc:
            raise CorruptShardError(self.path, f"undecodable sample ({type(exc).__name__}: {exc})",
                                    entry.sample_id) from exc
        # raw reads too: a NaN scale is damage either way
        check_fp8_sample(sample, self.path, entry.sample_id)
        check_token_values(sample, self.vocab_size, self.path, entry.sample_id)
        return sample

    def check_tokens(self, entry: SampleEntry) -> None:
        """The token rule (``format.validate.token_problem``) on one sample, reading only its ids and
        loss mask (5 bytes a token, where the layout puts them) instead of the whole blob: what
        ``dspark-verify`` checks after :meth:`verify` proved the bytes are the writer's. A compressed
        sample is decoded whole (:meth:`read_sample`), which checks the same rule."""
        if self.shape is None:
            raise ValueError("check_tokens needs the cache's shape to find the token ids")
        if self.shape.compressed:
            self.read_sample(entry)
            return
        placed = {name: (start, end) for name, start, end in place_tensors(self.shape.specs(entry.length))}
        data = entry.offset + entry.size - self.shape.data_size(entry.length)
        (ids_at, _), (mask_at, mask_end) = placed[INPUT_IDS], placed[LOSS_MASK]
        raw = self._read_exact(data + ids_at, mask_end - ids_at, entry)
        tensors = {INPUT_IDS: StoredTensor("I32", np.frombuffer(raw, NUMPY_DTYPES["I32"], entry.length)),
                   LOSS_MASK: StoredTensor("U8", np.frombuffer(raw, NUMPY_DTYPES["U8"], entry.length,
                                                               mask_at - ids_at))}
        check_token_values(tensors, self.vocab_size, self.path, entry.sample_id)

    def verify(self) -> None:
        """One sequential pass over the tar: the whole-file checksum, every sample's checksum and,
        with a ``shape``, every sample's header; memory stays at one chunk whatever the samples."""
        whole = xxhash.xxh3_64()
        position = 0
        for entry in self.index.samples:
            position = self._hash_span(whole, None, position, entry.offset)
            sample = xxhash.xxh3_64()
            header = (self.shape.header_size(entry.length, entry.sample_id, entry.offset, entry.size)
                      if self.shape is not None else 0)
            head = self._read_exact(entry.offset, header, entry) if header else b""
            sample.update(head)
            whole.update(head)
            position = self._hash_span(whole, sample, entry.offset + header, entry.offset + entry.size, entry)
            if sample.intdigest() != entry.xxh3:
                raise CorruptShardError(self.path, "checksum mismatch", entry.sample_id)
            if header:
                check_header(head, entry, self.shape, self.path)
        self._hash_span(whole, None, position, self.index.tar_bytes)
        if whole.intdigest() != self.index.tar_xxh3:
            raise CorruptShardError(self.path, "whole-shard checksum mismatch")

    def _hash_span(self, whole, sample, start: int, end: int, entry: SampleEntry | None = None) -> int:
        while start < end:
            chunk = self._read_exact(start, min(_HASH_CHUNK, end - start), entry)
            whole.update(chunk)
            if sample is not None:
                sample.update(chunk)
            start += len(chunk)
        return end

    def _read_exact(self, offset: int, size: int, entry: SampleEntry | None) -> bytes:
        data = os.pread(self._fd, size, offset)
        if len(data) != size:
            raise CorruptShardError(self.path, f"short read at byte {offset} ({len(data)} of {size} bytes)",
                                    entry.sample_id if entry is not None else None)
        return data
