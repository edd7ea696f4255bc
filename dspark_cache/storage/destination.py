"""Where a cache is written: :func:`open_output` picks the write side from the path, as ``backing`` picks the read side.

* a plain path: :class:`~.output.CacheOutput` over that directory;
* an object-store URL (:func:`~.remote.url.is_remote`): :class:`~.remote.output.RemoteOutput`, which
  writes through a local staging directory and makes the store follow it.
"""

from __future__ import annotations

import os

from dspark_cache.storage.backing import StorageOptions
from dspark_cache.storage.output import CacheOutput
from dspark_cache.storage.remote.url import is_remote


def open_output(
    path: str | os.PathLike,
    *,
    storage: StorageOptions | None = None,
    staging_dir: str | None = None,
    staging_limit: int | None = None,
    rank: int = 0,
    lease_wait: float | None = None,
) -> CacheOutput:
    """The write side of the cache at ``path``: a directory's :class:`CacheOutput`, or for an object-store URL
    a ``remote.output.RemoteOutput`` staged in ``staging_dir`` (``staging_limit`` bytes of tars at most;
    ``lease_wait``: seconds to wait for a lease another producer holds)."""
    if not is_remote(path):
        return CacheOutput(path)
    from dspark_cache.storage.remote.output import RemoteOutput  # the client library is an optional extra

    return RemoteOutput(
        os.fspath(path),
        storage=storage,
        staging_dir=staging_dir,
        staging_limit=staging_limit,
        rank=rank,
        lease_wait=lease_wait,
    )
