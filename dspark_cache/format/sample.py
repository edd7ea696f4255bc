"""One sample = one safetensors blob whose tensor bytes start at a 4096-byte file offset.

The blob is a valid safetensors file: 8-byte little-endian header length, a JSON header padded
with spaces (the spec allows it) so that the first tensor starts page-aligned in the tar file,
then the tensors back to back, each 64-byte aligned (small ``__padN__`` uint8 tensors fill the
gaps, because safetensors forbids holes). Readers that want zero-copy reads into pinned memory,
O_DIRECT or GPUDirect Storage can therefore use the bytes as they lie on disk.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import torch

from dspark_cache.format.layers import final_state_in_ids

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

CACHE_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}
_ST_CODES: dict[torch.dtype, str] = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_ST_DTYPES = {code: dtype for dtype, code in _ST_CODES.items()}


@dataclass(frozen=True)
class TensorSpec:
    """Name, dtype and shape of one stored tensor (enough to lay out bytes without data)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count * self.dtype.itemsize


@dataclass(frozen=True)
class PayloadLayout:
    """The byte layout of one sample blob placed at a given file offset."""

    header: bytes  # length prefix + padded JSON header
    placed: tuple[tuple[str, int, int], ...]  # (name, start, end) relative to the data section

    @property
    def size(self) -> int:
        return len(self.header) + (self.placed[-1][2] if self.placed else 0)


def sample_specs(length: int, hidden_dim: int, hidden_size: int, dtype: torch.dtype, store_last: bool) -> list[TensorSpec]:
    """The tensors of a sample of ``length`` tokens, in storage order."""
    specs = [TensorSpec(HIDDEN, dtype, (length, hidden_dim))]
    if store_last:
        specs.append(TensorSpec(LAST_HIDDEN, dtype, (length, hidden_size)))
    return specs + [TensorSpec(INPUT_IDS, torch.int32, (length,)), TensorSpec(LOSS_MASK, torch.uint8, (length,))]


def sample_metadata(sample_id: int, layer_ids: list[int], num_layers: int, hidden_size: int) -> dict[str, str]:
    """The ``__metadata__`` of a sample: self-describing for plain-WebDataset readers."""
    return {
        "format": SAMPLE_FORMAT,
        "sample_id": str(sample_id),
        "hidden_size": str(hidden_size),
        "final_in_hidden": "1" if final_state_in_ids(layer_ids, num_layers) else "0",
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
        dtype, shape = (_ST_CODES[spec.dtype], list(spec.shape)) if spec else ("U8", [end - start])
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [start, end]}
    raw = json.dumps(header, separators=(",", ":")).encode()
    padded = len(raw) + (-(file_offset + 8 + len(raw)) % PAGE_ALIGN)
    return PayloadLayout(struct.pack("<Q", padded) + raw.ljust(padded, b" "), placed)


def payload_buffers(layout: PayloadLayout, tensors: dict[str, torch.Tensor]) -> list[memoryview]:
    """The blob as a list of buffers (no copy of tensor data) to write in order."""
    buffers = [memoryview(layout.header)]
    for name, start, end in layout.placed:
        if name.startswith(PAD_PREFIX):
            buffers.append(memoryview(bytes(end - start)))
            continue
        tensor = tensors[name].contiguous()
        raw = tensor.reshape(-1).view(torch.uint8).numpy()
        if raw.nbytes != end - start:
            raise ValueError(f"tensor {name} has {raw.nbytes} bytes, layout expects {end - start}")
        buffers.append(memoryview(raw))
    return buffers


def decode_payload(blob: bytearray | memoryview | bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Parse a sample blob into tensors (zero-copy views of ``blob``) and its metadata."""
    view = memoryview(blob)
    (header_len,) = struct.unpack_from("<Q", view, 0)
    header = json.loads(bytes(view[8 : 8 + header_len]))
    metadata = header.pop("__metadata__", {}) or {}
    base = 8 + header_len
    tensors: dict[str, torch.Tensor] = {}
    for name, info in header.items():
        if name.startswith(PAD_PREFIX):
            continue
        dtype = _ST_DTYPES[info["dtype"]]
        start, end = info["data_offsets"]
        if base + end > len(view):
            raise ValueError(f"tensor {name} ends at byte {base + end}, blob has {len(view)}")
        if end == start:
            tensors[name] = torch.empty(info["shape"], dtype=dtype)
            continue
        flat = torch.frombuffer(view[base + start : base + end], dtype=dtype)
        tensors[name] = flat.view(info["shape"])
    return tensors, metadata


def assemble_sample(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> dict[str, torch.Tensor]:
    """NeMo's per-sample tensors (unpadded) from what a blob stores."""
    hidden = tensors[HIDDEN]
    if metadata.get("final_in_hidden") == "1":
        last = hidden[:, hidden.shape[1] - int(metadata["hidden_size"]) :]
    else:
        last = tensors[LAST_HIDDEN]
    return {
        INPUT_IDS: tensors[INPUT_IDS],
        LOSS_MASK: tensors[LOSS_MASK],
        HIDDEN: hidden,
        LAST_HIDDEN: last,
    }
