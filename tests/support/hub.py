"""A local Hugging Face cache holding a model under a hub id, as ``huggingface_hub`` resolves one offline:
what a user's ``org/name`` is on a machine that downloaded it."""

from __future__ import annotations

import os
import shutil

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_hub(model_dir: str, hub_cache: str, repo: str, commit: str = COMMIT) -> str:
    """Copy ``model_dir`` into ``hub_cache`` (an ``HF_HUB_CACHE``) as ``repo`` at ``commit`` (``main`` points
    there); the commit."""
    base = os.path.join(hub_cache, "models--" + repo.replace("/", "--"))
    shutil.copytree(model_dir, os.path.join(base, "snapshots", commit))
    os.makedirs(os.path.join(base, "refs"))
    with open(os.path.join(base, "refs", "main"), "w") as handle:
        handle.write(commit)
    return commit
