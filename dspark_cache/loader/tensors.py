"""Torch tensors from the format's torch-free samples, where samples are handed to users.

``dspark_cache.format`` decodes a sample into numpy views tagged with their safetensors dtype
code (:class:`~dspark_cache.format.sample.StoredTensor`), so that tools which never hand out a
tensor (``dspark-verify``, the monitor) never import torch. Everything the loader (and NeMo's
path on top of it) returns goes through here: the same dtypes, shapes and bytes as the blob,
without a copy.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from dspark_cache.format.sample import TORCH_NAMES, StoredTensor
from dspark_cache.format.wds import decode_dspark_arrays


def torch_dtype(code: str) -> torch.dtype:
    """The torch dtype of a safetensors code (``"BF16"`` -> ``torch.bfloat16``)."""
    return getattr(torch, TORCH_NAMES[code])


def to_torch(stored: StoredTensor) -> torch.Tensor:
    """A tensor sharing ``stored``'s memory (BF16's int16 bits are reinterpreted, not converted)."""
    return torch.from_numpy(stored.array).view(torch_dtype(stored.code))


def sample_to_torch(sample: Mapping[str, StoredTensor]) -> dict[str, torch.Tensor]:
    """:func:`to_torch` of every tensor of a decoded sample."""
    return {name: to_torch(stored) for name, stored in sample.items()}


def decode_dspark_sample(key: str, data: bytes) -> Any:
    """A WebDataset decoder handler: ``*.safetensors`` members into NeMo's per-sample tensors.

    Usage::

        import webdataset as wds
        from dspark_cache.loader.tensors import decode_dspark_sample
        for sample in wds.WebDataset(urls, shardshuffle=False).decode(decode_dspark_sample):
            sample["safetensors"]["target_hidden_states"]  # [L, len(ids) * H]

    Returns ``None`` for other members, which lets WebDataset try its other handlers.
    """
    arrays = decode_dspark_arrays(key, data)
    if arrays is None:
        return None
    sample_id = arrays.pop("sample_id")
    return {**sample_to_torch(arrays), "sample_id": sample_id}
