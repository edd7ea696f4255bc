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
for a plain-http endpoint. ``storage_options`` (``--storage-options JSON``) adds the client's
configuration keys (``endpoint``, ``region``, ``access_key_id``, ...) plus ``client_options``
and ``retry_config``; their values are never logged or put in a message.

Every failure comes out as a :class:`~dspark_cache.format.errors.CacheError` of one line that
names the object and says what to do: access denied (which credential), a missing bucket, and
transient faults (503 SlowDown, 500s, resets, timeouts) that the client already retried with
backoff. A missing object is not an error: reads return ``None``.
"""

from __future__ import annotations

import logging
import errno
import os
import pathlib
import random
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator, TypeVar

from dspark_cache.format.errors import CacheError
from dspark_cache.format.remote.url import RemoteURL

log = logging.getLogger(__name__)

EXTRA = "dspark-cache[s3]"
_CHUNK = 8 << 20  # streamed reads and writes move this much at a time
_MULTIPART = 64 << 20  # uploads larger than this go in parts, several in flight
_LOCAL_DISK = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)
_ATTEMPTS = 2  # one whole-object retry on top of the client's own (which resumes a cut download itself)
_T = TypeVar("_T")


class MissingExtraError(CacheError):
    """The object-store client is not installed."""


class ObjectStoreError(CacheError):
    """A request to the object store failed for good (after retries)."""


class AccessDeniedError(ObjectStoreError):
    """403, or credentials the store does not accept."""


class NoSuchBucketError(ObjectStoreError):
    """The bucket (or container) does not exist."""


class ConditionFailedError(ObjectStoreError):
    """A conditional write lost: the object exists (create) or changed (match)."""


@dataclass(frozen=True)
class ObjectInfo:
    """What a listing or ``head`` says of one object."""

    size: int
    etag: str
    modified: float  # seconds since the epoch


def _client() -> Any:
    try:
        import obstore
        import obstore.store  # noqa: F401  (the submodule from_url lives in)
    except ImportError as exc:
        raise MissingExtraError(
            f"caches on object storage need the optional client: pip install \"{EXTRA}\" (obstore), then rerun"
        ) from exc
    return obstore


def _default_client_options(endpoint: str | None) -> dict[str, Any]:
    options: dict[str, Any] = {"timeout": "300s", "connect_timeout": "10s"}
    if endpoint and endpoint.startswith("http://"):
        options["allow_http"] = True  # a local MinIO or test server: the user pointed us there
    return options


def _default_retry() -> dict[str, Any]:
    return {"max_retries": 8, "retry_timeout": timedelta(minutes=3),
            "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=15), "base": 2}}


def client_endpoint(config: dict[str, Any]) -> str | None:
    """The endpoint the client talks to: the options' spelling of it, else the AWS_ENDPOINT_URL variables."""
    for key in ("aws_endpoint_url_s3", "endpoint_url", "endpoint", "aws_endpoint", "aws_endpoint_url"):
        if config.get(key):
            return str(config[key])
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT")


def _first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:300] + ("..." if len(text) > 300 else "")


class ObjectStore:
    """The objects under one cache URL. Paths given to its methods are relative to the cache's root
    (``shards/shard-000000.tar``), as :class:`CachePaths` spells them relative to a directory."""

    def __init__(self, url: str | RemoteURL, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url if isinstance(url, RemoteURL) else RemoteURL.parse(url)
        obstore = _client()
        config = dict(storage_options or {})
        client_options = {**_default_client_options(client_endpoint(config)), **config.pop("client_options", {})}
        retry = config.pop("retry_config", None) or _default_retry()
        if "endpoint_url" in config:  # the spelling boto3 and s3fs users know
            config["endpoint"] = config.pop("endpoint_url")
        self._obstore = obstore
        self._pid = os.getpid()
        try:
            self._store = obstore.store.from_url(self.url.store_url, config=config or None,
                                                 client_options=client_options, retry_config=retry)
        except Exception as exc:  # an unknown option key, a malformed value: never echo the values
            raise ObjectStoreError(
                f"{self.url}: the object-store client refused its configuration ({type(exc).__name__}: "
                f"{_first_line(exc)}); check --storage-options / storage_options keys and the AWS_* variables"
            ) from exc

    def __repr__(self) -> str:  # never the options: they may hold secrets
        return f"ObjectStore({str(self.url)!r})"

    def name(self, relative: str) -> str:
        return self.url.name(relative)

    # -- errors -------------------------------------------------------------------------------

    def _translate(self, exc: Exception, what: str, relative: str) -> CacheError:
        errors = self._obstore.exceptions
        where = self.name(relative)
        text = _first_line(exc)
        if "NoSuchBucket" in text or "bucket does not exist" in text.lower():
            return NoSuchBucketError(f"{what} {where}: the bucket {self.url.bucket} does not exist (or this "
                                     "endpoint is not the store it is in); create it or fix the URL / AWS_ENDPOINT_URL")
        if isinstance(exc, (errors.PermissionDeniedError, errors.UnauthenticatedError)) or "AccessDenied" in text \
                or "InvalidAccessKeyId" in text or "SignatureDoesNotMatch" in text or "403 Forbidden" in text:
            return AccessDeniedError(
                f"{what} {where}: access denied (403). The credentials in use (AWS_ACCESS_KEY_ID / "
                "AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, or the instance's role) may not do this on bucket "
                f"{self.url.bucket}; fix the credentials or the bucket policy, then rerun")
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
                "DataLoader(..., multiprocessing_context=\"spawn\") (or \"forkserver\")")
        try:
            return call()
        except OSError as exc:
            if exc.errno in _LOCAL_DISK:  # our own write to this machine's disk (see _again)
                raise
            return self._failed(exc, what, relative, missing)
        except Exception as exc:
            return self._failed(exc, what, relative, missing)

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
            except (AccessDeniedError, NoSuchBucketError, ConditionFailedError, FileNotFoundError):
                raise
            except (ObjectStoreError, OSError) as exc:
                if isinstance(exc, OSError) and exc.errno in _LOCAL_DISK:  # this machine's disk: no retry mends it
                    raise ObjectStoreError(
                        f"{what} {self.name(relative)}: the local file {exc.filename or ''} could not be written "
                        f"({exc.strerror}); free space there or choose another --local-cache-dir / --staging-dir "
                        "(or a smaller --cache-limit / --staging-limit), then rerun") from exc
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
            result = self._call("reading", relative, lambda: self._obstore.get(self._store, key), missing=None)
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
            out: dict[str, ObjectInfo] = {}
            for chunk in self._obstore.list(self._store, prefix=prefix):
                for meta in chunk:
                    name = str(meta["path"])[len(prefix):]
                    if name and "/" not in name:
                        out[name] = self._info(meta)
            return out
        return self._again("listing", relative_dir, lambda: self._call("listing", relative_dir, listing))

    # -- writes -------------------------------------------------------------------------------

    def put(self, relative: str, data: bytes, *, create: bool = False, match: str | None = None) -> str:
        """Write a small object whole; ``create``: only where none exists (``If-None-Match: *``);
        ``match``: only over the version with that ETag (``If-Match``). Returns its ETag."""
        key = self.url.key(relative)
        mode: Any = "create" if create else ({"e_tag": match} if match else "overwrite")
        result = self._call("writing", relative, lambda: self._obstore.put(self._store, key, data, mode=mode))
        return str(result.get("e_tag") or "")

    def upload(self, relative: str, source: str) -> str:
        """Write the file ``source`` as the object (multipart above 64 MiB, parts in flight)."""
        key = self.url.key(relative)
        size = os.path.getsize(source)

        def attempt() -> str:
            # A path, not an open file: the client reads it itself, ~10% less CPU than through Python calls
            # (BENCHMARKS.md), which the device's copies share the cores with.
            result = self._call("writing", relative, lambda: self._obstore.put(
                self._store, key, pathlib.Path(source), use_multipart=size > _MULTIPART, chunk_size=_CHUNK * 2,
                max_concurrency=8))
            return str(result.get("e_tag") or "")
        return self._again("writing", relative, attempt)

    def delete(self, relative: str) -> None:
        key = self.url.key(relative)
        self._call("deleting", relative, lambda: self._obstore.delete(self._store, key), missing=None)

    def walk(self, relative_dir: str = "") -> Iterator[tuple[str, ObjectInfo]]:
        """Every object under a directory of the cache, recursively, as (relative path, info)."""
        root = self.url.key(relative_dir.rstrip("/") + "/") if relative_dir else (
            self.url.prefix + "/" if self.url.prefix else "")
        chunks = self._call("listing", relative_dir, lambda: list(self._obstore.list(self._store, prefix=root or None)))
        for chunk in chunks:
            for meta in chunk:
                yield self.url.relative(str(meta["path"])), self._info(meta)
