"""``open_cache``: a cache directory as a manifest plus its published, verified samples."""

from __future__ import annotations

import os
from typing import Iterator

import torch

from dspark_cache.format.errors import CacheError, IncompleteCacheError
from dspark_cache.format.geometry import SampleShape
from dspark_cache.format.manifest import load_manifest
from dspark_cache.format.paths import CachePaths
from dspark_cache.format.schema import Manifest, SampleEntry, ShardIndex
from dspark_cache.format.validate import check_catalog
from dspark_cache.format.tar.reader import ShardReader, load_shard_index


def read_manifest(path: str, *, allow_incomplete: bool = False) -> Manifest:
    """Read and check ``manifest.json``; an incomplete cache is refused unless ``allow_incomplete``."""
    manifest = load_manifest(path)
    if not manifest.complete and not allow_incomplete:
        raise IncompleteCacheError(
            f"{path} is incomplete: the producer has not finished (or was stopped). Rerun "
            "dspark-produce with the same arguments to finish it, or read it while it grows "
            "with follow=True"
        )
    return manifest


class Cache:
    """A cache directory: manifest, published shard indexes, and random access to samples."""

    def __init__(self, path: str, *, allow_incomplete: bool = False) -> None:
        self.path = os.fspath(path)
        self.paths = CachePaths(self.path)
        self.manifest = read_manifest(self.path, allow_incomplete=allow_incomplete)
        self.shape = SampleShape.from_manifest(self.manifest)
        self.shards: list[ShardIndex] = [load_shard_index(self.paths, i, self.manifest)
                                         for i in self.paths.indexed_shard_ids()]
        check_catalog(self.manifest, {s.shard_id: s for s in self.shards}, self.path)
        if self.manifest.complete and len(self.shards) != self.manifest.num_shards:
            missing = sorted(set(range(self.manifest.num_shards)) - {s.shard_id for s in self.shards})
            raise CacheError(
                f"{self.path}: manifest says complete with {self.manifest.num_shards} shards but shards "
                f"{missing[:10]} have no index; run dspark-verify {self.path}, then rerun dspark-produce to repair"
            )
        # Ascending sample id across the cache: shards hold ascending id ranges.
        self._entries: list[tuple[int, SampleEntry]] = [
            (n, e) for n, shard in enumerate(self.shards) for e in sorted(shard.samples, key=lambda e: e.sample_id)
        ]
        self._ids = [e.sample_id for _, e in self._entries]
        self._readers: dict[int, ShardReader] = {}

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def sample_ids(self) -> list[int]:
        return list(self._ids)

    def entry(self, position: int) -> tuple[ShardIndex, SampleEntry]:
        n, entry = self._entries[position]
        return self.shards[n], entry

    def reader(self, shard: ShardIndex) -> ShardReader:
        reader = self._readers.get(shard.shard_id)
        if reader is None:
            reader = self._readers[shard.shard_id] = ShardReader(self.paths, shard.shard_id, shard, self.shape)
        return reader

    def read(self, position: int) -> dict[str, torch.Tensor | int]:
        """The unpadded tensors of the sample at ``position`` (ascending id order)."""
        shard, entry = self.entry(position)
        sample: dict[str, torch.Tensor | int] = {"sample_id": entry.sample_id}
        sample.update(self.reader(shard).read_sample(entry))
        return sample

    def samples(self) -> Iterator[dict[str, torch.Tensor | int]]:
        """Every sample in ascending sample id, checksum-verified."""
        for position in range(len(self)):
            yield self.read(position)

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()

    def __enter__(self) -> "Cache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_cache(path: str | os.PathLike, *, allow_incomplete: bool = False) -> Cache:
    """Open a cache directory; refuses an incomplete one unless ``allow_incomplete``."""
    return Cache(os.fspath(path), allow_incomplete=allow_incomplete)
