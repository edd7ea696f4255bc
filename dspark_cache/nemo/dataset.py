"""A dspark cache as a map-style dataset, so that NeMo's own ``DataLoader`` and sampler drive it.

Index ``i`` is the ``i``-th sample in ascending sample id, which is NeMo's sample ``i`` for a
cache of the same rows. ``__getitems__`` fills a whole batch with one call into the loader's
batch filler (one read per sample, checksums verified, zero padding to ``seq_length``), so the
``DataLoader``'s ``collate_fn`` receives a finished batch; :func:`collate` passes it through.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np
import torch

from dspark_cache.format.errors import CacheError
from dspark_cache.loader.order import RankBatch, SampleRef
from dspark_cache.loader.reader import BatchLayout, BatchReader
from dspark_cache.nemo.nemo_format import CACHE_KEYS, stack_samples
from dspark_cache.storage.backing import StorageOptions
from dspark_cache.storage.cache import CacheDir


class DSparkMapDataset(torch.utils.data.Dataset):
    """Samples of a complete dspark cache by position (ascending sample id), batched on request.

    Safe in ``DataLoader`` worker processes: files and reader threads are opened per process.
    ``dtype``: the hidden states' dtype, as ``build_dataloader``'s (FP8 caches are dequantised to it;
    bf16 by default). ``cache_dir`` may be an object-store URL: shards are then downloaded to this
    node on first use (``storage``; by default from ``DSPARK_STORAGE_OPTIONS``, ``DSPARK_LOCAL_CACHE_DIR``
    and ``DSPARK_CACHE_LIMIT``, so that an unedited NeMo recipe can read one). ``target_layer_ids``:
    the layers whose states are handed out, as ``build_dataloader``'s (default: all the cache holds).
    """

    def __init__(self, cache_dir: str | os.PathLike, *, batch_size: int = 1, native: bool | None = None,
                 dtype: object = None, storage: StorageOptions | None = None,
                 target_layer_ids: Sequence[int] | None = None) -> None:
        self.cache_dir = os.fspath(cache_dir)
        self.batch_size = max(1, batch_size)
        self.native = native
        self.storage = storage
        cache = CacheDir(self.cache_dir, storage=storage)
        self.manifest = cache.manifest
        try:  # refuses a dtype the cache cannot give, or layers it does not hold
            self.layout = BatchLayout.from_manifest(self.manifest, dtype, target_layer_ids,
                                                    where=f"the cache at {self.cache_dir}")
        except BaseException:
            cache.close()
            raise
        self._shard, self._entry = _positions(cache)
        self._cache: CacheDir | None = cache
        self._reader: BatchReader | None = None
        self._pid = os.getpid()

    def __len__(self) -> int:
        return len(self._shard)

    @property
    def sample_ids(self) -> list[int]:
        """Sample id at each position."""
        cache = self._open_cache()
        return [cache.require(int(s)).samples[int(e)].sample_id for s, e in zip(self._shard, self._entry)]

    def __getitems__(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """The samples at ``indices`` as one batch with NeMo's four keys, padded to ``seq_length``."""
        batch = self.submit(indices).result()
        if torch.utils.data.get_worker_info() is not None:
            batch = {key: _shared_copy(value) for key, value in batch.items()}
        return batch

    def submit(self, indices: Sequence[int]) -> "PendingNemoBatch":
        """Start reading the batch of ``indices`` on the reader thread; ``.result()`` waits for it."""
        refs = tuple(
            SampleRef(int(self._shard[i]), int(self._entry[i])) for i in map(self._position, indices)
        )
        return PendingNemoBatch(
            self._batch_reader(len(refs)).submit(RankBatch(0, refs, (False,) * len(refs)))
        )

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        """One sample: each of NeMo's four keys without the batch dimension."""
        return {key: value[0] for key, value in self.__getitems__([index]).items()}

    def _position(self, index: int) -> int:
        n = len(self)
        position = index + n if index < 0 else index
        if not 0 <= position < n:
            raise IndexError(f"sample position {index} is out of range for {n} samples in {self.cache_dir}")
        return position

    def _open_cache(self) -> CacheDir:
        if self._pid != os.getpid() or self._cache is None:
            # A forked DataLoader worker: reader threads and descriptors belong to the parent.
            # The cache the parent opened, or an error if it was replaced since (positions are the parent's).
            self._cache = CacheDir(self.cache_dir, cache_id=self.manifest.cache_id, storage=self.storage)
            self._reader, self._pid = None, os.getpid()
            if self._cache.manifest.identity() != self.manifest.identity():
                raise CacheError(
                    f"{self.cache_dir} was replaced by a different cache while training read it; "
                    "restart training"
                )
        return self._cache

    def _batch_reader(self, rows: int) -> BatchReader:
        cache = self._open_cache()
        if self._reader is None or rows > self.batch_size:
            if self._reader is not None:
                self._reader.close()
            self.batch_size = max(self.batch_size, rows)
            in_worker = torch.utils.data.get_worker_info() is not None
            self._reader = BatchReader(
                cache, self.layout, batch_size=self.batch_size, num_threads=1,
                pad_to="seq_length", pin_memory=torch.cuda.is_available() and not in_worker,
                nemo_keys_only=True, native=self.native,
            )
        return self._reader

    def __getstate__(self) -> dict[str, Any]:
        # Spawned DataLoader workers get the sample positions, never descriptors or threads.
        state = dict(self.__dict__)
        state.update(_cache=None, _reader=None, _pid=-1)
        return state

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
        if self._cache is not None:
            self._cache.close()
        self._reader = self._cache = None


class PendingNemoBatch:
    """A batch being filled by the reader thread."""

    def __init__(self, pending: Any) -> None:
        self._pending = pending

    def result(self) -> dict[str, torch.Tensor]:
        batch = self._pending.result()
        return {key: batch[key] for key in CACHE_KEYS}  # NeMo's key order


def _shared_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy in shared memory, for handing a batch from a worker process to the main process.

    Sending the recycled batch memory itself would let torch move its storage into shared memory
    in place while the reader recycles it for the next batch: a worker returns copies, once.
    """
    out = torch.empty_like(tensor).share_memory_()
    return out.copy_(tensor)


def _positions(cache: CacheDir) -> tuple[np.ndarray, np.ndarray]:
    """(shard id, index entry) of every sample, in ascending sample id (every shard checked, no
    sample listed twice: positions must name one sample each)."""
    order = cache.sample_order()
    return np.asarray([s for s, _ in order], dtype=np.int32), np.asarray(
        [k for _, k in order], dtype=np.int32
    )


def collate(data: dict[str, torch.Tensor] | list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A batch from ``__getitems__`` as it is; per-sample dicts (``__getitem__``) stacked."""
    return data if isinstance(data, dict) else stack_samples(data)
