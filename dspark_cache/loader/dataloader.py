"""``build_dataloader``: deterministic, rank-equal, resumable batches, even from a growing cache."""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from typing import Any, Iterator

import torch

from dspark_cache.format.errors import CacheError
from dspark_cache.loader.catalog import ShardCatalog, wait_for_manifest
from dspark_cache.loader.planner import RankBatch, SampleRef, epoch_steps, rank_batch, shard_sequence, window_order, windows
from dspark_cache.loader.reader import BatchLayout, BatchReader
from dspark_cache.loader.validate import check_expectations

log = logging.getLogger(__name__)
STATE_VERSION = 1
# State fields that must match on restore; world size may change (the global order does not).
_STATE_IDENTITY = ("seed", "shuffle", "window", "drop_last", "partial_last", "batch_size", "follow")


class EpochOrder:
    """One epoch's sample order, extended window by window as their shards are published."""

    def __init__(self, catalog: ShardCatalog, seed: int, epoch: int, shuffle: bool, window: int, streaming: bool) -> None:
        shard_ids = list(range(catalog.manifest.num_shards))
        # While following a producer, visit shards in id order (the order they are produced in);
        # otherwise in the permuted order. Either way the order depends on shard ids only.
        sequence = sorted(shard_ids) if streaming else shard_sequence(shard_ids, seed, epoch, shuffle)
        self.catalog, self.seed, self.epoch, self.shuffle = catalog, seed, epoch, shuffle
        self.windows = windows(sequence, window)
        self.refs: list[SampleRef] = []
        self.loaded = 0

    @property
    def complete(self) -> bool:
        return self.loaded == len(self.windows)

    @property
    def total(self) -> int | None:
        return len(self.refs) if self.complete else None

    def extend(self) -> bool:
        """Add the next window if all its shards are published; False when it must wait."""
        if self.complete:
            return False
        shards = self.windows[self.loaded]
        indexes = {s: self.catalog.published(s) for s in shards}
        if any(index is None for index in indexes.values()):
            if not self.catalog.follow:
                missing = [s for s, i in indexes.items() if i is None]
                self.catalog.require(missing[0])  # raises: a complete cache misses a shard
            return False
        by_id = {s: sorted(range(i.num_samples), key=lambda k: i.samples[k].sample_id) for s, i in indexes.items()}
        self.refs += window_order(shards, by_id, self.seed, self.epoch, self.loaded, self.shuffle)
        self.loaded += 1
        return True


class DSparkLoader:
    """Iterable of batches for one rank; ``len()``, ``state_dict()``/``load_state_dict()``.

    Iterating continues the current epoch from the current position and, at its end, moves to
    the next epoch (a different order). ``state_dict()`` taken after ``k`` batches restores to
    exactly the batch ``k + 1`` an uninterrupted run would yield, on any world size.
    """

    def __init__(self, path: str | os.PathLike, batch_size: int, *, shuffle: bool = True, seed: int = 0,
                 epoch: int = 0, rank: int | None = None, world_size: int | None = None,
                 num_workers: int | None = None, pad_to: str = "seq_length", drop_last: bool = False,
                 partial_last: bool = False, follow: bool = False, expect: dict[str, Any] | None = None, window: int = 4, prefetch: int = 2,
                 pin_memory: bool | None = None, nemo_keys_only: bool = False, poll_interval: float = 0.5,
                 follow_timeout: float | None = None, verify: str = "once") -> None:
        if batch_size < 1 or window < 1:
            raise ValueError("batch_size and window must be >= 1")
        path = os.fspath(path)
        if follow:
            wait_for_manifest(path, poll_interval, follow_timeout)
        self.catalog = ShardCatalog(path, follow=follow)
        if expect:
            check_expectations(self.catalog.manifest, expect, where=path)
        dist_rank, dist_world = _distributed_defaults()
        self.rank = dist_rank if rank is None else rank
        self.world_size = dist_world if world_size is None else world_size
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in [0, {self.world_size})")
        self.batch_size, self.shuffle, self.seed, self.window = batch_size, shuffle, seed, window
        self.drop_last, self.partial_last, self.follow = drop_last, partial_last, follow
        self.prefetch = max(1, prefetch)
        self.poll_interval, self.follow_timeout = poll_interval, follow_timeout
        self.epoch, self.offset = epoch, 0
        self._orders: dict[int, EpochOrder] = {}
        threads = num_workers if num_workers is not None else min(4, os.cpu_count() or 1)
        self.reader = BatchReader(self.catalog, BatchLayout.from_manifest(self.catalog.manifest),
                                  batch_size=batch_size, num_threads=threads, pad_to=pad_to,
                                  pin_memory=torch.cuda.is_available() if pin_memory is None else pin_memory,
                                  nemo_keys_only=nemo_keys_only, verify_mode=verify,
                                  # In flight, the batch training holds, the one it just dropped.
                                  keep=self.prefetch + 2)
        self.dataset = _Sized(self)  # NeMo logs len(loader.dataset)
        self.sampler = self  # NeMo calls loader.sampler.set_epoch(epoch)

    # -- plan ---------------------------------------------------------------------------------

    @property
    def manifest(self):
        return self.catalog.manifest

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size

    def _order(self, epoch: int) -> EpochOrder:
        order = self._orders.get(epoch)
        if order is None:
            streaming = self.follow and epoch == 0
            order = EpochOrder(self.catalog, self.seed, epoch, self.shuffle, self.window, streaming)
            self._orders = {epoch: order}  # keep one epoch's refs, not all of them
        return order

    def num_samples(self) -> int:
        order = self._order(self.epoch)
        while order.extend():
            pass
        return order.total if order.total is not None else self.manifest.num_samples

    def __len__(self) -> int:
        """Batches this rank yields in a whole epoch (exact once the cache is complete)."""
        return epoch_steps(0, self.num_samples(), 0, self.batch_size, self.world_size, self.drop_last)

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning at the next iteration."""
        self.epoch, self.offset = epoch, 0

    def _await(self, order: EpochOrder, needed: int) -> None:
        """Grow the order until it holds ``needed`` samples or is complete (waiting in follow mode)."""
        waited_since = time.monotonic()
        last_note = waited_since
        while len(order.refs) < needed and not order.complete:
            if order.extend():
                continue
            now = time.monotonic()
            if self.follow_timeout is not None and now - waited_since > self.follow_timeout:
                raise CacheError(f"no new shard published in {self.catalog.paths.root} for {self.follow_timeout} s")
            if now - last_note > 30:
                log.info("waiting for shards %s to be published", order.windows[order.loaded])
                last_note = now
            self.catalog.refresh_manifest()
            time.sleep(self.poll_interval)

    def _plan_step(self, order: EpochOrder, base: int, step: int) -> RankBatch | None:
        self._await(order, base + (step + 1) * self.global_batch)
        steps = epoch_steps(len(order.refs), order.total, base, self.batch_size, self.world_size, self.drop_last)
        if step >= steps:
            return None
        total = order.total if order.total is not None else len(order.refs)
        return rank_batch(order.refs, total, base, step, self.batch_size, self.world_size, self.rank,
                          self.partial_last)

    # -- iterate ------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        order = self._order(self.epoch)
        base = self.offset
        pending: deque = deque()
        step = 0
        exhausted = False
        while True:
            while not exhausted and len(pending) < self.prefetch:
                planned = self._plan_step(order, base, step + len(pending))
                if planned is None:
                    exhausted = True
                else:
                    pending.append(self.reader.submit(planned))
            if not pending:
                break
            batch = pending.popleft().result()
            step += 1
            self.offset = base + step * self.global_batch  # counted before yielding: state_dict()
            yield batch  # taken after k batches then points at batch k + 1
        self.epoch, self.offset = self.epoch + 1, 0

    # -- resume -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """A few integers: where the next batch starts in the (world-size-free) global order."""
        return {"version": STATE_VERSION, "seed": self.seed, "shuffle": self.shuffle, "window": self.window,
                "drop_last": self.drop_last, "partial_last": self.partial_last, "batch_size": self.batch_size,
                "follow": self.follow,
                "epoch": self.epoch, "offset": self.offset, "world_size": self.world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"loader state version {state.get('version')!r} is not {STATE_VERSION}")
        diff = [f"{k}: state has {state.get(k)!r}, this loader has {getattr(self, k)!r}"
                for k in _STATE_IDENTITY if state.get(k) != getattr(self, k)]
        if diff:
            raise ValueError("cannot restore a loader state made with other settings:\n  " + "\n  ".join(diff))
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])

    def close(self) -> None:
        self.reader.close()
        self.catalog.close()


class _Sized:
    def __init__(self, loader: DSparkLoader) -> None:
        self._loader = loader

    def __len__(self) -> int:
        return self._loader.num_samples()


def _distributed_defaults() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def build_dataloader(cached_target_path: str | os.PathLike, batch_size: int, **kwargs: Any) -> DSparkLoader:
    """Batches of a dspark cache for one training rank (see :class:`DSparkLoader` for options).

    Keys: NeMo's ``input_ids``, ``loss_mask`` (int64 ``[B,S]``), ``target_hidden_states``
    ``[B,S,len(ids)*H]`` and ``target_last_hidden_states`` ``[B,S,H]`` (cache dtype, zero-padded),
    plus ``attention_mask`` ``[B,S]``, ``sample_ids`` ``[B]`` and ``is_repeat`` ``[B]`` (True for
    the repeats that pad the last step when ``drop_last`` is off).

    Every sample's xxh3 is checked the first time this process reads it (``verify="once"``, the
    default: later epochs re-read checked bytes from the page cache without hashing them);
    ``verify="always"`` checks every read. Each sample's header is checked on every read.

    Batch memory is recycled once nothing references a batch any more; a batch (or any view
    of it) that the caller keeps is never overwritten. Pinned batches (``pin_memory``, on by
    default where CUDA exists) come from CUDA's caching host allocator instead.
    """
    return DSparkLoader(cached_target_path, batch_size, **kwargs)
