"""Where a remote cache's node-local directories are, and whether this process may trust one it finds.

Readers (``mirror``), producers (``staging``) and monitors (``tui.remote.monitorcopy``) keep copies
of a store's objects in local directories, and serve what they find there as the store's. Two rules
keep that honest:

* a directory is keyed by the store's identity (the endpoint, or the account, the client talks to)
  and the URL: ``s3://b/p`` on two S3-compatible endpoints are two caches, and never share a copy
  (:func:`store_key`);
* a directory that another user owns, or that others may write (a group or other write bit), on the
  way from the ``--local-cache-dir`` base down to the copy, is refused (:func:`own_directory`): whoever
  can write there can plant files this process would serve as the store's.

Each such directory is the cache's layout plus one bookkeeping directory of its own (``.mirror``,
``.monitor``, the staging directory's ``.dspark-staging-records``), which holds, as :func:`replica_dirs`
names them, the record of what each copied file is a copy of (``seen``, :mod:`.copies`) and the
downloads in progress (``tmp``): :class:`Temporaries`, each locked by its writer while it lives.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import logging
import stat
import time
import uuid
from typing import Any, Iterator

from dspark_cache.format.atomic import atomic_write_with
from dspark_cache.format.errors import CacheError
from dspark_cache.storage.remote.node import hold_lock
from dspark_cache.storage.remote.client import client_endpoint
from dspark_cache.storage.remote.url import RemoteURL

log = logging.getLogger(__name__)

_GUARD_WAIT_S = 5.0  # at most this long a download waits for a cleaner's scan of the temporaries
_SAFE_MODE = 0o755  # what we create: only this user writes (the umask may take more away, never add)
_UNSAFE_BITS = stat.S_IWGRP | stat.S_IWOTH
_SLUG = re.compile(r"[^A-Za-z0-9.-]+")
# The options that name the account or endpoint of Azure and Google stores (obstore's keys, lowercased).
_AZURE_ACCOUNT = ("azure_storage_account_name", "account_name", "azure_account_name")
_AZURE_ENDPOINT = ("azure_storage_endpoint", "azure_endpoint", "endpoint")
_GCS_ENDPOINT = ("google_endpoint", "endpoint")


class LocalCopyError(CacheError):
    """A node-local directory of a remote cache that this process must not trust."""


def default_local_cache_dir() -> str:
    return os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "dspark-cache", "remote")


def _store_where(url: RemoteURL, storage_options: dict[str, Any] | None) -> str:
    """The endpoint or account the client talks to for ``url`` ("" for the provider's default)."""
    config = {str(k).lower(): v for k, v in (storage_options or {}).items()}
    if url.scheme in ("s3", "s3a"):
        return client_endpoint(config) or ""
    if url.scheme == "gs":
        return next((str(config[k]) for k in _GCS_ENDPOINT if config.get(k)), "")
    account = next((str(config[k]) for k in _AZURE_ACCOUNT if config.get(k)), "") or os.environ.get(
        "AZURE_STORAGE_ACCOUNT_NAME", "") or os.environ.get("AZURE_STORAGE_ACCOUNT", "")
    endpoint = next((str(config[k]) for k in _AZURE_ENDPOINT if config.get(k)), "") or os.environ.get(
        "AZURE_STORAGE_ENDPOINT", "")
    return f"{account}@{endpoint}" if endpoint else account


def store_key(url: RemoteURL, storage_options: dict[str, Any] | None) -> str:
    """One directory name per store: ``default`` for the provider's own endpoint, else a readable form of
    the endpoint or account and a hash of its exact spelling (two endpoints never map to one name)."""
    where = _store_where(url, storage_options).strip().rstrip("/")
    if not where:
        return "default"
    scheme, sep, rest = where.partition("://")
    canonical = f"{scheme.lower()}://{rest.lower()}" if sep else where.lower()
    readable = _SLUG.sub("_", rest if sep else where).strip("_.")[:48] or "store"
    return f"{readable}-{hashlib.sha256(canonical.encode()).hexdigest()[:12]}"


def local_copy_dir(kind: str | None, url: RemoteURL, storage_options: dict[str, Any] | None,
                   local_cache_dir: str | os.PathLike | None) -> tuple[str, str]:
    """``(base, directory)``: ``<base>/[kind/]<scheme>/<store>/<bucket>/<prefix>`` under the node-local
    base ``base`` (``--local-cache-dir``); ``kind``: ``staging``, ``monitor``, or ``None``: the readers'
    copy."""
    base = os.path.abspath(os.fspath(local_cache_dir or default_local_cache_dir()))
    parts = [kind] if kind else []
    parts += [url.scheme, store_key(url, storage_options), url.bucket, *filter(None, url.prefix.split("/"))]
    return base, os.path.join(base, *parts)


def own_directory(directory: str, base: str | None = None, *, what: str = "local copy",
                  option: str = "--local-cache-dir") -> None:
    """Make ``directory`` (and each directory between ``base`` and it) where missing, only this user
    writing them; refuse any of them (``base`` included) that another user owns or others may write."""
    directory = os.path.abspath(directory)
    chain = [directory]
    if base is not None and os.path.commonpath([os.path.abspath(base), directory]) == os.path.abspath(base):
        while chain[-1] != os.path.abspath(base):
            chain.append(os.path.dirname(chain[-1]))
    for path in reversed(chain):
        try:
            os.mkdir(path, _SAFE_MODE)
        except FileExistsError:
            pass
        except FileNotFoundError:  # above base: made as the user's umask says (never checked)
            os.makedirs(path, _SAFE_MODE, exist_ok=True)
        _check_owned(path, what, option)


def _check_owned(path: str, what: str, option: str) -> None:
    st = os.lstat(path)
    me = os.geteuid()
    if stat.S_ISLNK(st.st_mode):
        st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise LocalCopyError(f"the {what} {path} is not a directory; remove it or choose another {option}")
    if st.st_uid != me:
        raise LocalCopyError(
            f"the {what} {path} belongs to another user (uid {st.st_uid}, not {me}): its files could have "
            f"been put there by them, and are not read as the store's. Choose a {option} of your own")
    if st.st_mode & _UNSAFE_BITS:
        raise LocalCopyError(
            f"the {what} {path} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}): its files "
            f"could have been put there by them, and are not read as the store's. Run chmod go-w {path} if "
            f"only you wrote there (or remove it), or choose another {option}")


def replica_dirs(records: str) -> tuple[str, str]:
    """``(seen, tmp)`` of a node-local copy whose bookkeeping directory is ``records`` (the module's
    docstring)."""
    return os.path.join(records, "seen"), os.path.join(records, "tmp")


def own_replica_dirs(records: str, root: str, *, what: str = "local copy",
                     option: str = "--local-cache-dir") -> None:
    """Make the bookkeeping directories of the copy at ``root`` (:func:`replica_dirs`), as
    :func:`own_directory` makes and checks a directory."""
    for directory in (records, *replica_dirs(records)):
        own_directory(directory, root, what=what, option=option)


def write_private(path: str, data: bytes) -> None:
    """Replace ``path`` with ``data``, writable by this user only whatever the umask (a record of what a
    copy is: nobody else may rewrite it to vouch for a file they planted)."""
    def fill(handle: Any) -> None:
        os.fchmod(handle.fileno(), 0o644)
        handle.write(data)
    atomic_write_with(path, fill, durable=False)


def private(st: os.stat_result) -> bool:
    """Whether a file (its ``stat``) is this user's and nobody else may write it."""
    return st.st_uid == os.geteuid() and not st.st_mode & _UNSAFE_BITS


class Temporaries:
    """Files being downloaded in ``directory``, each under an ``flock`` its writer holds while it writes.

    A temporary is removed by :meth:`clean` only where its lock is free: its writer is gone, whatever
    pid namespace or host it ran in (a pid read from a name could be another process's, there or here).
    A writer creates and locks its file under a shared lock of ``.creating`` that the cleaner takes
    exclusively, so that the cleaner never finds a file between its creation and its lock.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._creating = os.path.join(directory, ".creating")

    @contextlib.contextmanager
    def new(self, name: str) -> Iterator[str]:
        """A new temporary's path, locked while the block runs; removed after it unless renamed away."""
        path = os.path.join(self.directory, f"{name}.{uuid.uuid4().hex}")
        guard = self._guard()
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
        finally:
            if guard is not None:
                os.close(guard)
        try:
            yield path
        finally:
            try:
                os.unlink(path)
            except FileNotFoundError:  # renamed into place (or the directory went)
                pass
            os.close(fd)

    def _guard(self) -> int | None:
        """The creation guard, shared; waited for while a cleaner scans (a moment), but never for long: a
        process forked while a cleaner held it keeps it, and a download must not wait on that process."""
        deadline = time.monotonic() + _GUARD_WAIT_S
        while (guard := hold_lock(self._creating, fcntl.LOCK_SH | fcntl.LOCK_NB)) is None:
            if time.monotonic() > deadline:
                log.debug("%s: its creation guard stays held; a temporary made without it", self.directory)
                return None
            time.sleep(0.01)
        return guard

    def clean(self) -> int:
        """Remove the temporaries no live writer holds; how many. Best effort: where a writer is creating
        one now (or a process forked meanwhile holds its guard), nothing now; the next mirror cleans."""
        guard = hold_lock(self._creating, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if guard is None:
            return 0
        removed = 0
        try:
            for name in os.listdir(self.directory):
                if name.startswith("."):
                    continue
                path = os.path.join(self.directory, name)
                try:
                    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
                except (FileNotFoundError, OSError):
                    continue
                try:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        continue  # a download in progress
                    if os.fstat(fd).st_ino == os.stat(path).st_ino:
                        os.unlink(path)
                        removed += 1
                except FileNotFoundError:
                    pass
                finally:
                    os.close(fd)
        finally:
            os.close(guard)
        return removed
