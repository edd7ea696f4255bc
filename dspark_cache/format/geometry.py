"""The shape of a sample: what its byte layout depends on besides its token count.

One object for the writer (sizes, headers), the planner (exact bytes before computing) and the
readers (what an index entry and a sample's header must say): they can never disagree.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import lru_cache

import torch

from dspark_cache.format.layers import final_state_in_ids
from dspark_cache.format.sample import (
    CACHE_DTYPES, PAGE_ALIGN, TensorSpec, layout_payload, place_tensors, sample_metadata, sample_specs,
)
from dspark_cache.format.schema import Manifest


@dataclass(frozen=True)
class SampleShape:
    """Layer ids, model size and dtype of a cache's samples."""

    layer_ids: tuple[int, ...] | list[int]
    num_layers: int
    hidden_size: int
    dtype: torch.dtype

    @classmethod
    def from_manifest(cls, manifest: Manifest) -> "SampleShape":
        return cls(tuple(manifest.target_layer_ids), manifest.num_hidden_layers, manifest.hidden_size,
                   CACHE_DTYPES[manifest.dtype])

    @property
    def hidden_dim(self) -> int:
        return len(self.layer_ids) * self.hidden_size

    @property
    def stores_last(self) -> bool:
        """The final state needs its own tensor only when it is not a feature layer."""
        return not final_state_in_ids(list(self.layer_ids), self.num_layers)

    def specs(self, length: int) -> list[TensorSpec]:
        return sample_specs(length, self.hidden_dim, self.hidden_size, self.dtype, self.stores_last)

    def metadata(self, sample_id: int) -> dict[str, str]:
        return sample_metadata(sample_id, list(self.layer_ids), self.num_layers, self.hidden_size)

    def data_size(self, length: int) -> int:
        """Bytes of a ``length``-token sample's data section (its blob minus the header)."""
        return _data_size(length, self.hidden_dim, self.hidden_size, self.dtype, self.stores_last)

    def header(self, length: int, sample_id: int, offset: int) -> bytes:
        """The exact header the writer puts before the data of this sample at file ``offset``
        (``layout_payload``'s, built from a per-length template: readers check one per sample)."""
        before, after = self._header_json(length)
        raw = before + str(sample_id).encode() + after
        padded = len(raw) + (-(offset + 8 + len(raw)) % PAGE_ALIGN)
        return struct.pack("<Q", padded) + raw.ljust(padded, b" ")

    def _header_json(self, length: int) -> tuple[bytes, bytes]:
        return _header_template(length, tuple(self.layer_ids), self.num_layers, self.hidden_size, self.dtype)


_SAMPLE_ID = "@@sample-id@@"


@lru_cache(maxsize=16384)
def _header_template(length: int, layer_ids: tuple[int, ...], num_layers: int, hidden_size: int,
                     dtype: torch.dtype) -> tuple[bytes, bytes]:
    """The header JSON of a ``length``-token sample, split where its sample id goes."""
    shape = SampleShape(layer_ids, num_layers, hidden_size, dtype)
    metadata = {**shape.metadata(0), "sample_id": _SAMPLE_ID}
    raw = layout_payload(shape.specs(length), metadata, 0).header[8:].rstrip(b" ")
    before, after = raw.split(_SAMPLE_ID.encode())
    return before, after


@lru_cache(maxsize=16384)
def _data_size(length: int, hidden_dim: int, hidden_size: int, dtype: torch.dtype, stores_last: bool) -> int:
    placed = place_tensors(sample_specs(length, hidden_dim, hidden_size, dtype, stores_last))
    return placed[-1][2] if placed else 0
