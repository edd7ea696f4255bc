"""Which samples' checksums a read checks: the first time this process reads a sample (``"once"``) or every time.

A checked sample is hashed (xxh3-64, as the producer writes it) while the batch filler reads it
into the batch: each chunk right after its read, while it is in the CPU cache, so checking costs
no second read of the file (:mod:`.fill`; the native filler's xxh3 is ``format/csrc/xxh3.h``, the Python
one's the ``xxhash`` package). A mismatch fails the batch, naming the shard and sample. With
``verify="once"`` (the default) a checked sample is remembered in a bitmap of its shard (one bit
per sample, so bounded by the cache's sample count) and later epochs read it without hashing.
``verify="always"`` hashes every read, as ``dspark-verify`` does.

What ``"once"`` trusts: bytes this process checked, in a file it still has open (or reopened
as the same file: ``CacheDir.identity``). A shard's bits are dropped when its file is opened again and is not the
same file as before (device, inode, size, mtime or ctime differ: replaced, or written, since),
and every bit is dropped in a forked child: a DataLoader worker checks what it reads itself,
since its parent's checks were another process's reads and the worker may reopen the files. A
byte that changes while this process keeps its file open and has already checked the sample
(a write in place, or a disk error under a page-cache eviction) is not seen by ``"once"``; it is
by ``"always"`` and by ``dspark-verify``.
"""

from __future__ import annotations

import os
import threading

from dspark_cache.storage.cache import FileIdentity

VERIFY_MODES = ("once", "always")


class VerifiedSamples:
    """Which samples this process has checked, per shard file: a bitmap each (``"once"``)."""

    def __init__(self, mode: str) -> None:
        if mode not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {VERIFY_MODES}, not {mode!r}")
        self.mode = mode
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._shards: dict[int, tuple[FileIdentity, bytearray]] = {}

    def _bits(self, shard_id: int, identity: FileIdentity, num_samples: int) -> bytearray:
        """The shard's bitmap for this file in this process (fresh when either changed); under the lock."""
        if self._pid != os.getpid():  # a forked child: its parent's checks are not its own
            self._shards.clear()
            self._pid = os.getpid()
        known = self._shards.get(shard_id)
        if known is None or known[0] != identity or len(known[1]) * 8 < num_samples:
            known = self._shards[shard_id] = (identity, bytearray(-(-num_samples // 8)))
        return known[1]

    def needed(self, shard_id: int, identity: FileIdentity, num_samples: int, entry: int) -> bool:
        """True when sample ``entry`` (its position in the shard's index) must be hashed on this read."""
        if self.mode == "always":
            return True
        with self._lock:
            return not self._bits(shard_id, identity, num_samples)[entry >> 3] >> (entry & 7) & 1

    def mark(self, shard_id: int, identity: FileIdentity, num_samples: int, entry: int) -> None:
        """Sample ``entry`` of this file checked out; call while the shard's descriptor is pinned."""
        if self.mode == "always":
            return
        with self._lock:
            self._bits(shard_id, identity, num_samples)[entry >> 3] |= 1 << (entry & 7)

    def bitmap_bytes(self) -> int:
        """Memory the bitmaps hold (one bit per sample of each shard read so far)."""
        with self._lock:
            return sum(len(bits) for _, bits in self._shards.values())
