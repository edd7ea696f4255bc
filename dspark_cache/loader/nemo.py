"""Drop-in replacements for NeMo Automodel's cached-DSpark reader functions."""

from __future__ import annotations

import functools
import os

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler, SequentialSampler

from dspark_cache.format.paths import CachePaths
from dspark_cache.loader.cache import Cache, open_cache
from dspark_cache.loader.collate import collate_padded


class CachedDSparkDataset(Dataset):
    """Map-style view of a complete cache: item ``i`` = the sample with the i-th smallest id."""

    def __init__(self, cache: Cache) -> None:
        self.cache = cache

    def __len__(self) -> int:
        return len(self.cache)

    def __getitem__(self, index: int) -> dict:
        sample = self.cache.read(index)
        sample.pop("sample_id")
        return sample


def build_cached_dspark_dataloader(
    cache_dir: str,
    batch_size: int,
    shuffle: bool = True,
    num_workers: int = 0,
    distributed: bool = False,
    seed: int = 0,
) -> DataLoader:
    """NeMo's ``build_cached_dspark_dataloader``: same keys, dtypes and shapes, exact ``len()``.

    Batches hold ``input_ids``/``loss_mask`` (int64 ``[B,S]``) and ``target_hidden_states`` /
    ``target_last_hidden_states`` (cache dtype, ``[B,S,...]``) zero-padded to the manifest's
    ``seq_length``. ``shuffle=False`` yields samples in ascending sample id.
    """
    cache = open_cache(cache_dir)
    dataset = CachedDSparkDataset(cache)
    if distributed:
        sampler = DistributedSampler(dataset, shuffle=shuffle, seed=seed)
    elif shuffle:
        sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(seed))
    else:
        sampler = SequentialSampler(dataset)
    collate = functools.partial(collate_padded, seq_length=cache.manifest.seq_length,
                                pad_token_id=cache.manifest.pad_token_id)
    return DataLoader(
        dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers, collate_fn=collate,
        pin_memory=torch.cuda.is_available(), drop_last=False, persistent_workers=num_workers > 0,
    )


def read_target_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """``{"embed_tokens.weight", "lm_head.weight"}`` from a cache directory (or the file itself)."""
    from safetensors.torch import load_file

    path = os.fspath(path)
    file = CachePaths(path).target_weights if os.path.isdir(path) else path
    if not os.path.exists(file):
        raise FileNotFoundError(f"{file} not found: the producer writes it before the first shard; rerun dspark-produce")
    return load_file(file)
