"""A NeMo-layout cache built by the tests from NeMo's documented layout, independently of the product.

NeMo 0.7.0 writes ``manifest.json`` (``format_version: 1``, indented, sorted keys),
``target_weights.safetensors`` and ``shard-NNNNNN.safetensors`` files of ``shard_size`` rows,
each with ``input_ids``/``loss_mask`` int64 ``[n, S]`` (ids right-padded with the pad token) and
the two hidden-state tensors ``[n, S, D]`` in the cache dtype. Here the samples come from one of
our caches (ascending sample id), so both caches hold the same samples.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import save_file

import dspark_cache

NEMO_FIELDS = (
    "target_model", "target_model_type", "target_vocab_size", "hidden_size", "num_hidden_layers",
    "seq_length", "dtype", "num_samples", "shard_size", "target_hidden_dim", "target_last_hidden_dim",
    "target_layer_ids", "train_data_path", "train_split", "shuffle_seed", "mask_reasoning_content",
    "mask_generation_prompt", "chat_template_sha256",
)


def padded_rows(cache_dir: str) -> list[dict[str, torch.Tensor]]:
    """Every sample of a dspark cache padded as NeMo stores it (hidden-state pads are zeros here)."""
    cache = dspark_cache.open_cache(cache_dir)
    m = cache.manifest
    rows = []
    for sample in cache.samples():
        n = sample["input_ids"].shape[0]
        hidden = sample["target_hidden_states"]
        last = sample.get("target_last_hidden_states", hidden[:, -m.hidden_size:])
        row = {
            "input_ids": torch.full((m.seq_length,), m.pad_token_id, dtype=torch.int64),
            "loss_mask": torch.zeros(m.seq_length, dtype=torch.int64),
            "target_hidden_states": torch.zeros(m.seq_length, hidden.shape[1], dtype=hidden.dtype),
            "target_last_hidden_states": torch.zeros(m.seq_length, m.hidden_size, dtype=hidden.dtype),
        }
        row["input_ids"][:n] = sample["input_ids"].long()
        row["loss_mask"][:n] = sample["loss_mask"].long()
        row["target_hidden_states"][:n] = hidden
        row["target_last_hidden_states"][:n] = last
        rows.append(row)
    return rows


def write_nemo_cache(src: str, dst: str, shard_size: int, **manifest_overrides) -> str:
    """Write the samples of dspark cache ``src`` as a NeMo 0.7.0 cache in ``dst``."""
    os.makedirs(dst)
    ours = dspark_cache.open_cache(src).manifest
    rows = padded_rows(src)
    for start in range(0, len(rows), shard_size):
        chunk = rows[start : start + shard_size]
        tensors = {k: torch.stack([r[k] for r in chunk]) for k in chunk[0]}
        save_file(tensors, os.path.join(dst, f"shard-{start // shard_size:06d}.safetensors"))
    manifest = {k: getattr(ours, k) for k in NEMO_FIELDS}
    manifest.update(num_samples=len(rows), shard_size=shard_size, complete=True, format_version=1)
    manifest.update(manifest_overrides)
    with open(os.path.join(dst, "manifest.json"), "w") as handle:
        json.dump(manifest, handle, indent=2, sort_keys=True)
    shutil.copy(
        os.path.join(src, "target_weights.safetensors"), os.path.join(dst, "target_weights.safetensors")
    )
    return dst
