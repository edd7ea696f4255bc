"""Drop-in replacements for NeMo Automodel's cached-DSpark reader functions."""

from __future__ import annotations

import os

import torch

from dspark_cache.format.paths import CachePaths
from dspark_cache.loader.dataloader import DSparkLoader


def build_cached_dspark_dataloader(
    cache_dir: str,
    batch_size: int,
    shuffle: bool = True,
    num_workers: int = 0,
    distributed: bool = False,
    seed: int = 0,
) -> DSparkLoader:
    """NeMo's ``build_cached_dspark_dataloader``, on our loader: same keys, dtypes and shapes.

    Batches hold exactly ``input_ids``/``loss_mask`` (int64 ``[B,S]``) and
    ``target_hidden_states``/``target_last_hidden_states`` (cache dtype, ``[B,S,...]``),
    zero-padded to the manifest's ``seq_length``; ``len()`` is exact and, with
    ``distributed=True``, equal on every rank. As in NeMo, the last batch may be smaller, and
    with several ranks it is shared evenly (at most ``world_size - 1`` repeated samples, as
    ``DistributedSampler`` pads). ``shuffle=False`` yields samples in ascending sample id.
    ``num_workers`` sets reader threads (0 = one); it never changes what a rank sees.
    """
    return DSparkLoader(
        cache_dir, batch_size, shuffle=shuffle, seed=seed,
        rank=None if distributed else 0, world_size=None if distributed else 1,
        num_workers=max(1, num_workers), drop_last=False, partial_last=True, nemo_keys_only=True,
    )


def read_target_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """``{"embed_tokens.weight", "lm_head.weight"}`` from a cache directory (or the file itself)."""
    from safetensors.torch import load_file

    path = os.fspath(path)
    file = CachePaths(path).target_weights if os.path.isdir(path) else path
    if not os.path.exists(file):
        raise FileNotFoundError(f"{file} not found: the producer writes it before the first shard; rerun dspark-produce")
    return load_file(file)
