"""Tiny hand-made NeMo-layout caches for the convert tests, written from NeMo's documented layout.

Rows are given as token ids and loss masks of length ``seq``; hidden states are random, including
at pad positions (NeMo's producer stores the target's outputs there), and the final state is the
last ``hidden`` columns of ``target_hidden_states`` whenever the layer ids end at
``num_layers - 1``, as NeMo's producer writes it.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from tests.support.nemo_fixture import NEMO_FIELDS

TINY_MODEL = "hub-only/tiny-model"  # not a local directory: the tokenizer cannot be loaded


def tiny_manifest(num_samples: int, seq: int, shard_size: int, hidden: int, layer_ids: list[int],
                  num_layers: int, **overrides) -> dict:
    manifest = {
        "target_model": TINY_MODEL,
        "target_model_type": "qwen3",
        "target_vocab_size": 100,
        "hidden_size": hidden,
        "num_hidden_layers": num_layers,
        "seq_length": seq,
        "dtype": "bf16",
        "num_samples": num_samples,
        "shard_size": shard_size,
        "target_hidden_dim": hidden * len(layer_ids),
        "target_last_hidden_dim": hidden,
        "target_layer_ids": layer_ids,
        "train_data_path": "rows.jsonl",
        "train_split": None,
        "shuffle_seed": 42,
        "mask_reasoning_content": False,
        "mask_generation_prompt": False,
        "chat_template_sha256": "0" * 64,
    }
    assert set(manifest) == set(NEMO_FIELDS)
    manifest.update(format_version=1, complete=True)
    manifest.update(overrides)
    return manifest


def write_tiny_nemo(dst: str, ids: list[list[int]], masks: list[list[int]], *, shard_size: int = 2,
                    hidden: int = 4, layer_ids: list[int] | None = None, num_layers: int = 2, seed: int = 0,
                    **overrides) -> dict[str, torch.Tensor]:
    """Write the cache; returns the whole padded tensors ``[N, S, ...]`` it holds."""
    layer_ids = [0, 1] if layer_ids is None else layer_ids
    n, seq = len(ids), len(ids[0])
    gen = torch.Generator().manual_seed(seed)
    full = {
        "input_ids": torch.tensor(ids, dtype=torch.int64),
        "loss_mask": torch.tensor(masks, dtype=torch.int64),
        "target_hidden_states": torch.randn(n, seq, hidden * len(layer_ids), generator=gen).to(
            torch.bfloat16
        ),
    }
    if layer_ids[-1] == num_layers - 1:
        full["target_last_hidden_states"] = full["target_hidden_states"][..., -hidden:].clone()
    else:
        full["target_last_hidden_states"] = torch.randn(n, seq, hidden, generator=gen).to(torch.bfloat16)
    os.makedirs(dst, exist_ok=True)
    for shard, start in enumerate(range(0, n, shard_size)):
        save_file({k: v[start : start + shard_size].contiguous() for k, v in full.items()},
                  os.path.join(dst, f"shard-{shard:06d}.safetensors"))
    save_file({"embed_tokens.weight": torch.randn(100, hidden, generator=gen).to(torch.bfloat16),
               "lm_head.weight": torch.randn(100, hidden, generator=gen).to(torch.bfloat16)},
              os.path.join(dst, "target_weights.safetensors"))
    manifest = tiny_manifest(n, seq, shard_size, hidden, layer_ids, num_layers, **overrides)
    with open(os.path.join(dst, "manifest.json"), "w") as handle:
        json.dump(manifest, handle, indent=2, sort_keys=True)
    return full
