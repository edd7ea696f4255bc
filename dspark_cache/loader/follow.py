"""Growing an epoch's order from the shards published so far, waiting for more while following.

The order itself is pure (:class:`~.order.EpochOrder`); this module is where it meets the
directory: it looks a window's shards up in the :class:`~dspark_cache.storage.cache.CacheDir`
and, in follow mode, polls until the producer publishes them.
"""

from __future__ import annotations

import logging
import time

from dspark_cache.format.errors import CacheError, NotACacheError
from dspark_cache.loader.order import EpochOrder
from dspark_cache.storage.backing import StorageOptions, open_backing
from dspark_cache.storage.cache import CacheDir

log = logging.getLogger(__name__)
_NOTE_EVERY = 30.0  # seconds between "still waiting" log lines


def wait_for_manifest(
    path: str, poll: float, timeout: float | None, storage: StorageOptions | None = None
) -> None:
    """Follow mode may start before the producer has planned: wait for the manifest (an object
    store is asked at most once a second)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    backing = open_backing(path, storage)
    try:
        while not backing.has_manifest():
            if deadline is not None and time.monotonic() > deadline:
                raise NotACacheError(
                    f"no manifest appeared in {path} within {timeout} s; is dspark-produce running?"
                )
            time.sleep(poll if backing.remote is None else max(poll, 1.0))
    finally:
        backing.close()


def extend(order: EpochOrder, cache: CacheDir) -> bool:
    """Add the order's next window if all its shards are published; False when it must wait.

    Outside follow mode a missing shard of a complete cache is an error, raised here.
    """
    if order.complete:
        return False
    indexes = {s: cache.published(s) for s in order.next_shards()}
    missing = [s for s, index in indexes.items() if index is None]
    if missing:
        if not cache.follow:
            cache.require(missing[0])  # raises: a complete cache misses a shard
        return False
    order.add_window(indexes)
    return True


def extend_all(order: EpochOrder, cache: CacheDir) -> None:
    """Add every window whose shards are published now, in order (no waiting)."""
    while extend(order, cache):
        pass


class Follower:
    """Grows an order to a needed size, polling the directory while the producer catches up."""

    def __init__(self, cache: CacheDir, poll_interval: float, timeout: float | None) -> None:
        self.cache, self.poll_interval, self.timeout = cache, poll_interval, timeout

    def grow(self, order: EpochOrder, needed: int) -> None:
        """Grow ``order`` until it holds ``needed`` samples or is complete (waiting in follow mode)."""
        waited_since = time.monotonic()
        last_note = waited_since
        while len(order.refs) < needed and not order.complete:
            if extend(order, self.cache):
                continue
            now = time.monotonic()
            if self.timeout is not None and now - waited_since > self.timeout:
                raise CacheError(f"no new shard published in {self.cache.root} for {self.timeout} s")
            if now - last_note > _NOTE_EVERY:
                log.info("waiting for shards %s to be published", order.next_shards())
                last_note = now
            self.cache.refresh()
            time.sleep(self.poll_interval)
