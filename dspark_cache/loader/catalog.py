"""What a reader may read: the manifest and the shards published so far (indexes loaded once).

Open shard files are shared by reader threads through a bounded pool. A batch program pins the
descriptors it uses (:meth:`ShardCatalog.pin`) until it has run: the pool never closes a pinned
descriptor, so its number can never be reused for another file under a running read. Each
descriptor's file identity is recorded when it is opened (:func:`.verify.file_identity`): the
checksums a process has checked hold for that file only.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict

from dspark_cache.format.errors import CacheError, CorruptShardError, NotACacheError
from dspark_cache.format.files import open_regular
from dspark_cache.format.paths import CachePaths
from dspark_cache.format.schema import Manifest, ShardIndex
from dspark_cache.format.tar.reader import load_shard_index
from dspark_cache.loader.cache import read_manifest
from dspark_cache.loader.verify import FileIdentity, file_identity

_MAX_OPEN_FILES = 128  # idle descriptors kept open; pinned ones may exceed it for a while


class ShardCatalog:
    """Published shard indexes (each loaded once) and a bounded pool of open shard files."""

    def __init__(self, path: str, *, follow: bool = False) -> None:
        self.paths = CachePaths(path)
        self.follow = follow
        self.manifest = read_manifest(path, allow_incomplete=follow)
        self._indexes: dict[int, ShardIndex] = {}
        self._fds: OrderedDict[int, int] = OrderedDict()  # shard id -> fd, least recently used first
        self._pins: dict[int, int] = {}  # shard id -> batch programs using its fd now
        self._identity: dict[int, FileIdentity] = {}  # shard id -> its open file's identity
        self._lock = threading.Lock()
        self._check_shard_files()

    def _check_shard_files(self) -> None:
        """Published shards the manifest does not plan mean a tampered manifest or directory."""
        extra = [s for s in self.paths.indexed_shard_ids() if s >= self.manifest.num_shards]
        if extra:
            raise CacheError(
                f"{self.paths.root}: shards {extra[:5]} are published but {self.paths.manifest} plans "
                f"{self.manifest.num_shards} shards; the manifest or the shard directory was changed by hand: "
                f"run dspark-verify {self.paths.root}"
            )

    def published(self, shard_id: int) -> ShardIndex | None:
        """The shard's index if it is published (index present, tar of the indexed size)."""
        index = self._indexes.get(shard_id)
        if index is None and os.path.exists(self.paths.shard_index(shard_id)):
            try:
                index = load_shard_index(self.paths, shard_id, self.manifest)
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

    def pin(self, shard_ids: set[int]) -> dict[int, int]:
        """Open descriptors for ``shard_ids`` (pread only), held open until :meth:`unpin`."""
        with self._lock:
            fds = {}
            for shard_id in shard_ids:
                fd = self._fds.get(shard_id)
                if fd is None:
                    try:
                        fd = open_regular(self.paths.shard_tar(shard_id))
                    except CacheError as exc:
                        raise CorruptShardError(self.paths.shard_tar(shard_id), str(exc)) from exc
                    try:
                        self._identity[shard_id] = file_identity(fd)
                    except OSError:
                        os.close(fd)
                        raise
                    self._fds[shard_id] = fd
                self._fds.move_to_end(shard_id)
                self._pins[shard_id] = self._pins.get(shard_id, 0) + 1
                fds[shard_id] = fd
            self._evict()
            return fds

    def identity(self, shard_id: int) -> FileIdentity:
        """The identity of the shard's open file (recorded at open); ask only while it is pinned."""
        with self._lock:
            return self._identity[shard_id]

    def unpin(self, shard_ids: set[int]) -> None:
        with self._lock:
            for shard_id in shard_ids:
                left = self._pins[shard_id] - 1
                if left:
                    self._pins[shard_id] = left
                else:
                    del self._pins[shard_id]
            self._evict()

    def _evict(self) -> None:
        """Close idle descriptors beyond the bound, least recently used first; never a pinned one."""
        idle = [s for s in self._fds if s not in self._pins]
        for shard_id in idle[: max(0, len(self._fds) - _MAX_OPEN_FILES)]:
            os.close(self._fds.pop(shard_id))
            del self._identity[shard_id]

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
            self._pins.clear()
            self._identity.clear()


def wait_for_manifest(path: str, poll: float, timeout: float | None) -> None:
    """Follow mode may start before the producer has planned: wait for the manifest."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not os.path.exists(CachePaths(path).manifest):
        if deadline is not None and time.monotonic() > deadline:
            raise NotACacheError(f"no manifest appeared in {path} within {timeout} s; is dspark-produce running?")
        time.sleep(poll)
