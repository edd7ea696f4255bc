"""A torch-free WebDataset decoder handler, so plain ``webdataset.WebDataset`` reads our shards.

Usage::

    import webdataset as wds
    from dspark_cache.format.wds import decode_dspark_arrays
    for sample in wds.WebDataset(urls, shardshuffle=False).decode(decode_dspark_arrays):
        sample["safetensors"]["target_hidden_states"].array  # [L, len(ids) * H], numpy

For torch tensors use ``dspark_cache.loader.tensors.decode_dspark_sample`` (the format never
imports torch).
"""

from __future__ import annotations

from typing import Any

from dspark_cache.format.sample import assemble_sample, decode_payload


def decode_dspark_arrays(key: str, data: bytes) -> Any:
    """Decode ``*.safetensors`` members into NeMo's per-sample tensors (unpadded), as
    :class:`~dspark_cache.format.sample.StoredTensor` (numpy view plus dtype code).

    Returns ``None`` for other members, which lets WebDataset try its other handlers.
    """
    if not key.lower().endswith("safetensors"):
        return None
    tensors, metadata = decode_payload(bytearray(data))
    sample: dict[str, Any] = dict(assemble_sample(tensors, metadata))
    sample["sample_id"] = int(metadata.get("sample_id", -1))
    return sample
