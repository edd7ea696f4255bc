"""Objects of a remote cache copied into a local directory, each with the version it was copied from.

Every node-local copy of a remote cache (the readers' mirror, a producer's staging directory, a
monitor's copy) is made and judged here, one way: :meth:`LocalCopies.unchanged` says whether the local
file is the store's current version (size and ETag, recorded per object as a :class:`CopiedFrom` in the
copy's ``seen`` directory, :func:`.localdir.replica_dirs`), and :meth:`LocalCopies.download` (streamed) or
:meth:`LocalCopies.write` (bytes at hand) replaces it: into a locked temporary (``localdir.Temporaries``),
removed on any failure, so the old copy stays whole; ``os.replace`` on success; the record written after.
A copy is kept as long as the store's object keeps its size and ETag, so a reader comparing the local
file's identity sees it change exactly when the store's object changed; an object gone from the store
is removed here.
The manifest and shard indexes are read whole, and no further than one byte past their readers'
limit (a larger object is cut there, for the reader's own size check to refuse).

A copy found on disk is served as the store's only once it is authenticated (:meth:`LocalCopies.unchanged`):
a small object whose ETag is the MD5 of its bytes (S3's, for a single PUT) is hashed and compared with
that ETag; any other copy must be the very file recorded when it was written (inode and ctime: a file
put in its place, or written over, is neither). A manifest fetched anyway is compared byte for byte.
Whoever may write the directory could forge the record too: ``localdir.own_directory`` refuses such
directories, and a record others may write (a umask of 002) is not believed (records are written
writable by this user only).
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import Callable

import msgspec

from dspark_cache.format.atomic import atomic_write_bytes
from dspark_cache.format.paths import MANIFEST
from dspark_cache.format.validate import MAX_INDEX_BYTES, MAX_MANIFEST_BYTES
from dspark_cache.storage.remote.localdir import Temporaries, private, replica_dirs, write_private
from dspark_cache.storage.remote.node import DaemonThreads
from dspark_cache.storage.remote.store import ObjectInfo, ObjectStore

_MAX_SMALL = {True: MAX_MANIFEST_BYTES, False: MAX_INDEX_BYTES}
_SMALL_IN_FLIGHT = 16  # copies at once
_MD5 = re.compile(r'^"?([0-9a-fA-F]{32})"?$')


class CopiedFrom(msgspec.Struct, frozen=True):
    """What a local copy is (the ``seen`` record): the store's version, and the local file written for it."""

    size: int
    etag: str
    inode: int
    ctime_ns: int
    md5: bool = False  # the ETag is the MD5 of the bytes copied: the copy is checked against the ETag


def md5_etag(etag: str) -> str | None:
    """The MD5 an ETag spells (S3's for an object put whole), or ``None``."""
    match = _MD5.match(etag)
    return match.group(1).lower() if match else None


def file_md5(path: str, limit: int) -> str | None:
    """The MD5 of a file of at most ``limit`` bytes (``None``: larger, or gone)."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(limit + 1)
    except FileNotFoundError:
        return None
    return None if len(data) > limit else _md5(data)


def _md5(data: bytes) -> str:
    return hashlib.md5(data, usedforsecurity=False).hexdigest()


def describe(path: str, info: ObjectInfo, data: bytes | None = None) -> CopiedFrom | None:
    """The record of the file at ``path`` as the copy of the store's version ``info`` (``data``: the bytes
    the store sent, when at hand); ``None`` where the file is gone."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    digest = md5_etag(info.etag)
    md5 = data is not None and digest is not None and _md5(data) == digest
    return CopiedFrom(info.size, info.etag, st.st_ino, st.st_ctime_ns, md5)


StatKey = tuple[int, int, int, int]


def authenticate(path: str, entry: CopiedFrom, limit: int,
                 verified: StatKey | None = None) -> StatKey | None:
    """The file's stat key where it is the copy ``entry`` records (the module's docstring), else ``None``.
    ``verified``: the key it had when last authenticated (an unchanged file is not read again)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    key = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key == verified:
        return key
    if entry.md5:  # against the store's own word for the bytes, not only our record
        ok = file_md5(path, limit) == md5_etag(entry.etag)
    else:
        ok = (st.st_ino, st.st_ctime_ns) == (entry.inode, entry.ctime_ns)
    return key if ok else None


class LocalCopies:
    """Copies of ``store``'s objects under ``root`` (paths relative to the cache), kept as
    :func:`.localdir.replica_dirs` says for the bookkeeping directory ``records`` (records in its ``seen``,
    downloads in progress in its ``tmp``: both made by the caller, as its directory rule says)."""

    def __init__(self, store: ObjectStore, root: str, records: str) -> None:
        self.store, self.root = store, root
        self._seen_dir, temporaries = replica_dirs(records)
        self.temporaries = Temporaries(temporaries)
        # relative path -> (the local file's stat, the record) once authenticated in this process
        self._verified: dict[str, tuple[StatKey, CopiedFrom]] = {}

    def local(self, relative: str) -> str:
        return os.path.join(self.root, *relative.split("/"))

    def _seen(self, relative: str) -> str:
        return os.path.join(self._seen_dir, relative.replace("/", "%"))

    def copied_from(self, relative: str) -> CopiedFrom | None:
        """The record of the store's version the local copy is, if any (and readable)."""
        try:
            with open(self._seen(relative), "rb") as handle:
                # others may have rewritten it: no word of it holds
                if not private(os.fstat(handle.fileno())):
                    return None
                return msgspec.json.decode(handle.read(4096), type=CopiedFrom)
        except (FileNotFoundError, msgspec.DecodeError, msgspec.ValidationError):
            return None  # none, or of an older layout: copied again

    def record(self, relative: str, info: ObjectInfo | None, data: bytes | None = None) -> None:
        """Record that the local file is now the store's version ``info`` (``data``: the bytes the store
        sent for it, when at hand; ``None`` info: there is no copy)."""
        self._verified.pop(relative, None)
        entry = None if info is None else describe(self.local(relative), info, data)
        if entry is None:
            try:
                os.unlink(self._seen(relative))
            except FileNotFoundError:
                pass
            return
        os.makedirs(self._seen_dir, exist_ok=True)
        write_private(self._seen(relative), msgspec.json.encode(entry))

    def remove(self, relative: str) -> None:
        try:
            os.unlink(self.local(relative))
        except FileNotFoundError:
            pass
        self.record(relative, None)

    def authentic(self, relative: str, entry: CopiedFrom | None = None) -> bool:
        """Whether the local file is the copy its record names (see the module's docstring)."""
        entry = entry or self.copied_from(relative)
        if entry is None:
            return False
        known = self._verified.get(relative)
        key = authenticate(self.local(relative), entry, _MAX_SMALL[relative == MANIFEST],
                           known[0] if known is not None and known[1] == entry else None)
        if key is not None:
            self._verified[relative] = (key, entry)
        return key is not None

    def unchanged(self, relative: str, info: ObjectInfo) -> bool:
        """Whether the local copy is authentic and of the store's version ``info``."""
        entry = self.copied_from(relative)
        return entry is not None and (entry.size, entry.etag) == (info.size, info.etag) and self.authentic(
            relative, entry)

    def download(self, relative: str, *, expected: int | None = None,
                 seen: Callable[[memoryview], object] | None = None,
                 restart: Callable[[], object] | None = None,
                 check: Callable[[str], None] | None = None) -> ObjectInfo:
        """Make the local copy the store's current version of ``relative``, streamed to a locked temporary
        and renamed over the old copy only when whole; returns the version copied. ``expected``, ``seen``,
        ``restart``: as :meth:`ObjectStore.download`; ``check(temporary)`` may refuse the bytes (raises).
        On any failure (the object gone: ``FileNotFoundError``) the temporary is removed and the old copy
        and its record are as they were."""
        with self.temporaries.new(relative.replace("/", "%")) as temporary:
            info = self.store.download(relative, temporary, seen=seen, restart=restart, expected=expected)
            if check is not None:
                check(temporary)
            os.replace(temporary, self.local(relative))
        self.record(relative, info)  # after the rename: the record names the file as it stays
        return info

    def write(self, relative: str, data: bytes, info: ObjectInfo) -> None:
        """Make the local copy ``data``, the store's version ``info`` (what a GET or our own PUT brought)."""
        atomic_write_bytes(self.local(relative), data, durable=False)
        self.record(relative, info, data)

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
        if self._holds(relative, data):  # the store's bytes: keep the file (a reader compares its identity)
            entry = self.copied_from(relative)
            if entry is None or (entry.size, entry.etag) != (info.size, info.etag) or not self.authentic(
                    relative, entry):
                self.record(relative, info, data)
            return
        self.write(relative, data, info)

    def _holds(self, relative: str, data: bytes) -> bool:
        """Whether the local file holds exactly ``data`` (what the store just sent: no record is trusted)."""
        try:
            with open(self.local(relative), "rb") as handle:
                return handle.read(len(data) + 1) == data
        except FileNotFoundError:
            return False
