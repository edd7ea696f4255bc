"""NeMo Automodel compatibility: NeMo's ``train_dspark`` recipe, unedited, trains from dspark caches.

* :func:`read_manifest`, :func:`read_target_weight_modules`,
  :func:`validate_cached_dspark_manifest` and :func:`build_cached_dspark_dataloader` are the
  recipe's cache calls with NeMo 0.7.0's signatures, return types and errors. Given a NeMo cache
  they behave exactly like NeMo's; given a dspark cache they yield the same batches, in the
  same order, with the same draws from torch's global RNG as NeMo's loader over NeMo's cache of
  the same rows, so a training run is the same run, only faster.
* :func:`install` puts them into NeMo's ``train_dspark`` recipe module (``recipe.RECIPE_MODULES``);
  ``python -m dspark_cache.nemo -c recipe.yaml`` runs the recipe with them installed.
* ``recipe_args.cached_target_path`` may name a mixture file (:mod:`.mixture`).
* ``dspark-convert`` moves caches between the two formats.
"""

from __future__ import annotations

from dspark_cache.nemo.calls import (
    build_cached_dspark_dataloader,
    read_manifest,
    read_target_weight_modules,
    validate_cached_dspark_manifest,
)
from dspark_cache.nemo.dataset import DSparkMapDataset
from dspark_cache.nemo.mixture import MixtureMapDataset
from dspark_cache.nemo.recipe import install, main

__all__ = [
    "DSparkMapDataset",
    "MixtureMapDataset",
    "build_cached_dspark_dataloader",
    "install",
    "main",
    "read_manifest",
    "read_target_weight_modules",
    "validate_cached_dspark_manifest",
]
