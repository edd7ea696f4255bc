"""One sample = one safetensors blob whose tensor bytes start at a 4096-byte file offset.

The blob is a valid safetensors file: 8-byte little-endian header length, a JSON header padded
with spaces (the spec allows it) so that the first tensor starts page-aligned in the tar file,
then the tensors back to back, each 64-byte aligned (small ``__padN__`` uint8 tensors fill the
gaps, because safetensors forbids holes). Readers that want zero-copy reads into pinned memory,
O_DIRECT or GPUDirect Storage can therefore use the bytes as they lie on disk.

This module never imports torch (the verifier and the monitor must not pay for it): dtypes are
safetensors codes (``"BF16"``), the writer takes buffers, and decoding gives numpy views tagged
with their code. The loader turns those into torch tensors (``loader/tensors.py``).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from dspark_cache.format.layers import stores_last as _stores_last

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

# A batch carries NeMo's keys (the four names above) plus this one, 1 on real tokens.
ATTENTION_MASK = "attention_mask"

# The per-sample metadata key saying whether the final state lies inside the hidden states
# ("1") or is stored as its own tensor ("0"). Written into every header: never rename it.
FINAL_IN_HIDDEN = "final_in_hidden"

# Safetensors dtype codes (the only dtype names in the format) as numpy dtypes. numpy has no
# bfloat16: BF16 is viewed as same-width int16 bits (the code says what they are).
NUMPY_DTYPES: dict[str, np.dtype] = {
    code: np.dtype(name) for code, name in
    {"BF16": "<i2", "F16": "<f2", "F32": "<f4", "F64": "<f8", "I64": "<i8", "I32": "<i4", "I16": "<i2",
     "I8": "i1", "U8": "u1", "BOOL": "?"}.items()
}
DTYPE_SIZES: dict[str, int] = {code: dtype.itemsize for code, dtype in NUMPY_DTYPES.items()}
# The manifest's cache dtype names.
CACHE_DTYPES: dict[str, str] = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}
# torch's name of each code, one table for the torch-side modules (loader, producer, nemo).
TORCH_NAMES: dict[str, str] = {
    "BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "I64": "int64",
    "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}


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


def sample_specs(length: int, hidden_dim: int, hidden_size: int, dtype: str, stores_last: bool) -> list[TensorSpec]:
    """The tensors of a sample of ``length`` tokens, in storage order (``dtype``: a code)."""
    specs = [TensorSpec(HIDDEN, dtype, (length, hidden_dim))]
    if stores_last:
        specs.append(TensorSpec(LAST_HIDDEN, dtype, (length, hidden_size)))
    return specs + [TensorSpec(INPUT_IDS, "I32", (length,)), TensorSpec(LOSS_MASK, "U8", (length,))]


def sample_metadata(sample_id: int, layer_ids: list[int], num_layers: int, hidden_size: int) -> dict[str, str]:
    """The ``__metadata__`` of a sample: self-describing for plain-WebDataset readers."""
    return {
        "format": SAMPLE_FORMAT,
        "sample_id": str(sample_id),
        "hidden_size": str(hidden_size),
        FINAL_IN_HIDDEN: "0" if _stores_last(layer_ids, num_layers) else "1",
    }


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
    """Lay out a blob that will start at ``file_offset`` of its file (the tar member's data)."""
    by_name = {spec.name: spec for spec in specs}
    placed = place_tensors(specs)
    header: dict[str, Any] = {"__metadata__": metadata}
    for name, start, end in placed:
        spec = by_name.get(name)
        dtype, shape = (spec.dtype, list(spec.shape)) if spec else ("U8", [end - start])
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [start, end]}
    raw = json.dumps(header, separators=(",", ":")).encode()
    padded = len(raw) + (-(file_offset + 8 + len(raw)) % PAGE_ALIGN)
    return PayloadLayout(struct.pack("<Q", padded) + raw.ljust(padded, b" "), placed)


def payload_buffers(layout: PayloadLayout, tensors: Mapping[str, Any]) -> list[memoryview]:
    """The blob as a list of buffers (no copy of tensor data) to write in order.

    ``tensors`` maps names to C-contiguous buffers (numpy arrays, memoryviews, bytes) holding
    each tensor's bytes as stored (little-endian, the spec's dtype).
    """
    buffers = [memoryview(layout.header)]
    for name, start, end in layout.placed:
        if name.startswith(PAD_PREFIX):
            buffers.append(memoryview(bytes(end - start)))
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
    """NeMo's per-sample tensors (unpadded) from what a blob stores (views, no copy)."""
    hidden = tensors[HIDDEN]
    if metadata.get(FINAL_IN_HIDDEN) == "1":
        columns = hidden.array.shape[1] - int(metadata["hidden_size"])
        last = StoredTensor(hidden.code, hidden.array[:, columns:])
    else:
        last = tensors[LAST_HIDDEN]
    return {
        INPUT_IDS: tensors[INPUT_IDS],
        LOSS_MASK: tensors[LOSS_MASK],
        HIDDEN: hidden,
        LAST_HIDDEN: last,
    }
