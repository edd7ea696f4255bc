"""The saved plan on disk (``plan/`` in a cache): its schema and its arrays.

The producer tokenises its input once per job and keeps the result here, so that a rerun with
the same input and settings starts in seconds. Each encoding rank writes one *part* (its rows'
token ids, loss masks and a row table); rank 0 then merges every part's row table into the
*plan* (samples in write order, batch and shard boundaries, exact shard sizes) that every rank
memory-maps. Arrays are standard ``.npy`` files (readable with ``numpy.load(..., mmap_mode="r")``,
never with pickle); each JSON header carries the arrays' lengths and xxh3-64 checksums, and is
written last, so a header on disk means its arrays are whole.
"""

from __future__ import annotations

import os
import stat
import struct
from typing import BinaryIO, Callable

import msgspec
import numpy as np
import xxhash

from dspark_cache.format.atomic import atomic_write_bytes
from dspark_cache.format.errors import CacheError
from dspark_cache.format.files import open_regular, read_regular
from dspark_cache.format.schema import SkippedRow, encode_json
# The token rule is every reader's (format.validate); the producer applies it to a plan through this name.
from dspark_cache.format.validate import token_problem  # noqa: F401

PLAN_FORMAT = "dspark-plan/1"
MAX_HEADER_BYTES = 1 << 28  # skipped rows are listed in a header: ~100 bytes each, millions fit

# A part's row table: one record per sample the part encoded (its tokens lie in the part's
# ``ids``/``mask`` arrays at ``offset``).
PART_ROW = np.dtype([("sample_id", "<i8"), ("offset", "<i8"), ("length", "<i4"), ("loss_tokens", "<i4")])
# The merged plan's sample table, in write order: which part holds each sample's tokens.
PLAN_SAMPLE = np.dtype([("sample_id", "<i8"), ("part", "<i4"), ("offset", "<i8"), ("length", "<i4"),
                        ("loss_tokens", "<i4")])
TOKEN_ID = np.dtype("<i4")
LOSS_MASK = np.dtype("u1")
BOUNDARY = np.dtype("<i8")  # batch starts (into samples), shard starts (into batches), shard bytes


class PlanError(CacheError):
    """A saved plan file is missing, damaged or not ours: the producer rebuilds the plan."""


class ArrayRecord(msgspec.Struct, frozen=True):
    """One ``.npy`` file of the plan: its element count and the xxh3-64 of its data bytes."""

    length: int
    xxh3_64: str


class InvalidRowNote(msgspec.Struct, frozen=True):
    """Why one input row is invalid, in full (the manifest lists only the reason's short name)."""

    row: int
    where: str
    detail: str


class PartHeader(msgspec.Struct, kw_only=True):
    """``plan/part-NNNNN.json``: one encoding rank's share of the input, tokenised."""

    format: str = PLAN_FORMAT
    encode_key: str  # what the tokens depend on (input bytes, tokenizer, template, rules)
    part: int
    num_parts: int  # row i belongs to part i % num_parts
    rows: int  # rows of the input this part read (valid or not)
    tokens: int
    arrays: dict[str, ArrayRecord]  # "ids", "mask", "rows"
    skipped: list[SkippedRow] = []  # rows of this part that give no sample
    invalid: list[InvalidRowNote] = []  # the first few invalid rows, with what is wrong with them


class PlanHeader(msgspec.Struct, kw_only=True):
    """``plan/plan.json``: the merged plan every rank maps, and what it was built from."""

    format: str = PLAN_FORMAT
    encode_key: str
    # encode_key plus what batching and shard sizes depend on (on disk under its first name)
    batching_key: str = msgspec.field(name="layout_key")
    num_rows: int
    num_parts: int
    parts: list[ArrayRecord]  # each part's header: its size and checksum (the parts it was merged from)
    arrays: dict[str, ArrayRecord]  # "samples", "batches", "shards", "shard_bytes"
    # which samples each shard holds (the manifest's plan_sha256; on disk under its first name)
    shard_samples_sha256: str = msgspec.field(name="layout_sha256")
    skipped: list[SkippedRow] = []
    invalid: list[InvalidRowNote] = []


# -- .npy files written as a stream, then read back memory-mapped --------------------------------

_NPY_MAGIC = b"\x93NUMPY\x01\x00"
_NPY_HEADER_BYTES = 256  # magic + length + dict, padded (a multiple of 64): room for our record dtypes


def _npy_header(dtype: np.dtype, length: int) -> bytes:
    body = repr({"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (length,)})
    room = _NPY_HEADER_BYTES - len(_NPY_MAGIC) - 2
    if len(body) + 1 > room:
        raise ValueError(f"a .npy header for {dtype} x {length} does not fit {_NPY_HEADER_BYTES} bytes")
    return _NPY_MAGIC + struct.pack("<H", room) + body.ljust(room - 1).encode("latin1") + b"\n"


class ArrayWriter:
    """Appends records of one dtype to a ``.npy`` file; :meth:`close` fixes its length.

    The file is written under a temporary name and renamed when closed, so a crash never leaves
    a plausible-looking array behind.
    """

    def __init__(self, path: str, dtype: np.dtype) -> None:
        self.path, self.dtype = path, np.dtype(dtype)
        self._tmp = f"{path}.{os.getpid()}.tmp"
        claim(path)
        self._file: BinaryIO = open(self._tmp, "wb")
        self._file.write(_npy_header(self.dtype, 0))
        self._hash = xxhash.xxh3_64()
        self.length = 0

    def append(self, values: np.ndarray) -> None:
        data = memoryview(np.ascontiguousarray(values, dtype=self.dtype)).cast("B")
        self._file.write(data)
        self._hash.update(data)
        self.length += len(data) // self.dtype.itemsize

    def close(self) -> ArrayRecord:
        """Finish the file (length in its header, fsync, rename); its record for the plan header."""
        self._file.seek(0)
        self._file.write(_npy_header(self.dtype, self.length))
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._tmp, self.path)
        return ArrayRecord(self.length, self._hash.hexdigest())

    def abandon(self) -> None:
        """Drop the unfinished file (an error or stop while writing)."""
        try:
            self._file.close()  # may fail to flush on a full disk: the file is dropped anyway
        except OSError:
            pass
        if os.path.exists(self._tmp):
            os.unlink(self._tmp)


def write_array(path: str, values: np.ndarray, dtype: np.dtype) -> ArrayRecord:
    """Write a whole array as a plan ``.npy`` file."""
    writer = ArrayWriter(path, dtype)
    try:
        writer.append(values)
    except BaseException:
        writer.abandon()
        raise
    return writer.close()


def load_array(path: str, dtype: np.dtype, record: ArrayRecord, verify: bool = True,
               inspect: Callable[[np.ndarray], None] | None = None) -> np.ndarray:
    """Memory-map a plan array, checking its kind, dtype, length, size and (``verify``) checksum.

    Nothing is read past what the ``.npy`` header and ``record`` imply: a file of any other size
    (a sparse terabyte, say) is refused from its ``st_size`` before a byte of it is hashed.
    ``inspect`` (with ``verify``) sees the values in order, a chunk at a time, as the checksum reads
    them: a check of every value that goes through the map instead (``ids.max()``) makes every page
    of it resident, memory that grows with the input (issue 41, item 13). A chunk is a view of a
    reused buffer: keep what it says, never the chunk.
    """
    dtype = np.dtype(dtype)
    try:
        if stat.S_ISLNK(os.lstat(path).st_mode):  # the producer writes plain files only
            raise PlanError(f"{path} is a symlink, not a plan file")
        fd = open_regular(path)  # never a FIFO, a device or a directory: numpy would block or read forever
    except FileNotFoundError:
        raise PlanError(f"{path} is missing") from None
    except CacheError as exc:
        raise PlanError(str(exc)) from exc
    with os.fdopen(fd, "rb") as handle:
        try:
            if np.lib.format.read_magic(handle) != (1, 0):
                raise ValueError("not a version 1.0 .npy header")
            shape, fortran, descr = np.lib.format.read_array_header_1_0(handle)
        except ValueError as exc:
            raise PlanError(f"{path} is not a readable .npy array ({exc})") from exc
        if descr != dtype or fortran or shape != (record.length,):
            raise PlanError(f"{path} holds {descr} x {shape}, the plan says {dtype} x ({record.length},)")
        offset, size = handle.tell(), os.fstat(fd).st_size
        if size != offset + record.length * dtype.itemsize:
            raise PlanError(
                f"{path} is {size} bytes; its header implies {offset + record.length * dtype.itemsize}"
            )
        if verify and _data_digest(fd, offset, size - offset, dtype, inspect) != record.xxh3_64:
            raise PlanError(f"{path} does not match its checksum (damaged or from another plan)")
        if not record.length:
            return np.zeros(0, dtype)  # mmap refuses an empty range
        # copy-on-write: private, writable views; the file is never changed through them
        return np.memmap(handle, dtype=dtype, mode="c", offset=offset, shape=(record.length,))


def _data_digest(fd: int, offset: int, size: int, dtype: np.dtype = np.dtype("u1"),
                 inspect: Callable[[np.ndarray], None] | None = None) -> str:
    """xxh3-64 of ``size`` bytes from ``offset``, read through a small buffer: hashing a large
    array through its mapping would make every page of it resident in this process. ``inspect``
    gets each buffer's values as ``dtype`` (whole items: the buffer holds a multiple of them)."""
    digest = xxhash.xxh3_64()
    buf = memoryview(bytearray(max(1, _DIGEST_BUFFER // dtype.itemsize) * dtype.itemsize))
    while size > 0:
        want, done = min(size, len(buf)), 0
        while done < want and (n := os.preadv(fd, [buf[done:want]], offset + done)):
            done += n
        digest.update(buf[:done])
        if inspect is not None and done >= dtype.itemsize:
            inspect(np.frombuffer(buf[:done - done % dtype.itemsize], dtype=dtype))
        if done < want:  # an end of file that came early (the file shrank): the digest differs
            break
        offset, size = offset + done, size - done
    return digest.hexdigest()


_DIGEST_BUFFER = 1 << 22  # bytes read (and inspected) at a time


def claim(path: str) -> None:
    """Make room for a plan file at ``path``: an empty directory there is removed (nothing is lost);
    anything else in a directory's place is not ours and is refused."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return
        os.rmdir(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise CacheError(
            f"{path} is a directory ({exc.strerror}) where the saved plan keeps a file; the producer "
            f"does not delete what it did not write: move it out of {os.path.dirname(path)} "
            "and rerun"
        ) from None


def write_header(path: str, header: PartHeader | PlanHeader) -> None:
    """Publish a header (after its arrays): atomic, durable (the write fsyncs the directory too)."""
    claim(path)
    atomic_write_bytes(path, encode_json(header, pretty=False))


def read_header(path: str, kind: type[PartHeader] | type[PlanHeader]) -> PartHeader | PlanHeader | None:
    """A plan or part header, or None when there is none; :class:`PlanError` when it is unreadable."""
    try:
        raw = read_regular(path, MAX_HEADER_BYTES)
    except FileNotFoundError:
        return None
    except CacheError as exc:
        raise PlanError(str(exc)) from exc
    try:
        header = msgspec.json.decode(raw, type=kind)
    except msgspec.DecodeError as exc:
        raise PlanError(f"{path} is not a plan header ({exc})") from exc
    if header.format != PLAN_FORMAT:
        raise PlanError(f"{path} has plan format {header.format!r}, this version reads {PLAN_FORMAT!r}")
    return header

