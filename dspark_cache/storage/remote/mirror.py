"""A remote cache read through a node-local directory: :class:`NodeMirror` (``local_cache_dir``).

Readers (the loader's C filler, ``open_cache``, ``dspark-verify``) read local files by offset,
so a remote cache is mirrored into an ordinary cache directory on local disk and read there:

* the manifest and the shard indexes (small) are copied in whole and kept current: the manifest
  at most every ``poll`` seconds, the index listing once at open and, while following a producer,
  at most every ``poll`` seconds (one LIST per 1000 shards). An object that vanished or changed
  remotely is removed or replaced locally, so the directory reader's own checks (a replaced
  cache, an unpublished shard) see what the store holds;
* a shard's tar is downloaded when a reader needs it or, ahead of that, in the order the epoch
  will read them (:meth:`prefetch`, several downloads in flight), checked against its index
  (size and whole-tar xxh3 while it streams: a corrupted download is fetched again once, then
  reported naming the object), and renamed into place whole;
* the tars kept locally are bounded by ``cache_limit`` bytes: least recently used first, a shard
  in use by any process never. Processes and ranks of one node that use the same
  ``local_cache_dir`` share one copy: a shard is downloaded once per node (an ``flock`` per shard
  for the download, a shared ``flock`` while a process reads it, which eviction must not see).

Layout: ``<local_cache_dir>/<scheme>/<store>/<bucket>/<prefix>/`` is a cache directory (``manifest.json``,
``shards/``; ``<store>`` names the endpoint or account, :func:`.localdir.store_key`), and its ``.mirror/``
holds the locks, the downloads in progress and, per copied object, the version it was copied from.
A copy found there is served only once authenticated (:mod:`.copies`), in a directory only this user
may write (:func:`.localdir.own_directory`).
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import threading
import time
import weakref
from concurrent.futures import Future
from typing import Any

import xxhash

from dspark_cache.format.errors import CacheError, CorruptShardError
from dspark_cache.format.paths import MANIFEST, SHARDS_DIR, CachePaths
from dspark_cache.format.schema import ShardIndex
from dspark_cache.storage.remote.copies import LocalCopies
from dspark_cache.storage.remote.localdir import (LocalCopyError, default_local_cache_dir, local_copy_dir,
                                                 own_directory, own_replica_dirs)
from dspark_cache.storage.remote.node import DaemonThreads, hold_lock, release_all
from dspark_cache.storage.remote.store import ObjectInfo, ObjectStore
from dspark_cache.storage.remote.url import RemoteURL

log = logging.getLogger(__name__)

_DEFAULT_SHARE = 0.5  # without cache_limit: at most half of the free space where the mirror lives
_POLL = 2.0  # seconds between checks of the remote manifest / listing
_IN_FLIGHT = 4  # downloads at once
# What is copied of a manifest (True) or an index (False) at most: one byte past the readers' limit,
# so that a hostile object is refused by their size check, never held whole.
_MIRROR = ".mirror"
_EVICTING = "evicting"  # held by the one process deleting tars to keep the node's copy within its limit


__all__ = ["NodeMirror", "default_local_cache_dir"]


class NodeMirror:
    """The node-local copy of one remote cache. ``root`` is the node-local directory to read.

    ``refresh_manifest()``/``refresh_listing()`` copy the small objects in (rate-bounded unless
    ``force``); ``tar_size(id)`` is a published shard's size in the store; ``acquire(index)``
    makes its tar local and holds it in use until ``release(id)``; ``prefetch(indexes)``
    downloads ahead in that order. ``close()`` stops downloads and lets go of every shard.
    """

    def __init__(self, url: str, *, storage_options: dict[str, Any] | None = None,
                 local_cache_dir: str | os.PathLike | None = None, cache_limit: int | None = None,
                 poll: float = _POLL) -> None:
        self.url = RemoteURL.parse(url)
        self.remote = str(self.url)
        self.store = ObjectStore(self.url, storage_options)
        base, self.root = local_copy_dir(None, self.url, storage_options, local_cache_dir)
        own_directory(self.root, base)
        self.paths = CachePaths(self.root)
        self._meta = os.path.join(self.root, _MIRROR)
        for sub in (self.paths.shards_dir, *(os.path.join(self._meta, d) for d in ("use", "get"))):
            own_directory(sub, self.root)
        own_replica_dirs(self._meta, self.root)
        self.copies = LocalCopies(self.store, self.root, self._meta)
        if cache_limit is not None and cache_limit <= 0:
            raise ValueError(f"cache_limit={cache_limit}: it is the most bytes of shards kept on this node, "
                             "more than 0")
        self.cache_limit = cache_limit if cache_limit is not None else int(
            shutil.disk_usage(self.root).free * _DEFAULT_SHARE)
        self.poll = poll
        self._listing: dict[str, ObjectInfo] = {}
        self._checked = {"manifest": 0.0, "listing": 0.0}
        self._in_use: dict[int, tuple[int, int]] = {}  # shard id -> (use-lock fd, holders in this process)
        self._held_bytes: dict[int, int] = {}  # shard id -> its tar's size, while in use here
        self._lock = threading.RLock()
        self._pool = DaemonThreads(_IN_FLIGHT)
        self._wanted: dict[int, Future] = {}  # shard id -> its prefetch
        self._wanted_bytes: dict[int, int] = {}
        self._closed = False
        self.downloads = 0  # tars this process downloaded (the rest it found on the node)
        self.copies.temporaries.clean()
        _mirrors.add(self)
        # Dropped without close(): its use locks must not keep shards unevictable for the process's life.
        weakref.finalize(self, release_all, self._in_use)

    def __repr__(self) -> str:
        return f"NodeMirror({str(self.url)!r} at {self.root!r})"

    # -- small objects ------------------------------------------------------------------------

    def _due(self, what: str, force: bool) -> bool:
        now = time.monotonic()
        if not force and now - self._checked[what] < self.poll:
            return False
        self._checked[what] = now
        return True

    def has_manifest(self) -> bool:
        """Whether the store holds a manifest now (one request)."""
        self.refresh_manifest(force=True)
        return os.path.exists(self.paths.manifest)

    def refresh_manifest(self, *, force: bool = False) -> None:
        """Copy the manifest in if it changed (at most every ``poll`` s unless ``force``, or at once where
        the local copy is gone: the store, not a removed local file, says whether the cache is there)."""
        if self._due("manifest", force) or not os.path.exists(self.paths.manifest):
            try:
                self.copies.copy(MANIFEST)
            except FileNotFoundError as exc:  # not the store's (an absent manifest is no error): ours
                raise self._vanished(exc) from exc

    def refresh_listing(self, *, force: bool = False) -> None:
        """List the shards in the store; copy new or changed indexes in, drop the local copies of
        shards that are no longer published (at most every ``poll`` s unless ``force``)."""
        if not self._due("listing", force):
            return
        try:
            self._refresh_listing()
        except FileNotFoundError as exc:
            raise self._vanished(exc) from exc

    def _refresh_listing(self) -> None:
        listing = self.store.list(SHARDS_DIR)
        with self._lock:
            self._listing = listing
        changed = [(f"{SHARDS_DIR}/{name}", info) for name, info in listing.items()
                   if (shard := self.paths.shard_file(name)) is not None and shard[1] == "idx"
                   and not self.copies.unchanged(f"{SHARDS_DIR}/{name}", info)]
        self.copies.copy_many(changed)
        for name in os.listdir(self.paths.shards_dir):
            shard = self.paths.shard_file(name)
            if shard is None:
                continue
            gone = name not in listing
            stale = shard[1] == "tar" and not gone and not self.copies.unchanged(
                f"{SHARDS_DIR}/{name}", listing[name])
            if (gone or stale) and not self._used_here(shard[0]):
                self.copies.remove(f"{SHARDS_DIR}/{name}")

    def fetch_file(self, relative: str) -> bool:
        """Copy one other file of the cache in (the target's weights, for ``dspark-verify``), if the
        store has it; whether it does."""
        info = self.store.head(relative)
        if info is None:
            self.copies.remove(relative)
            return False
        if not self.copies.unchanged(relative, info):
            self.copies.download(relative)
        return True

    def tar_size(self, shard_id: int) -> int:
        """The size of the shard's tar in the store (as last listed), -1 when it is not there."""
        with self._lock:
            info = self._listing.get(os.path.basename(self.paths.shard_tar(shard_id)))
        return -1 if info is None else info.size

    # -- tars ---------------------------------------------------------------------------------

    def _used_here(self, shard_id: int) -> bool:
        with self._lock:
            return shard_id in self._in_use

    def _vanished(self, exc: FileNotFoundError) -> LocalCopyError:
        """A file of this node's copy gone under us (its directory removed or cleaned): not the store's."""
        return LocalCopyError(
            f"the local copy of {self.remote} at {self.root} lost {exc.filename} while it was in use (was "
            "the directory removed or cleaned by another program?); rerun (it is made again), or give "
            "--local-cache-dir / local_cache_dir a directory nothing else cleans")

    def _lock_file(self, kind: str, shard_id: int) -> str:
        return os.path.join(self._meta, kind, os.path.basename(self.paths.shard_tar(shard_id)))

    def _present(self, index: ShardIndex) -> bool:
        relative = f"{SHARDS_DIR}/{os.path.basename(self.paths.shard_tar(index.shard_id))}"
        try:
            size = os.stat(self.copies.local(relative)).st_size
        except FileNotFoundError:
            return False
        with self._lock:
            listed = self._listing.get(relative.rsplit("/", 1)[1])
        same = self.copies.authentic(relative) if listed is None else self.copies.unchanged(relative, listed)
        return size == index.tar_bytes and same

    def _fetch(self, index: ShardIndex) -> None:
        """Download the tar (once per node: the others wait on its download lock, then find it)."""
        try:
            if self._present(index):
                return
            fd = hold_lock(self._lock_file("get", index.shard_id), fcntl.LOCK_EX)
            assert fd is not None
            try:
                if self._present(index):
                    return
                self._download(index)
            finally:
                os.close(fd)
            self._evict()
        except FileNotFoundError as exc:  # the store's missing objects are reported in _download
            raise self._vanished(exc) from exc

    def _download(self, index: ShardIndex) -> None:
        tar = self.paths.shard_tar(index.shard_id)
        relative = f"{SHARDS_DIR}/{os.path.basename(tar)}"
        use = self._lock_file("use", index.shard_id)
        problem = ""
        for attempt in (1, 2):  # a corrupted download is fetched again once
            digest = xxhash.xxh3_64()

            def check(temporary: str) -> None:
                problem = _check_tar(temporary, index, digest.intdigest())
                if problem is not None:
                    raise _Damaged(problem)
                os.utime(use if os.path.exists(use) else temporary)  # before the record names the file

            try:
                self.copies.download(relative, expected=index.tar_bytes, seen=digest.update,
                                     restart=digest.reset, check=check)
            except _Damaged as exc:
                problem = str(exc)
                log.warning("download of %s did not match its index (%s)%s", self.store.name(relative),
                            problem, "; fetching it again" if attempt == 1 else "")
                continue
            except FileNotFoundError as exc:
                if exc.filename is not None:  # a local file (the client names none for a missing object)
                    raise
                raise CorruptShardError(self.store.name(relative), "the tar is not in the store "
                                        "although its index is published") from exc
            with self._lock:
                self.downloads += 1
            return
        raise CorruptShardError(
            self.store.name(relative),
            f"downloaded twice, and twice it did not match its "
            f"index ({problem}): the object in the store is damaged",
        )

    def acquire(self, index: ShardIndex) -> None:
        """Make the shard's tar local and hold it in use (never evicted) until :meth:`release`."""
        shard_id = index.shard_id
        with self._lock:
            held = self._in_use.get(shard_id)
            if held is not None:
                self._in_use[shard_id] = (held[0], held[1] + 1)
                return
        try:
            fd = hold_lock(self._lock_file("use", shard_id), fcntl.LOCK_SH)
        except FileNotFoundError as exc:
            raise self._vanished(exc) from exc
        assert fd is not None
        try:
            with self._lock:
                pending = self._wanted.pop(shard_id, None)
                self._wanted_bytes.pop(shard_id, None)
            if pending is not None:
                try:
                    pending.result()
                except CacheError:
                    pass  # fetched below again, and its error raised here, where the shard is needed
            self._fetch(index)
            os.utime(self._lock_file("use", shard_id))  # most recently used: evicted last
        except BaseException:
            os.close(fd)
            raise
        with self._lock:
            held = self._in_use.get(shard_id)
            if held is not None:  # another thread took it meanwhile
                os.close(fd)
                self._in_use[shard_id] = (held[0], held[1] + 1)
            else:
                self._in_use[shard_id] = (fd, 1)
                self._held_bytes[shard_id] = index.tar_bytes

    def release(self, shard_id: int) -> None:
        with self._lock:
            held = self._in_use.get(shard_id)
            if held is None:  # held by the process this one was forked from
                return
            fd, holders = held
            if holders > 1:
                self._in_use[shard_id] = (fd, holders - 1)
                return
            del self._in_use[shard_id]
            self._held_bytes.pop(shard_id, None)
        os.close(fd)

    def prefetch(self, indexes: list[ShardIndex]) -> None:
        """Download these shards ahead, in this order, while their bytes fit the limit beside what
        this process holds in use (later calls replace the queue's order; what is downloading
        finishes); fetched ones are evicted last until they are read."""
        with self._lock:
            if self._closed:
                return
            # A fetched shard stays wanted (evicted last) until it is read, or until the order moves past it.
            upcoming = {index.shard_id for index in indexes}
            for shard_id in [s for s, f in self._wanted.items() if f.done() and s not in upcoming]:
                del self._wanted[shard_id], self._wanted_bytes[shard_id]
            budget = self.cache_limit - sum(self._held_bytes.values()) - sum(self._wanted_bytes.values())
            for index in indexes:
                if index.shard_id in self._wanted or index.shard_id in self._in_use:
                    continue
                if index.tar_bytes > budget:
                    break
                budget -= index.tar_bytes
                self._wanted_bytes[index.shard_id] = index.tar_bytes
                if self._present(index):  # already on the node: its room is reserved, it is not evicted
                    done: Future = Future()
                    done.set_result(None)
                    self._wanted[index.shard_id] = done
                else:
                    self._wanted[index.shard_id] = self._pool.submit(self._prefetch_one, index)

    def _prefetch_one(self, index: ShardIndex) -> None:
        try:
            self._fetch(index)
        except CacheError as exc:  # raised again where the shard is read
            log.debug("prefetch of shard %d failed: %s", index.shard_id, exc)
            raise

    def _evict(self) -> None:
        """Delete the least recently used tars not in use by any process while over the limit."""
        lock = hold_lock(os.path.join(self._meta, _EVICTING), fcntl.LOCK_EX | fcntl.LOCK_NB)
        if lock is None:
            return  # another process is evicting now
        try:
            tars = []
            for name in os.listdir(self.paths.shards_dir):
                shard = self.paths.shard_file(name)
                if shard is not None and shard[1] == "tar":
                    shard_id = shard[0]
                    path = os.path.join(self.paths.shards_dir, name)
                    use = self._lock_file("use", shard_id)
                    try:
                        size = os.stat(path).st_size
                        used = os.stat(use).st_mtime if os.path.exists(use) else os.stat(path).st_mtime
                    except FileNotFoundError:
                        continue
                    tars.append((used, shard_id, path, size))
            total = sum(t[3] for t in tars)
            with self._lock:
                wanted = set(self._wanted)
            # Prefetched shards are what the epoch reads next: never evicted before they are read
            # (prefetch stops at the limit instead).
            for _, shard_id, path, size in sorted(tars):
                if total <= self.cache_limit:
                    break
                if self._used_here(shard_id) or shard_id in wanted:
                    continue
                fd = hold_lock(self._lock_file("use", shard_id), fcntl.LOCK_EX | fcntl.LOCK_NB)
                if fd is None:
                    continue  # another process reads it
                try:
                    self.copies.remove(f"{SHARDS_DIR}/{os.path.basename(path)}")
                    total -= size
                finally:
                    os.close(fd)
            if total > self.cache_limit:
                log.info(
                    "the node-local copies at %s hold %d bytes, over their limit of %d: every shard there is in "
                    "use",
                    self.root,
                    total,
                    self.cache_limit,
                )
        finally:
            os.close(lock)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            wanted, self._wanted = self._wanted, {}
        for future in wanted.values():
            future.cancel()
        self._pool.close()  # downloads in flight finish (or time out) on their own, never waited for here
        with self._lock:  # the same dict emptied: the finalizer holds it, and must not close these again
            held = list(self._in_use.values())
            self._in_use.clear()
            self._held_bytes.clear()
        for fd, _ in held:
            os.close(fd)


# A forked DataLoader worker gets the parent's descriptors, flocks included: it must not keep the
# parent's shards held (unevictable) for its whole life, nor wait on the parent's threads and locks.
_mirrors: "weakref.WeakSet[NodeMirror]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for mirror in list(_mirrors):
        mirror._lock = threading.RLock()  # one held by another thread at the fork would stay held
        for fd, _ in mirror._in_use.values():
            os.close(fd)
        mirror._in_use.clear()
        mirror._held_bytes.clear()
        mirror._wanted.clear()
        mirror._wanted_bytes.clear()
        mirror._pool = DaemonThreads(_IN_FLIGHT)


os.register_at_fork(after_in_child=_after_fork_in_child)


class _Damaged(Exception):
    """A download that is not the tar its index describes (why, in words)."""


def _check_tar(path: str, index: ShardIndex, xxh3: int) -> str | None:
    """Why the downloaded file (whose bytes hashed to ``xxh3`` as they streamed in) is not the tar
    its index describes, or ``None``."""
    size = os.path.getsize(path)
    if size != index.tar_bytes:
        return f"{size} bytes, the index says {index.tar_bytes}"
    if xxh3 != index.tar_xxh3:
        return "its xxh3 differs from the index's"
    return None
