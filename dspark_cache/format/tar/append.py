"""Bytes into a shard file, hashed as they go: the shard's running xxh3-64 and each sample's.

A batch of samples reaches the file as one list of :class:`Piece` s (tar framing, safetensors
headers, tensor bytes wherever they lie, zero padding). :class:`TarAppender` writes them in
order and returns each sample's payload checksum, reading every byte once: the native loop
(``csrc/append.c``, called through ctypes, which releases the GIL) hashes a 64 KiB chunk into
both checksums while it is cached, then ``writev`` s it from where it lies. Without the native
library (no C compiler at install) the same bytes and the same checksums come from ``xxhash``
and ``os.writev`` (slower: three passes over each byte).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import xxhash

from dspark_cache.format.native import load_extension, native_wanted

APPEND_ABI = 1  # csrc/append.c's dspark_append_abi()
_ZEROS = np.zeros(1 << 13, dtype=np.uint8)  # padding is shorter: a tensor gap < 64, a tar block < 512, a page


@dataclass(frozen=True)
class Piece:
    """``buffer`` (C-contiguous bytes) written next; ``owner``: the index of the sample whose payload it is
    part of (its checksum covers it), or -1 for tar framing, covered by the shard's checksum only."""

    buffer: Any
    owner: int


def zeros(n: int) -> memoryview:
    """``n`` zero bytes without allocating them (padding)."""
    if n > _ZEROS.nbytes:
        return memoryview(bytes(n))
    return memoryview(_ZEROS)[:n]


@lru_cache(maxsize=1)
def _native() -> ctypes.CDLL | None:
    lib = load_extension("dspark_cache.format.tar._append", "dspark_append_abi", APPEND_ABI, "shard writer")
    if lib is None:
        return None
    p, u64 = ctypes.c_void_p, ctypes.c_uint64
    lib.dspark_append_state_size.restype = ctypes.c_size_t
    lib.dspark_append_reset.argtypes = [p]
    lib.dspark_append_reset.restype = None
    lib.dspark_append_digest.argtypes = [p]
    lib.dspark_append_digest.restype = u64
    lib.dspark_append.argtypes = [ctypes.c_int, p, p, p, p, ctypes.c_size_t, p, ctypes.c_size_t]
    lib.dspark_append.restype = ctypes.c_int
    return lib


def native_available() -> bool:
    """True when the C writer is built and loads."""
    return _native() is not None


def use_native_default() -> bool:
    """The native writer unless it is missing or ``DSPARK_NATIVE=0`` asks for the Python one."""
    return native_wanted() and native_available()


def _address(buffer: Any) -> tuple[int, int, Any]:
    """``(address, nbytes, what keeps it alive)`` of a C-contiguous buffer, read-only ones included."""
    array = buffer if isinstance(buffer, np.ndarray) else np.frombuffer(buffer, dtype=np.uint8)
    if not array.flags.c_contiguous:
        raise ValueError("a piece of a shard is not C-contiguous")
    flat = array.reshape(-1).view(np.uint8)
    return flat.ctypes.data, flat.nbytes, flat


class TarAppender:
    """Appends pieces to an open file descriptor, keeping the whole file's xxh3-64."""

    def __init__(self, fd: int, native: bool | None = None) -> None:
        self.fd = fd
        self._lib = _native() if (use_native_default() if native is None else native) else None
        if self._lib is not None:
            self._state = ctypes.create_string_buffer(self._lib.dspark_append_state_size())
            self._lib.dspark_append_reset(self._state)
        else:
            self._hash = xxhash.xxh3_64()

    @property
    def native(self) -> bool:
        return self._lib is not None

    def digest(self) -> int:
        """The xxh3-64 of everything appended so far."""
        if self._lib is not None:
            return int(self._lib.dspark_append_digest(self._state))
        return self._hash.intdigest()

    def append(self, pieces: list[Piece], samples: int) -> list[int]:
        """Write ``pieces`` in order; returns the payload checksum of each of ``samples`` (owners
        0..samples-1, each one's pieces consecutive). An ``OSError`` leaves the file partly written:
        the shard is to be abandoned."""
        _check_owners(pieces, samples)  # before a byte is written, on either path
        if self._lib is not None:
            return self._append_native(pieces, samples)
        hashes = [xxhash.xxh3_64() for _ in range(samples)]
        views = []
        for piece in pieces:
            view = memoryview(_address(piece.buffer)[2])
            self._hash.update(view)
            if piece.owner >= 0:
                hashes[piece.owner].update(view)
            views.append(view)
        _writev_all(self.fd, views)
        return [h.intdigest() for h in hashes]

    def _append_native(self, pieces: list[Piece], samples: int) -> list[int]:
        n = len(pieces)
        ptrs = np.empty(n, dtype=np.uint64)
        lens = np.empty(n, dtype=np.uint64)
        owners = np.empty(n, dtype=np.int64)
        alive = []
        for i, piece in enumerate(pieces):
            ptrs[i], lens[i], keep = _address(piece.buffer)
            owners[i] = piece.owner
            alive.append(keep)
        out = np.zeros(samples, dtype=np.uint64)
        rc = self._lib.dspark_append(self.fd, self._state, ptrs.ctypes.data, lens.ctypes.data,
                                     owners.ctypes.data, n, out.ctypes.data, samples)
        if rc:
            raise OSError(-rc, os.strerror(-rc))
        return [int(h) for h in out]


def _check_owners(pieces: list[Piece], samples: int) -> None:
    """Samples 0..samples-1 in order, each with a piece, each one's pieces together: a ``ValueError``
    otherwise (``csrc/append.c`` checks the same)."""
    current = highest = -1
    for piece in pieces:
        if piece.owner != current:
            current = piece.owner
            if current >= 0 and current != highest + 1:
                raise ValueError(f"piece owners must name samples 0..{samples - 1} in order, each one's "
                                 f"pieces together; sample {current} comes after sample {highest}")
            highest = max(highest, current)
    if highest != samples - 1:
        raise ValueError(f"pieces name samples 0..{highest}, not the {samples} samples asked for")


def _writev_all(fd: int, views: list[memoryview]) -> None:
    """``os.writev`` until every byte is written (short writes resumed), at most 1024 buffers a call."""
    pending = [v for v in views if v.nbytes]
    i = 0
    while i < len(pending):
        done = os.writev(fd, pending[i : i + 1024])
        while done:
            if done >= pending[i].nbytes:
                done -= pending[i].nbytes
                i += 1
            else:
                pending[i] = pending[i][done:]
                done = 0
