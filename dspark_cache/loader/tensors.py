"""Torch tensors from the format's torch-free samples, where samples are handed to users.

``dspark_cache.format`` decodes a sample into numpy views tagged with their safetensors dtype
code (:class:`~dspark_cache.format.sample.StoredTensor`), so that tools which never hand out a
tensor (``dspark-verify``, the monitor) never import torch. Everything the loader (and NeMo's
path on top of it) returns goes through here: the same dtypes, shapes and bytes as the blob,
without a copy. FP8 states come with their scales; :func:`dequantize` applies them on any device,
to the same bits as the loader's batch filler.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from dspark_cache.format.sample import (
    HIDDEN, HIDDEN_SCALE, LAST_HIDDEN, LAST_HIDDEN_SCALE, TORCH_NAMES, StoredTensor, dequantize_arrays,
)
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


def dequantize(batch: Mapping[str, Any], dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """A batch (or sample) of FP8 states with their scales, as ``dtype`` states without them.

    Works on any device (``dspark_cache.dequantize(batch_on_gpu)``) for batches from
    ``build_dataloader(..., dtype="raw")`` or samples from ``open_cache(..., dtype="raw")``: each
    float8 value times its row's scale for its ``H`` columns, computed in float32 and rounded
    once more to ``dtype``, so a bf16 result equals the loader's own dequantisation bit for bit.
    Other keys pass through; a batch without scales is returned as it is.
    """
    out = dict(batch)
    if HIDDEN_SCALE not in batch:
        return out
    for name, scale_name in ((HIDDEN, HIDDEN_SCALE), (LAST_HIDDEN, LAST_HIDDEN_SCALE)):
        states, scales = batch[name], out.pop(scale_name)
        groups = states.unflatten(-1, (scales.shape[-1], -1)).to(torch.float32)
        out[name] = (groups * scales.to(torch.float32).unsqueeze(-1)).flatten(-2).to(dtype)
    return out


_OUT_CODES = {torch.bfloat16: "BF16", torch.float32: "F32"}


def decode_dspark_sample(key: str, data: bytes, *, dtype: torch.dtype | None = torch.bfloat16) -> Any:
    """A WebDataset decoder handler: ``*.safetensors`` members into NeMo's per-sample tensors.

    Usage::

        import webdataset as wds
        from dspark_cache.loader.tensors import decode_dspark_sample
        for sample in wds.WebDataset(urls, shardshuffle=False).decode(decode_dspark_sample):
            sample["safetensors"]["target_hidden_states"]  # [L, len(ids) * H]

    An FP8 sample is dequantised to ``dtype`` (bf16 or float32; other samples keep their stored
    dtype); ``functools.partial(decode_dspark_sample, dtype=None)`` keeps it raw, with its scales.
    Returns ``None`` for other members, which lets WebDataset try its other handlers.
    """
    if dtype is not None and dtype not in _OUT_CODES:
        raise ValueError(f"FP8 samples dequantise to torch.bfloat16 or torch.float32, not {dtype}")
    arrays = decode_dspark_arrays(key, data, dequantize=None)
    if arrays is None:
        return None
    sample_id = arrays.pop("sample_id")
    if dtype is not None:
        arrays = dequantize_arrays(arrays, _OUT_CODES[dtype])
    return {**sample_to_torch(arrays), "sample_id": sample_id}
