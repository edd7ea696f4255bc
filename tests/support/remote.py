"""Putting a locally produced cache into an object store the way a writer publishes it: each shard's
tar before its index (the commit), the manifest last. What the read side's tests start from."""

from __future__ import annotations

import os
from typing import Callable

from dspark_cache.format.paths import MANIFEST, SHARDS_DIR, CachePaths
from dspark_cache.storage.remote.store import ObjectStore


def upload_cache(local: str, url: str, *, shards: list[int] | None = None, manifest: bool = True,
                 storage_options: dict | None = None) -> ObjectStore:
    """Upload the cache at ``local`` to ``url``: every file but the manifest and the shards, then the
    ``shards`` given (all by default) tar first, then (``manifest``) the manifest."""
    store = ObjectStore(url, storage_options)
    paths = CachePaths(local)
    ids = paths.indexed_shard_ids() if shards is None else shards
    for directory, _, files in os.walk(local):
        for name in sorted(files):
            relative = os.path.relpath(os.path.join(directory, name), local).replace(os.sep, "/")
            if relative != MANIFEST and not relative.startswith(f"{SHARDS_DIR}/"):
                store.upload(relative, os.path.join(directory, name))
    for shard_id in ids:
        publish_shard(store, local, shard_id)
    if manifest:
        store.upload(MANIFEST, paths.manifest)
    return store


def publish_shard(store: ObjectStore, local: str, shard_id: int) -> None:
    paths = CachePaths(local)
    for path in (paths.shard_tar(shard_id), paths.shard_index(shard_id)):
        store.upload(f"{SHARDS_DIR}/{os.path.basename(path)}", path)


class _Client:
    """The object-store client module as an :class:`ObjectStore` calls it, over one in-memory store,
    able to lose the answers of its next conditional writes after they landed (as a reset, or a retry
    that lost to the write it repeats, does on a real store)."""

    def __init__(self) -> None:
        import obstore

        self._obstore = obstore
        self.lose_answers = 0  # conditional writes still to lose the answer of
        self.before_match: Callable[[], object] | None = None  # run once, before the next If-Match write
        self.matches = 0  # If-Match writes sent
        self.before_put: Callable[[str], object] | None = None  # run before every write, with its key

    def __getattr__(self, name: str):
        return getattr(self._obstore, name)

    def put(self, store, key: str, data, **kwargs):
        if self.before_put is not None:
            self.before_put(key)
        self.matches += isinstance(kwargs.get("mode"), dict)
        if self.before_match is not None and isinstance(kwargs.get("mode"), dict):
            hook, self.before_match = self.before_match, None
            hook()
        result = self._obstore.put(store, key, data, **kwargs)
        if self.lose_answers and kwargs.get("mode", "overwrite") != "overwrite":
            self.lose_answers -= 1
            raise self._obstore.exceptions.PreconditionError(f"{key}: the retry of a write that landed (412)")
        return result


def memory_store(memory=None, url: str = "s3://bucket/cache") -> tuple[ObjectStore, _Client]:
    """An :class:`ObjectStore` at ``url`` whose objects live in ``memory`` (an ``obstore`` MemoryStore; a
    new one by default), which supports the conditional writes a lease needs; and its client, to lose
    answers. ObjectStore has no constructor over a given store, so its client store is swapped."""
    from obstore.store import MemoryStore

    store = ObjectStore(url, {"access_key_id": "k", "secret_access_key": "s", "region": "us-east-1"})
    client = _Client()
    store._store = memory if memory is not None else MemoryStore()
    store._obstore = client
    return store, client

# A cache's names relative to its root, as its object keys are under the cache's prefix
# (os.path.join("", name) is name).
KEYS = CachePaths("")
