"""Build, compare and publish the manifest; reconcile an existing cache directory for resume."""

from __future__ import annotations

import logging
import os
import shutil
import time

import msgspec

from dspark_cache import __version__
from dspark_cache.format.atomic import atomic_write_bytes
from dspark_cache.format.errors import CacheError, CorruptShardError, ManifestMismatchError
from dspark_cache.format.paths import CachePaths
from dspark_cache.format.schema import Manifest, decode_manifest, encode_json, identity_diff
from dspark_cache.format.tar.reader import load_shard_index
from dspark_cache.producer.plan import Plan

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
    """What ``--overwrite`` deletes: everything this tool writes, nothing else."""
    for sub in (paths.shards_dir, paths.status_dir, paths.events_dir, os.path.dirname(paths.stop_request)):
        shutil.rmtree(sub, ignore_errors=True)
    for file in (paths.manifest, paths.target_weights):
        if os.path.exists(file):
            os.unlink(file)


def check_existing(paths: CachePaths, new: Manifest, overwrite: bool) -> Manifest | None:
    """Return the existing manifest to resume from (or None for a fresh start).

    Refuses a different configuration, naming every differing field.
    """
    old = read_manifest_file(paths)
    if overwrite:
        clear_cache(paths)
        return None
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


def published_shards(paths: CachePaths, plan: Plan) -> set[int]:
    """Shards whose index and tar match the plan; damaged or foreign ones are removed."""
    for leftover in paths.partial_files():
        log.info("removing leftover %s from an interrupted run", leftover)
        os.unlink(leftover)
    planned = {s.shard_id: s for s in plan.shards}
    done = set()
    for shard_id in paths.indexed_shard_ids():
        shard = planned.get(shard_id)
        try:
            index = load_shard_index(paths, shard_id)
            ok = shard is not None and index.tar_bytes == shard.num_bytes and \
                [e.sample_id for e in index.samples] == [s.sample_id for s in shard.samples]
        except CorruptShardError as exc:
            log.warning("%s; it will be recomputed", exc)
            ok = False
        if ok:
            done.add(shard_id)
        else:
            for file in (paths.shard_index(shard_id), paths.shard_tar(shard_id)):
                if os.path.exists(file):
                    os.unlink(file)
    return done


def mark_complete(paths: CachePaths, manifest: Manifest) -> None:
    manifest.complete = True
    manifest.completed_at = time.time()
    write_manifest(paths, manifest)
