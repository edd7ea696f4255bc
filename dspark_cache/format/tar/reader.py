"""Read published shards by offset from their index, verifying every byte returned."""

from __future__ import annotations

import os

import msgspec
import torch
import xxhash

from dspark_cache.format.errors import CorruptShardError
from dspark_cache.format.paths import CachePaths
from dspark_cache.format.sample import assemble_sample, decode_payload
from dspark_cache.format.schema import SampleEntry, ShardIndex, decode_shard_index

_HASH_CHUNK = 8 << 20


def load_shard_index(paths: CachePaths, shard_id: int) -> ShardIndex:
    """Load a shard's index and check that its tar exists with exactly the indexed size."""
    idx_path = paths.shard_index(shard_id)
    try:
        with open(idx_path, "rb") as handle:
            index = decode_shard_index(handle.read())
    except msgspec.DecodeError as exc:
        raise CorruptShardError(idx_path, f"unreadable index ({exc})") from exc
    tar_path = paths.shard_tar(shard_id)
    try:
        size = os.stat(tar_path).st_size
    except FileNotFoundError as exc:
        raise CorruptShardError(tar_path, "the tar is missing although its index exists") from exc
    if size != index.tar_bytes:
        raise CorruptShardError(tar_path, f"size {size} bytes, index says {index.tar_bytes} (truncated?)")
    return index


class ShardReader:
    """Random access to the samples of one published shard."""

    def __init__(self, paths: CachePaths, shard_id: int, index: ShardIndex | None = None) -> None:
        self.index = index if index is not None else load_shard_index(paths, shard_id)
        self.path = paths.shard_tar(shard_id)
        self._fd = os.open(self.path, os.O_RDONLY)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

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

    def read_sample(self, entry: SampleEntry) -> dict[str, torch.Tensor]:
        """NeMo's unpadded per-sample tensors for one index entry."""
        tensors, metadata = decode_payload(self.read_blob(entry))
        return assemble_sample(tensors, metadata)

    def verify(self) -> None:
        """Hash the whole tar against the index (what ``dspark-verify`` runs per shard)."""
        hasher = xxhash.xxh3_64()
        with open(self.path, "rb") as handle:
            while chunk := handle.read(_HASH_CHUNK):
                hasher.update(chunk)
        if hasher.intdigest() != self.index.tar_xxh3:
            raise CorruptShardError(self.path, "whole-shard checksum mismatch")
        for entry in self.index.samples:
            self.read_blob(entry)
