"""Torch-free decoders so plain ``webdataset.WebDataset`` and ``wids.ShardListDataset`` read our shards.

Usage::

    import webdataset as wds
    from dspark_cache.format.wds import decode_dspark_arrays
    for sample in wds.WebDataset(urls, shardshuffle=False).decode(decode_dspark_arrays):
        sample["safetensors"]["target_hidden_states"].array  # [L, len(ids) * H], numpy

    import wids
    from dspark_cache.format.wds import decode_wids_sample
    dataset = wids.ShardListDataset("CACHE/shards/wids-index.json", transformations=[decode_wids_sample])
    dataset[0][".safetensors"]["target_last_hidden_states"].array  # [L, H]

Shards of a compressed cache (``dspark-produce --compression zstd``) decode with the same two
functions: each sample's zstd frame is decoded first (``pip install zstandard``, a dependency of
dspark-cache). Without dspark-cache, decode a member yourself: the safetensors header as usual, then
the data section is one zstd frame of byte planes (``format.codec``'s docstring says the layout).

A decoded sample holds NeMo's four per-sample tensors, unpadded, plus ``sample_id``. What a
generic safetensors reader (``safetensors.torch.load``) returns differs in two ways, both on
purpose: the blob's ``__padN__`` uint8 tensors (the fill that keeps every tensor 64-byte aligned)
are dropped, and ``target_last_hidden_states`` is always present although it is stored only
when ``N - 1`` is not among the layer ids; otherwise it is a view (no copy) of the last ``H``
columns of ``target_hidden_states`` (:mod:`.layers`).

For torch tensors use ``dspark_cache.loader.tensors.decode_dspark_sample`` (the format never
imports torch).
"""

from __future__ import annotations

import struct
from typing import Any, Mapping

from dspark_cache.format.codec import decode_blob
from dspark_cache.format.errors import CorruptShardError
from dspark_cache.format.sample import assemble_sample, decode_payload, dequantize_arrays
from dspark_cache.format.validate import check_fp8_sample, check_token_values

SAMPLE_EXTENSION = "safetensors"  # the one member of each sample: <key>.safetensors


def decode_dspark_arrays(key: str, data: bytes, *, dequantize: str | None = "BF16",
                         vocab_size: int | None = None) -> Any:
    """Decode ``*.safetensors`` members into NeMo's per-sample tensors (unpadded), as
    :class:`~dspark_cache.format.sample.StoredTensor` (numpy view plus dtype code).

    An FP8 sample is dequantised to ``dequantize`` (``"BF16"``, the loader's default, or ``"F32"``);
    ``functools.partial(decode_dspark_arrays, dequantize=None)`` keeps its float8 bytes and scales.
    Either way a bad scale or a NaN/inf code raises ``CorruptShardError`` naming ``key``, and so does
    a token id outside ``[0, vocab_size)`` or a loss mask value other than 0 or 1 (the token rule,
    ``format.validate.token_problem``). A blob does not record its target's vocabulary: pass the
    manifest's, ``functools.partial(decode_dspark_arrays, vocab_size=manifest.target_vocab_size)``;
    without it only negative ids are refused.
    A blob whose header does not parse raises ``CorruptShardError`` naming ``key`` too.
    A compressed cache's sample (``dspark-produce --compression zstd``) is decoded first
    (``format.codec.decode_blob``; bounded by what its header declares), to the same arrays bit for
    bit; a frame that is not its data raises ``CorruptShardError`` naming ``key``.
    Returns ``None`` for other members, which lets WebDataset try its other handlers.
    """
    if not key.lower().endswith(SAMPLE_EXTENSION):
        return None
    try:  # a blob is ours only if it parses: anything else is a damaged sample, named like one
        tensors, metadata = decode_payload(bytearray(decode_blob(data)))
        sample: dict[str, Any] = dict(assemble_sample(tensors, metadata))
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, struct.error, RecursionError) as exc:
        raise CorruptShardError(key, f"its safetensors header does not parse ({type(exc).__name__}: {exc})") \
            from None
    sid = str(metadata.get("sample_id", ""))
    sample_id = int(sid) if sid.isdigit() else None
    check_fp8_sample(sample, key, sample_id)
    check_token_values(sample, vocab_size, key, sample_id)
    if dequantize is not None:
        sample = dequantize_arrays(sample, dequantize)
    sample["sample_id"] = int(metadata.get("sample_id", -1))
    return sample


def decode_wids_sample(sample: Mapping[str, Any], *, vocab_size: int | None = None) -> dict[str, Any]:
    """A ``wids.ShardListDataset`` transformation: its ``.safetensors`` entry (a stream) decoded as
    :func:`decode_dspark_arrays` decodes it (``vocab_size`` likewise, through ``functools.partial``);
    ``__key__``, ``__shard__`` and the rest pass through."""
    out = dict(sample)
    for name, value in sample.items():
        if not name.startswith("__") and name.lower().endswith(SAMPLE_EXTENSION):
            out[name] = decode_dspark_arrays(name, value.read() if hasattr(value, "read") else value,
                                             vocab_size=vocab_size)
    return out
