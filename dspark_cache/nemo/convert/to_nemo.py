"""``--to nemo``: export a dspark cache in NeMo Automodel 0.7.0's own format.

NeMo's reader needs every row padded to ``seq_length``: ``input_ids`` with the manifest's
``pad_token_id``, the other tensors with zeros. (NeMo's own producer stores the target's outputs
at pad positions instead; training masks them, so zeros train the same.) Sample ``i`` of the
export is the ``i``-th sample in ascending sample id: ids are renumbered densely, because NeMo
addresses samples by position.

Each shard is streamed to ``shard-NNNNNN.safetensors.partial`` row by row at computed offsets
(the bytes ``safetensors.torch.save_file`` would write, without ever holding a shard in memory),
fsynced and renamed; the manifest says ``complete: false`` until the last one is in place. The
file is sized first and only real tokens (and the ids' pad run) are written: the zero padding is
left as holes, which read as zeros and, where the filesystem has sparse files, take no disk and
no write bandwidth (padding is most of a NeMo cache).

NeMo's format has no FP8: an FP8 cache is exported dequantised, to bf16 by default (what it
reads as everywhere) or to ``dtype="fp32"`` (what NeMo's recipe needs to train on a CPU), and the
manifest says that dtype.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO

import msgspec
import torch

from dspark_cache.format.atomic import fsync_dir
from dspark_cache.format.errors import CacheError, CorruptShardError
from dspark_cache.format.faults import crash_point
from dspark_cache.format.paths import TARGET_WEIGHTS
from dspark_cache.format.sample import CACHE_DTYPES, HIDDEN, INPUT_IDS, LAST_HIDDEN, LOSS_MASK
from dspark_cache.loader.cache import Cache, open_cache
from dspark_cache.nemo import nemo_format
from dspark_cache.nemo.convert.common import (
    ConvertError,
    ConvertResult,
    ConvertUsageError,
    Progress,
    check_destination_files,
    check_paths,
    clear_destination,
    ensure_weights,
    file_bytes,
    lock_cache,
    lock_destination,
    remove_partials,
    require_weights,
)
from dspark_cache.nemo.convert.stfile import (
    SafetensorsFile, TensorRange, file_size, header_bytes, pwrite_all, raw_bytes,
)
from dspark_cache.storage.backing import StorageOptions
from dspark_cache.storage.output import CacheOutput
from dspark_cache.storage.remote.url import is_remote

Spec = tuple[str, torch.dtype, tuple[int, ...]]


def nemo_manifest(cache: Cache, shard_size: int) -> dict:
    """Exactly NeMo's manifest fields (``nemo_format.MANIFEST_FIELDS``) for the export of ``cache`` (the
    dtype its samples are read as: an FP8 cache's dequantised one)."""
    ours = msgspec.structs.asdict(cache.manifest)
    fields = {name: ours[name] for name in nemo_format.MANIFEST_FIELDS}
    fields.update(num_samples=len(cache), shard_size=shard_size)
    if cache.out_code is not None:
        fields["dtype"] = {code: name for name, code in CACHE_DTYPES.items()}[cache.out_code]
    return fields


def shard_specs(manifest: dict, rows: int) -> list[Spec]:
    """The four tensors of a shard of ``rows`` samples, in the order ``save_file`` writes them."""
    seq, dtype = manifest["seq_length"], nemo_format.DTYPES[manifest["dtype"]]
    return [("input_ids", torch.int64, (rows, seq)), ("loss_mask", torch.int64, (rows, seq)),
            ("target_hidden_states", dtype, (rows, seq, manifest["target_hidden_dim"])),
            ("target_last_hidden_states", dtype, (rows, seq, manifest["target_last_hidden_dim"]))]


def _shard_is_complete(path: str, specs: list[Spec]) -> bool:
    """An earlier run renamed this shard into place only when whole: its header must fit ``specs``."""
    _, ranges = header_bytes(specs)
    try:
        with SafetensorsFile(path) as handle:
            found = {name: (t.dtype, t.shape, t.start) for name, t in handle.tensors.items()}
    except ConvertError:
        return False
    expected = {name: (r.dtype, r.shape, r.start) for name, r in ranges.items()}
    return found == expected and os.path.getsize(path) == file_size(specs)


def _existing_manifest(output: CacheOutput, new: dict, overwrite: bool) -> dict | None:
    """DST's NeMo manifest to resume from (None: fresh); refuses a different cache, naming the fields."""
    dst = output.root
    if overwrite:
        clear_destination(output)
        return None
    path = nemo_format.manifest_path(dst)
    if not os.path.exists(path):
        if nemo_format.shard_indices(dst) or output.published():
            raise ConvertError(f"{dst} holds shards but no manifest.json, so they cannot be verified; pass "
                               "--overwrite to replace them, or choose another DST")
        return None
    if not nemo_format.is_nemo_cache(dst):
        raise ConvertError(
            f"{path} is not a NeMo manifest (a dspark cache, or unreadable); pass --overwrite to "
            "replace that cache, or choose another DST"
        )
    old = nemo_format.read_manifest(dst, allow_incomplete=True)
    # NeMo's own resume rule: every field but the bookkeeping ones must match.
    diff = [k for k in sorted(old.keys() | new.keys())
            if k not in ("format_version", "complete") and old.get(k) != new.get(k)]
    if diff:
        lines = "\n".join(
            f"  {k}: DST has {old.get(k)!r}, this conversion gives {new.get(k)!r}" for k in diff
        )
        raise ConvertError(
            f"{dst} holds a different cache:\n{lines}\nPass --overwrite to replace it, or choose another DST"
        )
    return old


def _write_row(fd: int, ranges: dict[str, TensorRange], row: int, sample: dict, pad_id: int) -> None:
    """One sample as row ``row`` of each tensor. The file was sized up front, so what is not
    written (every pad position but the ids') is a hole: zeros."""
    ids = torch.full((ranges["input_ids"].shape[1],), pad_id, dtype=torch.int64)
    ids[: sample[INPUT_IDS].shape[0]] = sample[INPUT_IDS]
    pwrite_all(fd, [raw_bytes(ids)], ranges["input_ids"].row_offset(row))
    pwrite_all(fd, [raw_bytes(sample[LOSS_MASK].to(torch.int64))], ranges["loss_mask"].row_offset(row))
    for name in (HIDDEN, LAST_HIDDEN):
        pwrite_all(fd, [raw_bytes(sample[name])], ranges[name].row_offset(row))


def _write_shard(cache: Cache, positions: list[int], path: str, specs: list[Spec], pad_id: int) -> None:
    header, ranges = header_bytes(specs)
    seq = specs[0][2][1]
    partial = nemo_format.partial_path(path)
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        pwrite_all(fd, [memoryview(header)], 0)
        os.ftruncate(fd, file_size(specs))
        for row, position in enumerate(positions):
            sample = cache.read(position)  # checksum-verified
            if sample[INPUT_IDS].shape[0] > seq:
                raise ConvertError(
                    f"{cache.path}: sample {sample['sample_id']} has {sample[INPUT_IDS].shape[0]} "
                    f"tokens, more than the manifest's seq_length {seq}"
                )
            _write_row(fd, ranges, row, sample, pad_id)
            crash_point("nemo_mid_shard")
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(partial)
        raise
    os.close(fd)
    os.replace(partial, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))
    crash_point("nemo_after_rename")


def _open_source(src: str, dtype: str | None, storage: StorageOptions | None) -> Cache:
    if not is_remote(src) and nemo_format.is_nemo_cache(src):
        raise ConvertUsageError(f"{src} is already a NeMo-layout cache; to import it use --to dspark")
    storage = storage or StorageOptions()
    try:
        cache = open_cache(src, dtype=dtype, storage_options=storage.storage_options,
                           local_cache_dir=storage.local_cache_dir, cache_limit=storage.cache_limit)
        cache.cache.backing.fetch_file(TARGET_WEIGHTS)  # read locally below (a remote cache's copy)
    except CacheError as exc:
        raise ConvertError(str(exc)) from exc
    except ValueError as exc:  # a --dtype this cache cannot be read as
        raise ConvertUsageError(f"--dtype {dtype}: {exc}") from exc
    if cache.shape.fp8 and cache.out_code is None:
        cache.close()
        raise ConvertUsageError(f"--dtype {dtype}: NeMo's layout has no FP8; export as bf16 or fp32")
    return cache


def _reconcile(output: CacheOutput, manifest: dict, shards: list[list[int]],
               overwrite: bool) -> tuple[set[int], bool]:
    """Prepare DST: refuse another cache, clear leftovers; returns (shards to keep, already complete)."""
    dst = output.root
    check_destination_files(dst, overwrite)
    existing = _existing_manifest(output, manifest, overwrite)
    remove_partials(output)
    # beyond this cache's shards: NeMo's reader would refuse them
    for stale in nemo_format.shard_indices(dst):
        if stale >= len(shards):
            os.unlink(nemo_format.shard_path(dst, stale))
    kept = {k for k, rows in enumerate(shards) if os.path.exists(nemo_format.shard_path(dst, k))
            and _shard_is_complete(nemo_format.shard_path(dst, k), shard_specs(manifest, len(rows)))}
    return kept, existing is not None and existing.get("complete") is True and len(kept) == len(shards)


def convert_to_nemo(src: str, dst: str, *, shard_size: int | None = None, overwrite: bool = False,
                    progress: TextIO | None = sys.stderr, dtype: str | None = None,
                    storage: StorageOptions | None = None) -> ConvertResult:
    """Export the dspark cache ``src`` to a NeMo-format cache in ``dst`` (resumable; see the module doc).

    ``dtype`` (FP8 caches only): ``"bf16"`` (the default) or ``"fp32"``, what they are dequantised to.
    ``src`` may be an object-store URL, read through a node-local copy (``storage``)."""
    started = time.perf_counter()
    check_paths(src, dst)
    cache = _open_source(src, dtype, storage)
    source = cache.paths  # a remote cache's node-local copy
    weights = require_weights(source.target_weights, cache.manifest.target_vocab_size,
                              cache.manifest.hidden_size, cache.manifest.target_weights_xxh3)
    manifest = nemo_manifest(cache, shard_size or cache.manifest.shard_size)
    size, total = manifest["shard_size"], len(cache)
    # Positions in ascending sample id, whatever order the shards hold them in: NeMo's sample i.
    ids = cache.sample_ids
    order = sorted(range(total), key=ids.__getitem__)
    shards = [order[start : start + size] for start in range(0, total, size)]
    lock = lock_destination(dst)
    output = CacheOutput(dst)  # DST may hold our format (--overwrite)
    try:
        lock_cache(output, required=False)
        kept, finished = _reconcile(output, manifest, shards, overwrite)
        if not finished:
            nemo_format.write_manifest(dst, {**manifest, "complete": False})
        ensure_weights(source.target_weights, nemo_format.target_weights_path(dst), weights)
        out_bytes = [file_size(shard_specs(manifest, len(rows))) for rows in shards]
        progress_log = Progress(len(shards), sum(out_bytes), progress)
        progress_log.kept(len(kept), sum(out_bytes[k] for k in kept))
        for k in (k for k in range(len(shards)) if k not in kept):
            try:
                _write_shard(
                    cache,
                    shards[k],
                    nemo_format.shard_path(dst, k),
                    shard_specs(manifest, len(shards[k])),
                    cache.manifest.pad_token_id,
                )
            except CorruptShardError as exc:  # names the source shard and sample; published shards stay
                raise ConvertError(str(exc)) from exc
            progress_log.shard_done(k, len(shards[k]), out_bytes[k])
        if not finished:
            nemo_format.write_manifest(dst, {**manifest, "complete": True})
    finally:
        output.release()
        os.close(lock)
        cache.close()
    before = sum(s.tar_bytes for s in cache.shards) + file_bytes(
        [source.shard_index(s.shard_id) for s in cache.shards]
    )
    written = [nemo_format.shard_path(dst, k) for k in range(len(shards))]
    return ConvertResult("nemo", total, len(shards), len(kept), before, file_bytes(written),
                         time.perf_counter() - started, cache.manifest.pad_token_id,
                         allocated_after=sum(os.stat(p).st_blocks * 512 for p in written))
