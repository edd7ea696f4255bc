"""The standard ``wids`` shard index next to the shards, so ``wids.ShardListDataset`` opens a cache.

``wids`` (webdataset's random-access reader) needs every shard's sample count before it reads a
byte. We know them from our own shard indexes, so the cache carries the index ``wids`` itself
would make (schema ``wids-shard-index-v1``), at :attr:`CachePaths.wids_index`::

    {"__kind__": "wids-shard-index-v1", "wids_version": 1,
     "shardlist": [{"url": "shard-000000.tar", "nsamples": 256, "filesize": 1073745920}, ...]}

URLs are relative to the index's own directory, where ``wids`` resolves them, so a copied or
moved cache keeps working. Shards are listed in shard-id order and samples keep their order in
the tar, so ``dataset[i]`` is the ``i``-th sample in that order (not sample id ``i``).

When it is written (always atomically, :mod:`.atomic`):

* :func:`add_shard` at every shard's publication, after the shard's own index: entries of the
  other published shards come from the previous file, or from their index when the previous
  file lacks them; shards no longer published are dropped. Ranks publish concurrently, so one
  rank's rewrite can miss a shard another rank published a moment earlier.
* :func:`write_wids_index`, exactly, from every published index: when the cache completes and
  after ``dspark-verify --repair``. A complete cache's wids index is therefore exact.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from typing import Any

from dspark_cache.format.atomic import atomic_write_bytes
from dspark_cache.format.errors import CacheError
from dspark_cache.format.files import read_regular
from dspark_cache.format.paths import CachePaths
from dspark_cache.format.schema import ShardIndex
from dspark_cache.format.tar.reader import load_shard_index

log = logging.getLogger(__name__)

WIDS_KIND = "wids-shard-index-v1"
WIDS_VERSION = 1
# About 80 bytes a shard: room for a million shards, and a bound on what a damaged file costs.
MAX_WIDS_INDEX_BYTES = 256 << 20

Entry = dict[str, Any]


def shard_entry(paths: CachePaths, index: ShardIndex) -> Entry:
    """One shard as ``wids`` lists it: its tar's name (relative to the index), samples, bytes."""
    return {"url": os.path.basename(paths.shard_tar(index.shard_id)), "nsamples": index.num_samples,
            "filesize": index.tar_bytes}


def encode_wids_index(entries: list[Entry]) -> bytes:
    """The index file's bytes (one shard a line: readable, and diffs stay small)."""
    lines = ",\n    ".join(json.dumps(e, separators=(", ", ": ")) for e in entries)
    body = f"\n    {lines}\n  " if entries else ""
    return (f'{{\n  "__kind__": "{WIDS_KIND}",\n  "wids_version": {WIDS_VERSION},\n'
            f'  "shardlist": [{body}]\n}}\n').encode()


def write_wids_index(
    paths: CachePaths, *, durable: bool = True, entries: list[Entry] | None = None
) -> list[Entry]:
    """Rewrite the index exactly from every published shard index (or as ``entries``, where the tars are
    not in this directory); returns its entries.

    A shard whose index cannot be read is left out with a warning (it is not readable either);
    ``dspark-verify`` names it.
    """
    if entries is None:
        entries = [
            e for e in (_entry_from_index(paths, s) for s in paths.indexed_shard_ids()) if e is not None
        ]
    atomic_write_bytes(paths.wids_index, encode_wids_index(entries), durable=durable)
    return entries


def add_shard(paths: CachePaths, index: ShardIndex, *, durable: bool = False) -> None:
    """Put a just-published shard into the index (see the module docstring for what is kept).

    Not durable by default: a file lost in a crash is rebuilt from the shard indexes by the next
    publication or at completion, which writes it durably. One process's writer threads take turns
    (another rank's rewrite can still miss this one, as the module docstring says).
    """
    with _adding:
        _add_shard(paths, index, durable)


_adding = threading.Lock()


def _add_shard(paths: CachePaths, index: ShardIndex, durable: bool) -> None:
    previous = _previous_entries(paths)
    entries: list[Entry] = []
    for shard_id in paths.indexed_shard_ids():
        name = os.path.basename(paths.shard_tar(shard_id))
        if shard_id == index.shard_id:
            entries.append(shard_entry(paths, index))
        elif name in previous:
            entries.append(previous[name])
        elif (entry := _entry_from_index(paths, shard_id)) is not None:
            entries.append(entry)  # published by another rank since the file was last written
    atomic_write_bytes(paths.wids_index, encode_wids_index(entries), durable=durable)


def read_wids_index(paths: CachePaths) -> dict[str, Any]:
    """The index as written (parsed JSON); ``CacheError`` naming the file when it is unusable."""
    path = paths.wids_index
    try:
        data = json.loads(read_regular(path, MAX_WIDS_INDEX_BYTES))
    except FileNotFoundError as exc:
        raise CacheError(f"{path} is missing; rerun dspark-produce on the cache (or dspark-verify --repair) "
                         "to write it") from exc
    except (ValueError, UnicodeDecodeError) as exc:  # json's errors are ValueErrors
        raise CacheError(f"{path} is not JSON ({exc}); dspark-verify --repair rewrites it") from exc
    if not _well_formed(data):
        raise CacheError(f"{path} is not a {WIDS_KIND} file; dspark-verify --repair rewrites it")
    return data


def _well_formed(data: Any) -> bool:
    if (
        not isinstance(data, dict)
        or data.get("__kind__") != WIDS_KIND
        or data.get("wids_version") != WIDS_VERSION
    ):
        return False
    shards = data.get("shardlist")
    return isinstance(shards, list) and all(
        isinstance(e, dict) and isinstance(e.get("url"), str) and type(e.get("nsamples")) is int
        and type(e.get("filesize")) is int for e in shards)


def _previous_entries(paths: CachePaths) -> dict[str, Entry]:
    """The current file's entries by URL; none when it is missing or unusable (rebuilt instead)."""
    try:
        data = read_wids_index(paths)
    except CacheError as exc:
        if os.path.lexists(paths.wids_index):
            log.info("rebuilding %s from the shard indexes: %s", paths.wids_index, exc)
        return {}
    return {e["url"]: e for e in data["shardlist"]}


def _entry_from_index(paths: CachePaths, shard_id: int) -> Entry | None:
    try:
        return shard_entry(paths, load_shard_index(paths, shard_id))
    except CacheError as exc:  # a damaged shard, or one unpublished while we listed
        log.warning("%s leaves out shard %d: %s", paths.wids_index, shard_id, exc)
        return None
