"""Build, compare, publish and complete the manifest (a cache directory's shards: ``reconcile.py``).

The manifest is read through ``dspark_cache.format.manifest.load_manifest``, the one reader every
part uses (bounded, regular files only, fields checked against each other).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from typing import TYPE_CHECKING, Any

from dspark_cache import __version__
from dspark_cache.format.atomic import atomic_write_bytes
from dspark_cache.format.errors import CacheError, ManifestMismatchError, NotACacheError
from dspark_cache.format.manifest import load_manifest
from dspark_cache.format.paths import CachePaths
from dspark_cache.format.schema import Manifest, encode_json, identity_diff
from dspark_cache.format.tar.reader import load_shard_index
from dspark_cache.format.validate import InvalidManifestError
from dspark_cache.format.wids_index import write_wids_index
from dspark_cache.producer.layout import check_layout, remove_files, written_files
from dspark_cache.producer.plan.batches import Plan
from dspark_cache.producer.encode.template import sha256_text, tokenizer_sha256

if TYPE_CHECKING:  # types only: the convert tool imports this module without the producer's run
    from dspark_cache.producer.config import ProduceConfig
    from dspark_cache.producer.device.target import TargetInfo

log = logging.getLogger(__name__)


def library_versions() -> dict[str, str]:
    """The versions that shaped the cache's bytes (recorded, not compared on resume)."""
    import tokenizers
    import torch
    import transformers

    return {"dspark_cache": __version__, "torch": str(torch.__version__),
            "transformers": transformers.__version__, "tokenizers": tokenizers.__version__}


def build_manifest(cfg: ProduceConfig, info: TargetInfo, layer_ids: list[int], plan: Plan, tokenizer: Any,
                   input_sha256: str, compute_dtype: str) -> Manifest:
    """The manifest of the cache this run makes: its identity (what resume compares) and its plan's totals."""
    return Manifest(
        target_model=cfg.target_model, target_model_type=info.model_type, target_vocab_size=info.vocab_size,
        hidden_size=info.hidden_size, num_hidden_layers=info.num_layers, seq_length=cfg.seq_length,
        dtype=cfg.dtype, num_samples=plan.num_samples, shard_size=cfg.shard_size,
        target_hidden_dim=info.hidden_size * len(layer_ids), target_last_hidden_dim=info.hidden_size,
        target_layer_ids=layer_ids, train_data_path=str(cfg.input_data), train_split=cfg.split,
        shuffle_seed=cfg.shuffle_seed, mask_reasoning_content=cfg.mask_reasoning_content,
        mask_generation_prompt=cfg.mask_generation_prompt,
        chat_template_sha256=sha256_text(tokenizer.chat_template), input_sha256=input_sha256,
        tokenizer_sha256=tokenizer_sha256(tokenizer), compute_dtype=compute_dtype,
        attn_implementation=cfg.target_attn_implementation, pad_token_id=int(tokenizer.pad_token_id),
        num_rows=plan.num_rows, planned_samples=plan.num_samples, num_shards=len(plan.shards),
        planned_tokens=plan.num_tokens, planned_loss_tokens=plan.num_loss_tokens, planned_bytes=plan.num_bytes,
        planned_padded_tokens=plan.padded_tokens, plan_sha256=plan.layout_sha256(),
        skipped_rows=plan.skipped_counts(), skipped=plan.skipped, versions=library_versions(),
        target_fingerprint=info.fingerprint, created_at=time.time(),
    )


def read_manifest_file(paths: CachePaths) -> Manifest | None:
    """The manifest in ``paths.root`` (through format's reader), or None when there is none yet."""
    try:
        return load_manifest(paths.root)
    except NotACacheError:
        return None
    except InvalidManifestError:  # its message already says what to do
        raise
    except CacheError as exc:
        raise CacheError(f"{exc}. Use --overwrite to replace it, or another --output-dir") from exc


def adopt_cache_id(manifest: Manifest, existing: Manifest | None) -> None:
    """A run that starts a cache (a fresh directory, or ``--overwrite``) gives it a new ``cache_id``; a
    resume keeps the existing one, so readers of the cache it continues keep reading it."""
    manifest.cache_id = existing.cache_id if existing is not None else uuid.uuid4().hex


def current_cache_id(paths: CachePaths) -> str:
    """The ``cache_id`` of the manifest on disk, which rank 0 set for this run before any rank computes
    (every rank writes it into its indexes); ``""`` where no manifest exists (a bare pipeline)."""
    try:
        return load_manifest(paths.root).cache_id
    except NotACacheError:
        return ""


def write_manifest(paths: CachePaths, manifest: Manifest) -> None:
    atomic_write_bytes(paths.manifest, encode_json(manifest, pretty=True))


def clear_cache(paths: CachePaths) -> None:
    """What ``--overwrite`` deletes: the files this tool writes, one by one; not the lock, nothing else.

    The caller holds the lock and has checked that the cache's directories are real ones.
    """
    check_layout(paths)
    remove_files(written_files(paths))


def check_existing(paths: CachePaths, new: Manifest, overwrite: bool) -> Manifest | None:
    """Return the existing manifest to resume from (or None for a fresh start).

    Refuses a different configuration, naming every differing field.
    """
    if overwrite:  # before reading: an unreadable or foreign manifest is what --overwrite is for
        clear_cache(paths)
        return None
    old = read_manifest_file(paths)
    if old is None:
        if paths.indexed_shard_ids() or paths.partial_files():
            raise CacheError(
                f"{paths.root} holds shards but no {os.path.basename(paths.manifest)}: they cannot be "
                "verified. Pass --overwrite to start over, or choose another --output-dir"
            )
        return None
    diff = identity_diff(old, new)
    if diff:
        lines = "\n".join(f"  {name}: cache has {a!r}, this run has {b!r}" for name, a, b in diff)
        target_changed = any(name == "target_fingerprint" for name, _, _ in diff)
        if target_changed and old.target_fingerprint:
            lines += ("\n  (the checkpoint at --target-model is not the one the cache was made from: its weight "
                      "files or config.json changed; point --target-model at that checkpoint)")
        elif target_changed:
            lines += ("\n  (the cache was made by a version that did not fingerprint its target: --overwrite "
                      "remakes it)")
        raise ManifestMismatchError(
            f"{paths.root} holds a cache made with a different configuration:\n{lines}\n"
            "Rerun with the original settings to resume it, pass --overwrite to start over, "
            "or choose another --output-dir."
        )
    return old


def mark_complete(paths: CachePaths, manifest: Manifest) -> None:
    """Record what was stored (samples dropped as non-finite included) and flip ``complete``."""
    nonfinite = sorted(sid for i in paths.indexed_shard_ids() for sid in load_shard_index(paths, i).nonfinite)
    manifest.nonfinite_samples = nonfinite
    manifest.cache_id = current_cache_id(paths)  # another rank's manifest was built without rank 0's id
    manifest.num_samples = manifest.planned_samples - len(nonfinite)
    manifest.complete = True
    manifest.completed_at = time.time()
    write_wids_index(paths)  # exact now that every shard is published (ranks' updates could race)
    write_manifest(paths, manifest)
