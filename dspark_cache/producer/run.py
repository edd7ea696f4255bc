"""One producer run: validate, plan, reconcile with the cache on disk, compute, publish."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass

import torch

from dspark_cache.format.atomic import atomic_write_bytes
from dspark_cache.format.errors import CacheError
from dspark_cache.format.layers import build_target_layer_ids, validate_target_layer_ids
from dspark_cache.format.paths import CachePaths
from dspark_cache.format.sample import CACHE_DTYPES
from dspark_cache.format.schema import Manifest
from dspark_cache.producer.chat import ChatEncoder, resolve_chat_template, sha256_text, tokenizer_sha256
from dspark_cache.producer.config import ProduceConfig, validate_config
from dspark_cache.producer.inputs import InputSource, RawRow
from dspark_cache.producer.manifest import (
    check_existing, library_versions, mark_complete, published_shards, write_manifest,
)
from dspark_cache.producer.messages import normalise_row
from dspark_cache.producer.pipeline import PipelineStats, run_pipeline
from dspark_cache.producer.progress import ProgressLog
from dspark_cache.producer.tokenize import encode_rows
from dspark_cache.producer.plan import Plan, SampleShape, build_plan, collect_samples
from dspark_cache.producer.status import StatusReporter
from dspark_cache.producer.target import TargetInfo, TargetRunner, read_target_info, resolve_device

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    manifest: Manifest
    plan: Plan
    stats: PipelineStats | None
    seconds: float
    stopped: bool = False


class StopFlag:
    """Set by SIGINT/SIGTERM or by the monitor's stop file; checked between shards."""

    def __init__(self, paths: CachePaths) -> None:
        self.paths = paths
        self.event = threading.Event()
        self.reason = ""

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self.event.is_set():  # a second signal: stop now, the shard in flight is abandoned
            raise KeyboardInterrupt
        self.reason = signal.Signals(signum).name
        log.warning("%s received: finishing the shard in flight, then stopping (again to abort)", self.reason)
        self.event.set()

    def __call__(self) -> bool:
        if not self.event.is_set() and os.path.exists(self.paths.stop_request):
            self.reason = "stop requested by the monitor"
            self.event.set()
        return self.event.is_set()


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
        from dspark_cache.producer.inputs import InputError

        raise InputError(f"{cfg.input_data} holds no rows; check --input-data (and --split)")
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
        chat_template_sha256=sha256_text(tokenizer.chat_template), input_sha256=source.content_sha256(),
        tokenizer_sha256=tokenizer_sha256(tokenizer), compute_dtype=compute_dtype,
        attn_implementation=cfg.target_attn_implementation, pad_token_id=int(tokenizer.pad_token_id),
        num_rows=plan.num_rows, num_shards=len(plan.shards), planned_tokens=plan.num_tokens,
        planned_loss_tokens=plan.num_loss_tokens, planned_bytes=plan.num_bytes,
        skipped_rows=plan.skipped_counts(), skipped=plan.skipped, versions=library_versions(),
        created_at=time.time(),
    )


def write_target_weights(paths: CachePaths, runner: TargetRunner) -> None:
    from safetensors.torch import save

    atomic_write_bytes(paths.target_weights, save(runner.target_weights()))


def preflight_disk(paths: CachePaths, needed: int, force: bool) -> None:
    free = shutil.disk_usage(paths.root).free
    if needed > free and not force:
        raise CacheError(
            f"the cache needs {needed / 1e9:.2f} GB more but {paths.root} has {free / 1e9:.2f} GB free; "
            "free space or choose another --output-dir (or pass --force to start anyway)"
        )


def produce(cfg: ProduceConfig) -> RunResult:
    """Run the producer; raises on bad input or configuration before any device work."""
    started = time.time()
    validate_config(cfg)
    template = resolve_chat_template(cfg.chat_template) if cfg.chat_template else None
    info = read_target_info(cfg.target_model, cfg.trust_remote_code)
    layer_ids = list(cfg.target_layer_ids) if cfg.target_layer_ids else \
        build_target_layer_ids(info.num_layers, cfg.draft_num_hidden_layers)
    validate_target_layer_ids(layer_ids, info.num_layers)
    source = InputSource(cfg.input_data, cfg.split, cfg.shuffle_seed)
    device = resolve_device(cfg.device)
    compute_dtype = cfg.compute_dtype if cfg.compute_dtype != "auto" else ("bf16" if device.type == "cuda" else "fp32")

    tokenizer = _load_tokenizer(cfg, template)
    encoder = ChatEncoder(tokenizer, cfg.seq_length, cfg.mask_reasoning_content)
    shape = SampleShape(layer_ids, info.num_layers, info.hidden_size, CACHE_DTYPES[cfg.dtype])
    plan = make_plan(cfg, encoder, source, shape)
    log.info("plan: %d rows -> %d samples (%d skipped), %d tokens (%d supervised), %d shards, %.1f MB on disk",
             plan.num_rows, plan.num_samples, len(plan.skipped), plan.num_tokens, plan.num_loss_tokens,
             len(plan.shards), plan.num_bytes / 1e6)
    manifest = build_manifest(cfg, info, layer_ids, plan, tokenizer, source, compute_dtype)

    paths = CachePaths(cfg.output_dir)
    os.makedirs(paths.root, exist_ok=True)
    existing = check_existing(paths, manifest, cfg.overwrite)
    paths.ensure_dirs()
    status = StatusReporter(paths, rank=0, world_size=1)
    done = published_shards(paths, plan) if existing else set()
    todo = [s for s in plan.shards if s.shard_id not in done]
    if existing is not None:
        manifest.created_at = existing.created_at
        if existing.complete and not todo:
            log.info("%s is already complete: nothing to do", paths.root)
            return RunResult(existing, plan, None, time.time() - started)
        status.event("resumed", f"resuming: {len(done)} of {len(plan.shards)} shards already published",
                     published=len(done), total=len(plan.shards))
    preflight_disk(paths, sum(s.num_bytes for s in todo), cfg.force)
    status.event("plan", "planned", rows=plan.num_rows, samples=plan.num_samples, shards=len(plan.shards),
                 tokens=plan.num_tokens, bytes=plan.num_bytes, skipped=plan.skipped_counts())
    for row in plan.skipped:
        status.event("skipped_row", f"{row.where}: skipped ({row.reason})", row=row.row, reason=row.reason)

    status.update(force=True, state="loading", shards_owned=len(plan.shards), shards_done=len(done),
                  samples_total=plan.num_samples, tokens_total=plan.num_tokens)
    runner = TargetRunner(cfg.target_model, layer_ids, info.num_layers, device, CACHE_DTYPES[compute_dtype],
                          CACHE_DTYPES[cfg.dtype], cfg.target_attn_implementation, cfg.trust_remote_code)
    if existing is None or not os.path.exists(paths.target_weights):
        write_target_weights(paths, runner)
    manifest.complete = False
    write_manifest(paths, manifest)
    status.event("started", f"computing {len(todo)} shards on {device}", shards=len(todo), device=str(device))

    stop = StopFlag(paths)
    stop.install()
    base_samples = sum(len(s.samples) for s in plan.shards if s.shard_id in done)
    base_tokens = sum(s.num_tokens for s in plan.shards if s.shard_id in done)
    published = set(done)
    todo_tokens = sum(s.num_tokens for s in todo)
    progress = ProgressLog(todo_tokens, sum(len(s.samples) for s in todo))

    def on_published(shard, index) -> None:
        published.add(shard.shard_id)
        status.event("shard_published", f"shard {shard.shard_id} published", shard=shard.shard_id,
                     samples=index.num_samples, bytes=index.tar_bytes)
        status.update(force=True, shards_done=len(published))

    def on_batch(stats: PipelineStats, budget) -> None:
        status.update(state="running", samples_done=base_samples + stats.samples, tokens_done=base_tokens + stats.tokens,
                      bytes_written=stats.bytes, inflight_bytes=budget.inflight, stage_seconds=stats.times.as_dict(),
                      device_memory_bytes=torch.cuda.memory_allocated(device) if device.type == "cuda" else None)
        progress.update(stats.tokens, stats.samples, len(published), len(plan.shards))

    status.update(force=True, state="running")
    try:
        stats = run_pipeline(todo, runner.forward, paths=paths, shape=shape, device=device,
                             pad_id=manifest.pad_token_id, max_inflight_bytes=cfg.max_inflight_bytes,
                             on_published=on_published, should_stop=stop, on_batch=on_batch)
    except BaseException as exc:
        status.update(force=True, state="failed", last_error=str(exc) or type(exc).__name__)
        status.event("error", f"producer failed: {exc!r}; rerun the same command to resume")
        raise
    stopped = len(published) < len(plan.shards)
    if stopped:
        status.update(force=True, state="stopped")
        status.event("stopped", f"stopped ({stop.reason}); {len(published)} of {len(plan.shards)} shards published; "
                     "rerun the same command to resume")
    else:
        mark_complete(paths, manifest)
        status.update(force=True, state="finished", samples_done=plan.num_samples, tokens_done=plan.num_tokens)
        status.event("finished", "cache complete", samples=plan.num_samples, bytes=plan.num_bytes)
    return RunResult(manifest, plan, stats, time.time() - started, stopped)
