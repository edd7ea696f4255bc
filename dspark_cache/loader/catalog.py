"""What a reader may read: the manifest and the shards published so far (indexes loaded once)."""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict

from dspark_cache.format.errors import CacheError, CorruptShardError, NotACacheError
from dspark_cache.format.paths import CachePaths
from dspark_cache.format.schema import Manifest, ShardIndex
from dspark_cache.format.tar.reader import load_shard_index
from dspark_cache.loader.cache import read_manifest

_MAX_OPEN_FILES = 128


class ShardCatalog:
    """Published shard indexes (each loaded once) and a bounded pool of open shard files."""

    def __init__(self, path: str, *, follow: bool = False) -> None:
        self.paths = CachePaths(path)
        self.follow = follow
        self.manifest = read_manifest(path, allow_incomplete=follow)
        self._indexes: dict[int, ShardIndex] = {}
        self._fds: OrderedDict[int, int] = OrderedDict()
        self._lock = threading.Lock()

    def published(self, shard_id: int) -> ShardIndex | None:
        """The shard's index if it is published (index present, tar of the indexed size)."""
        index = self._indexes.get(shard_id)
        if index is None and os.path.exists(self.paths.shard_index(shard_id)):
            try:
                index = load_shard_index(self.paths, shard_id)
            except CorruptShardError:
                if not self.follow:
                    raise
                return None  # an index can appear a moment before the tar is fully visible
            self._indexes[shard_id] = index
        return index

    def require(self, shard_id: int) -> ShardIndex:
        index = self.published(shard_id)
        if index is None:
            raise CacheError(
                f"{self.paths.shard_tar(shard_id)} is not published although {self.paths.manifest} says the "
                f"cache is complete; run dspark-verify {self.paths.root}, then rerun dspark-produce to repair it"
            )
        return index

    def refresh_manifest(self) -> Manifest:
        """Re-read the manifest (follow mode); a different run in the same directory is an error."""
        fresh = read_manifest(self.paths.root, allow_incomplete=True)
        if fresh.identity() != self.manifest.identity():
            raise CacheError(
                f"{self.paths.manifest} changed identity while reading (the producer was restarted with "
                "other settings or --overwrite); restart training on the new cache"
            )
        self.manifest = fresh
        return fresh

    def fd(self, shard_id: int) -> int:
        """An open descriptor for a shard (LRU-bounded, shared by reader threads: pread only)."""
        with self._lock:
            fd = self._fds.get(shard_id)
            if fd is not None:
                self._fds.move_to_end(shard_id)
                return fd
            fd = os.open(self.paths.shard_tar(shard_id), os.O_RDONLY)
            self._fds[shard_id] = fd
            if len(self._fds) > _MAX_OPEN_FILES:
                # Closing under a reader still using it would be a bug; the pool is far larger
                # than the handful of shards a window reads at once.
                _, old = self._fds.popitem(last=False)
                os.close(old)
            return fd

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


def wait_for_manifest(path: str, poll: float, timeout: float | None) -> None:
    """Follow mode may start before the producer has planned: wait for the manifest."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not os.path.exists(CachePaths(path).manifest):
        if deadline is not None and time.monotonic() > deadline:
            raise NotACacheError(f"no manifest appeared in {path} within {timeout} s; is dspark-produce running?")
        time.sleep(poll)
