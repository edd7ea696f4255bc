"""The write side of a cache on object storage: :class:`RemoteOutput`, a ``CacheOutput`` over a staging directory.

The producer and ``dspark-convert`` write a remote cache exactly as they write a local one, into a
local *staging directory* (``--staging-dir``); this object makes the store follow it:

* **taking it**: the staging directory's own ``flock`` (the ranks of one node), then the store's
  lease (``lease.Lease``: one producer per cache, without a shared filesystem);
* **bringing it down** (:meth:`RemoteOutput.lock`, the job's leader, holding the lease): the staging
  directory is made to agree with the store (``pull.StagingPull``: a producer on another machine
  resumes with an empty one), and unfinished multipart uploads are aborted (``multipart``);
* **ranks on other nodes** (a torchrun job with no shared filesystem; the producer's ``exchange``
  decides what moves, and when): a rank joins with a staging directory that is not the leader's
  (:meth:`RemoteOutput.join`, ``apart``), and staged files are put up (:meth:`RemoteOutput.push`) or
  brought down (``pull_file``, ``pull_directory``, ``pull_indexes``) on demand;
* **publishing**: a shard is sealed in staging, then uploaded, size-checked and committed by its
  index on the store (``uploads.ShardUploads``, bounded by ``staging_limit``), and only then indexed
  in staging, where its tar is deleted;
* **the small files** (heartbeats, events, plan, weights) go up from a thread (``sync.StagingSync``);
* **completing**: every upload is waited for, the wids list and the weights are put, and the manifest
  last, so that a reader never sees a complete manifest before what it names.

Commits (a shard's index, the manifest) are conditional writes (:meth:`RemoteOutput.commit`): an
index is created only where none exists, the manifest written only over the version this producer
last wrote or read, each after the lease is checked. A producer that lost its lease (stalled past its
ttl while another took the cache over) may still have a commit in flight: it lands late, and fails,
instead of replacing a file of the cache the other producer wrote. The completing producer checks
that the store's indexes are the versions it wrote or read before it writes the complete manifest.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Any, Callable, Iterable, Iterator

import msgspec

from dspark_cache.format.errors import CacheError
from dspark_cache.format.schema import Manifest, ShardIndex, encode_json
from dspark_cache.format.tar.reader import load_shard_index
from dspark_cache.format.tar.writer import ShardWriter, write_index
from dspark_cache.format.validate import MAX_MANIFEST_BYTES
from dspark_cache.format.wids_index import shard_entry, write_wids_index
from dspark_cache.storage.backing import StorageOptions
from dspark_cache.storage.lock import CacheLockedError
from dspark_cache.storage.ours import is_written_name
from dspark_cache.storage.output import CacheOutput
from dspark_cache.storage.remote.copies import LocalCopies
from dspark_cache.storage.remote.lease import Lease
from dspark_cache.storage.remote.multipart import abort_unfinished_uploads
from dspark_cache.storage.remote.pull import StagingPull
from dspark_cache.storage.remote.staging import (claim_staging, default_staging_dir, discard_staging,
                                                missing_top)
from dspark_cache.storage.remote.store import ConditionFailedError, ObjectInfo, ObjectStore
from dspark_cache.storage.remote.sync import StagingSync
from dspark_cache.storage.remote.uploads import ShardUploads
from dspark_cache.storage.remote.url import RemoteURL

log = logging.getLogger(__name__)

STAGING_LIMIT = 8 << 30  # default bytes of sealed tars staged before the writer waits for uploads


class RemoteOutput(CacheOutput):
    """The cache at ``url``, written through the staging directory (see the module's docstring)."""

    def __init__(self, url: str, *, storage: StorageOptions | None = None, staging_dir: str | None = None,
                 staging_limit: int | None = None, rank: int = 0, lease_wait: float | None = None) -> None:
        """``lease_wait``: seconds to wait for a lease another producer holds (``Lease.take``; ``None``:
        its default)."""
        storage = (storage or StorageOptions()).resolved()
        self.url = RemoteURL.parse(url)
        super().__init__(staging_dir or default_staging_dir(self.url, storage.local_cache_dir,
                                                            storage.storage_options))
        self.shown = str(self.url)
        self._made = missing_top(self.root)  # what a run failing before any shard removes (drop_lock)
        self.store = ObjectStore(self.url, storage.storage_options)
        self._storage_options = storage.storage_options
        self.rank = rank
        self.staging_limit = staging_limit if staging_limit is not None else STAGING_LIMIT
        self._lease: Lease | None = None
        self.lease_wait = lease_wait
        self._copies = LocalCopies(self.store, self.root, self.paths.staging_records)
        self._sync = StagingSync(self.store, self.paths, rank, self._copies, self._holds)
        self._puller = StagingPull(self.store, self.paths, self._sync, self._copies)
        self._syncing = False
        self._sizes: dict[int, int] = {}  # shard id -> its tar's size on the store (-1: not there)
        self._sizes_lock = threading.Lock()
        self._announce: dict[int, Callable[[ShardIndex], None]] = {}  # shard id -> publish()'s callback
        self._announcing = threading.Lock()  # callbacks one at a time
        self._uploads = ShardUploads(self.store, self.paths, self.staging_limit, self._committed, self.commit)

    def __repr__(self) -> str:
        return f"RemoteOutput({str(self.url)!r} staged at {self.root!r})"

    # -- the directory ------------------------------------------------------------------------

    def check(self, *, written_names: bool = False) -> None:
        """The staging directory's checks, that it stages this cache and no other, and that the store answers
        (a missing bucket or refused credentials are named here, before any work)."""
        claim_staging(self.paths, str(self.url))
        super().check(written_names=written_names)
        self.store.list(self.paths.relative(self.paths.control_dir))

    # -- the lock -----------------------------------------------------------------------------

    def lock(self, run_id: str, world_size: int = 1, *, overwrite: bool = False) -> None:
        """This node's lock on the staging directory, the store's lease, then the store brought down."""
        super().lock(run_id, world_size, overwrite=overwrite)
        lease = Lease(self.store, run_id, world_size)
        try:
            lease.take(overwrite=overwrite, wait=self.lease_wait)
        except BaseException:
            super().release()
            raise
        self._lease = lease
        try:
            self.pull()
            self._sync.start(leader=True, pull_stop=True)
            self._syncing = True
        except BaseException:
            self.release()
            raise

    def join(self, *, apart: bool = False) -> None:
        """Another rank of the job: this node's lock; ``apart`` (this staging directory is not the leader's:
        another node), the store's published shards and manifest brought down (every rank must see the same
        published set), and a stop request brought down from the store from here on."""
        if apart:  # nobody made this node's staging directory a cache's
            os.makedirs(self.paths.control_dir, exist_ok=True)
            self.create()
        super().join()
        if apart:
            # An earlier run's stop request and heartbeats here are no run's now (the leader forgot the store's);
            # this rank's event log goes on from the store's segments.
            CacheOutput.forget_heartbeats(self)
            self._puller.events(self._puller.listing(self.paths.events_dir), ranks={self.rank})
            self._set_sizes(
                self._puller.shards(self._puller.listing(self.paths.shards_dir), clean_store=False)
            )
            self.pull_file(self.paths.manifest)
        self._sync.start(leader=False, pull_stop=apart)
        self._syncing = True

    def release(self) -> None:
        self._let_go()
        super().release()

    def drop_lock(self) -> None:
        self._let_go()
        super().drop_lock()
        discard_staging(self._made)  # a failed run (or dry run) leaves no staging directory it made

    def _let_go(self) -> None:
        """Last files up, the lease given back. Uploads still in flight are not waited for (a run that
        failed): their shards are unpublished, and a rerun computes them again."""
        if self._syncing:
            self._sync.stop()
            self._syncing = False
        if self._lease is not None:
            self._lease.release()
            self._lease = None
        self._uploads.close()

    # -- the store brought down ---------------------------------------------------------------

    def pull(self) -> None:
        """Make the staging directory agree with the store (the store is the truth)."""
        self.create()
        self._set_sizes(self._puller.pull())
        aborted = abort_unfinished_uploads(
            self.url, self._storage_options, lambda r: is_written_name(self.paths, r)
        )
        if aborted:
            log.info(
                "%s: aborted %d unfinished multipart uploads left by an interrupted producer",
                self.url,
                aborted,
            )

    def _set_sizes(self, sizes: dict[int, int]) -> None:
        with self._sizes_lock:
            self._sizes = sizes
            self._published = None  # listed again from the staging directory on first use

    # -- staged files put up and brought down on demand ---------------------------------------
    # Besides what the sync thread puts and :meth:`pull` brings down: for the ranks of a job on other
    # nodes, each staging its own copy (the producer's ``exchange`` says when). A file comes down only
    # where the staged one is not the store's version; none is removed here.

    def push(self, files: Iterable[str]) -> None:
        """Put these staged files on the store now, where they changed since last put or brought down."""
        self._sync.push_files(list(files))

    def pull_file(self, path: str) -> None:
        """The store's version of ``path`` staged, where the store holds one."""
        self._pull(path, self.store.head(self.paths.relative(path)))

    def pull_directory(self, directory: str) -> None:
        """The store's versions of ``directory``'s files staged."""
        for name, info in self.store.list(self.paths.relative(directory)).items():
            self._pull(os.path.join(directory, name), info)

    def _pull(self, path: str, info: ObjectInfo | None) -> None:
        if info is not None:
            self._puller.file(path, info, remove_missing=False)

    def pull_indexes(self) -> None:
        """The shard indexes the store holds that are not staged in its version (shards published from
        other staging directories) brought down, their tars' sizes noted."""
        self._copies.copy_many(
            [
                (self.paths.relative(self.paths.shard_index(k)), info)
                for k, info in self._list_sizes().items()
                if not self._copies.unchanged(self.paths.relative(self.paths.shard_index(k)), info)
            ]
        )

    def _list_sizes(self) -> dict[int, ObjectInfo]:
        """One listing of ``shards/``: the tars' sizes noted; the indexes returned by shard id."""
        indexes = {}
        for name, info in self.store.list(self.paths.relative(self.paths.shards_dir)).items():
            found = self.paths.shard_file(name)
            if found is not None and found[1] == "tar":
                with self._sizes_lock:
                    self._sizes[found[0]] = info.size
            elif found is not None:
                indexes[found[0]] = info
        return indexes

    # -- our files ----------------------------------------------------------------------------

    def _remove_remote(self, relatives: Iterable[str]) -> None:
        for relative in relatives:
            self.store.delete(relative)
            self._copies.record(relative, None)  # no version of it is known now: the next write creates it

    def clear(self) -> None:
        """``--overwrite``: the store's files of ours, then the staging directory's."""
        self._remove_remote(r for r, _ in self.store.walk() if is_written_name(self.paths, r))
        super().clear()
        with self._sizes_lock:
            self._sizes = {}
        self._sync.forget()

    def forget_heartbeats(self) -> None:
        super().forget_heartbeats()
        for directory in (self.paths.status_dir, self.paths.control_dir):
            relative = self.paths.relative(directory)
            self._remove_remote(f"{relative}/{name}" for name in self.store.list(relative)
                                if is_written_name(self.paths, f"{relative}/{name}"))

    # -- the manifest -------------------------------------------------------------------------

    def write_manifest(self, manifest: Manifest) -> None:
        """Staged, then put; a complete manifest only after the weights it names are on the store."""
        super().write_manifest(manifest)
        if manifest.complete and os.path.exists(self.paths.target_weights):
            self.push([self.paths.target_weights])
        with open(self.paths.manifest, "rb") as handle:
            data = handle.read()
        relative = self.paths.relative(self.paths.manifest)
        known = self._copies.copied_from(relative)  # the version last written or read
        self._copies.record(relative, ObjectInfo(len(data), self.commit(
            relative, data, known.etag if known else None), 0.0))

    def commit(self, relative: str, data: bytes, expected: str | None) -> str:
        """Put a commit (an index, the manifest): while this producer holds the cache, and conditionally,
        as a new object (``expected`` ``None``) or over the version with the ETag ``expected``; its ETag.

        Where the store holds another version all the same, a producer that lost its lease wrote it late
        (the condition failed): the lease holder, checking its lease again, replaces it; a producer
        without a lease fails, naming the file."""
        self._fence()
        try:
            return self.store.put(relative, data, create=expected is None, match=expected)
        except ConditionFailedError:
            self._fence()  # raises where this producer is the one that lost the cache
            # A rank without the lease (the leader's stands for it) may have read an older version of the
            # manifest than its job's own last one: that one, of the same cache, it may replace.
            if self._lease is None and not self._same_cache(relative, data):
                raise CacheLockedError(
                    f"{self.store.name(relative)} changed on the store while this rank wrote it: another "
                    "producer wrote the cache meanwhile. Rerun when no other producer writes the cache"
                ) from None
        found = self.store.head(relative)
        if found is not None and self._lease is not None:
            log.warning("%s: replacing a version this producer neither wrote nor read (written late by a "
                        "producer that had lost the cache's lease)", self.store.name(relative))
        return self.store.put(relative, data, create=found is None, match=found.etag if found else None)

    def _same_cache(self, relative: str, data: bytes) -> bool:
        """The store's version of a manifest or index and ``data`` name the same ``cache_id``."""
        got = self.store.get(relative, limit=MAX_MANIFEST_BYTES)
        try:
            theirs = msgspec.json.decode(got[0]) if got is not None else None
            ours = msgspec.json.decode(data)
        except msgspec.DecodeError:
            return False
        return isinstance(theirs, dict) and isinstance(ours, dict) and bool(ours.get("cache_id")) \
            and theirs.get("cache_id") == ours.get("cache_id")

    def complete(self, manifest: Manifest) -> None:
        self.flush()
        # One LIST for the tars' sizes (not a HEAD per shard another process published), and the
        # indexes checked against what this node wrote or read.
        self._check_indexes(self._list_sizes())
        super().complete(manifest)

    def _check_indexes(self, indexes: dict[int, ObjectInfo]) -> None:
        """Before the complete manifest: every index on the store is the version this node wrote or read
        (its ETag), and every shard published here is on the store; raise naming the first that is not."""
        for shard_id in sorted(set(indexes) | set(self.scan())):
            relative = self.paths.relative(self.paths.shard_index(shard_id))
            known = self._copies.copied_from(relative)
            on_store = indexes.get(shard_id)
            if on_store is not None and known is not None and known.etag == on_store.etag:
                continue
            what = "is not on the store" if on_store is None else (
                "is on the store, not published by this run" if known is None
                else "on the store is not the version this run wrote or read")
            raise CacheError(
                f"{self.store.name(relative)} {what}: another producer wrote the cache meanwhile (one that "
                "had lost its lease); the cache is not marked complete. Rerun the same command to resume: "
                "every shard is checked again")

    def write_wids_index(self) -> None:
        self._list_sizes()  # one LIST, not a HEAD per shard another process published
        entries = [shard_entry(self.paths, self.shard_index(k)) for k in sorted(self.scan())]
        write_wids_index(self.paths, entries=entries)
        self.push([self.paths.wids_index])

    def space_needed(self, missing_bytes: int, largest_shard: int, writers: int = 1) -> int:
        # Staged at once, at most: the limit's worth waiting, one shard let through past it (its upload
        # in flight), and each writer's shard, being written or sealed and waiting for room.
        return min(missing_bytes, self.staging_limit + (writers + 1) * largest_shard)

    # -- shards -------------------------------------------------------------------------------

    def published(self) -> frozenset[int]:
        with self._sizes_lock:  # the transfer threads add to it
            if self._published is not None:
                return frozenset(self._published)
        return self.scan()

    def scan(self) -> frozenset[int]:
        with self._sizes_lock:
            return super().scan()

    def shard_index(self, shard_id: int) -> ShardIndex:
        return load_shard_index(self.paths, shard_id, tar_size=self._tar_size(shard_id))

    def _tar_size(self, shard_id: int) -> int:
        with self._sizes_lock:
            known = self._sizes.get(shard_id)
        if known is None:  # published by another rank of this node: ask the store
            info = self.store.head(self.paths.relative(self.paths.shard_tar(shard_id)))
            known = -1 if info is None else info.size
            with self._sizes_lock:
                self._sizes[shard_id] = known
        return known

    def _holds(self) -> bool:
        """Whether this process may still write the job's files: it holds the lease, or does not take one."""
        return self._lease is None or self._lease.lost is None

    def _fence(self) -> None:
        """Before a commit (an index, the manifest): the lease this process holds still stands. Ranks
        other than the leader hold none: the leader's stands for them."""
        if self._lease is not None:
            self._lease.fence()

    def publish(self, writer: ShardWriter, nonfinite: list[int] | None = None,
                published: Callable[[ShardIndex], None] | None = None) -> ShardIndex:
        """Seal the shard in staging and queue its upload; it is published once its index is on the store,
        and ``published`` is called then (from a transfer thread, one call at a time)."""
        if self._lease is not None:
            self._lease.check()
        index = writer.seal(nonfinite)
        if published is not None:
            with self._sizes_lock:
                self._announce[index.shard_id] = published
        self._uploads.submit(index)
        return index

    def _committed(self, index: ShardIndex, etag: str) -> None:
        """On a transfer thread, once the store holds the shard's index (``etag``): index it in staging, drop its tar."""
        write_index(self.paths, index)
        relative = self.paths.relative(self.paths.shard_index(index.shard_id))
        self._copies.record(
            relative, ObjectInfo(os.path.getsize(self.paths.shard_index(index.shard_id)), etag, 0.0)
        )
        with self._sizes_lock:
            self._sizes[index.shard_id] = index.tar_bytes
            if self._published is not None:
                self._published.add(index.shard_id)
        try:
            os.unlink(self.paths.shard_tar(index.shard_id))
        except FileNotFoundError:
            pass
        with self._sizes_lock:
            announce = self._announce.pop(index.shard_id, None)
        if announce is not None:
            with self._announcing:
                announce(index)

    def flush(self) -> None:
        self._uploads.flush()

    def replace_index(self, index: ShardIndex) -> None:
        relative = self.paths.relative(self.paths.shard_index(index.shard_id))
        found = self.store.head(relative)
        self._committed(index, self.commit(relative, encode_json(index), found.etag if found else None))

    @contextlib.contextmanager
    def shard_tar(self, shard_id: int) -> Iterator[str]:
        path = self.paths.shard_tar(shard_id)
        os.makedirs(self.paths.shards_dir, exist_ok=True)
        relative = self.paths.relative(path)
        try:
            self._copies.download(relative)
            yield path
        finally:
            self._copies.remove(relative)

    def unpublish(self, shard_id: int) -> None:
        """The store's index, then its tar (readers stop seeing it first), then the staged copies."""
        self._remove_remote(self.paths.relative(p) for p in (self.paths.shard_index(shard_id),
                                                             self.paths.shard_tar(shard_id)))
        super().unpublish(shard_id)
        with self._sizes_lock:
            self._sizes.pop(shard_id, None)

    @property
    def transfer(self) -> dict[str, Any]:
        """What the uploads did: bytes up, bytes staged now, seconds the writer waited for room."""
        return {"uploaded_bytes": self._uploads.uploaded_bytes, "staged_bytes": self._uploads.staged_bytes,
                "stalled_seconds": self._uploads.stalled_seconds}

