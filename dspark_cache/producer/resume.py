"""The cache directory before computing: take it, then make what is on disk agree with the plan.

Rank 0 does this through the directory's :class:`CacheOutput`, holding its lock, before any rank
computes: a different configuration is refused, earlier runs' heartbeats and claims are
forgotten, leftovers and shards that do not match the plan are unpublished
(``reconcile_shards``), and the free space is checked against what the missing shards will take.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Collection

import numpy as np

from dspark_cache.format.errors import CacheError, CorruptShardError, ManifestMismatchError
from dspark_cache.format.geometry import SampleShape
from dspark_cache.format.manifest import adopt_cache_id
from dspark_cache.format.schema import Manifest, ShardIndex, identity_diff
from dspark_cache.format.tar.writer import predict_shard_bytes
from dspark_cache.format.validate import InvalidManifestError
from dspark_cache.producer.plan.batches import Plan, ShardPlan
from dspark_cache.producer.prepare import Prepared
from dspark_cache.storage.output import CacheOutput

log = logging.getLogger(__name__)


def take_directory(output: CacheOutput, run_id: str, world_size: int, overwrite: bool) -> None:
    """Rank 0, before reading the input: refuse sub-directories linked elsewhere, then lock the directory."""
    output.check(written_names=True)
    try:
        output.lock(run_id, world_size, overwrite=overwrite)
    except OSError as exc:  # /proc/..., a read-only mount, no permission: say which path and what to do
        where = exc.filename or output.paths.control_dir
        raise CacheError(f"--output-dir {output.shown} cannot hold a cache: creating {where} failed "
                         f"({exc.strerror or exc}); choose a directory on a writable filesystem") from None


def read_existing(output: CacheOutput) -> Manifest | None:
    """The manifest already in the output directory, or None when there is none yet."""
    try:
        return output.read_manifest()
    except InvalidManifestError:  # its message already says what to do
        raise
    except CacheError as exc:
        raise CacheError(f"{exc}. Use --overwrite to replace it, or another --output-dir") from exc


def check_existing(output: CacheOutput, new: Manifest, overwrite: bool) -> Manifest | None:
    """Return the existing manifest to resume from (or None for a fresh start).

    Refuses a different configuration, naming every differing field.
    """
    if overwrite:  # before reading: an unreadable or foreign manifest is what --overwrite is for
        output.clear()
        return None
    old = read_existing(output)
    if old is None:
        if output.published() or output.leftovers():
            raise CacheError(
                f"{output.shown} holds shards but no {os.path.basename(output.paths.manifest)}: they cannot be "
                "verified. Pass --overwrite to start over, or choose another --output-dir"
            )
        return None
    diff = identity_diff(old, new)
    if diff:
        lines = "\n".join(f"  {name}: cache has {a!r}, this run has {b!r}" for name, a, b in diff)
        target_changed = any(name == "target_fingerprint" for name, _, _ in diff)
        if target_changed and old.target_fingerprint:
            lines += (
                "\n  (the checkpoint at --target-model is not the one the cache was made from: its weight "
                "files or config.json changed; point --target-model at that checkpoint)"
            )
        elif target_changed:
            lines += ("\n  (the cache was made by a version that did not fingerprint its target: --overwrite "
                      "remakes it)")
        raise ManifestMismatchError(
            f"{output.shown} holds a cache made with a different configuration:\n{lines}\n"
            "Rerun with the original settings to resume it, pass --overwrite to start over, "
            "or choose another --output-dir."
        )
    return old


@dataclass(frozen=True)
class DiskSpace:
    """The one free-space report, for the check before a run and the message when the disk fills."""

    needed: int  # bytes the shards still to write take, with the partial files of ``writers`` in flight
    free: int  # bytes free on the disk the shards go to


def disk_space(output: CacheOutput, plan: Plan, done: Collection[int], writers: int) -> DiskSpace:
    todo = plan.bytes_missing(done)
    return DiskSpace(output.space_needed(sum(todo), max(todo, default=0), writers), output.free_space())


def preflight_disk(output: CacheOutput, plan: Plan, done: Collection[int], force: bool,
                   writers: int = 1) -> None:
    """Refuse to start when the shards still to write need more than the free space (unless ``--force``);
    ``writers``: shards written at once."""
    needed, free = dataclasses.astuple(disk_space(output, plan, done, writers))
    if needed > free and not force:
        where = "" if output.shown == output.root else f" (the staging directory of {output.shown})"
        raise CacheError(
            f"the cache needs {needed / 1e9:.2f} GB more but {output.root}{where} has {free / 1e9:.2f} GB free; "
            "free space or choose another --output-dir (or pass --force to start anyway)"
        )


def reconcile_directory(p: Prepared) -> Manifest | None:
    """Rank 0 only, holding the lock: refuse a mismatch, clean leftovers, check space.

    Returns the existing manifest (None for a fresh cache). The manifest on disk says
    ``complete: false`` from here on unless the cache is already complete and whole.
    """
    output = p.output
    output.check(written_names=True)  # again: planning may have taken hours
    existing = check_existing(output, p.manifest, p.cfg.overwrite)
    adopt_cache_id(p.manifest, existing)
    output.create()
    output.forget_heartbeats()
    if existing is not None:
        p.manifest.created_at = existing.created_at
        reconcile_shards(output, p.plan, p.shape, p.manifest.cache_id)  # removes partials and damaged shards
    done = output.published()
    preflight_disk(output, p.plan, done, p.cfg.force, p.cfg.writers)
    if existing is None or not existing.complete or done != {s.shard_id for s in p.plan.shards}:
        p.manifest.complete = False
        output.write_manifest(p.manifest)
    return existing


def _matches_plan(index: ShardIndex, shard: ShardPlan, shape: SampleShape, cache_id: str) -> bool:
    """The index is this cache's and lists exactly the planned samples (minus dropped non-finite ones) and sizes."""
    if index.cache_id != cache_id:  # readers refuse a shard of another cache: recompute it
        return False
    kept = shard.records[~np.isin(shard.sample_ids, np.asarray(index.nonfinite, dtype=np.int64))]
    if [e.sample_id for e in index.samples] != kept["sample_id"].tolist():
        return False
    if shape.compressed:  # its size is known only once written: the index's checks (tiling, headers) hold
        return True
    expected = (shard.num_bytes if kept.shape[0] == shard.num_samples
                else predict_shard_bytes(shape, kept["sample_id"].tolist(), kept["length"].tolist()))
    return index.tar_bytes == expected


def reconcile_shards(output: CacheOutput, plan: Plan, shape: SampleShape, cache_id: str) -> None:
    """Keep the shards whose index and tar match the plan; partial, damaged or foreign ones are removed."""
    for leftover in output.leftovers():
        log.info("removing leftover %s from an interrupted run", leftover)
        os.unlink(leftover)
    planned = {s.shard_id: s for s in plan.shards}
    for shard_id in sorted(output.published()):
        shard = planned.get(shard_id)
        try:
            ok = shard is not None and _matches_plan(output.shard_index(shard_id), shard, shape, cache_id)
        except CorruptShardError as exc:
            log.warning("%s; it will be recomputed", exc)
            ok = False
        if not ok:
            output.unpublish(shard_id)
