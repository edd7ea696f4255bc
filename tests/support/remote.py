"""Putting a locally produced cache into an object store the way a writer publishes it: each shard's
tar before its index (the commit), the manifest last. What the read side's tests start from."""

from __future__ import annotations

import os

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
