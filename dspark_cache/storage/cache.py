"""A cache directory opened for reading: one class for every reader of published shards.

:class:`CacheDir` is what the loader (batches), ``open_cache`` (samples one by one),
``dspark-verify`` and the NeMo dataset read a cache through, and what the monitor can use to
read indexes only. It imports no torch. API:

* ``CacheDir(root, *, allow_incomplete=False, follow=False, strict=True, cache_id=None, storage=None)``
  reads and checks ``manifest.json`` (an incomplete cache is refused unless ``allow_incomplete`` or ``follow``);
  ``strict`` refuses published shards the manifest does not plan (``dspark-verify`` reports them);
  ``cache_id`` (another process's ``CacheDir.cache_id``) refuses a cache replaced since that one opened.
  ``root`` may be an object-store URL (``s3://bucket/prefix``): the cache is then read from a
  node-local copy (:mod:`.backing`, options in ``storage``), through the same interface.
* ``manifest``, ``shape`` (:class:`SampleShape`), ``paths``, ``root``, ``follow``, ``cache_id``.
* ``indexed_ids()`` lists shard ids whose index file exists; ``extra_shards()`` those the
  manifest does not plan.
* ``published(id)`` loads a shard's index on first use (checked against the manifest), or
  ``None`` while it is not published; ``require(id)`` raises instead. Following a producer, an
  index that does not check out yet reads as not published (its tar may still be settling).
* ``load_all()`` loads every published index at once and checks them together (unique ids, a
  complete cache has every shard and the manifest's sample count); ``sample_order()`` is then
  every sample as ``(shard id, entry position)`` in ascending sample id.
* ``refresh()`` re-reads the manifest while following (a changed identity is an error).
* The cache opened stays the one read: every index must carry the manifest's ``cache_id``, and
  ``check_current()`` (each ``pin``, each ``refresh``, each index of another cache) raises
  :class:`CacheReplacedError` once ``manifest.json`` is gone or names another ``cache_id`` (a run with
  ``--overwrite`` rewrote the directory); ``check_opened(id, fd)`` (each shard file opened) that the
  file is still the one its index describes.
* ``pin(ids)`` / ``unpin(ids)`` hold shard files open for a batch filler: at most
  ``max_open_files`` idle descriptors stay open (least recently used closed first), and a pinned
  one is never closed, so its number cannot be reused under a running read. ``identity(id)``
  says which file a pinned descriptor is (:func:`file_identity`). Nothing is opened unless
  ``pin`` is called.
* ``prefetch(ids)`` fetches a remote cache's shards ahead, in that order (a local cache: nothing);
  ``hold(index)`` / ``let_go(id)`` bracket a shard file opened by another reader (``open_cache``).
* ``close()`` (or ``with``) closes every descriptor.

The write side (publishing and unpublishing shards, the manifest written) is ``output.CacheOutput``.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict

from dspark_cache.format.errors import CacheError, CorruptShardError, NotACacheError
from dspark_cache.format.files import open_regular
from dspark_cache.format.geometry import SampleShape
from dspark_cache.format.manifest import read_manifest
from dspark_cache.format.paths import CachePaths
from dspark_cache.format.schema import Manifest, ShardIndex
from dspark_cache.format.tar.reader import load_shard_index
from dspark_cache.format.validate import ForeignShardError, check_catalog
from dspark_cache.storage.backing import StorageOptions, open_backing

MAX_OPEN_FILES = 128  # idle descriptors kept open; pinned ones may exceed it for a while
_REMOTE_OPEN_FILES = 1  # an idle open file holds its shard on the node: unevictable

FileIdentity = tuple[int, ...]


def file_identity(fd: int) -> FileIdentity:
    """What says that a descriptor opened later is the same file with the same bytes."""
    st = os.fstat(fd)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def path_identity(path: str) -> FileIdentity | None:
    """:func:`file_identity` of the file at ``path`` now (``None``: there is none); an atomic replace
    (a new inode) or a rewrite changes it."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _close_all(fds: dict[int, int]) -> None:
    for fd in fds.values():
        try:
            os.close(fd)
        except OSError:  # already closed by a fork's exec or the interpreter's shutdown
            pass
    fds.clear()


class CacheReplacedError(CacheError):
    """The cache a reader opened was removed, or replaced by another run (``--overwrite``), under it."""


class CacheDir:
    """A cache directory for reading: manifest, published shard indexes (loaded lazily, once) and
    a bounded pool of open shard files. See the module docstring for the whole API."""

    def __init__(self, root: str | os.PathLike, *, allow_incomplete: bool = False, follow: bool = False,
                 strict: bool = True, max_open_files: int = MAX_OPEN_FILES, cache_id: str | None = None,
                 storage: StorageOptions | None = None, poll: float | None = None) -> None:
        self.root = os.fspath(root)  # what messages name: the directory, or the URL
        self.backing = open_backing(self.root, storage, poll=poll)
        self.remote = self.backing.remote
        self.paths = CachePaths(self.backing.root)
        self.follow = follow
        self.backing.refresh_manifest(force=True)
        self.backing.refresh_listing(force=True)
        # Taken before the read: a manifest replaced right after it still reads as changed.
        self._manifest_file = path_identity(self.paths.manifest)
        self.manifest = read_manifest(
            self.paths.root, allow_incomplete=allow_incomplete or follow, shown=self.root
        )
        self.cache_id = self.manifest.cache_id if cache_id is None else cache_id
        if self.manifest.cache_id != self.cache_id:
            raise self._replaced(f"it is cache {self.manifest.cache_id or '(no id)'} now")
        self._index_files: dict[int, FileIdentity | None] = {}  # shard id -> its index file when loaded
        self.shape = SampleShape.from_manifest(self.manifest)
        # A remote cache's open files are shards held on this node: few, so that eviction can
        # keep its local copy within cache_limit.
        self.max_open_files = (
            max_open_files if self.remote is None else min(max_open_files, _REMOTE_OPEN_FILES)
        )
        self._indexes: dict[int, ShardIndex] = {}
        self._fds: OrderedDict[int, int] = OrderedDict()  # shard id -> fd, least recently used first
        # Plain ints close with nothing: a CacheDir dropped without close() (a loader per epoch, a
        # one-off open_cache) would keep up to max_open_files descriptors until the process exits.
        weakref.finalize(self, _close_all, self._fds)
        self._pins: dict[int, int] = {}  # shard id -> batch programs using its fd now
        self._identity: dict[int, FileIdentity] = {}  # shard id -> its open file's identity
        self._lock = threading.Lock()
        if strict:
            self.check_shard_set()

    # -- which shards -------------------------------------------------------------------------

    def indexed_ids(self) -> list[int]:
        """Shard ids whose index file exists (published, unless damaged since)."""
        self.backing.refresh_listing()
        return self.paths.indexed_shard_ids()

    def extra_shards(self) -> list[int]:
        """Published shard ids the manifest does not plan."""
        return [s for s in self.indexed_ids() if not 0 <= s < self.manifest.num_shards]

    def check_shard_set(self) -> None:
        """Published shards the manifest does not plan mean a tampered manifest or directory."""
        extra = self.extra_shards()
        if extra:
            raise CacheError(
                f"{self.root}: shards {extra[:5]} are published but {self.paths.manifest} plans "
                f"{self.manifest.num_shards} shards; the manifest or the shard directory was changed by hand: "
                f"run dspark-verify {self.root}"
            )

    def _missing(self, shard_ids: list[int]) -> CacheError:
        return CacheError(
            f"{self.root}: {self.paths.manifest} says the cache is complete with {self.manifest.num_shards} "
            f"shards, but shards {shard_ids[:10]} are not published (no index); run dspark-verify {self.root}, "
            "then rerun dspark-produce to repair it"
        )

    # -- indexes ------------------------------------------------------------------------------

    def published(self, shard_id: int) -> ShardIndex | None:
        """The shard's index if it is published (index present, tar of the indexed size, this cache's)."""
        index = self._indexes.get(shard_id)
        if index is None and self.follow and not os.path.exists(self.paths.shard_index(shard_id)):
            self.backing.refresh_listing()  # a remote store is listed again at a bounded rate
        if index is None and os.path.exists(self.paths.shard_index(shard_id)):
            seen = path_identity(self.paths.shard_index(shard_id))
            try:
                index = load_shard_index(self.paths, shard_id, self.manifest,
                                         tar_size=self.backing.tar_size(shard_id))
            except ForeignShardError:
                self.check_current(force=True)  # raises when the whole cache was replaced
                raise  # the manifest is the one opened: a shard of another cache was put here
            except CorruptShardError:
                if not self.follow:
                    raise
                return None  # an index can appear a moment before the tar is fully visible
            self._indexes[shard_id] = index
            self._index_files[shard_id] = seen
        return index

    def require(self, shard_id: int) -> ShardIndex:
        """The shard's index; a complete cache missing it is an error."""
        index = self.published(shard_id)
        if index is None:
            raise self._missing([shard_id])
        return index

    def load_all(self) -> list[ShardIndex]:
        """Every published shard's index, in shard id order, checked together: no sample listed
        twice, and a complete cache has every planned shard and the manifest's sample count."""
        indexes = {s: self.published(s) for s in self.indexed_ids()}
        loaded = {s: index for s, index in indexes.items() if index is not None}
        check_catalog(self.manifest, loaded, self.root)
        if self.manifest.complete and len(loaded) != self.manifest.num_shards:
            raise self._missing(sorted(set(range(self.manifest.num_shards)) - set(loaded)))
        return [loaded[s] for s in sorted(loaded)]

    def sample_order(self) -> list[tuple[int, int]]:
        """``(shard id, entry position)`` of every published sample, in ascending sample id."""
        keyed = [(entry.sample_id, index.shard_id, k)
                 for index in self.load_all() for k, entry in enumerate(index.samples)]
        keyed.sort()
        return [(shard_id, k) for _, shard_id, k in keyed]

    def refresh(self) -> Manifest:
        """Re-read the manifest (follow mode); a different run in the same directory is an error."""
        fresh = self.check_current()
        if fresh is None:
            return self.manifest
        if fresh.identity() != self.manifest.identity():
            raise CacheError(
                f"{self.paths.manifest} changed identity while reading (the producer was restarted with "
                "other settings or --overwrite); restart training on the new cache"
            )
        self.manifest = fresh
        return fresh

    # -- the same cache -----------------------------------------------------------------------

    def _replaced(self, how: str) -> CacheReplacedError:
        return CacheReplacedError(
            f"the cache at {self.root} was replaced (overwritten by another dspark-produce or dspark-convert run) "
            f"while being read: {how}. Samples read so far belong to the old cache; restart training on the new "
            "cache (from its start, not from a checkpoint's loader state)"
        )

    def check_current(self, *, force: bool = False) -> Manifest | None:
        """Raise :class:`CacheReplacedError` when ``manifest.json`` is gone or names another ``cache_id``
        than the one opened. Costs one ``stat`` while the file is unchanged (then ``None``); a changed
        file (or ``force``) is re-read and returned. A remote cache's manifest is fetched again at
        most every few seconds."""
        self.backing.refresh_manifest(force=force)
        seen = path_identity(self.paths.manifest)
        if seen is not None and seen == self._manifest_file and not force:
            return None
        try:
            fresh = read_manifest(self.paths.root, allow_incomplete=True, shown=self.root)
        except NotACacheError as exc:
            raise self._replaced("its manifest.json is gone") from exc
        if fresh.cache_id != self.cache_id:
            raise self._replaced(f"it was cache {self.cache_id or '(no id)'} and is cache "
                                 f"{fresh.cache_id or '(no id)'} now")
        self._manifest_file = seen
        return fresh

    def check_opened(self, shard_id: int, fd: int) -> None:
        """``fd``, just opened for the shard's tar, must be the file its loaded index describes: the
        index file unchanged since it was read (checked after the open, so a tar swapped in before it
        is caught), and a tar of another size only within a cache still the one opened (a truncated
        tar is then left to the read, whose short read or checksum names the sample)."""
        index = self._indexes.get(shard_id)
        if index is None:
            return
        same_index = path_identity(self.paths.shard_index(shard_id)) == self._index_files.get(shard_id)
        if same_index and os.fstat(fd).st_size == index.tar_bytes:
            return
        self.check_current(force=True)  # raises when the whole cache was replaced
        # the tar alone changed size (truncated, appended to): the read names the sample it hits
        if same_index:
            return
        raise CorruptShardError(
            self.paths.shard_tar(shard_id),
            "the shard was rewritten or removed after its index "
            "was read (another process changed the cache while it was being read)",
        )

    # -- open files ---------------------------------------------------------------------------

    def pin(self, shard_ids: set[int]) -> dict[int, int]:
        """Open descriptors for ``shard_ids`` (read-only, for ``pread``), held open until :meth:`unpin`."""
        # A remote shard not open yet is made local first, outside the lock: a download takes seconds,
        # and the other readers' pins and unpins of shards already here must not wait behind it.
        early = [s for s in shard_ids if s not in self._fds] if self.remote is not None else []
        held = []
        try:
            for shard_id in early:
                self.hold(self.require(shard_id))
                held.append(shard_id)
            return self._pin(shard_ids)
        finally:
            for shard_id in held:  # the open took a hold of its own
                self.let_go(shard_id)

    def _pin(self, shard_ids: set[int]) -> dict[int, int]:
        with self._lock:
            self.check_current()  # one stat per batch: a replaced cache stops the reader here
            fds = {}
            for shard_id in shard_ids:
                fd = self._fds.get(shard_id)
                if fd is None:
                    fd = self._fds[shard_id] = self._open(shard_id)
                self._fds.move_to_end(shard_id)
                self._pins[shard_id] = self._pins.get(shard_id, 0) + 1
                fds[shard_id] = fd
            self._evict()
            return fds

    def _open(self, shard_id: int) -> int:
        """Open the shard's tar and record which file it is; under the lock."""
        path = self.paths.shard_tar(shard_id)
        self.hold(self.require(shard_id))
        try:
            fd = open_regular(path)
        except CacheError as exc:
            self.let_go(shard_id)
            raise CorruptShardError(path, str(exc)) from exc
        try:
            self.check_opened(shard_id, fd)
            self._identity[shard_id] = file_identity(fd)
        except BaseException:
            os.close(fd)
            self.let_go(shard_id)
            raise
        return fd

    def hold(self, index: ShardIndex) -> None:
        """The shard's tar is a local file (a remote one downloaded) and stays one until :meth:`let_go`."""
        try:
            self.backing.acquire(index)
        except CorruptShardError:
            self.check_current(force=True)  # a download unlike its index: the whole cache replaced?
            raise

    def let_go(self, shard_id: int) -> None:
        self.backing.release(shard_id)

    def prefetch(self, shard_ids: list[int]) -> None:
        """Fetch these published shards ahead, in this order (a remote cache's; a local one: nothing)."""
        if self.remote is None:
            return
        indexes = []
        for shard_id in shard_ids:  # indexes of later windows are loaded here (local copies: cheap)
            index = self._indexes.get(shard_id) or self.published(shard_id)
            if index is None:
                break  # not published yet (following a producer): nothing after it is read before it
            indexes.append(index)
        self.backing.prefetch(indexes)

    def identity(self, shard_id: int) -> FileIdentity:
        """The identity of the shard's open file (recorded at open); ask only while it is pinned."""
        with self._lock:
            return self._identity[shard_id]

    def unpin(self, shard_ids: set[int]) -> None:
        """Release descriptors taken by :meth:`pin`; idle ones beyond the bound are closed."""
        with self._lock:
            for shard_id in shard_ids:
                left = self._pins[shard_id] - 1
                if left:
                    self._pins[shard_id] = left
                else:
                    del self._pins[shard_id]
            self._evict()

    def _evict(self) -> None:
        """Close idle descriptors beyond the bound, least recently used first; never a pinned one."""
        idle = [s for s in self._fds if s not in self._pins]
        for shard_id in idle[: max(0, len(self._fds) - self.max_open_files)]:
            os.close(self._fds.pop(shard_id))
            del self._identity[shard_id]
            self.let_go(shard_id)

    def close(self) -> None:
        """Close every descriptor (indexes stay loaded; a later :meth:`pin` reopens files)."""
        with self._lock:
            for shard_id, fd in self._fds.items():
                os.close(fd)
                self.let_go(shard_id)
            self._fds.clear()
            self._pins.clear()
            self._identity.clear()
            self.backing.close()

    def __enter__(self) -> "CacheDir":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
