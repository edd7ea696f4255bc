"""What rank 0 prints when a run ends, or what ``--dry-run`` prints instead of running."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dspark_cache.format.errors import CacheError, CorruptShardError
from dspark_cache.format.geometry import SampleShape
from dspark_cache.format.layers import build_target_layer_ids
from dspark_cache.format.schema import Manifest
from dspark_cache.storage.output import CacheOutput
from dspark_cache.storage.remote.url import is_remote

if TYPE_CHECKING:
    from dspark_cache.producer.pipeline.writer import PipelineStats
    from dspark_cache.producer.plan.batches import Plan


@dataclass
class RunResult:
    """What one rank's run did; the command line turns it into a summary and an exit code."""

    manifest: Manifest
    plan: Plan
    stats: PipelineStats | None
    seconds: float
    output: CacheOutput  # what was written to (the summary counts its shards)
    stopped: bool = False
    missing: list[int] = field(default_factory=list)  # shards owned by a rank that died


@dataclass(frozen=True)
class Published:
    """What the cache directory holds now, counted from its shard indexes."""

    shards: int
    samples: int
    tokens: int
    bytes: int


def published(output: CacheOutput) -> Published:
    """Count the published shards, samples, tokens and bytes from the indexes (a shard exists when its index does)."""
    shards = samples = tokens = size = 0
    for shard_id in sorted(output.scan()):
        try:
            index = output.shard_index(shard_id)
        except CorruptShardError:  # counted as not there; dspark-verify names it
            continue
        shards += 1
        samples += index.num_samples
        tokens += sum(entry.length for entry in index.samples)
        size += index.tar_bytes
    return Published(shards, samples, tokens, size)


def summary(result: RunResult) -> str:
    """Rank 0's last line: what the cache holds now (read from its output), what was planned, what it cost."""
    m, plan, output_dir = result.manifest, result.plan, result.output.shown
    try:
        done = published(result.output)
    # the run's own line must not fail on a damaged index: say so instead
    except (CacheError, OSError) as exc:
        return (f"cache {'complete' if m.complete else 'incomplete'}: planned {plan.num_samples} samples in "
                f"{len(plan.shards)} shards; the published shards could not be counted ({exc}); "
                f"run dspark-verify {output_dir}")
    skipped = f"{len(plan.skipped)} rows skipped"
    if m.complete:
        return (
            f"cache complete: {done.samples} samples ({skipped}), {done.tokens} tokens, {done.shards} shards, "
            f"{done.bytes / 1e6:.1f} MB ({done.bytes / max(done.tokens, 1):.0f} bytes/token), "
            f"{result.seconds:.1f} s"
        )
    return (
        f"cache incomplete: {done.shards} of {len(plan.shards)} shards, {done.samples} of {plan.num_samples} "
        f"samples, {done.tokens} of {plan.num_tokens} tokens, {done.bytes / 1e6:.1f} of "
        f"{plan.num_bytes / 1e6:.1f} MB published ({skipped}), {result.seconds:.1f} s"
    )


def bytes_per_token(shape: SampleShape) -> int:
    """Stored bytes of one token of a sample of ``shape`` (states, their scales, id and mask)."""
    return sum(spec.nbytes for spec in shape.specs(1))


def layers_cost(depths: list[int], num_layers: int, shape: SampleShape, tokens: int) -> str:
    """What ``--for-draft-layers`` costs: the union's bytes against one cache per drafter depth."""
    own = bytes_per_token(shape)
    alone = sum(
        bytes_per_token(dataclasses.replace(shape, layer_ids=tuple(build_target_layer_ids(num_layers, d))))
        for d in depths
    )
    return (
        f"--for-draft-layers {','.join(map(str, depths))}: layers {list(shape.layer_ids)} ({len(shape.layer_ids)} of "
        f"{num_layers}) serve all {len(depths)} drafter depths: {own} bytes/token, {own * tokens / 1e9:.3f} GB "
        f"for these {tokens} tokens; one cache per depth would store {alone} bytes/token ({alone / own:.2f}x)"
    )


def plan_report(plan: Plan, manifest: Manifest, output: CacheOutput, note: str | None = None) -> str:
    """What ``--dry-run`` prints: enough to size a job before renting devices (``note``: one more line)."""
    skipped = ", ".join(f"{n} {reason}" for reason, n in plan.skipped_counts().items()) or "none"
    batches = sum(len(s.batches) for s in plan.shards)
    output_dir = output.shown
    free = "object storage" if is_remote(output_dir) else f"{output.free_space() / 1e9:.1f} GB free"
    return "\n".join(
        [
            f"dry run: {plan.num_rows} rows -> {plan.num_samples} samples (skipped: {skipped})",
            f"  tokens: {plan.num_tokens} ({plan.num_loss_tokens} supervised), seq_length {manifest.seq_length}",
            f"  batches: {batches}, {plan.padded_tokens} tokens computed (padding {100 * plan.padding_waste:.1f}%)",
            f"  shards: {len(plan.shards)} of at most {manifest.shard_size} samples, {plan.num_bytes} bytes "
            f"({plan.num_bytes / 1e9:.3f} GB, {plan.num_bytes / max(1, plan.num_tokens):.0f} bytes/token"
            + (
                f"; uncompressed: --compression {manifest.compression} stores fewer"
                if manifest.compression != "none"
                else ""
            )
            + ")",
            f"  stored per token: layers {manifest.target_layer_ids} x {manifest.hidden_size} in {manifest.dtype}; "
            f"{output_dir}: {free}",
            *([f"  {note}"] if note else []),
        ]
    )
