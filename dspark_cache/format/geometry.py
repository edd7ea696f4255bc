"""The shape of a sample: what its byte layout depends on besides its token count.

One object for the writer (sizes, headers), the planner (exact bytes before computing) and the
readers (what an index entry and a sample's header must say): they can never disagree. The
loader's batch rows (``loader/segments.py``) and the producer's target are described by it too.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

from dspark_cache.format.codec import CodecError, decode_data
from dspark_cache.format.layers import stores_last
from dspark_cache.format.sample import (
    CACHE_DTYPES, DTYPE_SIZES, PAGE_ALIGN, TensorSpec, is_fp8, layout_payload, place_tensors, sample_metadata,
    sample_specs,
)
from dspark_cache.format.schema import Manifest


@dataclass(frozen=True)
class SampleShape:
    """Layer ids, model size and dtype of a cache's samples (hashable: ids are kept as a tuple)."""

    layer_ids: tuple[int, ...]
    num_layers: int
    hidden_size: int
    dtype: str  # the hidden states' safetensors code, e.g. "BF16" (``CACHE_DTYPES[manifest.dtype]``)
    compression: str = "none"  # the manifest's: "zstd" stores each sample's data as a frame (format.codec)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_ids", tuple(self.layer_ids))  # callers may pass a list
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"unknown dtype code {self.dtype!r}; expected one of {sorted(DTYPE_SIZES)}")
        if self.compression not in ("none", "zstd"):
            raise ValueError(f"unknown compression {self.compression!r}; expected 'none' or 'zstd'")

    @classmethod
    def from_manifest(cls, manifest: Manifest) -> "SampleShape":
        """The shape of every sample of the cache that ``manifest`` describes."""
        return cls(tuple(manifest.target_layer_ids), manifest.num_hidden_layers, manifest.hidden_size,
                   CACHE_DTYPES[manifest.dtype], manifest.compression)

    @property
    def compressed(self) -> bool:
        """Samples stored as a header and one zstd frame of their data (``format.codec``)."""
        return self.compression != "none"

    @property
    def uncompressed(self) -> "SampleShape":
        """The same samples stored as they are (what a compressed sample decodes to)."""
        return replace(self, compression="none") if self.compressed else self

    def itemsizes(self, length: int) -> dict[str, int]:
        """Bytes per element of each tensor of a ``length``-token sample (its byte planes)."""
        return _itemsizes(length, self)

    def placed(self, length: int) -> tuple[tuple[str, int, int], ...]:
        """``(name, start, end)`` of each tensor and fill of a ``length``-token sample's data section."""
        return _placed(length, self)

    def decode(self, blob: bytes | bytearray | memoryview, length: int) -> bytes | bytearray | memoryview:
        """A stored ``length``-token sample as its uncompressed blob: the same header (unpadded: any
        safetensors reader reads it so), then the data section decoded from its frame
        (``format.codec.decode_data``: a ``CodecError`` for a frame that is not this sample's). An
        uncompressed sample is returned as it is."""
        if not self.compressed:
            return blob
        view = memoryview(blob)
        header = 8 + struct.unpack_from("<Q", view, 0)[0]
        data_size = self.data_size(length)
        if header > len(view):
            raise CodecError(f"its header claims {header} bytes, the sample has {len(view)}")
        out = bytearray(header + data_size)
        out[:header] = view[:header]
        decode_data(view[header:], self.placed(length), self.itemsizes(length),
                    np.frombuffer(out, dtype=np.uint8, offset=header))
        return out

    def header_size(self, length: int, sample_id: int, offset: int, size: int) -> int:
        """Bytes of the header of a stored sample of ``size`` bytes at file ``offset``: what is not
        its data section (uncompressed), or the exact header's length (compressed: its frame follows)."""
        if self.compressed:
            return len(self.header(length, sample_id, offset))
        return size - self.data_size(length)

    @property
    def itemsize(self) -> int:
        """Bytes per element of the hidden states."""
        return DTYPE_SIZES[self.dtype]

    @property
    def fp8(self) -> bool:
        """Float8 states with per-(token, layer) scales stored next to them."""
        return is_fp8(self.dtype)

    @property
    def hidden_dim(self) -> int:
        return len(self.layer_ids) * self.hidden_size

    @property
    def stores_last(self) -> bool:
        """The final state needs its own tensor only when it is not a feature layer."""
        return stores_last(self.layer_ids, self.num_layers)

    def specs(self, length: int) -> list[TensorSpec]:
        """The tensors of a ``length``-token sample, in storage order (FP8: scales included)."""
        return sample_specs(length, self.hidden_dim, self.hidden_size, self.dtype, self.stores_last)

    def metadata(self, sample_id: int) -> dict[str, str]:
        """The ``__metadata__`` of sample ``sample_id``'s header."""
        return sample_metadata(sample_id, list(self.layer_ids), self.num_layers, self.hidden_size, self.dtype,
                               self.compression)

    def data_size(self, length: int) -> int:
        """Bytes of a ``length``-token sample's data section (its blob minus the header)."""
        return _data_size(length, self)

    def header(self, length: int, sample_id: int, offset: int) -> bytes:
        """The exact header the writer puts before the data of this sample at file ``offset``
        (``layout_payload``'s, built from a per-length template: readers check one per sample)."""
        before, after = self._header_json(length)
        raw = before + str(sample_id).encode() + after
        padded = len(raw) + (0 if self.compressed else -(offset + 8 + len(raw)) % PAGE_ALIGN)
        return struct.pack("<Q", padded) + raw.ljust(padded, b" ")

    def _header_json(self, length: int) -> tuple[bytes, bytes]:
        return _header_template(length, self)


_SAMPLE_ID = "@@sample-id@@"


@lru_cache(maxsize=16384)
def _header_template(length: int, shape: SampleShape) -> tuple[bytes, bytes]:
    """The header JSON of a ``length``-token sample, split where its sample id goes."""
    metadata = {**shape.metadata(0), "sample_id": _SAMPLE_ID}
    raw = layout_payload(shape.specs(length), metadata, 0).header[8:].rstrip(b" ")
    before, after = raw.split(_SAMPLE_ID.encode())
    return before, after


@lru_cache(maxsize=16384)
def _placed(length: int, shape: SampleShape) -> tuple[tuple[str, int, int], ...]:
    return place_tensors(shape.specs(length))


@lru_cache(maxsize=16384)
def _itemsizes(length: int, shape: SampleShape) -> dict[str, int]:
    return {spec.name: DTYPE_SIZES[spec.dtype] for spec in shape.specs(length)}


@lru_cache(maxsize=16384)
def _data_size(length: int, shape: SampleShape) -> int:
    placed = place_tensors(shape.specs(length))
    return placed[-1][2] if placed else 0
