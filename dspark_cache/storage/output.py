"""The write side of a cache directory: :class:`CacheOutput`, the twin of ``cache.CacheDir``.

One object owns an output directory's life for the producer and ``dspark-convert``: the lock
and its holder (``lock``), the checks that its directories are real, which files are ours,
clearing for ``--overwrite``, the manifest written and completed, the current ``cache_id``,
shards published and unpublished, and the set of published shards. Its interface is about
objects (a whole file written, a shard published, files listed, read or deleted, the directory
locked), so that a storage backend other than a local directory plugs in here. Which files are
ours, and the checks before any is deleted, are ``ours``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from typing import Callable, Iterable, Iterator

from dspark_cache.format.manifest import read_manifest, write_manifest
from dspark_cache.format.paths import CachePaths
from dspark_cache.format.schema import Manifest, ShardIndex
from dspark_cache.format.tar.reader import load_shard_index
from dspark_cache.format.tar.writer import ShardWriter, write_index
from dspark_cache.format.wids_index import write_wids_index
from dspark_cache.storage.lock import DirectoryLock, lock_exclusive, lock_shared
from dspark_cache.storage.ours import (
    check_directories, check_written_names, heartbeat_files, plan_files, remove_files, written_files,
)

class CacheOutput:
    """One cache directory being written. Nothing is touched until a method is called.

    * ``check(written_names=False)`` refuses a directory that is not one, sub-directories that are
      links or not directories, a lock file that is not a file, leftovers that are not files
      (``written_names``: anything but a file or link under a name the producer writes);
      ``create()`` makes the directories shards are published in.
    * ``lock(run_id, world_size)`` holds it exclusively (or raises ``CacheLockedError`` naming the
      holder), ``share()`` lets a job's other ranks ``join()``, ``release()`` lets go, and
      ``drop_lock()`` also deletes the lock file (a failed dry run that created it).
    * ``written_files()``, ``heartbeat_files()``, ``plan_files()``, ``leftovers()``: which files
      are ours; ``remove(files)`` deletes some, ``clear()`` every one (``--overwrite``),
      ``forget_heartbeats()`` earlier runs' heartbeats, stop requests and completion claims.
    * ``read_manifest()`` (``None`` when there is none), ``write_manifest(m)``, ``cache_id``, and
      ``complete(m)`` (the manifest of a cache whose every shard is published).
    * ``published()``: the published shard ids, listed once and kept current by this object's
      ``publish(writer)`` and ``unpublish(id)``; ``scan()`` lists them again, to see what other
      processes (the job's other ranks, its pipeline's writer) published; ``shard_index(id)``.
    """

    def __init__(self, root: str | os.PathLike) -> None:
        self.paths = CachePaths(os.fspath(root))
        self.root = self.paths.root
        # what messages call the cache (a remote one's URL; ``root`` is then its staging)
        self.shown = self.root
        self._lock: DirectoryLock | None = None
        self._locked = False  # taken (the lock is None where the filesystem has no locks)
        self._published: set[int] | None = None

    # -- the directory ------------------------------------------------------------------------

    def check(self, *, written_names: bool = False) -> None:
        """Refuse a cache whose own directories or files are not what this tool would write there."""
        check_directories(self.paths)
        if written_names:
            check_written_names(self.paths)

    def create(self) -> None:
        """The directory and the sub-directories shards, heartbeats and events are written in."""
        self.paths.ensure_dirs()

    # -- the lock -----------------------------------------------------------------------------

    def lock(self, run_id: str, world_size: int = 1, *, overwrite: bool = False) -> None:
        """Hold the directory exclusively (its ``control/`` made first), or raise naming who holds it."""
        os.makedirs(self.paths.control_dir, exist_ok=True)
        self._lock = lock_exclusive(self.paths, run_id, world_size, overwrite)
        self._locked = True

    def share(self) -> None:
        """Exclusive -> shared, so that the job's other ranks can :meth:`join` it."""
        if self._lock is not None:
            self._lock.share()

    def join(self, *, apart: bool = False) -> None:
        """Hold the directory shared with the job's rank 0, once it has shared its lock (``apart``: this
        rank's directory is not rank 0's, which a remote cache's staging directory on another node can be;
        the ranks writing a directory share it)."""
        self._lock = lock_shared(self.paths)
        self._locked = True

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()
        self._lock, self._locked = None, False

    def drop_lock(self) -> None:
        """Release the lock and delete its file: a failed dry run leaves no lock file it did not find."""
        if self._lock is not None:
            self._lock.remove()
        elif self._locked:  # a filesystem without locks: nobody can hold it
            remove_files([self.paths.lock])
        self._lock, self._locked = None, False

    # -- our files ----------------------------------------------------------------------------

    def written_files(self) -> list[str]:
        """Every file this tool writes in the cache, except the lock and the saved plan."""
        return written_files(self.paths)

    def heartbeat_files(self) -> list[str]:
        """Status files, stop requests and completion claims (never the lock, never events)."""
        return heartbeat_files(self.paths)

    def plan_files(self) -> list[str]:
        """The saved plan's files and their temporaries (``--overwrite`` leaves them to the plan
        store: they are rebuilt before the cache is cleared)."""
        return plan_files(self.paths)

    def leftovers(self) -> list[str]:
        """What an interrupted writer left half-written in ``shards/`` (never read)."""
        return self.paths.partial_files()

    def remove(self, files: Iterable[str]) -> None:
        """Delete each of ``files`` (a symlink itself, never its target; a directory never)."""
        remove_files(files)

    def clear(self) -> None:
        """What ``--overwrite`` deletes: the files this tool writes, one by one; not the lock, nothing
        else. The caller holds the lock and has checked the directory."""
        remove_files(self.written_files())
        self._published = set()

    def forget_heartbeats(self) -> None:
        """Earlier runs' heartbeats, stop requests and completion claims describe no live process
        (the caller holds the lock)."""
        remove_files(self.heartbeat_files())

    # -- the manifest -------------------------------------------------------------------------

    def read_manifest(self) -> Manifest | None:
        """The manifest on disk, complete or not; ``None`` when there is none yet."""
        return read_manifest(self.root, missing_ok=True, allow_incomplete=True)

    def write_manifest(self, manifest: Manifest) -> None:
        write_manifest(self.paths, manifest)

    @property
    def cache_id(self) -> str:
        """The ``cache_id`` of the manifest on disk (every index published carries it); ``""`` where
        there is no manifest (a bare pipeline)."""
        manifest = self.read_manifest()
        return manifest.cache_id if manifest is not None else ""

    def complete(self, manifest: Manifest) -> None:
        """Record what was stored (samples dropped as non-finite included) and flip ``complete``."""
        self.flush()
        nonfinite = sorted(sid for i in sorted(self.scan()) for sid in self.shard_index(i).nonfinite)
        manifest.nonfinite_samples = nonfinite
        manifest.cache_id = self.cache_id  # another rank's manifest was built without rank 0's id
        manifest.num_samples = manifest.planned_samples - len(nonfinite)
        manifest.complete = True
        manifest.completed_at = time.time()
        self.write_wids_index()  # exact now that every shard is published (ranks' updates could race)
        self.write_manifest(manifest)

    def write_wids_index(self) -> None:
        """Rewrite wids' shard list from every published shard."""
        write_wids_index(self.paths)

    def space_needed(self, missing_bytes: int, largest_shard: int, writers: int = 1) -> int:
        """Bytes this machine's disk must have free for the shards still to be written (``largest_shard``:
        the largest of them; ``writers``: shards written at once)."""
        return missing_bytes

    # -- shards -------------------------------------------------------------------------------

    def free_space(self) -> int:
        """Bytes free on the disk the shards go to (the nearest existing directory before the cache is made)."""
        probe = os.path.abspath(self.root)
        while not os.path.isdir(probe) and os.path.dirname(probe) != probe:
            probe = os.path.dirname(probe)
        return shutil.disk_usage(probe).free

    def published(self) -> frozenset[int]:
        """The shard ids whose index is published, as this object knows them (listed on first use)."""
        if self._published is None:
            return self.scan()
        return frozenset(self._published)

    def scan(self) -> frozenset[int]:
        """List the published shards again (other processes publish too)."""
        self._published = set(self.paths.indexed_shard_ids())
        return frozenset(self._published)

    def shard_index(self, shard_id: int) -> ShardIndex:
        """A published shard's index, checked (``CorruptShardError`` when it is damaged)."""
        return load_shard_index(self.paths, shard_id)

    def publish(self, writer: ShardWriter, nonfinite: list[int] | None = None,
                published: Callable[[ShardIndex], None] | None = None) -> ShardIndex:
        """Publish the shard ``writer`` wrote: its tar, then its index (the commit); ``published`` is called
        with the index once readers see the shard (here at once; a backend that uploads calls it later,
        from its own thread)."""
        index = writer.publish(nonfinite=nonfinite)
        if self._published is not None:
            self._published.add(index.shard_id)
        if published is not None:
            published(index)
        return index

    def flush(self) -> None:
        """Wait until every shard handed to :meth:`publish` is published (a directory's are at once)."""

    def replace_index(self, index: ShardIndex) -> None:
        """Publish a rebuilt index over a published shard's damaged one (``dspark-verify --repair``)."""
        write_index(self.paths, index)

    @contextlib.contextmanager
    def shard_tar(self, shard_id: int) -> Iterator[str]:
        """A published shard's tar as a local file, for as long as the block runs (a remote one is downloaded)."""
        yield self.paths.shard_tar(shard_id)

    def unpublish(self, shard_id: int) -> None:
        """Remove a shard's index, then its tar: readers stop seeing it first, and a rerun recomputes
        it. A symlink is removed itself, never its target."""
        for file in (self.paths.shard_index(shard_id), self.paths.shard_tar(shard_id)):
            if os.path.lexists(file):
                os.unlink(file)
        if self._published is not None:
            self._published.discard(shard_id)

