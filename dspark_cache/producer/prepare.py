"""Before the model loads: validate the settings, encode the input, plan it, build the manifest.

Two steps, so that rank 0 can take the output directory between them: :func:`resolve_settings`
(the cheap checks, nothing read from the input) and :func:`prepare` (encode, plan, manifest).
Every rank prepares the same thing from the same input and settings, and nothing but the saved
plan is written, so bad input or configuration fails here, before any device work.
"""

from __future__ import annotations

import logging
import time

import msgspec
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dspark_cache import __version__
from dspark_cache.format.errors import CacheError
from dspark_cache.format.faults import crash_point
from dspark_cache.format.geometry import SampleShape
from dspark_cache.format.layers import build_target_layer_ids, draft_layer_union, validate_target_layer_ids
from dspark_cache.format.paths import CachePaths
from dspark_cache.format.sample import CACHE_DTYPES
from dspark_cache.format.schema import REGENERATED_KEY, Manifest, RegeneratedInput, RowRegeneration
from dspark_cache.format.validate import manifest_problems
from dspark_cache.producer.config import ConfigError, ProduceConfig, validate_config
from dspark_cache.producer.device.target import TargetInfo, read_target_info, resolve_device
from dspark_cache.producer.device.topology import Topology
from dspark_cache.producer.encode.chat import ChatEncoder
from dspark_cache.producer.encode.template import resolve_chat_template, sha256_text, tokenizer_sha256
from dspark_cache.producer.exchange import Exchange, exchange_for
from dspark_cache.producer.inputs.source import InputSource
from dspark_cache.producer.plan.batches import Plan
from dspark_cache.producer.plan.job import plan_job
from dspark_cache.producer.report.summary import layers_cost
from dspark_cache.storage.output import CacheOutput

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
    output: CacheOutput  # the directory being written
    exchange: Exchange  # how this rank reads the files the job's other ranks write there
    device: torch.device
    compute_dtype: str

    @property
    def paths(self) -> CachePaths:
        return self.output.paths


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
               output: CacheOutput | None = None, input_sha256: str | None = None,
               vocab_size: int | None = None, exchange: Exchange | None = None) -> Plan:
    """The plan of ``source`` for this job: the saved one in ``output`` (default ``cfg.output_dir``)
    when input and settings are unchanged, else encoded (this rank's share of the rows, across
    ``cfg.tokenize_workers`` processes), merged and saved there; ``exchange``: how the job's ranks
    read each other's files (default: ``output``'s).

    Raises :class:`InputError` when the input holds no row, or no row gives a supervised sample.
    """
    output = output or CacheOutput(cfg.output_dir)
    me = Topology.from_environment(cfg.tp_size, cfg.ep_size)
    return plan_job(cfg, output, exchange or exchange_for(output), me, source, encoder, shape,
                    input_sha256 or source.content_sha256(), vocab_size)


def library_versions() -> dict[str, str]:
    """The versions that shaped the cache's bytes (recorded, not compared on resume)."""
    import tokenizers
    import torch
    import transformers

    return {"dspark_cache": __version__, "torch": str(torch.__version__),
            "transformers": transformers.__version__, "tokenizers": tokenizers.__version__}


def regenerated_inputs(source: InputSource) -> list[RegeneratedInput]:
    """The runs of ``dspark-regenerate`` that made the input's rows, each with its number of rows, in
    the order they first appear; [] for rows that say nothing of it. One more pass over the rows (JSON
    parsed, nothing tokenised), as every run already reads the whole input for its hash."""
    runs: dict[bytes, RegeneratedInput] = {}
    unreadable = 0
    for row in source.rows():
        record = row.value.get(REGENERATED_KEY) if row.error is None and isinstance(row.value, dict) else None
        if record is None:
            continue
        try:
            run = msgspec.convert(record, RowRegeneration).run()
        except msgspec.ValidationError:
            unreadable += 1
            continue
        key = msgspec.json.encode(run)
        seen = runs.get(key)
        runs[key] = RegeneratedInput(**msgspec.structs.asdict(run), rows=1 + (seen.rows if seen else 0))
    if unreadable:
        log.warning(
            "%d rows of %s carry a %r record that is not dspark-regenerate's; the manifest does not count "
            "them as regenerated",
            unreadable,
            source.path,
            REGENERATED_KEY,
        )
    return list(runs.values())


def build_manifest(cfg: ProduceConfig, info: TargetInfo, layer_ids: list[int], plan: Plan, tokenizer: Any,
                   input_sha256: str, compute_dtype: str,
                   regenerated: list[RegeneratedInput] | None = None) -> Manifest:
    """The manifest of the cache this run makes: its identity (what resume compares) and its plan's totals."""
    return Manifest(
        target_model=cfg.target_model,
        target_model_type=info.model_type,
        target_vocab_size=info.vocab_size,
        hidden_size=info.hidden_size,
        num_hidden_layers=info.num_layers,
        seq_length=cfg.seq_length,
        dtype=cfg.dtype,
        compression=cfg.compression,
        compression_level=cfg.level,
        num_samples=plan.num_samples,
        shard_size=cfg.shard_size,
        target_hidden_dim=info.hidden_size * len(layer_ids),
        target_last_hidden_dim=info.hidden_size,
        target_layer_ids=layer_ids,
        train_data_path=str(cfg.input_data),
        train_split=cfg.split,
        shuffle_seed=cfg.shuffle_seed,
        mask_reasoning_content=cfg.mask_reasoning_content,
        mask_generation_prompt=cfg.mask_generation_prompt,
        chat_template_sha256=sha256_text(tokenizer.chat_template),
        input_sha256=input_sha256,
        tokenizer_sha256=tokenizer_sha256(tokenizer),
        compute_dtype=compute_dtype,
        attn_implementation=cfg.target_attn_implementation,
        pad_token_id=int(tokenizer.pad_token_id),
        num_rows=plan.num_rows,
        planned_samples=plan.num_samples,
        num_shards=len(plan.shards),
        planned_tokens=plan.num_tokens,
        planned_loss_tokens=plan.num_loss_tokens,
        planned_bytes=plan.num_bytes,
        planned_padded_tokens=plan.padded_tokens,
        plan_sha256=plan.shard_samples_sha256(),
        max_batch_tokens=cfg.batch_token_budget,
        skipped_rows=plan.skipped_counts(),
        skipped=plan.skipped,
        versions=library_versions(),
        target_fingerprint=info.fingerprint,
        regenerated=list(regenerated or []),
        created_at=time.time(),
    )


def _check_readable(manifest: Manifest, cfg: ProduceConfig) -> None:
    """Refuse, before the model loads, a cache our own readers would refuse once computed: the limits
    the settings alone show are usage errors earlier (``validate_config``); the plan's totals (shard
    count) are known only here."""
    problems = list(manifest_problems(manifest))
    if problems:
        raise CacheError(f"the cache this job plans for {cfg.output_dir} could not be read back: "
                         + "; ".join(problems) + ". Change the settings that give these values (a larger "
                         "--shard-size makes fewer shards), or split the input into several caches")


@dataclass
class Settings:
    """The run's settings checked and resolved: what the cheap checks give before the input is read."""

    cfg: ProduceConfig
    template: str | None
    info: TargetInfo
    layer_ids: list[int]
    source: InputSource
    device: torch.device
    compute_dtype: str


def resolve_settings(cfg: ProduceConfig) -> Settings:
    """The cheap checks, identical on every rank: the settings, the chat template, the target's
    config, its layer ids, where the input is and which device computes. Nothing is read from the
    input yet, so a producer that cannot have the output directory is refused before it does."""
    validate_config(cfg)
    template = resolve_chat_template(cfg.chat_template) if cfg.chat_template else None
    info = read_target_info(cfg.target_model, cfg.trust_remote_code, cfg.allow_pickle_weights)
    if cfg.for_draft_layers:
        layer_ids = draft_layer_union(info.num_layers, cfg.for_draft_layers)
    elif cfg.target_layer_ids:
        layer_ids = list(cfg.target_layer_ids)
    else:
        layer_ids = build_target_layer_ids(info.num_layers, cfg.draft_num_hidden_layers)
    try:  # ids past the target's depth are a setting that cannot work, as any other bad id (exit 2)
        validate_target_layer_ids(layer_ids, info.num_layers)
    except ValueError as exc:
        raise ConfigError(f"{exc}; the target is {cfg.target_model}") from None
    source = InputSource(cfg.input_data, cfg.split, cfg.shuffle_seed, cfg.max_row_bytes)
    device = resolve_device(cfg.device)
    compute_dtype = (
        cfg.compute_dtype if cfg.compute_dtype != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    )
    return Settings(cfg, template, info, layer_ids, source, device, compute_dtype)


def prepare(settings: Settings, output: CacheOutput) -> Prepared:
    """Encode and plan the input (identical on every rank; the plan is saved in ``output``) and build
    the manifest; nothing else is written yet."""
    cfg, info, layer_ids = settings.cfg, settings.info, settings.layer_ids
    tokenizer = load_tokenizer(cfg, settings.template)
    encoder = ChatEncoder(tokenizer, cfg.seq_length, cfg.mask_reasoning_content, cfg.mask_generation_prompt)
    shape = SampleShape(layer_ids, info.num_layers, info.hidden_size, CACHE_DTYPES[cfg.dtype],
                        cfg.compression)
    input_sha256 = settings.source.content_sha256()
    exchange = exchange_for(output)
    plan = plan_input(cfg, encoder, settings.source, shape, output, input_sha256, info.vocab_size, exchange)
    log.info(
        "plan: %d rows -> %d samples (%d skipped), %d tokens (%d supervised), %d shards, %.1f MB on disk, "
        "padding %.1f%% of computed tokens",
        plan.num_rows,
        plan.num_samples,
        len(plan.skipped),
        plan.num_tokens,
        plan.num_loss_tokens,
        len(plan.shards),
        plan.num_bytes / 1e6,
        100 * plan.padding_waste,
    )
    if cfg.for_draft_layers:
        log.info("%s", layers_cost(cfg.for_draft_layers, info.num_layers, shape, plan.num_tokens))
    regenerated = regenerated_inputs(settings.source)
    if regenerated:
        log.info(
            "input: %s",
            "; ".join(
                f"{r.rows} rows regenerated by {r.model} (--turns {r.turns}, temperature "
                f"{r.temperature}, top-p {r.top_p}, max-tokens {r.max_tokens}, seed {r.seed})"
                for r in regenerated
            ),
        )
    manifest = build_manifest(cfg, info, layer_ids, plan, tokenizer, input_sha256, settings.compute_dtype,
                              regenerated)
    _check_readable(manifest, cfg)
    crash_point("planned")
    return Prepared(cfg, info, layer_ids, shape, plan, manifest, output, exchange, settings.device,
                    settings.compute_dtype)
