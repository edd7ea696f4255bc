"""dspark-cache: precompute a frozen target LLM's hidden states once, stream them into training.

The public API (the loader, ``open_cache``, the NeMo calls, ``CacheDir``) is imported lazily, on
first use, so that light consumers (the TUI, ``dspark-verify``) never pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.2.0"

_LAZY = {
    "open_cache": "dspark_cache.loader.cache",
    "Cache": "dspark_cache.loader.cache",
    "CacheDir": "dspark_cache.storage.cache",  # torch-free: manifest, indexes, open shard files
    "build_dataloader": "dspark_cache.loader.build",
    "DSparkLoader": "dspark_cache.loader.dataloader",
    "Source": "dspark_cache.loader.sources",  # one cache of a mixture, with its weight (torch-free)
    "dequantize": "dspark_cache.loader.tensors",  # FP8 batches (dtype="raw") on any device
    "build_cached_dspark_dataloader": "dspark_cache.nemo",
    "read_target_weight_modules": "dspark_cache.nemo",
    # The errors a reader catches (torch-free): every one is a CacheError.
    "CacheError": "dspark_cache.format.errors",
    "NotACacheError": "dspark_cache.format.errors",
    "IncompleteCacheError": "dspark_cache.format.errors",
    "CorruptShardError": "dspark_cache.format.errors",
    "ManifestMismatchError": "dspark_cache.format.errors",
    "CacheReplacedError": "dspark_cache.storage.cache",
    "CacheLockedError": "dspark_cache.storage.lock",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dspark_cache' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    """The public API too, though it is imported only when first used (``dir()``, completion)."""
    return sorted({*__all__, *(name for name in globals() if name.startswith("__"))})
