"""``open_cache``: a cache directory's samples one by one, as torch tensors, in ascending sample id.

The directory itself (manifest, indexes, their checks) is :class:`~dspark_cache.storage.cache.CacheDir`;
this module adds only the conversion of a sample blob to tensors (an FP8 cache's dequantised, to
bf16 unless ``dtype`` says otherwise; ``dtype="raw"`` keeps its float8 states and scales; token
ids and loss masks int64, as in batches) and, with ``target_layer_ids``, the choice of layers.
"""

from __future__ import annotations

import os
from typing import Any, Iterator, Sequence

import torch

from dspark_cache.format.layers import layer_positions
from dspark_cache.format.sample import dequantize_arrays
from dspark_cache.format.schema import SampleEntry, ShardIndex
from dspark_cache.format.tar.reader import ShardReader
from dspark_cache.loader.reader import resolve_out_code
from dspark_cache.loader.tensors import sample_to_torch, select_layers
from dspark_cache.storage.backing import StorageOptions
from dspark_cache.storage.cache import CacheDir

__all__ = ["Cache", "open_cache"]

_PREFETCH_SHARDS = 8  # a remote cache's shards fetched ahead of a sequential read


class Cache:
    """A complete (or, with ``allow_incomplete``, growing) cache: manifest, every published shard
    index (loaded and checked when opened), and random access to samples by position. ``dtype``:
    the hidden states' dtype, as ``build_dataloader``'s (FP8 caches: bf16 by default, or ``"fp32"``,
    or ``"raw"``); ``target_layer_ids`` the layers handed out, as ``build_dataloader``'s."""

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        allow_incomplete: bool = False,
        dtype: object = None,
        storage: StorageOptions | None = None,
        target_layer_ids: Sequence[int] | None = None,
    ) -> None:
        self.cache = CacheDir(path, allow_incomplete=allow_incomplete, storage=storage)
        self.path, self.paths = self.cache.root, self.cache.paths
        self.manifest, self.shape = self.cache.manifest, self.cache.shape
        try:
            self.out_code = resolve_out_code(self.shape, dtype)  # None: as stored
            self.select = None if target_layer_ids is None else \
                layer_positions(self.shape.layer_ids, target_layer_ids, where=f"the cache at {self.path}")
            # all of them, as stored: nothing to pick
            if self.select == tuple(range(len(self.shape.layer_ids))):
                self.select = None
        except BaseException:
            self.cache.close()
            raise
        self.shards: list[ShardIndex] = self.cache.load_all()
        self._order = self.cache.sample_order()  # (shard id, entry position), ascending sample id
        self._sequence = list(dict.fromkeys(shard for shard, _ in self._order))  # shards in read order
        self._readers: dict[int, ShardReader] = {}

    def __len__(self) -> int:
        return len(self._order)

    @property
    def sample_ids(self) -> list[int]:
        """The sample id at each position."""
        return [self.entry(position)[1].sample_id for position in range(len(self))]

    def entry(self, position: int) -> tuple[ShardIndex, SampleEntry]:
        """The shard index and index entry of the sample at ``position``."""
        shard_id, k = self._order[position]
        shard = self.cache.require(shard_id)
        return shard, shard.samples[k]

    def reader(self, shard: ShardIndex) -> ShardReader:
        """An open reader of ``shard``; at most ``max_open_files`` stay open (oldest closed first)."""
        reader = self._readers.pop(shard.shard_id, None)
        if reader is None:
            if len(self._readers) >= self.cache.max_open_files:
                self._drop(next(iter(self._readers)))
            if self.cache.remote is not None:  # reads go in ascending id: fetch the shards after this one
                at = self._sequence.index(shard.shard_id)
                self.cache.prefetch(self._sequence[at + 1: at + 1 + _PREFETCH_SHARDS])
            self.cache.hold(shard)  # a remote cache's shard: downloaded to this node, kept while open
            try:
                reader = ShardReader(
                    self.paths, shard.shard_id, shard, self.shape, self.manifest.target_vocab_size
                )
            except BaseException:
                self.cache.let_go(shard.shard_id)
                raise
            try:
                self.cache.check_opened(shard.shard_id, reader.fileno())
            except BaseException:
                reader.close()
                self.cache.let_go(shard.shard_id)
                raise
        self._readers[shard.shard_id] = reader  # most recently used last
        return reader

    def read(self, position: int) -> dict[str, torch.Tensor | int]:
        """The unpadded tensors of the sample at ``position`` (ascending id order), checksum-verified."""
        self.cache.check_current()  # one stat: a cache replaced under us is an error, not other samples
        shard, entry = self.entry(position)
        sample: dict[str, torch.Tensor | int] = {"sample_id": entry.sample_id}
        stored = self.reader(shard).read_sample(entry)
        if self.out_code is not None:
            stored = dequantize_arrays(stored, self.out_code)
        sample.update(sample_to_torch(stored))
        if self.select is not None:
            sample.update(select_layers(sample, self.select, self.shape.hidden_size))
        return sample

    def samples(self) -> Iterator[dict[str, torch.Tensor | int]]:
        """Every sample in ascending sample id, checksum-verified."""
        for position in range(len(self)):
            yield self.read(position)

    def _drop(self, shard_id: int) -> None:
        self._readers.pop(shard_id).close()
        self.cache.let_go(shard_id)

    def close(self) -> None:
        for shard_id in list(self._readers):
            self._drop(shard_id)
        self.cache.close()

    def __enter__(self) -> "Cache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_cache(path: str | os.PathLike, *, allow_incomplete: bool = False, dtype: object = None,
               storage_options: dict[str, Any] | None = None, local_cache_dir: str | None = None,
               cache_limit: int | None = None, target_layer_ids: Sequence[int] | None = None) -> Cache:
    """Open a cache directory or object-store URL (``s3://bucket/prefix``: read through a node-local
    copy, as ``build_dataloader``'s options say); refuses an incomplete one unless ``allow_incomplete``.
    An FP8 cache's samples come dequantised to bf16 (``dtype="fp32"``: float32; ``dtype="raw"``:
    float8 plus scales); ``target_layer_ids``: only these of its layers, in this order (default: all)."""
    return Cache(os.fspath(path), allow_incomplete=allow_incomplete, dtype=dtype,
                 storage=StorageOptions(storage_options, local_cache_dir, cache_limit),
                 target_layer_ids=target_layer_ids)
