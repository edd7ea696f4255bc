"""Sample checksums: checked the first time this process reads a sample (``"once"``) or every time.

A sample is checked by hashing its payload (xxh3_64, the ``xxhash`` package, as the producer
writes it) straight from its shard file, in 1 MiB chunks, just before the batch program reads
it into the batch: a ``preadv`` and a hash per chunk, both without the GIL. The first read of
a shard comes from disk; the program's read of the same bytes a moment later comes from the
page cache. With ``verify="once"`` (the default) a checked sample is remembered in a bitmap of
its shard (one bit per sample, so bounded by the cache's sample count) and later epochs read it
without hashing: the batch filler then only reads, copies and zeroes. ``verify="always"``
hashes every read, as ``dspark-verify`` does.

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

import numpy as np
import xxhash

from dspark_cache.format.cache import FileIdentity
from dspark_cache.loader.fill import RC_CHECKSUM, RC_READ_ERROR, RC_SHORT_READ, Failure

VERIFY_MODES = ("once", "always")
# Bytes per read while hashing: the chunk is hashed while it is still in the core's L2 cache,
# and a chunk costs two GIL hand-overs (preadv, hash).
CHUNK = 1 << 20


def check_payload(fd: int, offset: int, size: int, want: int, buf: np.ndarray, tag: object) -> Failure | None:
    """Hash ``size`` bytes at ``offset`` of ``fd`` through ``buf``; a Failure unless the xxh3 is ``want``."""
    hasher = xxhash.xxh3_64()
    view = memoryview(buf)
    pos = 0
    while pos < size:
        piece = view[: min(len(view), size - pos)]
        try:
            got = os.preadv(fd, [piece], offset + pos)
        except OSError as err:
            return Failure(RC_READ_ERROR, tag, err.errno or 0)
        if got == 0:
            return Failure(RC_SHORT_READ, tag, pos)
        hasher.update(piece[:got])  # xxhash hashes a large buffer without the GIL
        pos += got
    return None if hasher.intdigest() == want else Failure(RC_CHECKSUM, tag, 0)


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
