"""One cache's loader: deterministic, rank-equal, resumable batches, even from a growing cache.

The loader composes small stages: options checked once (:mod:`.config`), the directory
(:class:`~dspark_cache.storage.cache.CacheDir`), the order (:mod:`.order`), growing it while
following a producer (:mod:`.follow`), reading batches (:mod:`.reader`: program, memory, filler)
and NeMo's attribute shims (:mod:`.shims`). This module holds the epoch loop and the resume state.
"""

from __future__ import annotations

import numbers
import os
from collections import deque
from typing import Any, Iterator

import torch

from dspark_cache.format.schema import Manifest
from dspark_cache.loader.config import ORDER_OPTIONS, LoaderConfig
from dspark_cache.loader.follow import Follower, extend_all, wait_for_manifest
from dspark_cache.loader.order import EpochOrder, RankBatch, epoch_steps, rank_batch
from dspark_cache.loader.reader import BatchLayout, BatchReader
from dspark_cache.loader.shims import NemoAttributes
from dspark_cache.loader.validate import check_expectations
from dspark_cache.storage.cache import CacheDir

STATE_VERSION = 1
_PREFETCH_EVERY = 4  # batches between updates of what a remote cache downloads ahead
_PREFETCH_SHARDS = 64  # shards it may queue at once (its byte budget stops it sooner)


class DSparkLoader(NemoAttributes):
    """Iterable of batches for one rank; ``len()``, ``state_dict()``/``load_state_dict()``.

    Options: :class:`~.config.LoaderConfig`. Iterating continues the current epoch from the
    current position and, at its end, moves to the next epoch (a different order).
    ``state_dict()`` taken after ``k`` batches restores to exactly the batch ``k + 1`` an
    uninterrupted run would yield, on any world size.
    """

    def __init__(self, path: str | os.PathLike, batch_size: int, **options: Any) -> None:
        self.config = config = LoaderConfig(batch_size, **options)
        path = os.fspath(path)
        if config.follow:
            wait_for_manifest(path, config.poll_interval, config.follow_timeout, config.storage)
        self.cache = CacheDir(path, follow=config.follow, storage=config.storage,
                              poll=max(1.0, config.poll_interval) if config.follow else None)
        try:  # checks dtype and layers against the cache
            layout = BatchLayout.from_manifest(self.cache.manifest, config.dtype, config.target_layer_ids,
                                               where=f"the cache at {path}")
        except BaseException:
            self.cache.close()
            raise
        if config.expect:
            check_expectations(self.cache.manifest, config.expect, where=path, delivered=layout.states_code,
                               layers=layout.delivered_layer_ids)
        self.rank, self.world_size = config.ranks()
        self.epoch, self.offset = config.epoch, 0
        self._orders: dict[int, EpochOrder] = {}
        self._follower = Follower(self.cache, config.poll_interval, config.follow_timeout)
        self.reader = BatchReader(self.cache, layout,
                                  batch_size=batch_size, num_threads=config.threads, pad_to=config.pad_to,
                                  pin_memory=config.pinned, nemo_keys_only=config.nemo_keys_only,
                                  verify_mode=config.verify,
                                  # In flight, the batch training holds, the one it just dropped.
                                  keep=config.read_ahead + 2)

    # -- order --------------------------------------------------------------------------------

    @property
    def manifest(self) -> Manifest:
        return self.cache.manifest

    @property
    def batch_size(self) -> int:
        return self.config.batch_size

    @property
    def global_batch(self) -> int:
        return self.config.batch_size * self.world_size

    def _order(self, epoch: int) -> EpochOrder:
        order = self._orders.get(epoch)
        if order is None:
            c = self.config
            streaming = c.follow and epoch == 0
            order = EpochOrder(self.manifest.num_shards, c.seed, epoch, c.shuffle, c.window, streaming)
            self._orders = {epoch: order}  # keep one epoch's refs, not all of them
        return order

    def num_samples(self) -> int:
        """Samples of the current epoch (those published so far while the cache grows)."""
        order = self._order(self.epoch)
        extend_all(order, self.cache)
        return order.total if order.total is not None else self.manifest.num_samples

    def __len__(self) -> int:
        """Batches this rank yields in a whole epoch (exact once the cache is complete)."""
        return epoch_steps(
            0, self.num_samples(), 0, self.config.batch_size, self.world_size, self.config.drop_last
        )

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning at the next iteration."""
        self.epoch, self.offset = epoch, 0

    def _step_batch(self, order: EpochOrder, base: int, step: int) -> RankBatch | None:
        """This rank's part of global step ``step`` from ``base`` (growing the order to reach it),
        or None past the epoch's last step."""
        c = self.config
        if not order.complete:
            self._follower.grow(order, base + (step + 1) * self.global_batch)
        steps = epoch_steps(len(order.refs), order.total, base, c.batch_size, self.world_size, c.drop_last)
        if step >= steps:
            return None
        total = order.total if order.total is not None else len(order.refs)
        return rank_batch(
            order.refs, total, base, step, c.batch_size, self.world_size, self.rank, c.partial_last
        )

    # -- iterate ------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        order = self._order(self.epoch)
        base = self.offset
        pending: deque = deque()
        step = 0
        exhausted = False
        while True:
            if step % _PREFETCH_EVERY == 0:  # a remote cache fetches what is read next
                self._prefetch(order, base + step * self.global_batch)
            while not exhausted and len(pending) < self.config.read_ahead:
                wanted = self._step_batch(order, base, step + len(pending))
                if wanted is None:
                    exhausted = True
                else:
                    pending.append(self.reader.submit(wanted))
            if not pending:
                break
            batch = pending.popleft().result()
            step += 1
            self.offset = base + step * self.global_batch  # counted before yielding: state_dict()
            yield batch  # taken after k batches then points at batch k + 1
        self.epoch, self.offset = self.epoch + 1, 0

    def _prefetch(self, order: EpochOrder, position: int) -> None:
        if self.cache.remote is not None:
            self.cache.prefetch(order.shards_from(position, _PREFETCH_SHARDS))

    # -- resume -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """A few integers: where the next batch starts in the (world-size-free) global order, the
        batch size and world size it was taken on, and which cache that order is of (its ``cache_id``)."""
        return {"version": STATE_VERSION, **{k: getattr(self.config, k) for k in ORDER_OPTIONS},
                "batch_size": self.config.batch_size, "epoch": self.epoch, "offset": self.offset,
                "world_size": self.world_size, **self._identity()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` (from :meth:`state_dict`) left off, on any world size and batch size.

        The state is a position in the global order, which no rank count or batch size shapes: the
        rest of the epoch follows from it, every sample once. With the state's global batch
        (``batch_size`` x ``world_size``; 2 ranks x 8 continuing as 1 x 16 or 4 x 4) the global
        batches are those of the uninterrupted run; with another, the same samples in other batches."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"loader state version {state.get('version')!r} is not {STATE_VERSION}")
        diff = [f"{k}: state has {state.get(k)!r}, this loader has {getattr(self.config, k)!r}"
                for k in ORDER_OPTIONS if state.get(k) != getattr(self.config, k)]
        if diff:
            raise ValueError(
                "cannot restore a loader state made with other settings:\n  " + "\n  ".join(diff)
            )
        self._check_identity(state)
        bad = [f"{k}={state.get(k)!r}" for k in ("epoch", "offset") if not _count(state.get(k))]
        if bad:  # int() would take 1.5 or "3", and a negative offset would shift the epoch silently
            raise ValueError(f"loader state {', '.join(bad)}: epoch and offset are whole numbers >= 0, as "
                             "state_dict() writes them; pass the state it returned, unchanged")
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])

    def _identity(self) -> dict[str, Any]:
        """What the order is of, in a state: this cache's id."""
        return {"cache_id": self.cache.cache_id}

    def _check_identity(self, state: dict[str, Any]) -> None:
        if "mixture" in state:
            raise ValueError("cannot restore a loader state taken on a mixture of caches into a loader of "
                             f"one cache ({self.cache.root}); build the loader on the same mixture")
        # states from before ids: no check
        if state.get("cache_id", self.cache.cache_id) != self.cache.cache_id:
            raise ValueError(
                f"cannot restore a loader state taken on cache {state['cache_id'] or '(no id)'}: "
                f"{self.cache.root} holds cache {self.cache.cache_id or '(no id)'} now (it was "
                "re-produced with --overwrite), whose order is of other samples; start its first "
                "epoch from the beginning instead of loading this state"
            )

    def close(self) -> None:
        self.reader.close()
        self.cache.close()


def _count(value: Any) -> bool:
    """A whole number >= 0 (not a bool, a float or a string that ``int()`` would take)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0
