"""The cache directory before computing: lock it, then make what is on disk agree with the plan.

Rank 0 does this, holding the directory's lock, before any rank computes: a different
configuration is refused, earlier runs' heartbeats and claims are forgotten, leftovers and shards
that do not match the plan are deleted (``reconcile_shards``), and the free space is checked
against what the missing shards will take.
"""

from __future__ import annotations

import logging
import os
import shutil

import numpy as np

from dspark_cache.format.cache import unpublish_shard
from dspark_cache.format.errors import CacheError, CorruptShardError
from dspark_cache.format.paths import CachePaths
from dspark_cache.format.schema import Manifest, ShardIndex
from dspark_cache.format.tar.reader import load_shard_index
from dspark_cache.producer.device.ranks import RankInfo
from dspark_cache.producer.layout import check_layout, check_written_names, heartbeat_files, remove_files
from dspark_cache.producer.lock import DirectoryLock, lock_exclusive
from dspark_cache.producer.manifest import adopt_cache_id, check_existing, write_manifest
from dspark_cache.producer.plan.batches import Plan, SampleShape, ShardPlan, shard_bytes_of
from dspark_cache.producer.prepare import Prepared

log = logging.getLogger(__name__)


def take_directory(paths: CachePaths, run_id: str, me: RankInfo, overwrite: bool) -> DirectoryLock | None:
    """Rank 0, before reading the input: refuse a linked-out layout, then lock the directory."""
    check_layout(paths)
    check_written_names(paths)
    try:
        os.makedirs(paths.control_dir, exist_ok=True)
        return lock_exclusive(paths, run_id, me.world_size, overwrite)
    except OSError as exc:  # /proc/..., a read-only mount, no permission: say which path and what to do
        where = exc.filename or paths.control_dir
        raise CacheError(f"--output-dir {paths.root} cannot hold a cache: creating {where} failed "
                         f"({exc.strerror or exc}); choose a directory on a writable filesystem") from None


def bytes_missing(paths: CachePaths, plan: Plan) -> int:
    """What the shards not yet published will take on disk."""
    done = set(paths.indexed_shard_ids())
    return sum(s.num_bytes for s in plan.shards if s.shard_id not in done)


def preflight_disk(paths: CachePaths, needed: int, force: bool) -> None:
    """Refuse to start when ``needed`` bytes exceed the free space (unless ``--force``)."""
    free = shutil.disk_usage(paths.root).free
    if needed > free and not force:
        raise CacheError(
            f"the cache needs {needed / 1e9:.2f} GB more but {paths.root} has {free / 1e9:.2f} GB free; "
            "free space or choose another --output-dir (or pass --force to start anyway)"
        )


def reconcile_directory(p: Prepared) -> Manifest | None:
    """Rank 0 only, holding the lock: refuse a mismatch, clean leftovers, check space.

    Returns the existing manifest (None for a fresh cache). The manifest on disk says
    ``complete: false`` from here on unless the cache is already complete and whole.
    """
    check_layout(p.paths)  # again: planning may have taken hours
    check_written_names(p.paths)
    os.makedirs(p.paths.root, exist_ok=True)
    existing = check_existing(p.paths, p.manifest, p.cfg.overwrite)
    adopt_cache_id(p.manifest, existing)
    p.paths.ensure_dirs()
    _forget_other_runs(p.paths)
    if existing is not None:
        p.manifest.created_at = existing.created_at
        reconcile_shards(p.paths, p.plan, p.shape, p.manifest.cache_id)  # removes partials and damaged shards
    preflight_disk(p.paths, bytes_missing(p.paths, p.plan), p.cfg.force)
    done = set(p.paths.indexed_shard_ids())
    if existing is None or not existing.complete or done != {s.shard_id for s in p.plan.shards}:
        p.manifest.complete = False
        write_manifest(p.paths, p.manifest)
    return existing


def _matches_plan(index: ShardIndex, shard: ShardPlan, shape: SampleShape, cache_id: str) -> bool:
    """The index is this cache's and lists exactly the planned samples (minus dropped non-finite ones) and sizes."""
    if index.cache_id != cache_id:  # readers refuse a shard of another cache: recompute it
        return False
    kept = shard.records[~np.isin(shard.sample_ids, np.asarray(index.nonfinite, dtype=np.int64))]
    if [e.sample_id for e in index.samples] != kept["sample_id"].tolist():
        return False
    expected = shard.num_bytes if kept.shape[0] == shard.num_samples else shard_bytes_of(shape, kept)
    return index.tar_bytes == expected


def reconcile_shards(paths: CachePaths, plan: Plan, shape: SampleShape, cache_id: str) -> set[int]:
    """Shards whose index and tar match the plan; partial, damaged or foreign ones are removed."""
    for leftover in paths.partial_files():
        log.info("removing leftover %s from an interrupted run", leftover)
        os.unlink(leftover)
    planned = {s.shard_id: s for s in plan.shards}
    done = set()
    for shard_id in paths.indexed_shard_ids():
        shard = planned.get(shard_id)
        try:
            ok = shard is not None and _matches_plan(load_shard_index(paths, shard_id), shard, shape, cache_id)
        except CorruptShardError as exc:
            log.warning("%s; it will be recomputed", exc)
            ok = False
        if ok:
            done.add(shard_id)
        else:
            unpublish_shard(paths, shard_id)
    return done


def _forget_other_runs(paths: CachePaths) -> None:
    """Earlier runs' heartbeats, stop requests and completion claims describe no live process (we hold the lock)."""
    remove_files(heartbeat_files(paths))
