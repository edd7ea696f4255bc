"""Exceptions shared by every part of the system; each message tells the user what to do."""

from __future__ import annotations


class CacheError(Exception):
    """Base class for every error about a cache directory."""


class NotACacheError(CacheError):
    """The directory holds no manifest."""


class IncompleteCacheError(CacheError):
    """The manifest says the producer has not finished."""


class CorruptShardError(CacheError):
    """A shard or one of its samples does not match its index (size or checksum)."""

    def __init__(self, path: str, reason: str, sample_id: int | None = None) -> None:
        where = f"{path}" if sample_id is None else f"{path} (sample {sample_id})"
        self.detail = f"{where}: {reason}"  # what is wrong, without what to do (dspark-verify says that once)
        super().__init__(
            f"corrupt shard {where}: {reason}. Run dspark-verify --repair on the cache (it rebuilds a damaged "
            "index from an intact tar and unpublishes what cannot be trusted), then rerun dspark-produce with "
            "the same arguments: resume recomputes exactly the missing shards."
        )
        self.path = path
        self.sample_id = sample_id


class ManifestMismatchError(CacheError):
    """An existing cache was produced with a different configuration."""
