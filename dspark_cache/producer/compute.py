"""Computing: load the target on this rank's device and run the pipeline over the shards it owns."""

from __future__ import annotations

import errno
import os
import shutil

import torch

from dspark_cache.format.atomic import atomic_write_bytes
from dspark_cache.format.errors import CacheError
from dspark_cache.format.sample import CACHE_DTYPES
from dspark_cache.format.schema import EventKind, RankState
from dspark_cache.producer.pipeline import PipelineStats, run_pipeline
from dspark_cache.producer.plan import ShardPlan
from dspark_cache.producer.prepare import Prepared
from dspark_cache.producer.progress import ProgressLog
from dspark_cache.producer.reconcile import bytes_missing
from dspark_cache.producer.signals import StopFlag
from dspark_cache.producer.status import StatusReporter
from dspark_cache.producer.target import TargetRunner


class DiskFullError(CacheError):
    """A write hit ENOSPC; published shards are intact and the run is resumable."""


def load_runner(p: Prepared) -> TargetRunner:
    """The target on this rank's device, in the compute dtype, capturing the planned layers."""
    cfg = p.cfg
    return TargetRunner(cfg.target_model, p.layer_ids, p.info.num_layers, p.device, CACHE_DTYPES[p.compute_dtype],
                        CACHE_DTYPES[cfg.dtype], cfg.target_attn_implementation, cfg.trust_remote_code)


def ensure_target_weights(p: Prepared, runner: TargetRunner | None) -> None:
    """Write ``embed_tokens`` and ``lm_head`` once (training needs them); loads the target when not given."""
    if os.path.exists(p.paths.target_weights):
        return
    from safetensors.torch import save

    runner = runner or load_runner(p)
    atomic_write_bytes(p.paths.target_weights, save(runner.target_weights()))


def compute_shards(p: Prepared, owned: list[ShardPlan], status: StatusReporter, stop: StopFlag,
                   leader: bool = True) -> PipelineStats:
    """Load the target and run the pipeline over this rank's shards, reporting as each batch and shard lands.

    Only the ``leader`` (rank 0) writes the target weights: one extraction and one file per job.
    """
    status.update(force=True, state=RankState.LOADING)
    runner = load_runner(p)
    if leader:
        ensure_target_weights(p, runner)
    status.event(EventKind.STARTED, f"computing {len(owned)} shards on {p.device}",
                 shards=[s.shard_id for s in owned], device=str(p.device))
    done_before = set(p.paths.indexed_shard_ids())
    published: set[int] = set()
    progress = ProgressLog(sum(s.num_tokens for s in owned), sum(s.num_samples for s in owned))
    base = {"samples": 0, "tokens": 0}  # what earlier runs published counts as done
    for s in p.plan.shards:
        if s.shard_id in done_before:
            base["samples"] += s.num_samples
            base["tokens"] += s.num_tokens

    def on_published(shard: ShardPlan, index) -> None:
        published.add(shard.shard_id)
        status.event(EventKind.SHARD_PUBLISHED, f"shard {shard.shard_id} published", shard=shard.shard_id,
                     samples=index.num_samples, bytes=index.tar_bytes)
        for sid in index.nonfinite:
            status.event(EventKind.WARNING, f"sample {sid} dropped: non-finite hidden states", sample=sid)
        status.update(force=True, shards_done=len(published), shard=None)
        progress.shards_published(len(published), len(owned))

    def on_batch(stats: PipelineStats, budget) -> None:
        status.update(state=RankState.RUNNING, shard=stats.current_shard,
                      samples_done=base["samples"] + stats.samples, tokens_done=base["tokens"] + stats.tokens,
                      bytes_written=stats.bytes, inflight_bytes=budget.inflight, stage_seconds=stats.times.as_dict(),
                      device_memory_bytes=torch.cuda.memory_allocated(p.device) if p.device.type == "cuda" else None)
        progress.update(stats.tokens, stats.samples, len(published), len(owned))

    # Resumed work counts as done from the first heartbeat of the run, so the rate anchor taken
    # here does not see the jump to it (a resume read as 50x the real tokens/s).
    status.update(force=True, state=RankState.RUNNING, shards_owned=len(owned), samples_done=base["samples"],
                  tokens_done=base["tokens"])
    try:
        stats = run_pipeline(owned, runner.forward, paths=p.paths, shape=p.shape, device=p.device,
                             pad_id=p.manifest.pad_token_id, max_inflight_bytes=p.cfg.max_inflight_bytes,
                             on_published=on_published, should_stop=stop, on_batch=on_batch,
                             on_nonfinite=p.cfg.on_nonfinite)
        progress.update(stats.tokens, stats.samples, len(published), len(owned))  # the last batch's counts too
        return stats
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise _disk_full(p, exc) from exc
        raise
    finally:
        progress.close()  # the bar ends (and logging is given back) before any summary or error prints


def _disk_full(p: Prepared, exc: OSError) -> DiskFullError:
    done = set(p.paths.indexed_shard_ids())
    needed = bytes_missing(p.paths, p.plan)
    free = shutil.disk_usage(p.paths.root).free
    return DiskFullError(
        f"disk full while writing {p.paths.shards_dir} ({exc.strerror}): {len(done)} of {len(p.plan.shards)} shards "
        f"are published and intact; the rest needs {needed / 1e9:.3f} GB and {free / 1e9:.3f} GB is free. "
        "Free space, then rerun the same command to resume"
    )
