"""The lossless codec of compressed caches (``dspark-produce --compression zstd``): byte planes + zstd.

A compressed sample keeps the safetensors header of its uncompressed form (the same JSON, plus the
metadata key ``compression``; no alignment padding: a compressed sample is never read in place),
followed by **one zstd frame** (with its content checksum) holding the sample's data section as the
uncompressed sample lays it out (:func:`~dspark_cache.format.sample.place_tensors`), except that
each tensor's bytes are stored as byte planes: all elements' byte 0, then all byte 1, ... (a bf16
state's high bytes, sign and exponent, lie together and compress; its low mantissa bytes barely do).
One-byte tensors (float8 codes, the loss mask) and the zero fill between tensors are stored as they
are. The frame records its content size, which must be exactly the data section's size for the
sample's length (``SampleShape.data_size``): that is known before a byte is decoded, so a frame that
declares another size, or decodes to another, is refused before anything is allocated from it, and a
decode never writes past one sample's bytes. Decoding gives back the uncompressed data section
bit for bit, so every reader works on it as on an uncompressed sample's.

The sample's checksum (its index entry's ``xxh3``) covers the stored bytes, header and frame, so
``dspark-verify`` checks a compressed cache without decoding it. The frame's own checksum (of the
decoded bytes, 4 bytes a sample) refuses a frame that decodes to other bytes than the writer's even
where the sample's checksum was rewritten to match. The frames are plain zstd (RFC 8878): any zstd
decoder reads them; :func:`decode_data` is the one place they are decoded here.
"""

from __future__ import annotations

import json
import struct
import threading
from typing import Any, Iterable, Mapping

import numpy as np
import zstandard

from dspark_cache.format.sample import COMPRESSION_KEY, DTYPE_SIZES, PAD_PREFIX

NONE = "none"
ZSTD = "zstd"
CODECS = (NONE, ZSTD)  # dspark-produce --compression
DEFAULT_LEVEL = 1  # measured fastest for its ratio on our states (BENCHMARKS.md, "Compression")
LEVELS = (-7, 19)  # the zstd levels --compression-level accepts (negative: faster, larger)
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_CHECKSUM_FLAG = 0x04  # in the frame header descriptor (RFC 8878, 3.1.1.1.1)


class CodecError(ValueError):
    """A stored frame that is not the sample's data section: readers name the sample as corrupt."""


def frame_bound(data_size: int) -> int:
    """The most bytes zstd's frame of ``data_size`` bytes can take (``ZSTD_COMPRESSBOUND``), plus
    its header: a longer stored sample is not one the writer wrote."""
    small = (128 << 10) - data_size >> 11 if data_size < 128 << 10 else 0
    return data_size + (data_size >> 8) + small + 32


_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    """This thread's compressor of ``level`` (a compressor is not shared between threads)."""
    cache = getattr(_local, "compressors", None)
    if cache is None:
        cache = _local.compressors = {}
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=True)
    return cache[level]


def _decompressor() -> zstandard.ZstdDecompressor:
    found = getattr(_local, "decompressor", None)
    if found is None:
        found = _local.decompressor = zstandard.ZstdDecompressor()
    return found


def _flat(buffer: Any) -> np.ndarray:
    """A C-contiguous buffer (numpy array, memoryview, bytes) as flat uint8, without a copy."""
    if isinstance(buffer, np.ndarray):
        return buffer.reshape(-1).view(np.uint8)
    return np.frombuffer(buffer, dtype=np.uint8)


def encode_data(placed: Iterable[tuple[str, int, int]], itemsizes: Mapping[str, int],
                tensors: Mapping[str, Any], data_size: int, level: int = DEFAULT_LEVEL) -> bytes:
    """One zstd frame of a sample's data section with every tensor as byte planes.

    ``placed``: ``(name, start, end)`` of each tensor and fill (``place_tensors``); ``itemsizes``:
    bytes per element of each tensor; ``tensors``: each one's stored bytes (C-contiguous buffers).
    Names not in ``tensors`` are the zero fill."""
    planes = np.zeros(data_size, dtype=np.uint8)
    for name, start, end in placed:
        if name not in tensors or end == start:
            continue
        src = _flat(tensors[name])
        if src.nbytes != end - start:
            raise ValueError(f"tensor {name} has {src.nbytes} bytes, the layout expects {end - start}")
        size = itemsizes[name]
        if size == 1:
            planes[start:end] = src
        else:  # plane j = byte j of every element
            planes[start:end].reshape(size, -1)[:] = src.reshape(-1, size).T
    return _compressor(level).compress(planes)


def _unshuffle(planes: np.ndarray, out: np.ndarray, size: int) -> None:
    """``size`` byte planes back into elements: shifts and ors over whole planes (numpy's strided
    transpose of single bytes runs ~20x slower)."""
    if size == 1:
        out[:] = planes
        return
    wide = np.dtype(f"<u{size}")
    rows = planes.reshape(size, -1)
    dst = out.view(wide)
    np.left_shift(rows[size - 1], 8 * (size - 1), out=dst, dtype=wide)
    for j in range(size - 2, -1, -1):
        if j:
            dst |= np.left_shift(rows[j], 8 * j, dtype=wide)
        else:
            dst |= rows[0]


def check_frame(frame: Any, data_size: int) -> None:
    """Refuse, before decoding anything, a frame that does not declare exactly ``data_size`` bytes."""
    head = bytes(memoryview(frame)[:18])
    if head[:4] != _ZSTD_MAGIC or len(head) < 6:
        raise CodecError("its compressed data is not a zstd frame")
    if not head[4] & _CHECKSUM_FLAG:
        raise CodecError("its zstd frame carries no content checksum (the writer always adds one)")
    try:
        declared = zstandard.frame_content_size(head)
    except zstandard.ZstdError as exc:
        raise CodecError(f"its zstd frame header does not parse ({exc})") from None
    if declared != data_size:
        said = "no size" if declared < 0 else f"{declared} bytes"
        raise CodecError(f"its zstd frame declares {said}, but a sample of this length has {data_size}")


def decode_data(frame: Any, placed: Iterable[tuple[str, int, int]], itemsizes: Mapping[str, int],
                out: np.ndarray) -> None:
    """Decode a sample's frame into ``out`` (its data section, ``out.nbytes`` bytes: the size the
    sample's length gives), undoing the byte planes; :class:`CodecError` for a frame that declares
    or decodes to another size, or that is not zstd. Names absent from ``itemsizes``: the fill."""
    check_frame(frame, out.nbytes)
    # Bounded: the frame declares out.nbytes (checked), and zstd refuses one that decodes to more or less.
    try:
        data = _decompressor().decompress(frame, max_output_size=out.nbytes, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise CodecError(f"its zstd frame does not decode ({exc})") from None
    if len(data) != out.nbytes:
        raise CodecError(f"its zstd frame decodes to {len(data)} bytes, not {out.nbytes}")
    planes = np.frombuffer(data, dtype=np.uint8)
    for name, start, end in placed:
        size = itemsizes.get(name, 1)
        if end > start:
            _unshuffle(planes[start:end], out[start:end], size)


# Without its cache's shape (a plain WebDataset reader), a compressed sample's decoded size is what its
# own header declares: it is refused beyond this many times its stored bytes (real states compress
# 1.2-3x; a frame of zeros, ~30,000x), so a crafted blob cannot make a reader allocate without bound.
MAX_RATIO = 64
_SLACK = 1 << 20


def decode_blob(blob: bytes | bytearray | memoryview) -> bytes | bytearray | memoryview:
    """A sample blob as its uncompressed form, read from the blob alone (its header says the tensors
    and the codec): a compressed sample's frame is decoded (:func:`decode_data`), bounded by
    :data:`MAX_RATIO` x its size; any other blob is returned as it is. ``ValueError`` (a
    :class:`CodecError` among them) for a blob whose header does not parse or whose frame is not its data."""
    view = memoryview(blob)
    (header_len,) = struct.unpack_from("<Q", view, 0)
    if header_len > len(view) - 8:
        raise ValueError(f"its header claims {header_len} bytes, the blob has {len(view)}")
    header = json.loads(bytes(view[8 : 8 + header_len]))
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict) or COMPRESSION_KEY not in metadata:
        return blob
    if metadata[COMPRESSION_KEY] != ZSTD:
        raise CodecError(f"compression {metadata[COMPRESSION_KEY]!r} is not one this version reads "
                         f"({ZSTD!r}); upgrade dspark-cache")
    placed, itemsizes = [], {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = (int(v) for v in info["data_offsets"])
        if not 0 <= start <= end:
            raise ValueError(f"tensor {name} has data offsets {start}..{end}")
        placed.append((name, start, end))
        itemsizes[name] = 1 if name.startswith(PAD_PREFIX) else DTYPE_SIZES[info["dtype"]]
    placed.sort(key=lambda p: p[1])
    if any(a[2] != b[1] for a, b in zip(placed, placed[1:])) or (placed and placed[0][1]):
        raise ValueError("its tensors do not tile the data section")
    data_size = placed[-1][2] if placed else 0
    if data_size > MAX_RATIO * len(view) + _SLACK:
        raise CodecError(f"its header declares {data_size} bytes of tensors for {len(view)} stored bytes, "
                         f"more than {MAX_RATIO}x: not a sample the writer made")
    start = 8 + header_len
    out = bytearray(start + data_size)
    out[:start] = view[:start]
    decode_data(view[start:], placed, itemsizes, np.frombuffer(out, dtype=np.uint8, offset=start))
    return out
