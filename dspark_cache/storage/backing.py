"""Where a cache opened for reading lives: a local directory, or an object store mirrored to one.

:class:`~dspark_cache.storage.cache.CacheDir` reads a local directory through one interface,
whatever backs it; this module picks the backing from the path:

* a plain path: :class:`LocalBacking`, where every call is free and files are read in place;
* an object-store URL (``s3://bucket/prefix``, :func:`~.remote.url.is_remote`):
  :class:`~.remote.mirror.NodeMirror`, which copies the manifest and indexes into a node-local
  directory, downloads tars as they are needed or ahead of the epoch's order, and bounds them.

The interface: ``root`` (the local directory read), ``remote`` (the URL, or ``None``),
``has_manifest()``, ``refresh_manifest(force=)``, ``refresh_listing(force=)``,
``tar_size(id)`` (the published tar's size, or ``None``: take it from the local file),
``acquire(index)`` / ``release(id)`` around each open of a shard's tar, ``prefetch(indexes)``
and ``close()``.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

from dspark_cache.format.paths import CachePaths
from dspark_cache.format.schema import ShardIndex
from dspark_cache.storage.remote.url import is_remote


@dataclass(frozen=True)
class StorageOptions:
    """How a remote cache is reached and kept on this node: the client's options (``--storage-options``),
    the node-local directory (default ``$DSPARK_LOCAL_CACHE_DIR`` or ``~/.cache/dspark-cache/remote``)
    and its byte limit (default: half the free space there). Ignored for a local cache."""

    storage_options: dict[str, Any] | None = field(default=None, repr=False)  # may hold secrets
    local_cache_dir: str | None = None
    cache_limit: int | None = None

    def resolved(self) -> "StorageOptions":
        """Unset fields from the environment: ``DSPARK_STORAGE_OPTIONS`` (JSON), ``DSPARK_LOCAL_CACHE_DIR``,
        ``DSPARK_CACHE_LIMIT`` (bytes, or with a K/M/G/T suffix): how a program that only passes a
        path (an unedited NeMo recipe) configures a remote cache."""
        options = self.storage_options
        if options is None and os.environ.get(ENV_STORAGE_OPTIONS):
            options = parse_storage_options(os.environ[ENV_STORAGE_OPTIONS], ENV_STORAGE_OPTIONS)
        limit = self.cache_limit
        if limit is None and os.environ.get(ENV_CACHE_LIMIT):
            limit = parse_size(os.environ[ENV_CACHE_LIMIT], ENV_CACHE_LIMIT)
        return StorageOptions(
            options, self.local_cache_dir or os.environ.get(ENV_LOCAL_CACHE_DIR) or None, limit
        )


ENV_STORAGE_OPTIONS = "DSPARK_STORAGE_OPTIONS"
ENV_LOCAL_CACHE_DIR = "DSPARK_LOCAL_CACHE_DIR"
ENV_CACHE_LIMIT = "DSPARK_CACHE_LIMIT"
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str, where: str) -> int:
    """``"500G"``, ``"1.5T"``, ``"1048576"`` (binary units) as bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if match is None or float(match[1]) <= 0:
        raise ValueError(
            f"{where}={text!r} is not a size; write bytes, or a number with K, M, G or T (e.g. 500G)"
        )
    return int(float(match[1]) * _UNITS[match[2].upper()])


def parse_storage_options(text: str, where: str) -> dict[str, Any]:
    """The JSON object of ``--storage-options`` / ``DSPARK_STORAGE_OPTIONS`` (never echoed: it may hold secrets)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where} is not valid JSON ({exc.msg} at character {exc.pos}); give an object such "
                         'as {"endpoint": "https://...", "region": "us-east-1"}') from None
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a JSON object of client options, not a {type(value).__name__}")
    return value


class Backing(Protocol):
    root: str
    remote: str | None

    def has_manifest(self) -> bool: ...
    def refresh_manifest(self, *, force: bool = False) -> None: ...
    def refresh_listing(self, *, force: bool = False) -> None: ...
    def tar_size(self, shard_id: int) -> int | None: ...
    def acquire(self, index: ShardIndex) -> None: ...
    def release(self, shard_id: int) -> None: ...
    def prefetch(self, indexes: list[ShardIndex]) -> None: ...
    def fetch_file(self, relative: str) -> bool: ...
    def close(self) -> None: ...


class LocalBacking:
    """A cache directory on a filesystem of this machine: read in place, nothing to fetch."""

    remote = None

    def __init__(self, root: str) -> None:
        self.root = root

    def has_manifest(self) -> bool:
        return os.path.exists(CachePaths(self.root).manifest)

    def refresh_manifest(self, *, force: bool = False) -> None:
        pass

    def refresh_listing(self, *, force: bool = False) -> None:
        pass

    def tar_size(self, shard_id: int) -> int | None:
        return None

    def acquire(self, index: ShardIndex) -> None:
        pass

    def release(self, shard_id: int) -> None:
        pass

    def prefetch(self, indexes: list[ShardIndex]) -> None:
        pass

    def fetch_file(self, relative: str) -> bool:
        """Whether the cache has this file; it is already where readers read it."""
        return os.path.lexists(os.path.join(self.root, relative))

    def close(self) -> None:
        pass


def open_backing(
    path: str | os.PathLike, storage: StorageOptions | None = None, *, poll: float | None = None
) -> Backing:
    """The backing of the cache at ``path`` (a directory, or an object-store URL)."""
    if not is_remote(path):
        return LocalBacking(os.fspath(path))
    from dspark_cache.storage.remote.mirror import NodeMirror  # the client library is an optional extra

    storage = (storage or StorageOptions()).resolved()
    mirror = NodeMirror(
        str(path),
        storage_options=storage.storage_options,
        local_cache_dir=storage.local_cache_dir,
        cache_limit=storage.cache_limit,
        **({} if poll is None else {"poll": poll}),
    )
    return mirror
