"""The staging directory of a cache on object storage: where it is, that it stages one cache, what it is.

A producer (or ``dspark-convert``) writes a remote cache into a local staging directory first
(``remote.output``). Two caches sharing one would take each other's shards for their own, so the
directory names the URL it stages in ``.dspark-staging``, made by the first process that finds it
empty (the ranks of a node race for that, and one link wins) and checked by every later one. The
ranks of a job compare :func:`staging_identity` to know which of them share rank 0's directory.
What the store's files brought down are copies of, and the downloads in progress, are kept in
``.dspark-staging-records`` as every node-local copy keeps them (:func:`.localdir.replica_dirs`).
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
from typing import Any

from dspark_cache.format.errors import CacheError
from dspark_cache.format.paths import CachePaths
from dspark_cache.storage.remote.localdir import (
    Temporaries,
    local_copy_dir,
    own_directory,
    own_replica_dirs,
    replica_dirs,
)
from dspark_cache.storage.remote.url import RemoteURL


class StagingDirectoryError(CacheError):
    """The staging directory belongs to another remote cache, or holds files of no cache."""


def default_staging_dir(url: RemoteURL, local_cache_dir: str | None,
                        storage_options: dict[str, Any] | None = None) -> str:
    """``<--local-cache-dir>/staging/<scheme>/<store>/<bucket>/<prefix>``: next to the readers' copies, never
    one of them, and one per store (``<store>``: the endpoint or account, :func:`.localdir.store_key`)."""
    return local_copy_dir("staging", url, storage_options, local_cache_dir)[1]


def claim_staging(paths: CachePaths, url: str) -> None:
    """Make ``paths.root`` the staging directory of ``url`` (created, its mark written), or refuse one that
    stages another cache or holds other files."""
    root, mark = paths.root, paths.staging_mark
    # Only this user may write it: the store is brought down into it, and what is found there resumes.
    own_directory(root, what="staging directory", option="--staging-dir")
    for _ in range(2):
        try:
            with open(mark, encoding="utf-8") as handle:
                staged = handle.read().strip()
            break
        except FileNotFoundError:
            if any(not name.startswith(os.path.basename(mark)) for name in os.listdir(root)):
                raise StagingDirectoryError(
                    f"staging directory {root} is not empty and does not stage a remote cache; give "
                    "--staging-dir an empty or new directory (it holds shards until they are uploaded)"
                ) from None
            temporary = f"{mark}.{os.getpid()}.{threading.get_ident()}.tmp"
            with open(temporary, "w", encoding="utf-8") as handle:
                handle.write(f"{url}\n")
            try:
                os.link(temporary, mark)  # whole or not at all, and only where no other process made one
            except FileExistsError:
                pass
            finally:
                os.unlink(temporary)
    else:
        raise StagingDirectoryError(
            f"staging directory {root}: its {os.path.basename(mark)} keeps vanishing; is "
            "another program clearing it? Choose another --staging-dir"
        )
    if staged != url:
        raise StagingDirectoryError(
            f"staging directory {root} stages {staged}, not {url}; two caches cannot share one --staging-dir: "
            "choose another (or remove that one once its producer is done)"
        )
    own_replica_dirs(paths.staging_records, root, what="staging directory", option="--staging-dir")
    Temporaries(replica_dirs(paths.staging_records)[1]).clean()  # downloads of a process killed midway


def missing_top(root: str) -> str | None:
    """The outermost directory on the way to ``root`` (``root`` included) that is not there yet: what
    a run that creates ``root`` makes, and a failed one removes (:func:`discard_staging`); ``None``:
    ``root`` is there."""
    top, up = None, os.path.abspath(root)
    while not os.path.lexists(up):
        top, up = up, os.path.dirname(up)
    return top


def discard_staging(top: str | None) -> None:
    """A run that failed before any shard removes the staging directory it made (``missing_top`` before it
    began): nothing of it is the store's, and the store, the truth, is brought down again by the next run."""
    if top is not None:
        shutil.rmtree(top, ignore_errors=True)


def staging_identity(root: str) -> str:
    """The same for two processes only on the same machine's same directory (boot id, device, inode)."""
    st = os.stat(root)
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as handle:
            machine = handle.read().strip()
    except OSError:
        machine = socket.gethostname()
    return f"{machine}:{st.st_dev}:{st.st_ino}"
