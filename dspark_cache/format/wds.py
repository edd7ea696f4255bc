"""A WebDataset decoder handler, so plain ``webdataset.WebDataset`` reads our shards.

Usage::

    import webdataset as wds
    from dspark_cache.format.wds import decode_dspark_sample
    for sample in wds.WebDataset(urls, shardshuffle=False).decode(decode_dspark_sample):
        sample["safetensors"]["target_hidden_states"]  # [L, len(ids) * H]
"""

from __future__ import annotations

from typing import Any

from dspark_cache.format.sample import assemble_sample, decode_payload


def decode_dspark_sample(key: str, data: bytes) -> Any:
    """Decode ``*.safetensors`` members into NeMo's per-sample tensors (unpadded).

    Returns ``None`` for other members, which lets WebDataset try its other handlers.
    """
    if not key.lower().endswith("safetensors"):
        return None
    tensors, metadata = decode_payload(bytearray(data))
    sample = assemble_sample(tensors, metadata)
    sample["sample_id"] = int(metadata.get("sample_id", -1))
    return sample
