"""Which cache paths are object-store URLs, and how a URL splits into store, prefix and keys.

One rule for every part: a path with a ``scheme://`` other than ``file://`` is a remote cache
(``s3://bucket/prefix``, ``gs://...``, ``az://...``); anything else is a local directory and
keeps today's code path. Keys inside the cache are the local layout's relative paths
(``manifest.json``, ``shards/shard-000000.tar``), so :class:`~dspark_cache.format.paths.CachePaths`
stays the one source of every name.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

_URL = re.compile(r"^(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*)://(?P<bucket>[^/]*)(?P<prefix>/.*)?$")
# What obstore serves: S3 and S3-compatible stores, Google Cloud Storage, Azure.
SCHEMES = ("s3", "s3a", "gs", "az", "adl", "azure", "abfs", "abfss")


def is_remote(path: str | os.PathLike) -> bool:
    """True for an object-store URL (``file://`` and plain paths are local)."""
    if not isinstance(path, str):
        return False
    match = _URL.match(path)
    return match is not None and match["scheme"].lower() != "file"


@dataclass(frozen=True)
class RemoteURL:
    """``scheme://bucket/prefix``: the store (scheme and bucket) and the cache's prefix in it."""

    scheme: str
    bucket: str
    prefix: str  # no leading or trailing slash; "" for a cache at the bucket's top

    @classmethod
    def parse(cls, url: str) -> "RemoteURL":
        match = _URL.match(url)
        if match is None or match["scheme"].lower() == "file":
            raise ValueError(f"{url!r} is not an object-store URL (scheme://bucket/prefix)")
        scheme = match["scheme"].lower()
        if scheme not in SCHEMES:
            raise ValueError(
                f"{url}: the scheme {scheme}:// is not an object store this tool reads; use one of "
                f"{', '.join(s + '://' for s in SCHEMES)}, or a local directory"
            )
        if not match["bucket"]:
            raise ValueError(f"{url}: no bucket; write {scheme}://BUCKET/PREFIX")
        prefix = (match["prefix"] or "").strip("/")
        if prefix and any(part in ("", ".", "..") for part in prefix.split("/")):
            raise ValueError(f"{url}: the prefix has an empty, '.' or '..' part; write {scheme}://BUCKET/a/b")
        return cls(scheme, match["bucket"], prefix)

    @property
    def store_url(self) -> str:
        return f"{self.scheme}://{self.bucket}"

    def key(self, relative: str) -> str:
        """The object key of a file of the cache, from its path relative to the cache's root."""
        relative = relative.replace(os.sep, "/").lstrip("/")
        return f"{self.prefix}/{relative}" if self.prefix else relative

    def relative(self, key: str) -> str:
        """The inverse of :meth:`key`."""
        return key[len(self.prefix) + 1:] if self.prefix else key

    def __str__(self) -> str:
        return f"{self.store_url}/{self.prefix}" if self.prefix else self.store_url

    def name(self, relative: str) -> str:
        """The full URL of one object, for messages."""
        return f"{self.store_url}/{self.key(relative)}"
