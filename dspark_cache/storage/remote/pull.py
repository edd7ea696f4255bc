"""The store brought down into a staging directory: what a producer resuming a remote cache starts from.

The store is the truth. :meth:`StagingPull.pull` makes the staging directory agree with it: the
shard indexes the store holds come down (several at once), staged indexes the store does not hold
go, staged tars go (sealed and never committed, or uploaded already), and a tar on the store
without its index (a producer killed between the two) is deleted there; the manifest and the
target weights are the store's or none; the plan's files come down; each rank's event log is
rebuilt from its segments where the staged one is shorter. A file comes down only where the
store's version (size and ETag, recorded in ``copies``) is not the one the staged file is.
"""

from __future__ import annotations

import logging
import os

from dspark_cache.format.atomic import atomic_write_bytes
from dspark_cache.format.paths import CachePaths
from dspark_cache.format.validate import MAX_MANIFEST_BYTES
from dspark_cache.storage.remote.copies import LocalCopies
from dspark_cache.storage.remote.store import ObjectInfo, ObjectStore
from dspark_cache.storage.remote.sync import MAX_SEGMENT_BYTES, StagingSync, segment_starts

log = logging.getLogger(__name__)


def file_size(path: str) -> int:
    """The file's size, -1 where there is none."""
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return -1


class StagingPull:
    """Brings ``store``'s objects into the staging directory ``paths``; ``sync`` learns what came down."""

    def __init__(self, store: ObjectStore, paths: CachePaths, sync: StagingSync, copies: LocalCopies) -> None:
        self.store, self.paths, self.sync, self.copies = store, paths, sync, copies

    def listing(self, directory: str) -> dict[str, ObjectInfo]:
        """One directory's objects, keyed by their path relative to the cache (as :meth:`pull` lists them)."""
        relative = self.paths.relative(directory)
        return {f"{relative}/{name}": info for name, info in self.store.list(relative).items()}

    def pull(self) -> dict[int, int]:
        """Everything (see the module's docstring); returns each published shard's tar size on the store."""
        listing = dict(self.store.walk())
        paths = self.paths
        sizes = self.shards(listing)
        for path in (paths.manifest, paths.target_weights):
            self.file(path, listing.get(paths.relative(path)))  # the store's, or none
        plan = paths.relative(paths.plan_dir) + "/"
        for relative, info in listing.items():
            if relative.startswith(plan) and "/" not in relative[len(plan):]:
                self.file(os.path.join(paths.root, relative), info, remove_missing=False)
        self.events(listing)
        return sizes

    def shards(self, listing: dict[str, ObjectInfo], *, clean_store: bool = True) -> dict[int, int]:
        """The staged indexes made the store's; ``clean_store``: a tar without an index deleted there
        (only the lease holder may). Returns each indexed shard's tar size on the store (-1: none)."""
        paths = self.paths
        shards = paths.relative(paths.shards_dir)
        indexes: dict[int, ObjectInfo] = {}
        tars: dict[int, int] = {}
        for relative, info in listing.items():
            directory, _, name = relative.rpartition("/")
            found = paths.shard_file(name) if directory == shards else None
            if found is not None and found[1] == "idx":
                indexes[found[0]] = info
            elif found is not None:
                tars[found[0]] = info.size
        for shard_id in sorted(set(tars) - set(indexes)) if clean_store else []:  # uploaded, never committed
            tar = paths.relative(paths.shard_tar(shard_id))
            log.info("removing %s: its upload was never committed by an index", self.store.name(tar))
            self.store.delete(tar)
        for name in os.listdir(paths.shards_dir) if os.path.isdir(paths.shards_dir) else []:
            found = paths.shard_file(name)
            if found is None:
                continue
            shard_id, kind = found
            # sealed and not committed, or unpublished on the store
            if kind == "tar" or shard_id not in indexes:
                self.copies.remove(f"{shards}/{name}")
        self.copies.copy_many(
            [
                (self.paths.relative(paths.shard_index(k)), info)
                for k, info in sorted(indexes.items())
                if not self.copies.unchanged(self.paths.relative(paths.shard_index(k)), info)
            ]
        )
        return {k: tars.get(k, -1) for k in indexes}

    def file(self, path: str, info: ObjectInfo | None, *, remove_missing: bool = True) -> None:
        """Bring one file down where the staged one is not the store's version; remove it where the store has none."""
        relative = self.paths.relative(path)
        if info is None:
            if remove_missing:
                self.copies.remove(relative)
            return
        if not self.copies.unchanged(relative, info):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            limit = MAX_MANIFEST_BYTES if path == self.paths.manifest else None
            self.copies.download(relative, expected=limit)
        self.sync.mark(path)

    def events(self, listing: dict[str, ObjectInfo], ranks: set[int] | None = None) -> None:
        """Each rank's event log (``ranks``: these ranks') from its segments, where the staged one is shorter."""
        events = self.paths.relative(self.paths.events_dir)
        segments: dict[int, dict[int, str]] = {}
        for relative in listing:
            directory, _, name = relative.rpartition("/")
            found = self.paths.events_segment_of(name) if directory == events else None
            if found is not None:
                segments.setdefault(found[0], {})[found[1]] = relative
        for rank, parts in segments.items():
            if ranks is not None and rank not in ranks:
                continue
            sizes = [listing[parts[k]].size for k in sorted(parts)]
            if file_size(self.paths.events(rank)) >= segment_starts(sizes)[-1] + sizes[-1]:
                continue
            data = b"".join(self._segment(parts[k]) for k in sorted(parts))
            os.makedirs(self.paths.events_dir, exist_ok=True)
            atomic_write_bytes(self.paths.events(rank), data, durable=False)

    def _segment(self, relative: str) -> bytes:
        got = self.store.get(relative, limit=MAX_SEGMENT_BYTES)
        return b"" if got is None else got[0][:MAX_SEGMENT_BYTES]
