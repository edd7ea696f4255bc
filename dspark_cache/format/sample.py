"""One sample = one safetensors blob whose tensor bytes start at a 4096-byte file offset.

The blob is a valid safetensors file: 8-byte little-endian header length, a JSON header padded
with spaces (the spec allows it) so that the first tensor starts page-aligned in the tar file,
then the tensors back to back, each 64-byte aligned (small ``__padN__`` uint8 tensors fill the
gaps, because safetensors forbids holes). Readers that want zero-copy reads into pinned memory,
O_DIRECT or GPUDirect Storage can therefore use the bytes as they lie on disk.

This module never imports torch (the verifier and the monitor must not pay for it): dtypes are
safetensors codes (``"BF16"``), the writer takes buffers, and decoding gives numpy views tagged
with their code. The loader turns those into torch tensors (``loader/tensors.py``).

FP8 samples (``--dtype fp8``, code ``F8_E4M3``; ``fp8_e5m2``, ``F8_E5M2``) store each hidden
state row as float8 with one float32 scale per (token, captured layer), and one per token for a
separately stored final state: ``value = fp8 * scale``. The scales come first in the blob, so a
reader that dequantises while it reads has them before the data they scale (one forward pass).
:func:`fp8_to_float32` and :func:`dequantize_arrays` are the torch-free dequantisation.
"""

from __future__ import annotations

import functools
import json
import math
import struct
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from dspark_cache.format.layers import stores_last as _stores_last
from dspark_cache.format.schema import FP8_SCALE_SCHEME

PAGE_ALIGN = 4096
TENSOR_ALIGN = 64
SAMPLE_FORMAT = "dspark-cache/1"

# Tensor names inside a sample blob, in storage order (largest first keeps them aligned cheaply).
# target_hidden_states is stored exactly as NeMo's per-sample tensor, so a reader can read it
# straight into a batch row. When the final post-norm state is one of the feature layers (the
# default), it is those last H columns, and target_last_hidden_states is not stored again.
HIDDEN = "target_hidden_states"  # [L, len(ids) * H]
LAST_HIDDEN = "target_last_hidden_states"  # [L, H], stored only when N-1 is not among the ids
INPUT_IDS = "input_ids"  # [L] int32
LOSS_MASK = "loss_mask"  # [L] uint8
PAD_PREFIX = "__pad"
# FP8 samples only, stored before the states they scale: float32, positive and finite.
HIDDEN_SCALE = "target_hidden_states_scale"  # [L, len(ids)]: one per token and captured layer
LAST_HIDDEN_SCALE = "target_last_hidden_states_scale"  # [L, 1], stored only with LAST_HIDDEN
SCALE_CODE = "F32"

# A batch carries NeMo's keys (the four names above) plus this one, 1 on real tokens.
ATTENTION_MASK = "attention_mask"

# The per-sample metadata key saying whether the final state lies inside the hidden states
# ("1") or is stored as its own tensor ("0"). Written into every header: never rename it.
FINAL_IN_HIDDEN = "final_in_hidden"
# FP8 samples' metadata key naming how the scales were made (absent from other samples, whose
# headers stay byte-identical to earlier releases'). Also the manifest's ``scale_scheme``.
SCALE_SCHEME_KEY = "scale_scheme"
SCALE_SCHEME = FP8_SCALE_SCHEME
# Compressed samples' metadata key naming their codec (format.codec; absent from other samples).
COMPRESSION_KEY = "compression"

# Safetensors dtype codes (the only dtype names in the format) as numpy dtypes. numpy has no
# bfloat16: BF16 is viewed as same-width int16 bits (the code says what they are).
NUMPY_DTYPES: dict[str, np.dtype] = {
    code: np.dtype(name) for code, name in
    {"BF16": "<i2", "F16": "<f2", "F32": "<f4", "F64": "<f8", "I64": "<i8", "I32": "<i4", "I16": "<i2",
     "I8": "i1", "U8": "u1", "BOOL": "?", "F8_E4M3": "u1", "F8_E5M2": "u1"}.items()
}
DTYPE_SIZES: dict[str, int] = {code: dtype.itemsize for code, dtype in NUMPY_DTYPES.items()}
# The manifest's cache dtype names.
CACHE_DTYPES: dict[str, str] = {"bf16": "BF16", "fp16": "F16", "fp32": "F32", "fp8": "F8_E4M3",
                                "fp8_e5m2": "F8_E5M2"}
# FP8 codes -> the largest finite value (a scale maps a row's max |x| onto it) and, for decoding,
# the mantissa bits and the exponent bias (e4m3fn, e5m2).
FP8_MAX: dict[str, float] = {"F8_E4M3": 448.0, "F8_E5M2": 57344.0}
_FP8_BITS: dict[str, tuple[int, int]] = {"F8_E4M3": (3, 7), "F8_E5M2": (2, 15)}
# The FP8 rule (fp8_bad_scales, fp8_bad_codes; the C filler's read_dequant mirrors it): a scale is
# positive and scale * FP8_MAX stays below this float32, the least one that rounds to inf as bfloat16
# (whose range float32 contains), so every state of a valid sample is finite as bf16 and as float32.
FP8_SCALE_LIMIT = float.fromhex("0x1.ffp127")
# Codes that are no number, as (mask, pattern): e4m3fn's NaN S.1111.111, e5m2's inf and NaNs S.11111.xx.
FP8_SPECIAL: dict[str, tuple[int, int]] = {"F8_E4M3": (0x7F, 0x7F), "F8_E5M2": (0x7C, 0x7C)}
# torch's name of each code, one table for the torch-side modules (loader, producer, nemo).
TORCH_NAMES: dict[str, str] = {
    "BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "I64": "int64",
    "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}


def is_fp8(code: str) -> bool:
    """True for the float8 codes, whose samples carry scales."""
    return code in FP8_MAX


@dataclass(frozen=True)
class StoredTensor:
    """One decoded tensor: its safetensors code and a numpy view of its bytes (no copy).

    ``array`` has the code's numpy dtype (int16 bits for BF16), so it can be sliced and handed
    to torch without a copy (``loader.tensors.to_torch``).
    """

    code: str
    array: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)


@dataclass(frozen=True)
class TensorSpec:
    """Name, dtype and shape of one stored tensor (enough to lay out bytes without data)."""

    name: str
    dtype: str  # a safetensors code, e.g. "BF16"
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count * DTYPE_SIZES[self.dtype]


@dataclass(frozen=True)
class PayloadLayout:
    """The byte layout of one sample blob placed at a given file offset."""

    header: bytes  # length prefix + padded JSON header
    placed: tuple[tuple[str, int, int], ...]  # (name, start, end) relative to the data section

    @property
    def size(self) -> int:
        return len(self.header) + (self.placed[-1][2] if self.placed else 0)


def sample_specs(
    length: int, hidden_dim: int, hidden_size: int, dtype: str, stores_last: bool
) -> list[TensorSpec]:
    """The tensors of a sample of ``length`` tokens, in storage order (``dtype``: a code).

    FP8 samples start with their scales (one per token and ``hidden_size`` columns)."""
    specs = []
    if is_fp8(dtype):
        specs.append(TensorSpec(HIDDEN_SCALE, SCALE_CODE, (length, hidden_dim // hidden_size)))
        if stores_last:
            specs.append(TensorSpec(LAST_HIDDEN_SCALE, SCALE_CODE, (length, 1)))
    specs.append(TensorSpec(HIDDEN, dtype, (length, hidden_dim)))
    if stores_last:
        specs.append(TensorSpec(LAST_HIDDEN, dtype, (length, hidden_size)))
    return specs + [TensorSpec(INPUT_IDS, "I32", (length,)), TensorSpec(LOSS_MASK, "U8", (length,))]


def sample_metadata(sample_id: int, layer_ids: list[int], num_layers: int, hidden_size: int,
                    dtype: str = "", compression: str = "none") -> dict[str, str]:
    """The ``__metadata__`` of a sample: self-describing for plain-WebDataset readers (an FP8
    ``dtype`` code adds how its scales were made, a ``compression`` other than none its codec)."""
    metadata = {
        "format": SAMPLE_FORMAT,
        "sample_id": str(sample_id),
        "hidden_size": str(hidden_size),
        FINAL_IN_HIDDEN: "0" if _stores_last(layer_ids, num_layers) else "1",
    }
    if is_fp8(dtype):
        metadata[SCALE_SCHEME_KEY] = SCALE_SCHEME
    if compression != "none":
        metadata[COMPRESSION_KEY] = compression
    return metadata


def place_tensors(specs: list[TensorSpec]) -> tuple[tuple[str, int, int], ...]:
    """``(name, start, end)`` of every tensor and ``__padN__`` fill, relative to the data section.

    Placement depends on the specs only (not on the header), so readers can plan a sample's
    reads from its length alone.
    """
    placed: list[tuple[str, int, int]] = []
    cursor = 0
    for spec in specs:
        gap = -cursor % TENSOR_ALIGN
        if gap:
            placed.append((f"{PAD_PREFIX}{len(placed)}__", cursor, cursor + gap))
            cursor += gap
        placed.append((spec.name, cursor, cursor + spec.nbytes))
        cursor += spec.nbytes
    return tuple(placed)


def layout_payload(specs: list[TensorSpec], metadata: dict[str, str], file_offset: int) -> PayloadLayout:
    """Lay out a blob that will start at ``file_offset`` of its file (the tar member's data).

    A compressed sample's header (metadata naming a ``compression``) is not padded: its data is a
    frame to decode, never read in place (``format.codec``)."""
    by_name = {spec.name: spec for spec in specs}
    placed = place_tensors(specs)
    header: dict[str, Any] = {"__metadata__": metadata}
    for name, start, end in placed:
        spec = by_name.get(name)
        dtype, shape = (spec.dtype, list(spec.shape)) if spec else ("U8", [end - start])
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [start, end]}
    raw = json.dumps(header, separators=(",", ":")).encode()
    padded = len(raw) + (0 if COMPRESSION_KEY in metadata else -(file_offset + 8 + len(raw)) % PAGE_ALIGN)
    return PayloadLayout(struct.pack("<Q", padded) + raw.ljust(padded, b" "), placed)


def payload_buffers(layout: PayloadLayout, tensors: Mapping[str, Any],
                    zeros: Callable[[int], memoryview] = lambda n: memoryview(bytes(n))) -> list[memoryview]:
    """The blob as a list of buffers (no copy of tensor data) to write in order.

    ``tensors`` maps names to C-contiguous buffers (numpy arrays, memoryviews, bytes) holding
    each tensor's bytes as stored (little-endian, the spec's dtype); ``zeros(n)`` gives the
    padding between them (a shared zero buffer, for a writer).
    """
    buffers = [memoryview(layout.header)]
    for name, start, end in layout.placed:
        if name.startswith(PAD_PREFIX):
            buffers.append(zeros(end - start))
            continue
        buffers.append(_byte_view(name, tensors[name], end - start))
    return buffers


def _byte_view(name: str, buffer: Any, expected: int) -> memoryview:
    """``buffer`` as flat bytes, checked against the layout's size."""
    view = memoryview(buffer)
    if view.nbytes == 0:  # cast() refuses views with a zero in their shape
        view = memoryview(b"")
    elif not view.c_contiguous:
        raise ValueError(f"tensor {name} is not C-contiguous")
    else:
        view = view.cast("B")
    if view.nbytes != expected:
        raise ValueError(f"tensor {name} has {view.nbytes} bytes, layout expects {expected}")
    return view


def decode_payload(blob: bytearray | memoryview | bytes) -> tuple[dict[str, StoredTensor], dict[str, str]]:
    """Parse a sample blob into tensors (zero-copy numpy views of ``blob``) and its metadata."""
    view = memoryview(blob)
    (header_len,) = struct.unpack_from("<Q", view, 0)
    header = json.loads(bytes(view[8 : 8 + header_len]))
    metadata = header.pop("__metadata__", {}) or {}
    base = 8 + header_len
    tensors: dict[str, StoredTensor] = {}
    for name, info in header.items():
        if name.startswith(PAD_PREFIX):
            continue
        code, shape = info["dtype"], tuple(info["shape"])
        dtype = NUMPY_DTYPES[code]
        start, end = info["data_offsets"]
        if base + end > len(view):
            raise ValueError(f"tensor {name} ends at byte {base + end}, blob has {len(view)}")
        if math.prod(shape) * dtype.itemsize != end - start:  # checked before anything is allocated
            raise ValueError(f"tensor {name} of shape {list(shape)} does not fill bytes {start}..{end}")
        if end == start:
            tensors[name] = StoredTensor(code, np.empty(shape, dtype=dtype))
            continue
        flat = np.frombuffer(view[base + start : base + end], dtype=dtype)
        tensors[name] = StoredTensor(code, flat.reshape(shape))
    return tensors, metadata


def assemble_sample(tensors: dict[str, StoredTensor], metadata: dict[str, str]) -> dict[str, StoredTensor]:
    """NeMo's per-sample tensors (unpadded) from what a blob stores (views, no copy).

    An FP8 sample also gives its two scale tensors (raw: :func:`dequantize_arrays` applies them)."""
    hidden = tensors[HIDDEN]
    final_in_hidden = metadata.get(FINAL_IN_HIDDEN) == "1"
    if final_in_hidden:
        columns = hidden.array.shape[1] - int(metadata["hidden_size"])
        last = StoredTensor(hidden.code, hidden.array[:, columns:])
    else:
        last = tensors[LAST_HIDDEN]
    sample = {
        INPUT_IDS: tensors[INPUT_IDS],
        LOSS_MASK: tensors[LOSS_MASK],
        HIDDEN: hidden,
        LAST_HIDDEN: last,
    }
    if is_fp8(hidden.code):
        scale = tensors[HIDDEN_SCALE]
        sample[HIDDEN_SCALE] = scale
        # The final state is the last layer's columns, so its scale is that layer's.
        sample[LAST_HIDDEN_SCALE] = StoredTensor(scale.code, scale.array[:, -1:]) if final_in_hidden \
            else tensors[LAST_HIDDEN_SCALE]
    return sample


# -- FP8 ----------------------------------------------------------------------------------------


def fp8_bad_scales(scales: Any, code: str) -> Any:
    """True where a float32 scale is NaN, infinite, zero or negative, or ``scale * FP8_MAX[code]``
    (the largest state it can give) is not below :data:`FP8_SCALE_LIMIT` in float32. Operators only,
    so numpy arrays and torch tensors (any device) are checked by the same rule."""
    if isinstance(scales, np.ndarray):
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow to inf is what is looked for
            return ~((scales > 0) & (scales * FP8_MAX[code] < FP8_SCALE_LIMIT))
    return ~((scales > 0) & (scales * FP8_MAX[code] < FP8_SCALE_LIMIT))


def fp8_bad_codes(codes: Any, code: str) -> Any:
    """True where a float8 code (uint8 bits: numpy or torch) is a NaN or inf code (:data:`FP8_SPECIAL`):
    the producer never writes one (it saturates), so it is damage."""
    mask, pattern = FP8_SPECIAL[code]
    return (codes & mask) == pattern


def fp8_scale_reason(token: int, column: int | None = None, value: float | None = None) -> str:
    """Why a sample with a bad scale is refused (every reader says it the same way)."""
    where = f"token {token}" if column is None else f"token {token}, column {column}"
    found = "is not" if value is None else f"is {value!r}, not"
    return (f"the FP8 scale of {where} {found} a positive number whose states stay finite (scale x the "
            f"format's largest value must be below {FP8_SCALE_LIMIT:.6g})")


def fp8_code_reason(token: int, column: int | None = None) -> str:
    where = f"token {token}" if column is None else f"token {token}, column {column}"
    return f"the FP8 states of {where} hold a NaN or inf code, which the producer never writes"


def fp8_to_float32(bits: np.ndarray, code: str) -> np.ndarray:
    """Decode float8 bytes (uint8) to float32, exactly.

    A normal code's exponent (rebiased) and mantissa are moved into place as float32 bits; a
    subnormal one is its mantissa times a power of two. No arithmetic touches a subnormal
    float32, so a flush-to-zero mode cannot change the result, and the loader's C filler decodes
    with the same rule. Codes the producer never writes (e4m3's NaN, e5m2's inf/NaN) decode to
    finite numbers (480, 2**16 ... 1.75 * 2**16).
    """
    mbits, bias = _FP8_BITS[code]
    wide = bits.astype(np.uint32)
    exponent, mantissa = (wide & 0x7F) >> mbits, wide & ((1 << mbits) - 1)
    normal = (((exponent + (127 - bias)) << 23) | (mantissa << (23 - mbits))).view(np.float32)
    tiny = mantissa.astype(np.float32) * np.float32(2.0 ** (1 - bias - mbits))
    magnitude = np.where(exponent > 0, normal, tiny)
    return np.where(wide & 0x80, -magnitude, magnitude).astype(np.float32, copy=False)


def float32_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 to bfloat16 bits (int16, the format's BF16 view), rounding to nearest even as
    torch and the C filler do."""
    bits = values.astype(np.float32, copy=False).view(np.uint32)
    rounded = (bits >> 16) & 1
    rounded += bits
    rounded += np.uint32(0x7FFF)
    rounded >>= 16
    return rounded.astype(np.uint16).view(np.int16)


@functools.lru_cache(maxsize=None)
def _fp8_table(code: str) -> np.ndarray:
    """:func:`fp8_to_float32` of all 256 codes: a lookup is one numpy pass instead of a dozen."""
    table = fp8_to_float32(np.arange(256, dtype=np.uint8), code)
    table.setflags(write=False)
    return table


def dequantize_rows(data: np.ndarray, scales: np.ndarray, code: str, out_code: str) -> np.ndarray:
    """``[L, k * g]`` float8 bytes times ``[L, k]`` scales (one per ``g`` columns) as ``out_code``
    (``"F32"`` or ``"BF16"``), computed in float32 (one rounding more for BF16)."""
    rows, groups = scales.shape
    values = _fp8_table(code)[data].reshape(rows, groups, -1)
    values *= scales.astype(np.float32)[:, :, None]
    values = values.reshape(data.shape)
    if out_code == "F32":
        return values
    if out_code == "BF16":
        return float32_to_bf16_bits(values)
    raise ValueError(f"FP8 states dequantise to F32 or BF16, not {out_code!r}")


def dequantize_arrays(sample: dict[str, StoredTensor], out_code: str = "BF16") -> dict[str, StoredTensor]:
    """An assembled sample with its FP8 states dequantised to ``out_code`` and the scales dropped;
    any other sample is returned as it is."""
    hidden = sample.get(HIDDEN)
    if hidden is None or not is_fp8(hidden.code):
        return sample
    out = {name: t for name, t in sample.items() if name not in (HIDDEN_SCALE, LAST_HIDDEN_SCALE)}
    for name, scale in ((HIDDEN, HIDDEN_SCALE), (LAST_HIDDEN, LAST_HIDDEN_SCALE)):
        stored = sample[name]
        out[name] = StoredTensor(
            out_code, dequantize_rows(stored.array, sample[scale].array, stored.code, out_code)
        )
    return out
