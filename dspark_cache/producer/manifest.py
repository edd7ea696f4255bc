"""Build, compare and publish the manifest; reconcile an existing cache directory for resume."""

from __future__ import annotations

import logging
import os
import time

import msgspec

from dspark_cache import __version__
from dspark_cache.format.atomic import atomic_write_bytes
from dspark_cache.format.cache import unpublish_shard
from dspark_cache.format.errors import CacheError, CorruptShardError, ManifestMismatchError
from dspark_cache.format.paths import CachePaths
from dspark_cache.format.schema import Manifest, ShardIndex, decode_manifest, encode_json, identity_diff
from dspark_cache.format.tar.reader import load_shard_index
from dspark_cache.format.tar.writer import predict_shard_bytes
from dspark_cache.producer.layout import check_layout, remove_files, written_files
from dspark_cache.producer.plan import Plan, SampleShape, ShardPlan

log = logging.getLogger(__name__)


def library_versions() -> dict[str, str]:
    import tokenizers
    import torch
    import transformers

    return {"dspark_cache": __version__, "torch": str(torch.__version__),
            "transformers": transformers.__version__, "tokenizers": tokenizers.__version__}


def read_manifest_file(paths: CachePaths) -> Manifest | None:
    try:
        with open(paths.manifest, "rb") as handle:
            return decode_manifest(handle.read(), paths.manifest)
    except FileNotFoundError:
        return None
    except msgspec.DecodeError as exc:
        raise CacheError(f"{exc}. Use --overwrite to replace it, or another --output-dir") from exc


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
        raise ManifestMismatchError(
            f"{paths.root} holds a cache made with a different configuration:\n{lines}\n"
            "Rerun with the original settings to resume it, pass --overwrite to start over, "
            "or choose another --output-dir."
        )
    return old


def _matches_plan(index: ShardIndex, shard: ShardPlan, shape: SampleShape) -> bool:
    """The index lists exactly the planned samples (minus dropped non-finite ones) and sizes."""
    dropped = set(index.nonfinite)
    kept = [s for s in shard.samples if s.sample_id not in dropped]
    if [e.sample_id for e in index.samples] != [s.sample_id for s in kept]:
        return False
    expected = shard.num_bytes if not dropped else \
        predict_shard_bytes([(shape.specs(s.length), shape.metadata(s.sample_id)) for s in kept])
    return index.tar_bytes == expected


def reconcile_shards(paths: CachePaths, plan: Plan, shape: SampleShape) -> set[int]:
    """Shards whose index and tar match the plan; partial, damaged or foreign ones are removed."""
    for leftover in paths.partial_files():
        log.info("removing leftover %s from an interrupted run", leftover)
        os.unlink(leftover)
    planned = {s.shard_id: s for s in plan.shards}
    done = set()
    for shard_id in paths.indexed_shard_ids():
        shard = planned.get(shard_id)
        try:
            ok = shard is not None and _matches_plan(load_shard_index(paths, shard_id), shard, shape)
        except CorruptShardError as exc:
            log.warning("%s; it will be recomputed", exc)
            ok = False
        if ok:
            done.add(shard_id)
        else:
            unpublish_shard(paths, shard_id)
    return done


def claim_completion(paths: CachePaths, run_id: str) -> bool:
    """True for exactly one rank of a run: the one that creates the claim file first."""
    os.makedirs(paths.control_dir, exist_ok=True)
    try:
        fd = os.open(paths.completion_claim(run_id),
                     os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def mark_complete(paths: CachePaths, manifest: Manifest) -> None:
    """Record what was stored (samples dropped as non-finite included) and flip ``complete``."""
    nonfinite = sorted(sid for i in paths.indexed_shard_ids() for sid in load_shard_index(paths, i).nonfinite)
    manifest.nonfinite_samples = nonfinite
    manifest.num_samples = manifest.planned_samples - len(nonfinite)
    manifest.complete = True
    manifest.completed_at = time.time()
    write_manifest(paths, manifest)
