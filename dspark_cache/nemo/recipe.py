"""Run NeMo's own ``train_dspark`` recipe, unedited, on dspark caches.

The recipe looks its cache calls up as module globals of
``nemo_automodel.recipes.llm.train_dspark`` when it sets up; :func:`install` points those
globals at :mod:`.calls`. NeMo's files are never edited, and since every call handles a
NeMo cache exactly as NeMo does, installing is always safe.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Callable, Sequence

from dspark_cache.nemo import calls

RECIPE_MODULE = "nemo_automodel.recipes.llm.train_dspark"
# recipe global -> our implementation (NeMo 0.7.0's names)
REPLACEMENTS: dict[str, Callable] = {
    "read_manifest": calls.read_manifest,
    "read_target_weight_modules": calls.read_target_weight_modules,
    "build_cached_dspark_dataloader": calls.build_cached_dspark_dataloader,
    "_validate_cached_dspark_manifest": calls.validate_cached_dspark_manifest,
}


def install(module: ModuleType | None = None) -> ModuleType:
    """Replace the recipe's cache calls with ours; returns the recipe module.

    ``module`` defaults to the imported ``nemo_automodel.recipes.llm.train_dspark``.
    """
    if module is None:
        try:
            module = importlib.import_module(RECIPE_MODULE)
        except ImportError as exc:
            raise ImportError(f"cannot import {RECIPE_MODULE} ({exc}); install NVIDIA's recipe with "
                              "`pip install nemo-automodel==0.7.0` in this environment") from exc
    missing = [name for name in REPLACEMENTS if not hasattr(module, name)]
    if missing:
        raise RuntimeError(f"{module.__name__} has no {', '.join(missing)}: this nemo-automodel is not the 0.7.0 "
                           "API dspark_cache.nemo was built for; install nemo-automodel==0.7.0")
    for name, replacement in REPLACEMENTS.items():
        setattr(module, name, replacement)
    return module


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m dspark_cache.nemo -c recipe.yaml [--a.b=v ...]``: NeMo's recipe ``main()`` with
    :func:`install` applied; the arguments are NeMo's own (works under ``torchrun``)."""
    recipe = install()
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    recipe.main()
