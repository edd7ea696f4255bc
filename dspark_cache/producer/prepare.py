"""Before the model loads: validate the settings, encode the input, plan it, build the manifest.

Every rank prepares the same thing from the same input and settings, and nothing is written
yet, so bad input or configuration fails here, before any device work.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from dspark_cache.format.errors import CacheError
from dspark_cache.format.faults import crash_point
from dspark_cache.format.layers import build_target_layer_ids, validate_target_layer_ids
from dspark_cache.format.paths import CachePaths
from dspark_cache.format.sample import CACHE_DTYPES
from dspark_cache.format.schema import Manifest
from dspark_cache.format.validate import manifest_problems
from dspark_cache.producer.encode.chat import ChatEncoder
from dspark_cache.producer.config import ProduceConfig, validate_config
from dspark_cache.producer.device.ranks import rank_info
from dspark_cache.producer.inputs.source import InputSource
from dspark_cache.producer.manifest import build_manifest
from dspark_cache.producer.plan.batches import Plan, SampleShape
from dspark_cache.producer.plan.job import plan_job
from dspark_cache.producer.device.target import TargetInfo, read_target_info, resolve_device
from dspark_cache.producer.encode.template import resolve_chat_template

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


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


def load_tokenizer(cfg: ProduceConfig, template: str | None = None) -> Any:
    """The target's tokenizer, with ``template`` (``--chat-template``, resolved) as its chat template.

    A tokenizer without a pad token pads with its eos token, as NeMo's producer does.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.target_model, trust_remote_code=cfg.trust_remote_code)
    if template is not None:
        tokenizer.chat_template = template
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def plan_input(cfg: ProduceConfig, encoder: ChatEncoder, source: InputSource, shape: SampleShape,
               paths: CachePaths | None = None, input_sha256: str | None = None,
               vocab_size: int | None = None) -> Plan:
    """The plan of ``source`` for this job: the saved one in ``paths`` (default ``cfg.output_dir``)
    when input and settings are unchanged, else encoded (this rank's share of the rows, across
    ``cfg.tokenize_workers`` processes), merged and saved there.

    Raises :class:`InputError` when the input holds no row, or no row gives a supervised sample.
    """
    return plan_job(cfg, paths or CachePaths(cfg.output_dir), rank_info(), source, encoder, shape,
                    input_sha256 or source.content_sha256(), vocab_size)


def _check_readable(manifest: Manifest, cfg: ProduceConfig) -> None:
    """Refuse, before the model loads, a cache our own readers would refuse once computed: the limits
    the settings alone show are usage errors earlier (``validate_config``); the plan's totals (shard
    count) are known only here."""
    problems = list(manifest_problems(manifest))
    if problems:
        raise CacheError(f"the cache this job plans for {cfg.output_dir} could not be read back: "
                         + "; ".join(problems) + ". Change the settings that give these values (a larger "
                         "--shard-size makes fewer shards), or split the input into several caches")


def prepare(cfg: ProduceConfig, before_planning: Callable[[CachePaths], None] | None = None) -> Prepared:
    """Validate and plan (identical on every rank); nothing is written yet.

    ``before_planning`` runs once the cheap checks have passed and before the input is read
    (rank 0 takes the directory's lock there, so that a second producer is refused at once).
    """
    validate_config(cfg)
    template = resolve_chat_template(cfg.chat_template) if cfg.chat_template else None
    info = read_target_info(cfg.target_model, cfg.trust_remote_code, cfg.allow_pickle_weights)
    layer_ids = list(cfg.target_layer_ids) if cfg.target_layer_ids else \
        build_target_layer_ids(info.num_layers, cfg.draft_num_hidden_layers)
    validate_target_layer_ids(layer_ids, info.num_layers)
    source = InputSource(cfg.input_data, cfg.split, cfg.shuffle_seed, cfg.max_row_bytes)
    device = resolve_device(cfg.device)
    compute_dtype = cfg.compute_dtype if cfg.compute_dtype != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    paths = CachePaths(cfg.output_dir)
    if before_planning is not None:
        before_planning(paths)
    tokenizer = load_tokenizer(cfg, template)
    encoder = ChatEncoder(tokenizer, cfg.seq_length, cfg.mask_reasoning_content, cfg.mask_generation_prompt)
    shape = SampleShape(layer_ids, info.num_layers, info.hidden_size, CACHE_DTYPES[cfg.dtype])
    input_sha256 = source.content_sha256()
    plan = plan_input(cfg, encoder, source, shape, paths, input_sha256, info.vocab_size)
    log.info("plan: %d rows -> %d samples (%d skipped), %d tokens (%d supervised), %d shards, %.1f MB on disk, "
             "padding %.1f%% of computed tokens", plan.num_rows, plan.num_samples, len(plan.skipped),
             plan.num_tokens, plan.num_loss_tokens, len(plan.shards), plan.num_bytes / 1e6, 100 * plan.padding_waste)
    manifest = build_manifest(cfg, info, layer_ids, plan, tokenizer, input_sha256, compute_dtype)
    _check_readable(manifest, cfg)
    crash_point("planned")
    return Prepared(cfg, info, layer_ids, shape, plan, manifest, paths, device, compute_dtype)
