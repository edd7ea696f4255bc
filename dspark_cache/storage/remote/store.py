"""One cache's objects in an object store: :class:`ObjectStore`, our only door to the client library.

The client is obstore (Rust's ``object_store``), chosen by measurement (BENCHMARKS.md, "Object
store client"): on the same local S3 server it reads a 64 MiB object about 5x faster than
s3fs, supports conditional writes (``If-None-Match: *`` and ``If-Match``) that a lease needs,
multipart uploads, ranged reads, and serves S3, GCS and Azure through one interface. It is an
optional extra (``pip install "dspark-cache[s3]"``); without it a remote path is one line that
names the extra.

Credentials come the client's standard way: ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` /
``AWS_SESSION_TOKEN``, web identity, instance metadata; ``AWS_ENDPOINT_URL`` or
``AWS_ENDPOINT_URL_S3`` for S3-compatible stores (MinIO, Ceph, R2, ...), ``AWS_ALLOW_HTTP=true``
for a plain-http endpoint; ``storage_options`` and the client's configuration are :mod:`.client`'s.

Keys under the cache's prefix that the client cannot represent (an empty segment ``a//b``, a ``.``
or ``..`` segment, control characters: written by another tool) are skipped by every listing, each
named once in a warning; the rest of the listing goes on past them (see :meth:`ObjectStore.walk`).

Every failure comes out as a :class:`~dspark_cache.format.errors.CacheError` of one line that
names the object and says what to do: access denied (which credential), a missing bucket, and
transient faults (503 SlowDown, 500s, resets, timeouts) that the client already retried with
backoff. A missing object is not an error: reads return ``None``.
"""

from __future__ import annotations

import errno
import logging
import os
import pathlib
import random
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, TypeVar

from dspark_cache.format.errors import CacheError
from dspark_cache.format.paths import CONTROL_DIR, EVENTS_DIR, MANIFEST, PLAN_DIR, SHARDS_DIR, STATUS_DIR, \
    TARGET_WEIGHTS
from dspark_cache.storage.remote.client import configure, first_line, is_panic
from dspark_cache.storage.remote.url import RemoteURL

log = logging.getLogger(__name__)

_CHUNK = 8 << 20  # streamed reads and writes move this much at a time
_MULTIPART = 64 << 20  # uploads larger than this go in parts, several in flight
_LOCAL_DISK = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)
_ATTEMPTS = 2  # one whole-object retry on top of the client's own (which resumes a cut download itself)
_T = TypeVar("_T")
# The cache's own names at its root: what a listing of the root that a key the client cannot represent
# broke still finds (each file asked for, each directory listed on its own).
_ROOT_FILES = (MANIFEST, TARGET_WEIGHTS)
_ROOT_DIRS = (SHARDS_DIR, STATUS_DIR, EVENTS_DIR, CONTROL_DIR, PLAN_DIR)
# How the client names the key it could not parse, in its error's message.
_BAD_KEY = re.compile(r'Path "(.*?)"(?=:? ?(?:contained empty path segment|Encountered illegal))', re.DOTALL)


class ObjectStoreError(CacheError):
    """A request to the object store failed for good (after retries)."""


class AccessDeniedError(ObjectStoreError):
    """403, or credentials the store does not accept."""


class NoSuchBucketError(ObjectStoreError):
    """The bucket (or container) does not exist."""


class ConditionFailedError(ObjectStoreError):
    """A conditional write lost: the object exists (create) or changed (match)."""


class UnrepresentableKeyError(ObjectStoreError):
    """A directory of the cache holds a key the client cannot represent, and so cannot be listed whole."""


@dataclass(frozen=True)
class ObjectInfo:
    """What a listing or ``head`` says of one object."""

    size: int
    etag: str
    modified: float  # seconds since the epoch


def shown_key(key: str) -> str:
    """A key as a message shows it: control characters escaped (``\\x01``), the rest as it is."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in key)


class ObjectStore:
    """The objects under one cache URL. Paths given to its methods are relative to the cache's root
    (``shards/shard-000000.tar``), as :class:`CachePaths` spells them relative to a directory."""

    def __init__(self, url: str | RemoteURL, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url if isinstance(url, RemoteURL) else RemoteURL.parse(url)
        self._pid = os.getpid()
        self._named: set[str] = set()  # keys the client cannot represent, each warned about once
        try:
            self._obstore, self._store = configure(self.url, storage_options)
        except ValueError as exc:  # never the values: they may hold secrets
            raise ObjectStoreError(f"{self.url}: {exc}; check --storage-options / storage_options keys and the "
                                   "AWS_* variables") from None

    def __repr__(self) -> str:  # never the options: they may hold secrets
        return f"ObjectStore({str(self.url)!r})"

    def name(self, relative: str) -> str:
        return self.url.name(relative)

    # -- errors -------------------------------------------------------------------------------

    def _translate(self, exc: Exception, what: str, relative: str) -> CacheError:
        errors = self._obstore.exceptions
        where = self.name(relative)
        text = first_line(exc)
        full = str(exc)  # the markers may sit past the first line's 300 characters (a long request URL)
        if "NoSuchBucket" in full or "bucket does not exist" in full.lower():
            return NoSuchBucketError(
                f"{what} {where}: the bucket {self.url.bucket} does not exist (or this "
                "endpoint is not the store it is in); create it or fix the URL / AWS_ENDPOINT_URL"
            )
        if isinstance(exc, (errors.PermissionDeniedError, errors.UnauthenticatedError)) or any(
                marker in full for marker in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                                              "403 Forbidden")):
            return AccessDeniedError(
                f"{what} {where}: access denied (403). The credentials in use (AWS_ACCESS_KEY_ID / "
                "AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, or the instance's role) may not do this on bucket "
                f"{self.url.bucket}; fix the credentials or the bucket policy, then rerun"
            )
        if isinstance(exc, (errors.PreconditionError, errors.AlreadyExistsError)):
            return ConditionFailedError(f"{what} {where}: the object exists or changed since it was read")
        return ObjectStoreError(
            f"{what} {where} failed after retries ({type(exc).__name__}: {text}); check the network and "
            "the endpoint, then rerun: what was already stored is kept")

    def _call(self, what: str, relative: str, call: Callable[[], _T], *, missing: Any = ...) -> _T:
        if os.getpid() != self._pid:
            # The client's runtime threads do not survive fork(): a request from the child would hang.
            raise ObjectStoreError(
                f"{what} {self.name(relative)} from a forked process: the object-store client does not survive "
                "fork(). Read remote caches in the main process or in spawned workers: "
                'DataLoader(..., multiprocessing_context="spawn") (or "forkserver")'
            )
        try:
            return call()
        except OSError as exc:
            if exc.errno in _LOCAL_DISK:  # our own write to this machine's disk (see _again)
                raise
            return self._failed(exc, what, relative, missing)
        except CacheError:  # ours already, one line
            raise
        except Exception as exc:
            return self._failed(exc, what, relative, missing)
        except BaseException as exc:  # a panic of the client: one line, as any other failure
            if not is_panic(exc):
                raise
            raise ObjectStoreError(f"{what} {self.name(relative)}: the object-store client failed (panic: "
                                   f"{first_line(exc)}); rerun, and report it if it repeats") from None

    def _failed(self, exc: Exception, what: str, relative: str, missing: Any) -> Any:
        """``missing`` for an absent object (``FileNotFoundError`` where none is given); else the error translated."""
        absent = isinstance(exc, (FileNotFoundError, self._obstore.exceptions.NotFoundError))
        if absent and "NoSuchBucket" not in str(exc):  # an absent object; an absent bucket is an error
            if missing is ...:
                raise FileNotFoundError(f"{self.name(relative)} does not exist") from exc
            return missing
        raise self._translate(exc, what, relative) from exc

    def _again(self, what: str, relative: str, attempt: Callable[[], _T]) -> _T:
        """``attempt`` again (with backoff) where the client gave up mid-stream; errors that
        retrying cannot mend (denied, missing bucket, a lost condition) at once."""
        for tries in range(1, _ATTEMPTS + 1):
            try:
                return attempt()
            except (AccessDeniedError, NoSuchBucketError, ConditionFailedError, UnrepresentableKeyError,
                    FileNotFoundError):
                raise
            except (ObjectStoreError, OSError) as exc:
                # this machine's disk: no retry mends it
                if isinstance(exc, OSError) and exc.errno in _LOCAL_DISK:
                    raise ObjectStoreError(
                        f"{what} {self.name(relative)}: the local file {exc.filename or ''} could not be written "
                        f"({exc.strerror}); free space there or choose another --local-cache-dir / --staging-dir "
                        "(or a smaller --cache-limit / --staging-limit), then rerun"
                    ) from exc
                if tries == _ATTEMPTS:
                    if isinstance(exc, CacheError):
                        raise
                    raise ObjectStoreError(f"{what} {self.name(relative)} failed {tries} times ({exc}); "
                                           "check the network and the endpoint, then rerun") from exc
                delay = min(10.0, 0.2 * 2 ** tries) * (0.5 + random.random())
                log.warning("%s %s failed (%s); again in %.1f s", what, self.name(relative), exc, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")

    def _info(self, meta: dict[str, Any]) -> ObjectInfo:
        modified = meta.get("last_modified")
        return ObjectInfo(int(meta["size"]), str(meta.get("e_tag") or ""),
                          modified.timestamp() if modified is not None else 0.0)

    # -- reads --------------------------------------------------------------------------------

    def head(self, relative: str) -> ObjectInfo | None:
        key = self.url.key(relative)
        meta = self._call("reading", relative, lambda: self._obstore.head(self._store, key), missing=None)
        return None if meta is None else self._info(meta)

    def get(self, relative: str, limit: int | None = None) -> tuple[bytes, ObjectInfo] | None:
        """The object and what it is, or ``None`` when there is none (small objects). With ``limit``,
        at most ``limit + 1`` bytes are read: a larger object comes back cut there, for the reader's
        own size check to refuse, and never whole in memory."""
        key = self.url.key(relative)

        def read(result: Any) -> bytes:
            if limit is None:
                return bytes(result.bytes())
            parts, size = [], 0
            for chunk in result.stream(min_chunk_size=min(_CHUNK, limit + 1)):
                parts.append(bytes(chunk))
                size += len(parts[-1])
                if size > limit:
                    break
            return b"".join(parts)[: limit + 1]

        def attempt() -> tuple[bytes, ObjectInfo] | None:
            result = self._call(
                "reading", relative, lambda: self._obstore.get(self._store, key), missing=None
            )
            if result is None:
                return None
            data = self._call("reading", relative, lambda: read(result))
            return data, self._info(result.meta)
        return self._again("reading", relative, attempt)

    def download(self, relative: str, destination: str, *, seen: Callable[[memoryview], object] | None = None,
                 restart: Callable[[], object] | None = None, expected: int | None = None) -> ObjectInfo:
        """Stream the object into the file ``destination`` (created or truncated), handing each chunk
        to ``seen`` as it passes (a hash, say; ``restart`` is called before each attempt); raises
        ``FileNotFoundError`` when there is no such object. ``expected``: its size, when known; a
        larger object is cut soon after it, for the caller's size check to refuse (never streamed whole)."""
        key = self.url.key(relative)

        def attempt() -> ObjectInfo:
            if restart is not None:
                restart()
            result = self._call("reading", relative, lambda: self._obstore.get(self._store, key))
            with open(destination, "wb") as handle:
                def copy() -> None:
                    written = 0
                    for chunk in result.stream(min_chunk_size=_CHUNK):
                        view = memoryview(chunk)
                        try:
                            handle.write(view)
                        except OSError as exc:
                            exc.filename = exc.filename or destination  # the message names the file
                            raise
                        written += len(view)
                        if seen is not None:
                            seen(view)
                        if expected is not None and written > expected:
                            break
                self._call("reading", relative, copy)
            return self._info(result.meta)
        return self._again("reading", relative, attempt)

    def list(self, relative_dir: str) -> dict[str, ObjectInfo]:
        """Objects directly under a directory of the cache: ``{name: info}`` (one LIST per 1000)."""
        prefix = self.url.key(relative_dir.rstrip("/") + "/")

        def listing() -> dict[str, ObjectInfo]:
            objects = self._children(relative_dir)[0]
            return {str(meta["path"])[len(prefix):]: self._info(meta) for meta in objects}
        return self._again("listing", relative_dir, lambda: self._call("listing", relative_dir, listing))

    def _children(self, relative_dir: str) -> tuple[list[dict[str, Any]], list[str]]:
        """The objects directly under a directory of the cache and its sub-directories (relative paths).

        A key there that the client cannot represent fails the client's whole listing: it is named
        (a warning). At the cache's root, the cache's own files are then asked for by name and its own
        directories listed each on its own; in a directory of the cache's own, nothing would say which of
        its files the failed listing hid, so that is an :class:`UnrepresentableKeyError` naming the key;
        a directory of another tool's is left out. Keys deeper down are never read here (a delimited
        listing shows their directory only), so such a key hides nothing of another directory."""
        prefix = self.url.key(relative_dir.rstrip("/") + "/") if relative_dir else (
            self.url.prefix + "/" if self.url.prefix else None)
        try:
            found = self._obstore.list_with_delimiter(self._store, prefix=prefix)
            directories = [self.url.relative(str(p).rstrip("/")) for p in found["common_prefixes"]]
            return list(found["objects"]), directories
        except self._obstore.exceptions.InvalidPathError as exc:
            bad = self._unrepresentable(exc)
            if not relative_dir:
                heads = [self._head_meta(self.url.key(name)) for name in _ROOT_FILES]
                return [meta for meta in heads if meta is not None], list(_ROOT_DIRS)
            if relative_dir.strip("/") in _ROOT_DIRS:
                raise UnrepresentableKeyError(
                    f"listing {self.name(relative_dir.strip('/'))}/: it holds the key {shown_key(bad)}, "
                    "which this object-store client cannot represent (an empty, '.' or '..' path segment "
                    "or a control character), and the client cannot list the cache's files beside it. No "
                    "file of this tool's is named so: rename or delete it (e.g. with the AWS CLI or boto3), "
                    "then rerun"
                ) from None
            return [], []

    def _head_meta(self, key: str) -> dict[str, Any] | None:
        try:
            return self._obstore.head(self._store, key)
        except (FileNotFoundError, self._obstore.exceptions.NotFoundError):
            return None

    def _unrepresentable(self, exc: Exception) -> str:
        """The key a listing failed on (the client could not parse it), named in a warning once."""
        match = _BAD_KEY.search(str(exc))
        if match is None:
            raise exc
        bad = match[1]
        if bad not in self._named:
            self._named.add(bad)
            log.warning("%s/%s: a key this object-store client cannot represent (an empty, '.' or '..' path "
                        "segment or a control character); skipped. Rename or delete it if it should be read",
                        self.url.store_url, shown_key(bad))
        return bad

    # -- writes -------------------------------------------------------------------------------

    def put(self, relative: str, data: bytes, *, create: bool = False, match: str | None = None) -> str:
        """Write a small object whole; ``create``: only where none exists (``If-None-Match: *``);
        ``match``: only over the version with that ETag (``If-Match``). Returns its ETag.

        A conditional write is ours where the store holds exactly ``data`` after it lost
        (:class:`ConditionFailedError`) or its answer was lost (a reset, a timeout the client does not
        retry after sending): it landed, and the client's retry of it lost to it, or its answer never
        came. One that did not land is sent again (the condition keeps that safe)."""
        key = self.url.key(relative)
        mode: Any = "create" if create else ({"e_tag": match} if match else "overwrite")

        def attempt() -> str:
            try:
                # If-Match over an object gone since is a 404 (S3): the version matched is no longer there.
                result = self._call("writing", relative,
                                    lambda: self._obstore.put(self._store, key, data, mode=mode),
                                    missing=None if match else ...)
                if result is None:
                    raise ConditionFailedError(
                        f"writing {self.name(relative)}: the version it was to replace is gone")
                return str(result.get("e_tag") or "")
            except (AccessDeniedError, NoSuchBucketError):
                raise
            except ObjectStoreError:
                if mode == "overwrite":
                    raise
                got = self.get(relative, limit=len(data))
                if got is not None and got[0] == data:
                    log.info("%s: the store holds what was written (its answer was lost)",
                             self.name(relative))
                    return got[1].etag
                raise
        return attempt() if mode == "overwrite" else self._again("writing", relative, attempt)

    def upload(self, relative: str, source: str) -> str:
        """Write the file ``source`` as the object (multipart above 64 MiB, parts in flight)."""
        key = self.url.key(relative)
        size = os.path.getsize(source)

        def attempt() -> str:
            # A path, not an open file: the client reads it itself, ~10% less CPU than through Python calls
            # (BENCHMARKS.md), which the device's copies share the cores with.
            result = self._call(
                "writing",
                relative,
                lambda: self._obstore.put(
                    self._store,
                    key,
                    pathlib.Path(source),
                    use_multipart=size > _MULTIPART,
                    chunk_size=_CHUNK * 2,
                    max_concurrency=8,
                ),
            )
            return str(result.get("e_tag") or "")
        return self._again("writing", relative, attempt)

    def delete(self, relative: str) -> None:
        key = self.url.key(relative)
        self._call("deleting", relative, lambda: self._obstore.delete(self._store, key), missing=None)

    def walk(self, relative_dir: str = "") -> Iterator[tuple[str, ObjectInfo]]:
        """Every object under a directory of the cache, recursively, as (relative path, info): a directory
        at a time, keys the client cannot represent skipped and named (see :meth:`_children`)."""
        objects, directories = self._call("listing", relative_dir, lambda: self._children(relative_dir))
        for meta in objects:
            yield self.url.relative(str(meta["path"])), self._info(meta)
        for directory in directories:
            yield from self.walk(directory)
