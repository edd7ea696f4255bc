"""Safetensors files read and written a row at a time, so a multi-GB NeMo shard never sits in RAM.

A NeMo shard is one safetensors file whose tensors are ``[n, S, ...]``. ``safetensors``' own API
either maps the whole file (touched pages then count against the process) or needs every tensor
in memory to write one. Here the header is parsed (and checked) by hand and rows are moved with
``pread``/``pwrite`` at computed offsets: memory stays at one row, whatever the shard size.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

import numpy as np
import torch

from dspark_cache.format.files import NotARegularFileError, open_regular
from dspark_cache.nemo.convert.common import ConvertError

_CODES: dict[torch.dtype, str] = {
    torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}
# A header larger than this is not a NeMo shard (four entries take ~300 bytes, NeMo writes no
# metadata); the bound keeps a damaged length field from asking for memory.
_MAX_HEADER = 1 << 20
# safetensors pads its JSON header with spaces to this multiple.
_HEADER_ALIGN = 8


@dataclass(frozen=True)
class TensorRange:
    """Where one tensor's bytes lie in its file (``start`` is an absolute file offset)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def position_bytes(self) -> int:
        """Bytes of one sequence position of one row (``shape[2:]`` elements)."""
        return math.prod(self.shape[2:]) * self.dtype.itemsize

    def row_offset(self, row: int) -> int:
        return self.start + row * self.shape[1] * self.position_bytes


def header_bytes(
    specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
) -> tuple[bytes, dict[str, TensorRange]]:
    """The header ``safetensors.torch.save_file`` writes for these tensors (no metadata), in the
    given order, and where each tensor's bytes will lie."""
    entries: dict[str, dict] = {}
    cursor = 0
    for name, dtype, shape in specs:
        size = math.prod(shape) * dtype.itemsize
        entries[name] = {
            "dtype": _CODES[dtype],
            "shape": list(shape),
            "data_offsets": [cursor, cursor + size],
        }
        cursor += size
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % _HEADER_ALIGN)
    base = 8 + len(raw)
    ranges = {name: TensorRange(name, dtype, tuple(shape), base + entries[name]["data_offsets"][0])
              for name, dtype, shape in specs}
    return struct.pack("<Q", len(raw)) + raw, ranges


def file_size(specs: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> int:
    """Bytes of the safetensors file holding these tensors."""
    header, ranges = header_bytes(specs)
    return len(header) + sum(r.nbytes for r in ranges.values())


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _parse_entry(path: str, name: str, info: object, base: int, size: int) -> TensorRange:
    if not isinstance(info, dict) or info.get("dtype") not in _DTYPES:
        raise ConvertError(f"{path}: tensor {name!r} has an unknown or missing dtype ({info!r:.200})")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not (isinstance(shape, list) and all(map(_is_count, shape))):
        raise ConvertError(f"{path}: tensor {name!r} has an invalid shape {shape!r:.200}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))):
        raise ConvertError(f"{path}: tensor {name!r} has invalid data_offsets {offsets!r:.200}")
    tensor = TensorRange(name, _DTYPES[info["dtype"]], tuple(shape), base + offsets[0])
    if offsets[1] - offsets[0] != tensor.nbytes:
        raise ConvertError(f"{path}: tensor {name!r} spans bytes {offsets} but its shape {shape} needs "
                           f"{tensor.nbytes}")
    if base + offsets[1] > size:
        raise ConvertError(
            f"{path}: tensor {name!r} ends at byte {base + offsets[1]} but the file has {size} "
            "bytes (truncated? copy the shard again or re-run its producer)"
        )
    return tensor


def _check_tiling(path: str, tensors: dict[str, TensorRange], base: int, size: int) -> None:
    """The tensors must cover the data area exactly, in order, as ``safetensors`` itself demands:
    an overlap would read one tensor's bytes as another's, a gap or a tail is not this format."""
    cursor = base
    for tensor in sorted(tensors.values(), key=lambda t: (t.start, t.nbytes)):
        if tensor.start != cursor:
            raise ConvertError(
                f"{path}: tensor {tensor.name!r} starts at byte {tensor.start}, not {cursor} where "
                "the previous one ends (overlapping or gapped offsets: not a safetensors file "
                "as NeMo writes it; copy the shard again or re-run its producer)"
            )
        cursor += tensor.nbytes
    if cursor != size:
        raise ConvertError(
            f"{path}: the tensors end at byte {cursor} but the file has {size} bytes (damaged or "
            "appended to; copy the shard again or re-run its producer)"
        )


class SafetensorsFile:
    """Random row access to a safetensors file of ``[n, S, ...]`` tensors, by ``pread``."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self._fd = open_regular(path)  # a FIFO would block the open, /dev/zero read forever
        except NotARegularFileError as exc:
            raise ConvertError(f"{path} is {exc.reason}: a shard must be a plain file; put the real shard "
                               "there (copy it again, or re-run its producer)") from exc
        except OSError as exc:
            raise ConvertError(f"{path}: cannot open ({exc.strerror})") from exc
        try:
            self.tensors = self._read_header()
        except BaseException:
            os.close(self._fd)
            raise

    def _read_header(self) -> dict[str, TensorRange]:
        size = os.fstat(self._fd).st_size
        prefix = os.pread(self._fd, 8, 0)
        if len(prefix) < 8:
            raise ConvertError(f"{self.path}: {size} bytes is too short for a safetensors file")
        (length,) = struct.unpack("<Q", prefix)
        if length > min(size - 8, _MAX_HEADER):
            raise ConvertError(f"{self.path}: header length {length} does not fit a {size}-byte file "
                               "(not a safetensors file, or truncated)")
        try:
            header = json.loads(os.pread(self._fd, length, 8))
        except (ValueError, RecursionError) as exc:  # bad JSON or UTF-8, or nested past the parser's depth
            raise ConvertError(f"{self.path}: unreadable safetensors header ({type(exc).__name__}: {exc}); "
                               "copy the shard again or re-run its producer") from exc
        if not isinstance(header, dict):
            raise ConvertError(f"{self.path}: the safetensors header is not a JSON object")
        base = 8 + length
        tensors = {name: _parse_entry(self.path, name, info, base, size)
                   for name, info in header.items() if name != "__metadata__"}
        _check_tiling(self.path, tensors, base, size)
        return tensors

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read(self, name: str, row: int, count: int) -> torch.Tensor:
        """The first ``count`` positions of row ``row`` of tensor ``name``: ``[count, *shape[2:]]``."""
        tensor = self.tensors[name]
        out = torch.empty((count, *tensor.shape[2:]), dtype=tensor.dtype)
        want = count * tensor.position_bytes
        if want:
            got = os.preadv(self._fd, [out.view(-1).view(torch.uint8).numpy()], tensor.row_offset(row))
            if got != want:
                raise ConvertError(f"{self.path}: short read of {name} row {row} ({got} of {want} bytes); "
                                   "the file changed or is truncated")
        return out


_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def raw_bytes(tensor: torch.Tensor) -> memoryview:
    """A tensor's bytes in C order, copied only when it is strided. The copy goes through numpy:
    torch (2.13, CPU) copies a strided column slice such as the final-state columns of
    ``target_hidden_states`` ~100x slower (8 ms against 0.05 ms for 1 MB)."""
    same_width = tensor.view(_SAME_WIDTH_INT[tensor.dtype.itemsize]).numpy()
    return memoryview(np.ascontiguousarray(same_width).reshape(-1).view(np.uint8))


def pwrite_all(fd: int, buffers: list[memoryview], offset: int) -> int:
    """Write every byte of ``buffers`` at ``offset`` (``pwritev`` may write less than asked)."""
    pending = [memoryview(b).cast("B") for b in buffers if memoryview(b).nbytes]
    total = sum(b.nbytes for b in pending)
    while pending:
        written = os.pwritev(fd, pending, offset)
        offset += written
        while pending and written >= pending[0].nbytes:
            written -= pending[0].nbytes
            pending.pop(0)
        if pending and written:
            pending[0] = pending[0][written:]
    return total
