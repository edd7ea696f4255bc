"""Small objects of a remote cache copied into a local directory, each with the version it was copied from.

A copy is kept as long as the store's object keeps its size and ETag (recorded per object, in a
``seen`` directory beside the copies), so a reader comparing the local file's identity sees it
change exactly when the store's object changed; an object gone from the store is removed here.
The manifest and shard indexes are read whole, and no further than one byte past their readers'
limit (a larger object is cut there, for the reader's own size check to refuse).
"""

from __future__ import annotations

import os

from dspark_cache.format.atomic import atomic_write_bytes
from dspark_cache.format.paths import MANIFEST
from dspark_cache.format.remote.node import DaemonThreads
from dspark_cache.format.remote.store import ObjectInfo, ObjectStore
from dspark_cache.format.validate import MAX_INDEX_BYTES, MAX_MANIFEST_BYTES

_MAX_SMALL = {True: MAX_MANIFEST_BYTES, False: MAX_INDEX_BYTES}
_SMALL_IN_FLIGHT = 16  # copies at once


class LocalCopies:
    """Copies of ``store``'s objects under ``root`` (paths relative to the cache), versions recorded in ``seen``."""

    def __init__(self, store: ObjectStore, root: str, seen: str) -> None:
        self.store, self.root, self._seen_dir = store, root, seen

    def local(self, relative: str) -> str:
        return os.path.join(self.root, *relative.split("/"))

    def _seen(self, relative: str) -> str:
        return os.path.join(self._seen_dir, relative.replace("/", "%"))

    def copied_from(self, relative: str) -> str | None:
        """``"size:etag"`` of the store's version the local copy is, if recorded."""
        try:
            with open(self._seen(relative)) as handle:
                return handle.read()
        except FileNotFoundError:
            return None

    def record(self, relative: str, info: ObjectInfo | None) -> None:
        if info is None:
            try:
                os.unlink(self._seen(relative))
            except FileNotFoundError:
                pass
        else:
            os.makedirs(self._seen_dir, exist_ok=True)
            atomic_write_bytes(self._seen(relative), f"{info.size}:{info.etag}".encode(), durable=False)

    def remove(self, relative: str) -> None:
        try:
            os.unlink(self.local(relative))
        except FileNotFoundError:
            pass
        self.record(relative, None)

    def unchanged(self, relative: str, info: ObjectInfo) -> bool:
        return self.copied_from(relative) == f"{info.size}:{info.etag}" and os.path.exists(self.local(relative))

    def copy_many(self, objects: list[tuple[str, ObjectInfo]]) -> None:
        """Copy these small objects in, several requests in flight (a cache of 10,000 shards has as
        many indexes: one at a time, opening it would wait on 10,000 round trips)."""
        if len(objects) <= 1:
            for relative, info in objects:
                self.copy(relative, info)
            return
        threads = DaemonThreads(min(_SMALL_IN_FLIGHT, len(objects)), "dspark-index")
        try:
            for future in [threads.submit(self.copy, relative, info) for relative, info in objects]:
                future.result()
        finally:
            threads.close()

    def copy(self, relative: str, known: ObjectInfo | None = None) -> None:
        """Make the local copy of a small object the store's current one (removed where it is gone)."""
        if known is not None and self.unchanged(relative, known):
            return
        got = self.store.get(relative, _MAX_SMALL[relative == MANIFEST])
        if got is None:
            self.remove(relative)
            return
        data, info = got
        if self.unchanged(relative, info):
            return  # unchanged: keep the file (a reader compares its identity)
        atomic_write_bytes(self.local(relative), data, durable=False)
        self.record(relative, info)
