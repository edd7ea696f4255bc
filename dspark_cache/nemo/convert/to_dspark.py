"""``--to dspark``: import a NeMo cache as a dspark cache, shard for shard, padding stripped.

NeMo sample ``i`` becomes our sample id ``i`` and NeMo shard ``k`` our shard ``k`` (same
samples, ascending id), written with the producer's shard writer, so checksums, atomic
publication and resume are the producer's. Two passes: the first reads only ids and masks to
find every row's real length (the manifest's planned totals and each shard's exact size need
them before anything is written); the second moves the real tokens' bytes, one row at a time.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import TextIO

import numpy as np
import torch

from dspark_cache import __version__
from dspark_cache.format.codec import DEFAULT_LEVEL
from dspark_cache.format.errors import CorruptShardError
from dspark_cache.format.geometry import SampleShape
from dspark_cache.format.manifest import ManifestDecodeError, adopt_cache_id, read_manifest
from dspark_cache.format.sample import HIDDEN, INPUT_IDS, LAST_HIDDEN, LOSS_MASK
from dspark_cache.format.schema import Manifest, SkippedRow, identity_diff
from dspark_cache.format.tar.writer import ShardWriter, predict_shard_bytes
from dspark_cache.format.validate import token_problem
from dspark_cache.nemo import nemo_format
from dspark_cache.nemo.convert.common import (
    ConvertError,
    ConvertResult,
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
from dspark_cache.nemo.convert.nemo_source import NemoSource, open_nemo_source
from dspark_cache.nemo.convert.padding import PadEvidence, PadRule, real_length, resolve_pad_rule
from dspark_cache.nemo.convert.stfile import SafetensorsFile
from dspark_cache.producer import byte_views, dtype_code
from dspark_cache.storage.backing import StorageOptions
from dspark_cache.storage.destination import open_output
from dspark_cache.storage.output import CacheOutput

ALL_PADDING = "no real token (all padding)"
_INT32_MAX = 2**31 - 1


@dataclass
class ImportPlan:
    """Per NeMo row: real length (0 = skipped) and supervised tokens; per shard: exact tar bytes."""

    lengths: np.ndarray
    loss_tokens: np.ndarray
    shard_bytes: list[int] = field(default_factory=list)
    ambiguous: int = 0
    skipped: list[SkippedRow] = field(default_factory=list)
    compressed: bool = False  # shard_bytes are then the uncompressed sizes: an upper estimate, not exact

    def kept_ids(self, rows: range) -> list[int]:
        return [sid for sid in rows if self.lengths[sid]]


def _check_row(
    path: str, row: int, sample: int, ids: torch.Tensor, mask: torch.Tensor, vocab_size: int
) -> None:
    """format's rule for what a sample may hold (training indexes the embedding with every id)."""
    problem = token_problem(ids.numpy(), mask.numpy(), min(vocab_size, _INT32_MAX + 1))
    if problem:
        raise ConvertError(
            f"{path} row {row} (sample {sample}): {problem}; the shard is damaged or belongs to "
            "another target: copy it again or re-run NeMo's precompute"
        )


def plan_import(source: NemoSource, rule: PadRule, shape: SampleShape) -> ImportPlan:
    """First pass: check every shard and row, and size every output shard exactly."""
    plan = ImportPlan(np.zeros(source.num_samples, np.int64), np.zeros(source.num_samples, np.int64),
                      compressed=shape.compressed)
    seq = source.seq_length
    evidence = PadEvidence()
    for shard in range(source.num_shards):
        kept_ids, kept_lengths = [], []
        with source.open_shard(shard) as handle:
            for row, sid in enumerate(source.rows(shard)):
                ids, mask = handle.read("input_ids", row, seq), handle.read("loss_mask", row, seq)
                _check_row(handle.path, row, sid, ids, mask, source.vocab_size)
                evidence.add(ids, mask)
                length, ambiguous = real_length(ids, mask, rule)
                plan.ambiguous += ambiguous
                if not length:
                    plan.skipped.append(SkippedRow(row=sid, reason=ALL_PADDING,
                                                   where=f"{os.path.basename(handle.path)} row {row}"))
                    continue
                plan.lengths[sid], plan.loss_tokens[sid] = length, int(mask[:length].sum())
                kept_ids.append(sid)
                kept_lengths.append(length)
        plan.shard_bytes.append(predict_shard_bytes(shape, kept_ids, kept_lengths))
    evidence.check(rule, source.root)
    return plan


def build_manifest(source: NemoSource, rule: PadRule, plan: ImportPlan, compression: str = "none",
                   compression_level: int = 0) -> Manifest:
    """NeMo's identity fields as recorded, plus ours (what NeMo never recorded stays empty)."""
    m = source.manifest
    kept = int(np.count_nonzero(plan.lengths))
    return Manifest(
        complete=False,
        target_model=m["target_model"],
        target_model_type=m["target_model_type"],
        target_vocab_size=m["target_vocab_size"],
        hidden_size=m["hidden_size"],
        num_hidden_layers=m["num_hidden_layers"],
        seq_length=m["seq_length"],
        dtype=m["dtype"],
        compression=compression,
        compression_level=compression_level,
        num_samples=kept,
        shard_size=m["shard_size"],
        target_hidden_dim=m["target_hidden_dim"],
        target_last_hidden_dim=m["target_last_hidden_dim"],
        target_layer_ids=list(m["target_layer_ids"]),
        train_data_path=m["train_data_path"],
        train_split=m.get("train_split"),
        shuffle_seed=m["shuffle_seed"],
        mask_reasoning_content=bool(m["mask_reasoning_content"]),
        mask_generation_prompt=bool(m["mask_generation_prompt"]),
        chat_template_sha256=m["chat_template_sha256"],
        compute_dtype="",  # NeMo does not record it (bf16 on CUDA, fp32 on CPU): unknown
        pad_token_id=rule.pad_id,
        num_rows=source.num_samples,
        planned_samples=kept,
        num_shards=source.num_shards,
        planned_tokens=int(plan.lengths.sum()),
        planned_loss_tokens=int(plan.loss_tokens.sum()),
        planned_bytes=sum(plan.shard_bytes),
        skipped_rows={ALL_PADDING: len(plan.skipped)} if plan.skipped else {},
        skipped=plan.skipped,
        versions=_versions(),
        created_at=time.time(),
    )


def _existing_manifest(output: CacheOutput, new: Manifest, overwrite: bool) -> Manifest | None:
    """The manifest of an earlier run into DST to resume, None for a fresh start; refuses another cache."""
    if overwrite:
        clear_destination(output)
        return None
    paths = output.paths
    if not os.path.exists(paths.manifest):
        if output.published() or nemo_format.shard_indices(paths.root):
            raise ConvertError(
                f"{output.shown} holds shards but no manifest.json, so they cannot be verified; "
                "pass --overwrite to replace them, or choose another DST"
            )
        return None
    if nemo_format.is_nemo_cache(paths.root):
        raise ConvertError(
            f"{output.shown} holds a NeMo-layout cache; pass --overwrite to replace it, or choose another DST"
        )
    try:  # unchecked: a manifest of ours that does not add up is another cache, named by the diff
        old = read_manifest(paths.root, allow_incomplete=True, checked=False)
    except ManifestDecodeError as exc:
        raise ConvertError(f"{exc}; pass --overwrite to replace it, or choose another DST") from exc
    diff = identity_diff(old, new)
    if diff:
        lines = "\n".join(f"  {name}: DST has {a!r}, this conversion gives {b!r}" for name, a, b in diff)
        raise ConvertError(
            f"{output.shown} holds a different cache:\n{lines}\nPass --overwrite to replace it, "
            "or choose another DST"
        )
    return old


def _kept_shards(output: CacheOutput, source: NemoSource, plan: ImportPlan, cache_id: str) -> set[int]:
    """Shards an earlier run of this cache published that hold exactly the planned samples; others are removed."""
    kept = set()
    for shard in sorted(output.published()):
        ok = False
        if shard < source.num_shards:
            try:
                index = output.shard_index(shard)
                ok = (index.cache_id == cache_id
                      and [e.sample_id for e in index.samples] == plan.kept_ids(source.rows(shard))
                      and (plan.compressed or index.tar_bytes == plan.shard_bytes[shard])
                      and not index.nonfinite)
            except CorruptShardError:
                ok = False
        if ok:
            kept.add(shard)
        else:
            output.unpublish(shard)
    return kept


_SAME_SIZE_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN equals itself, -0 differs from 0): the copy must be exact. Same-width
    integer views need no copy; numpy compares the strided column slice ~100x faster than torch."""
    kind = _SAME_SIZE_INT[a.dtype.itemsize]
    return bool(np.array_equal(a.view(kind).numpy(), b.view(kind).numpy()))


def _versions() -> dict[str, str]:
    """Library versions for the manifest, read from package metadata (importing transformers only
    to ask its version would cost a second when the pad id is given)."""
    from importlib.metadata import version

    return {
        "dspark_cache": __version__,
        "torch": str(torch.__version__),
        "transformers": version("transformers"),
        "tokenizers": version("tokenizers"),
    }


def _row_tensors(handle: SafetensorsFile, row: int, sid: int, length: int,
                 shape: SampleShape) -> dict[str, torch.Tensor]:
    hidden = handle.read("target_hidden_states", row, length)
    last = handle.read("target_last_hidden_states", row, length)
    tensors = {HIDDEN: hidden, INPUT_IDS: handle.read("input_ids", row, length).to(torch.int32),
               LOSS_MASK: handle.read("loss_mask", row, length).to(torch.uint8)}
    if shape.stores_last:
        tensors[LAST_HIDDEN] = last
    elif not _same_bits(hidden[:, -shape.hidden_size:], last):
        # We store the final state once, as those columns: if they differ, one of them would be lost.
        raise ConvertError(
            f"{handle.path} row {row} (sample {sid}): target_last_hidden_states differs from the last "
            f"{shape.hidden_size} columns of target_hidden_states, although target_layer_ids ends at "
            f"num_hidden_layers - 1 = {shape.num_layers - 1}, where NeMo's precompute writes the same tensor "
            "twice. The shard is damaged or was not written by NeMo's precompute; nothing of it was published"
        )
    return tensors


def _write_shard(output: CacheOutput, source: NemoSource, plan: ImportPlan, shape: SampleShape, shard: int,
                 cache_id: str, compression_level: int = DEFAULT_LEVEL) -> None:
    writer = ShardWriter(output.paths, shard, cache_id=cache_id, compression_level=compression_level)
    try:
        with source.open_shard(shard) as handle:
            for row, sid in enumerate(source.rows(shard)):
                length = int(plan.lengths[sid])
                if length:
                    writer.append(sid, int(plan.loss_tokens[sid]), shape.specs(length), shape.metadata(sid),
                                  byte_views(_row_tensors(handle, row, sid, length, shape)))
        output.publish(writer)
    except BaseException:
        writer.abort()  # nothing half-written is ever visible; published shards stay
        raise


def _reconcile(output: CacheOutput, source: NemoSource, plan: ImportPlan, manifest: Manifest,
               overwrite: bool) -> tuple[set[int], bool]:
    """Prepare DST: refuse another cache, clear leftovers; returns (shards to keep, already complete)."""
    existing = _existing_manifest(output, manifest, overwrite)
    adopt_cache_id(manifest, existing)
    output.create()
    remove_partials(output)
    if existing is None:
        return set(), False
    manifest.created_at = existing.created_at
    kept = _kept_shards(output, source, plan, manifest.cache_id)
    return kept, existing.complete and len(kept) == source.num_shards


def convert_to_dspark(src: str, dst: str, *, pad_token_id: int | None = None, eos_token_id: int | None = None,
                      overwrite: bool = False, progress: TextIO | None = sys.stderr,
                      storage: StorageOptions | None = None, staging_dir: str | None = None,
                      staging_limit: int | None = None, compression: str = "none",
                      compression_level: int | None = None) -> ConvertResult:
    """Import the NeMo cache ``src`` into the dspark cache ``dst`` (resumable; see the module doc): a
    directory, or an object-store URL written through the staging directory ``staging_dir``;
    ``compression`` ``"zstd"`` stores it compressed at ``compression_level`` (``format.codec``)."""
    started = time.perf_counter()
    check_paths(src, dst)
    source = open_nemo_source(src)
    weights = require_weights(nemo_format.target_weights_path(src), source.vocab_size, source.hidden_size)
    rule = resolve_pad_rule(source.manifest["target_model"], source.manifest_path, pad_token_id, eos_token_id,
                            source.vocab_size)
    shape = SampleShape(source.layer_ids, source.num_layers, source.hidden_size, dtype_code(source.dtype),
                        compression)
    level = 0 if compression == "none" else DEFAULT_LEVEL if compression_level is None else compression_level
    plan = plan_import(source, rule, shape)  # everything is checked before DST is touched
    manifest = build_manifest(source, rule, plan, compression, level)
    manifest.target_weights_xxh3 = weights.xxh3  # the file copied below is this one, byte for byte
    output = open_output(dst, storage=storage, staging_dir=staging_dir, staging_limit=staging_limit)
    paths = output.paths
    lock = lock_destination(output.root)
    try:
        lock_cache(output, required=True)
        check_destination_files(output.root, overwrite)
        kept, finished = _reconcile(output, source, plan, manifest, overwrite)
        if not finished:
            output.write_manifest(manifest)  # complete: false, before the first shard
        ensure_weights(nemo_format.target_weights_path(src), paths.target_weights, weights)
        progress_log = Progress(source.num_shards, source.shard_bytes(), progress)
        progress_log.kept(len(kept), sum(os.path.getsize(source.shard_file(k)) for k in kept))
        for shard in (k for k in range(source.num_shards) if k not in kept):
            _write_shard(output, source, plan, shape, shard, manifest.cache_id, level)
            progress_log.shard_done(shard, len(plan.kept_ids(source.rows(shard))),
                                    os.path.getsize(source.shard_file(shard)))
        if not finished:
            output.complete(manifest)
    finally:
        output.release()
        os.close(lock)
    after = sum(output.shard_index(k).tar_bytes for k in output.scan()) + file_bytes(
        [paths.shard_index(k) for k in range(source.num_shards)])  # the tars of a remote cache are not here
    return ConvertResult(
        "dspark",
        manifest.num_samples,
        source.num_shards,
        len(kept),
        source.shard_bytes(),
        after,
        time.perf_counter() - started,
        rule.pad_id,
        plan.ambiguous,
        len(plan.skipped),
        rule.source,
    )
