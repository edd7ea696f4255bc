"""Run NeMo's own ``train_dspark`` recipe, unedited, on dspark caches.

The recipe looks its cache calls up as module globals of its module when it sets up
(``nemo_automodel.recipes.llm.train_dspark`` in 0.7.0; NeMo's nightly moves its recipes to
``nemo_automodel.recipes.speculative_decoding``); :func:`install` points those globals at
:mod:`.calls`. NeMo's files are never edited, and since every call handles a NeMo cache exactly
as NeMo does, installing is always safe.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Callable, Sequence

from dspark_cache.nemo import calls

# Where NeMo keeps the recipe, newest layout first: a release that keeps the old path as an alias
# would leave the real module's globals untouched if the alias were patched.
RECIPE_MODULES = ("nemo_automodel.recipes.speculative_decoding.train_dspark",  # after 0.7.0 (nightly)
                  "nemo_automodel.recipes.llm.train_dspark")  # 0.7.0
# recipe global -> our implementation (NeMo 0.7.0's names)
REPLACEMENTS: dict[str, Callable] = {
    "read_manifest": calls.read_manifest,
    "read_target_weight_modules": calls.read_target_weight_modules,
    "build_cached_dspark_dataloader": calls.build_cached_dspark_dataloader,
    "_validate_cached_dspark_manifest": calls.validate_cached_dspark_manifest,
}


def install(module: ModuleType | None = None) -> ModuleType:
    """Replace the recipe's cache calls with ours; returns the recipe module.

    ``module`` defaults to the recipe module, found under either of ``RECIPE_MODULES``.
    """
    if module is None:
        module = recipe_module()
    missing = [name for name in REPLACEMENTS if not hasattr(module, name)]
    if missing:
        raise RuntimeError(
            f"{module.__name__} has no {', '.join(missing)}: this nemo-automodel is not the 0.7.0 "
            "API dspark_cache.nemo was built for; install nemo-automodel==0.7.0"
        )
    for name, replacement in REPLACEMENTS.items():
        setattr(module, name, replacement)
    return module


def recipe_module() -> ModuleType:
    """NeMo's ``train_dspark`` module under the first of ``RECIPE_MODULES`` that exists."""
    absent = []
    for name in RECIPE_MODULES:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is None or not name.startswith(exc.name):  # it exists but needs what is missing
                raise ImportError(f"cannot import {name} ({exc}); install what it needs, or "
                                  "nemo-automodel==0.7.0 afresh in this environment") from exc
            absent.append(f"{name} ({exc})")
    raise ImportError(f"cannot import NeMo's train_dspark recipe: {'; '.join(absent)}; install NVIDIA's "
                      "recipe with `pip install nemo-automodel==0.7.0` in this environment")


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m dspark_cache.nemo -c recipe.yaml [--a.b=v ...]``: NeMo's recipe ``main()`` with
    :func:`install` applied; the arguments are NeMo's own (works under ``torchrun``)."""
    recipe = install()
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    recipe.main()
