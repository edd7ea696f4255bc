"""One producer run (one rank of it): validate, plan, reconcile the cache on disk, compute, publish."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from dspark_cache.format.atomic import atomic_write_bytes
from dspark_cache.format.errors import CacheError
from dspark_cache.format.faults import crash_point
from dspark_cache.format.layers import build_target_layer_ids, validate_target_layer_ids
from dspark_cache.format.paths import CachePaths
from dspark_cache.format.sample import CACHE_DTYPES
from dspark_cache.format.schema import Manifest
from dspark_cache.producer.chat import ChatEncoder
from dspark_cache.producer.template import resolve_chat_template, sha256_text, tokenizer_sha256
from dspark_cache.producer.config import ProduceConfig, validate_config
from dspark_cache.producer.distributed import (
    RankInfo, assign_shards, await_other_ranks, barrier_before_setup, new_run_id, rank_info, share_setup,
)
from dspark_cache.producer.inputs import InputError, InputSource, RawRow
from dspark_cache.producer.layout import check_layout, heartbeat_files, remove_files
from dspark_cache.producer.lock import DirectoryLock, lock_exclusive, lock_shared
from dspark_cache.producer.manifest import (
    check_existing, claim_completion, library_versions, mark_complete, reconcile_shards, read_manifest_file,
    write_manifest,
)
from dspark_cache.producer.messages import normalise_row
from dspark_cache.producer.pipeline import PipelineStats, run_pipeline
from dspark_cache.producer.plan import Plan, SampleShape, ShardPlan, build_plan, collect_samples
from dspark_cache.producer.progress import ProgressLog
from dspark_cache.producer.signals import StopFlag
from dspark_cache.producer.status import StatusReporter
from dspark_cache.producer.target import TargetInfo, TargetRunner, read_target_info, resolve_device
from dspark_cache.producer.tokenize import encode_rows

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    manifest: Manifest
    plan: Plan
    stats: PipelineStats | None
    seconds: float
    stopped: bool = False
    missing: list[int] = field(default_factory=list)  # shards owned by a rank that died


class DiskFullError(CacheError):
    """A write hit ENOSPC; published shards are intact and the run is resumable."""


def _load_tokenizer(cfg: ProduceConfig, template: str | None):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.target_model, trust_remote_code=cfg.trust_remote_code)
    if template is not None:
        tokenizer.chat_template = template
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def make_plan(cfg: ProduceConfig, encoder: ChatEncoder, source: InputSource, shape: SampleShape) -> Plan:
    def encode(row: RawRow):
        messages, tools = normalise_row(row.value)
        return encoder.encode(messages, tools)

    num_rows, samples, skipped = collect_samples(encode_rows(source.rows(), encode, cfg.tokenize_workers), cfg.on_invalid)
    if num_rows == 0:
        raise InputError(f"{cfg.input_data} holds no rows; check --input-data (and --split)")
    if not samples:
        reasons = ", ".join(f"{n} {r}" for r, n in Plan(num_rows, [], skipped).skipped_counts().items())
        raise InputError(f"none of the {num_rows} rows of {cfg.input_data} gives a supervised sample ({reasons})")
    return build_plan(num_rows, samples, skipped, shape, shard_size=cfg.shard_size,
                      batch_size=cfg.batch_size, max_batch_tokens=cfg.batch_token_budget)


def build_manifest(cfg: ProduceConfig, info: TargetInfo, layer_ids: list[int], plan: Plan, tokenizer,
                   source: InputSource, compute_dtype: str) -> Manifest:
    return Manifest(
        target_model=cfg.target_model, target_model_type=info.model_type, target_vocab_size=info.vocab_size,
        hidden_size=info.hidden_size, num_hidden_layers=info.num_layers, seq_length=cfg.seq_length,
        dtype=cfg.dtype, num_samples=plan.num_samples, shard_size=cfg.shard_size,
        target_hidden_dim=info.hidden_size * len(layer_ids), target_last_hidden_dim=info.hidden_size,
        target_layer_ids=layer_ids, train_data_path=str(cfg.input_data), train_split=cfg.split,
        shuffle_seed=cfg.shuffle_seed, mask_reasoning_content=cfg.mask_reasoning_content,
        mask_generation_prompt=cfg.mask_generation_prompt,
        chat_template_sha256=sha256_text(tokenizer.chat_template), input_sha256=source.content_sha256(),
        tokenizer_sha256=tokenizer_sha256(tokenizer), compute_dtype=compute_dtype,
        attn_implementation=cfg.target_attn_implementation, pad_token_id=int(tokenizer.pad_token_id),
        num_rows=plan.num_rows, planned_samples=plan.num_samples, num_shards=len(plan.shards),
        planned_tokens=plan.num_tokens, planned_loss_tokens=plan.num_loss_tokens, planned_bytes=plan.num_bytes,
        skipped_rows=plan.skipped_counts(), skipped=plan.skipped, versions=library_versions(),
        created_at=time.time(),
    )


def preflight_disk(paths: CachePaths, needed: int, force: bool) -> None:
    free = shutil.disk_usage(paths.root).free
    if needed > free and not force:
        raise CacheError(
            f"the cache needs {needed / 1e9:.2f} GB more but {paths.root} has {free / 1e9:.2f} GB free; "
            "free space or choose another --output-dir (or pass --force to start anyway)"
        )


@dataclass
class Prepared:
    """Everything a rank knows before it loads the model."""

    cfg: ProduceConfig
    info: TargetInfo
    layer_ids: list[int]
    shape: SampleShape
    plan: Plan
    manifest: Manifest
    paths: CachePaths
    device: torch.device
    compute_dtype: str


def prepare(cfg: ProduceConfig, before_planning: Callable[[CachePaths], None] | None = None) -> Prepared:
    """Validate and plan (identical on every rank); nothing is written yet.

    ``before_planning`` runs once the cheap checks have passed and before the input is read
    (rank 0 takes the directory's lock there, so that a second producer is refused at once).
    """
    validate_config(cfg)
    template = resolve_chat_template(cfg.chat_template) if cfg.chat_template else None
    info = read_target_info(cfg.target_model, cfg.trust_remote_code)
    layer_ids = list(cfg.target_layer_ids) if cfg.target_layer_ids else \
        build_target_layer_ids(info.num_layers, cfg.draft_num_hidden_layers)
    validate_target_layer_ids(layer_ids, info.num_layers)
    source = InputSource(cfg.input_data, cfg.split, cfg.shuffle_seed, cfg.max_row_bytes)
    device = resolve_device(cfg.device)
    compute_dtype = cfg.compute_dtype if cfg.compute_dtype != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    paths = CachePaths(cfg.output_dir)
    if before_planning is not None:
        before_planning(paths)
    tokenizer = _load_tokenizer(cfg, template)
    encoder = ChatEncoder(tokenizer, cfg.seq_length, cfg.mask_reasoning_content, cfg.mask_generation_prompt)
    shape = SampleShape(layer_ids, info.num_layers, info.hidden_size, CACHE_DTYPES[cfg.dtype])
    plan = make_plan(cfg, encoder, source, shape)
    log.info("plan: %d rows -> %d samples (%d skipped), %d tokens (%d supervised), %d shards, %.1f MB on disk",
             plan.num_rows, plan.num_samples, len(plan.skipped), plan.num_tokens, plan.num_loss_tokens,
             len(plan.shards), plan.num_bytes / 1e6)
    manifest = build_manifest(cfg, info, layer_ids, plan, tokenizer, source, compute_dtype)
    crash_point("planned")
    return Prepared(cfg, info, layer_ids, shape, plan, manifest, paths, device, compute_dtype)


def setup_directory(p: Prepared) -> Manifest | None:
    """Rank 0 only, holding the lock: refuse a mismatch, clean leftovers, check space; returns the existing manifest."""
    check_layout(p.paths)  # again: planning may have taken hours
    os.makedirs(p.paths.root, exist_ok=True)
    existing = check_existing(p.paths, p.manifest, p.cfg.overwrite)
    p.paths.ensure_dirs()
    _forget_other_runs(p.paths)
    if existing is not None:
        p.manifest.created_at = existing.created_at
        reconcile_shards(p.paths, p.plan, p.shape)  # removes partials and damaged shards
    done = set(p.paths.indexed_shard_ids())
    preflight_disk(p.paths, sum(s.num_bytes for s in p.plan.shards if s.shard_id not in done), p.cfg.force)
    if existing is None or not existing.complete or done != {s.shard_id for s in p.plan.shards}:
        p.manifest.complete = False
        write_manifest(p.paths, p.manifest)
    return existing


def _forget_other_runs(paths: CachePaths) -> None:
    """Earlier runs' heartbeats, stop requests and completion claims describe no live process (we hold the lock)."""
    remove_files(heartbeat_files(paths))


def take_directory(paths: CachePaths, run_id: str, me: RankInfo, overwrite: bool) -> DirectoryLock | None:
    """Rank 0, before reading the input: refuse a linked-out layout, then lock the directory."""
    check_layout(paths)
    os.makedirs(paths.control_dir, exist_ok=True)
    return lock_exclusive(paths, run_id, me.world_size, overwrite)


def ensure_target_weights(p: Prepared, runner: TargetRunner | None) -> None:
    if os.path.exists(p.paths.target_weights):
        return
    from safetensors.torch import save

    runner = runner or load_runner(p)
    atomic_write_bytes(p.paths.target_weights, save(runner.target_weights()))


def load_runner(p: Prepared) -> TargetRunner:
    cfg = p.cfg
    return TargetRunner(cfg.target_model, p.layer_ids, p.info.num_layers, p.device, CACHE_DTYPES[p.compute_dtype],
                        CACHE_DTYPES[cfg.dtype], cfg.target_attn_implementation, cfg.trust_remote_code)


def _disk_full(p: Prepared, exc: OSError) -> DiskFullError:
    done = set(p.paths.indexed_shard_ids())
    needed = sum(s.num_bytes for s in p.plan.shards if s.shard_id not in done)
    free = shutil.disk_usage(p.paths.root).free
    return DiskFullError(
        f"disk full while writing {p.paths.shards_dir} ({exc.strerror}): {len(done)} of {len(p.plan.shards)} shards "
        f"are published and intact; the rest needs {needed / 1e9:.3f} GB and {free / 1e9:.3f} GB is free. "
        "Free space, then rerun the same command to resume"
    )


def compute_shards(p: Prepared, owned: list[ShardPlan], status: StatusReporter, stop: StopFlag) -> PipelineStats:
    """Load the target and run the pipeline over this rank's shards."""
    status.update(force=True, state="loading")
    runner = load_runner(p)
    ensure_target_weights(p, runner)
    status.event("started", f"computing {len(owned)} shards on {p.device}", shards=[s.shard_id for s in owned],
                 device=str(p.device))
    done_before = set(p.paths.indexed_shard_ids())
    published: set[int] = set()
    progress = ProgressLog(sum(s.num_tokens for s in owned), sum(len(s.samples) for s in owned))
    base = {"samples": 0, "tokens": 0}
    for s in p.plan.shards:
        if s.shard_id in done_before:
            base["samples"] += len(s.samples)
            base["tokens"] += s.num_tokens

    def on_published(shard: ShardPlan, index) -> None:
        published.add(shard.shard_id)
        status.event("shard_published", f"shard {shard.shard_id} published", shard=shard.shard_id,
                     samples=index.num_samples, bytes=index.tar_bytes)
        for sid in index.nonfinite:
            status.event("warning", f"sample {sid} dropped: non-finite hidden states", sample=sid)
        status.update(force=True, shards_done=len(published), shard=None)

    def on_batch(stats: PipelineStats, budget) -> None:
        status.update(state="running", shard=stats.current_shard, samples_done=base["samples"] + stats.samples,
                      tokens_done=base["tokens"] + stats.tokens, bytes_written=stats.bytes,
                      inflight_bytes=budget.inflight, stage_seconds=stats.times.as_dict(),
                      device_memory_bytes=torch.cuda.memory_allocated(p.device) if p.device.type == "cuda" else None)
        progress.update(stats.tokens, stats.samples, len(published), len(owned))

    status.update(force=True, state="running", shards_owned=len(owned))
    try:
        return run_pipeline(owned, runner.forward, paths=p.paths, shape=p.shape, device=p.device,
                            pad_id=p.manifest.pad_token_id, max_inflight_bytes=p.cfg.max_inflight_bytes,
                            on_published=on_published, should_stop=stop, on_batch=on_batch,
                            on_nonfinite=p.cfg.on_nonfinite)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise _disk_full(p, exc) from exc
        raise


def finish(p: Prepared, status: StatusReporter, run_id: str, me: RankInfo) -> tuple[Manifest, list[int]]:
    """Wait for the other ranks' shards; the rank that sees them all marks the cache complete."""
    planned = {s.shard_id for s in p.plan.shards}
    status.update(force=True, state="waiting")
    missing = await_other_ranks(p.paths, planned, me, run_id, p.cfg.rank_timeout)
    if missing:
        return p.manifest, sorted(missing)
    if claim_completion(p.paths, run_id):
        mark_complete(p.paths, p.manifest)
        status.event("finished", "cache complete", samples=p.manifest.num_samples, bytes=p.plan.num_bytes)
        return p.manifest, []
    deadline = time.time() + p.cfg.rank_timeout  # another rank claimed it: let it finish writing
    while time.time() < deadline:
        manifest = read_manifest_file(p.paths)
        if manifest is not None and manifest.complete:
            return manifest, []
        time.sleep(0.1)
    return p.manifest, []


def produce(cfg: ProduceConfig) -> RunResult:
    """Run this rank of the producer; bad input or configuration raises before device work."""
    started = time.time()
    me = rank_info()
    run_id = new_run_id()  # rank 0's is the job's: share_setup hands it to every rank
    lock: DirectoryLock | None = None

    def take(paths: CachePaths) -> None:
        nonlocal lock
        if me.is_leader:
            lock = take_directory(paths, run_id, me, cfg.overwrite)

    try:
        p = prepare(cfg, take)
        barrier_before_setup(me)
        error, existing = None, None
        if me.is_leader:
            try:
                existing = setup_directory(p)
                if lock is not None and me.world_size > 1:
                    lock.share()  # the job's other ranks join it from here on
            except Exception as exc:
                error = str(exc)
                if me.world_size == 1:
                    raise
        error, run_id = share_setup(me, error, run_id)
        if error:
            raise CacheError(error if me.is_leader else f"rank 0 could not prepare {p.paths.root}: {error}")
        if not me.is_leader:
            lock = lock_shared(p.paths)
            existing = read_manifest_file(p.paths)
        return _run_locked(p, me, run_id, existing, started)
    finally:
        if lock is not None:
            lock.release()


def _run_locked(p: Prepared, me: RankInfo, run_id: str, existing: Manifest | None, started: float) -> RunResult:
    status = StatusReporter(p.paths, me.rank, me.world_size, run_id)
    status.start_heartbeat()
    stop = StopFlag(p.paths)
    stop.install()
    try:
        return _run_rank(p, me, run_id, existing, status, stop, started)
    except BaseException as exc:
        status.update(force=True, state="failed", last_error=str(exc) or type(exc).__name__)
        shard = status.status.shard  # the shard in flight failed; the monitor marks it
        status.event("error", f"producer failed: {exc}", **({"shard": shard} if shard is not None else {}))
        raise
    finally:
        stop.uninstall()
        status.stop_heartbeat()


def _run_rank(p: Prepared, me: RankInfo, run_id: str, existing: Manifest | None, status: StatusReporter,
              stop: StopFlag, started: float) -> RunResult:
    done = set(p.paths.indexed_shard_ids())
    todo = [s for s in p.plan.shards if s.shard_id not in done]
    owned = assign_shards(todo, me.world_size)[me.rank]
    status.update(force=True, shards_owned=len(owned), samples_total=p.plan.num_samples,
                  tokens_total=p.plan.num_tokens, shards_done=0)
    if me.is_leader:
        _announce(p, existing, done, status)
    if existing is not None and existing.complete and not todo:
        log.info("%s is already complete: nothing to do", p.paths.root)
        status.update(force=True, state="finished")
        return RunResult(existing, p.plan, None, time.time() - started)
    stats = compute_shards(p, owned, status, stop) if owned else None
    if me.is_leader:
        ensure_target_weights(p, None)
    if stop():
        status.update(force=True, state="stopped")
        status.event("stopped", f"stopped ({stop.reason}); rerun the same command to resume")
        return RunResult(p.manifest, p.plan, stats, time.time() - started, stopped=True)
    manifest, missing = finish(p, status, run_id, me)
    if missing:
        status.update(force=True, state="incomplete")
        status.event("error", f"shards {missing} were not published (their rank stopped); rerun to complete them",
                     missing=missing)
    else:
        status.update(force=True, state="finished", samples_done=p.plan.num_samples, tokens_done=p.plan.num_tokens)
    return RunResult(manifest, p.plan, stats, time.time() - started, missing=missing)


def _announce(p: Prepared, existing: Manifest | None, done: set[int], status: StatusReporter) -> None:
    plan = p.plan
    if existing is not None:
        status.event("resumed", f"resuming: {len(done)} of {len(plan.shards)} shards already published",
                     published=len(done), total=len(plan.shards))
    status.event("plan", "planned", rows=plan.num_rows, samples=plan.num_samples, shards=len(plan.shards),
                 tokens=plan.num_tokens, bytes=plan.num_bytes, skipped=plan.skipped_counts())
    for row in plan.skipped:
        status.event("skipped_row", f"{row.where}: skipped ({row.reason})", row=row.row, reason=row.reason)
