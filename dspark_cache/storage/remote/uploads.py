"""Sealed shards on their way to object storage, several at once, in publication order within each.

A shard is sealed in the staging directory (its tar whole and durable there, its index built);
:meth:`ShardUploads.submit` then queues it and returns, so the writer goes on with the next shard
while this one uploads. For each shard, on a transfer thread: the tar is uploaded (in parts, several
in flight, where it is large), its size on the store is checked against the index, and only then is
the index written (created, ``If-None-Match``: ``RemoteOutput.commit``), which is the commit that
readers see; after that the staging copy of the tar is deleted and the index kept there
(``committed``), so that the staging directory holds the published set and what is still on its way.

Staging is bounded: ``submit`` blocks while the tars not yet uploaded would exceed ``limit`` bytes
(one shard is always let through), which holds the writer, then the host ring, then the device,
exactly as a slow local disk does. The producer's writer lanes submit side by side, each with its
shard sealed (or still being written) beside the limit's worth: the staging disk holds at most the
limit, one shard let through and one shard a writer (``RemoteOutput.space_needed``). The first
failure is kept and raised by the next ``submit`` or by :meth:`flush`; a shard whose upload failed
is not published, and a rerun recomputes it.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from typing import Callable

from dspark_cache.format.faults import crash_point
from dspark_cache.format.paths import CachePaths
from dspark_cache.format.schema import ShardIndex, encode_json
from dspark_cache.storage.remote.node import DaemonThreads
from dspark_cache.storage.remote.store import ObjectStore, ObjectStoreError

log = logging.getLogger(__name__)

IN_FLIGHT = 4  # shards uploading at once (each a multipart upload of several parts in flight when large)


class ShardUploads:
    def __init__(self, store: ObjectStore, paths: CachePaths, limit: int,
                 committed: Callable[[ShardIndex, str], None],
                 commit: Callable[[str, bytes, str | None], str], threads: int = IN_FLIGHT) -> None:
        """``commit(relative, data, expected)``: the index put as a commit (``RemoteOutput.commit``);
        ``committed(index, etag)``: what follows once it is on the store."""
        self.store, self.paths, self.limit = store, paths, limit
        self._committed, self._commit = committed, commit
        self._pool: DaemonThreads | None = None
        self._threads = threads
        self._waiting = threading.Condition()
        self._staged = 0  # bytes of tars sealed and not yet uploaded
        self._pending: dict[int, Future] = {}
        self.error: BaseException | None = None
        self.uploaded_bytes = 0
        self.stalled_seconds = 0.0  # time ``submit`` held the writer because staging was full

    @property
    def staged_bytes(self) -> int:
        return self._staged

    def submit(self, index: ShardIndex) -> None:
        """Queue a sealed shard; blocks while staging is full; raises an earlier upload's failure."""
        self._raise()
        started = time.monotonic()
        with self._waiting:  # the producer's writer threads submit side by side
            while self._staged and self._staged + index.tar_bytes > self.limit and self.error is None:
                self._waiting.wait(0.5)
            self._raise()
            self._staged += index.tar_bytes
            self.stalled_seconds += time.monotonic() - started
            if self._pool is None:
                self._pool = DaemonThreads(self._threads, "dspark-upload")
            self._pending[index.shard_id] = self._pool.submit(self._upload, index)

    def _upload(self, index: ShardIndex) -> None:
        shard = index.shard_id
        tar = self.paths.relative(self.paths.shard_tar(shard))
        try:
            if self.error is not None:
                return  # one failure ends the run: publish nothing more
            self.store.upload(tar, self.paths.shard_tar(shard))
            crash_point("after_tar_upload")
            info = self.store.head(tar)
            if info is None or info.size != index.tar_bytes:
                raise ObjectStoreError(
                    f"{self.store.name(tar)}: after its upload the store holds "
                    f"{'nothing' if info is None else f'{info.size} bytes'}, its index says {index.tar_bytes}; the "
                    "shard is not published (rerun to upload it again; if this repeats, check the store)"
                )
            # The commit: only while this producer holds the cache, and only as a new object, so that
            # this write landing late, after another producer took the cache over, fails.
            etag = self._commit(self.paths.relative(self.paths.shard_index(shard)), encode_json(index), None)
            crash_point("after_index_upload")
            self._committed(index, etag)
            with self._waiting:
                self.uploaded_bytes += index.tar_bytes
        except BaseException as exc:  # noqa: BLE001  (kept for the writer, which stops the run)
            with self._waiting:
                if self.error is None:
                    self.error = exc
            raise
        finally:
            with self._waiting:
                self._staged -= index.tar_bytes
                self._pending.pop(shard, None)
                self._waiting.notify_all()

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def flush(self) -> None:
        """Wait until every queued shard is published (or one failed: raised)."""
        for future in list(self._pending.values()):
            try:
                future.result()
            except BaseException:  # noqa: BLE001  (the first failure is raised below)
                pass
        self._raise()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
