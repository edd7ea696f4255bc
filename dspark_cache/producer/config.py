"""The producer's settings: NeMo's flag names and defaults, plus ours.

Parsing imports no torch (``dspark-produce --help`` and usage errors stay instant); dtypes and
devices are resolved into torch objects later, where the run needs them. The command line's
shared conventions (``--version``, ``--log-level``, usage errors, exit codes) come from
``dspark_cache.cli``, which builds the parser and calls :func:`add_arguments`.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Callable

import msgspec

from dspark_cache.format.codec import CODECS, DEFAULT_LEVEL, LEVELS
from dspark_cache.format.layers import EMBEDDING_LAYER, validate_target_layer_ids
from dspark_cache.format.sample import CACHE_DTYPES, is_fp8  # names -> safetensors codes: no torch
from dspark_cache.format.schema import SampleEntry
from dspark_cache.format.status import RANK_TIMEOUT_S
from dspark_cache.format.validate import MAX_INDEX_BYTES, MAX_SEQ_LENGTH
from dspark_cache.producer.device.topology import size_argument
from dspark_cache.storage.remote.url import is_remote

if TYPE_CHECKING:
    from dspark_cache.storage.output import CacheOutput

# A target computes in a float dtype; FP8 is a storage format only (quantised after the forward).
COMPUTE_DTYPES = sorted(name for name, code in CACHE_DTYPES.items() if not is_fp8(code))

DESCRIPTION = ("Run a frozen target once over chat data and write its hidden states as compact, resumable "
               "WebDataset shards for DSpark drafter training. NeMo's precompute_dspark command lines work "
               "unchanged.")


_U64_MAX = (1 << 64) - 1
# The most index entries a shard index can hold and still be read back: its readers refuse an
# index over MAX_INDEX_BYTES, so --shard-size is bounded by it at the widest entry a cache can hold.
_WIDEST_ENTRY = (
    len(
        msgspec.json.encode(
            SampleEntry(_U64_MAX, MAX_SEQ_LENGTH, MAX_SEQ_LENGTH, _U64_MAX, _U64_MAX, _U64_MAX)
        )
    )
    + 1
)  # + the comma between entries
MAX_SHARD_SIZE = MAX_INDEX_BYTES // _WIDEST_ENTRY

DEVICE_FORMS = "auto, cpu, cuda or cuda:N"
_DEVICE = re.compile(r"auto|cpu|cuda(:[0-9]+)?")


def device_problem(value: str) -> str | None:
    """Why ``value`` is not a ``--device`` this producer runs on, or None when it is one."""
    if _DEVICE.fullmatch(value):
        return None
    return f"--device {value!r} is not a device this producer runs on; use {DEVICE_FORMS}"


def device_argument(value: str) -> str:
    """argparse ``type`` for ``--device``: checked while parsing, so a typo is a one-line usage error (exit 2)."""
    problem = device_problem(value)
    if problem:
        raise argparse.ArgumentTypeError(problem.removeprefix("--device "))
    return value


MAX_WRITER_THREADS = 8  # default's cap: past it one rank's writers outrun any GPU's capture (BENCHMARKS.md)
WRITER_THREADS_LIMIT = 64  # what --writer-threads takes: each is a thread and an open shard file


def rank_cores() -> int:
    """The cores this rank may use: those it may run on, shared with the node's other ranks."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        per_node = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:  # torchrun sets it; anything else is not ours to refuse here (even --help reads it)
        per_node = 1
    return max(1, cores // per_node)


def default_writer_threads() -> int:
    """One writer per core this rank has, at most 8. The thread that drives a GPU mostly waits, and
    a CPU target's forward leaves the writers little to do: neither needs a core kept free."""
    return min(MAX_WRITER_THREADS, rank_cores())


@dataclass
class ProduceConfig:
    """Every ``dspark-produce`` setting (the command line's options, by their dest names)."""

    target_model: str
    input_data: str
    output_dir: str
    seq_length: int = 2048
    batch_size: int = 4
    shard_size: int = 256
    dtype: str = "bf16"
    compression: str = "none"
    compression_level: int | None = None
    device: str = "auto"
    num_workers: int | None = None
    split: str | None = None
    shuffle_seed: int = 42
    draft_num_hidden_layers: int = 5
    target_layer_ids: list[int] | None = None
    for_draft_layers: list[int] | None = None
    chat_template: str | None = None
    mask_reasoning_content: bool = False
    mask_generation_prompt: bool = False
    target_attn_implementation: str | None = None
    target_force_hf: bool = False
    trust_remote_code: bool = False
    allow_pickle_weights: bool = False
    resume: bool = False
    log_level: str = "INFO"
    # Ours.
    compute_dtype: str = "auto"
    max_batch_tokens: int | None = None
    max_inflight_bytes: int = 1 << 30
    writer_threads: int | None = None
    on_invalid: str = "error"
    max_row_bytes: int = 1 << 28
    on_nonfinite: str = "error"
    rank_timeout: float = RANK_TIMEOUT_S
    overwrite: bool = False
    force: bool = False
    dry_run: bool = False
    tp_size: int = 1
    ep_size: int = 1
    device_map: str | None = None
    # An --output-dir on object storage (s3://...).
    storage_options: str | None = None
    staging_dir: str | None = None
    staging_limit: str | None = None
    lease_wait: float | None = None

    @property
    def tokenize_workers(self) -> int:
        """Encoding processes: ``--num-workers``, else this rank's share of the node's cores (at most 16)."""
        if self.num_workers is not None:
            return self.num_workers
        return min(16, rank_cores())

    @property
    def level(self) -> int:
        """The zstd level recorded in the manifest (0 when nothing is compressed)."""
        if self.compression == "none":
            return 0
        return DEFAULT_LEVEL if self.compression_level is None else self.compression_level

    @property
    def writers(self) -> int:
        """Shards written at once: ``--writer-threads``, else :func:`default_writer_threads`."""
        return self.writer_threads if self.writer_threads is not None else default_writer_threads()

    @property
    def batch_token_budget(self) -> int:
        """Padded tokens per forward batch: ``--max-batch-tokens``, else batch size x sequence length."""
        return self.max_batch_tokens or self.batch_size * self.seq_length


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The producer's options (``--log-level`` and ``--version`` come with the shared parser)."""
    p.add_argument("--target-model", required=True, help="HF checkpoint directory or hub id")
    p.add_argument("--input-data", required=True,
                   help="JSONL/JSON/Parquet file, a directory of them, or an HF dataset id")
    p.add_argument("--output-dir", required=True, help="cache directory (resumed when it matches)")
    p.add_argument("--seq-length", type=int, default=2048, help="right-truncate samples to this many tokens")
    p.add_argument(
        "--batch-size",
        type=int,
        default=4,
        help="with --seq-length, the padded tokens per forward: batch-size x seq-length (NeMo's memory "
        "per forward); a batch of short samples holds more than batch-size of them",
    )
    p.add_argument(
        "--shard-size",
        type=int,
        default=256,
        help="at most this many samples per shard (shards are cut from whole batches; any value works)",
    )
    p.add_argument("--dtype", choices=sorted(CACHE_DTYPES), default="bf16", help="cache float dtype")
    p.add_argument("--compression", choices=list(CODECS), default="none",
                   help="lossless codec of each sample's payload: zstd stores the states as byte planes "
                   "in one zstd frame (bf16 ~0.7x the bytes, read back bit for bit by every reader; "
                   "BENCHMARKS.md); one cache holds one codec")
    p.add_argument("--compression-level", type=int, default=None, metavar="N",
                   help=f"zstd level with --compression zstd, {LEVELS[0]}..{LEVELS[1]} (default "
                   f"{DEFAULT_LEVEL}: higher levels cost the writers several times the CPU for no "
                   "fewer bytes on states)")
    p.add_argument(
        "--device",
        type=device_argument,
        default="auto",
        help=f"{DEVICE_FORMS}; auto = CUDA when present (under torchrun cuda:LOCAL_RANK), else cpu",
    )
    p.add_argument(
        "--tp-size",
        type=size_argument,
        default=1,
        help="tensor parallelism for a target larger than one device: each group of this many torchrun "
        "ranks holds one copy of the target, split by transformers' TP plan; the group's first rank "
        "writes, groups share the shards",
    )
    p.add_argument(
        "--ep-size",
        type=size_argument,
        default=1,
        help="expert parallelism for a mixture-of-experts target: its experts spread over this many "
        "ranks (attention is split over the same ranks: equal to --tp-size, or --tp-size left out)",
    )
    p.add_argument(
        "--device-map",
        choices=["auto"],
        default=None,
        help="auto: one process spreads the target's layers over every visible GPU (accelerate), for a "
        "target with no TP plan; slower than --tp-size, as one GPU computes at a time (default: the "
        "whole target on --device)",
    )
    p.add_argument("--num-workers", type=int, default=None,
                   help="tokenising processes (default: this rank's share of the node's cores, at most 16; "
                   "0 = in process)")
    p.add_argument(
        "--split",
        default=None,
        help="HF split syntax: NAME, NAME[a:b] (negative counts from the end) or NAME[a%%:b%%], taken "
        "after the --shuffle-seed shuffle (JSON/JSONL files are shuffled only when --split is given); "
        "a plain file's one split is 'train'",
    )
    p.add_argument(
        "--shuffle-seed",
        type=int,
        default=42,
        help="seed of the row shuffle (the order datasets' Dataset.shuffle(seed) gives): Parquet, "
        "save_to_disk and hub inputs are always shuffled; JSON/JSONL files only when --split is given "
        "(without it they are read in file order, as NeMo reads them). --split then takes its slice "
        "(NAME[a:b] rows, NAME[a%%:b%%] percent) of the shuffled rows: the same seed and --split "
        "select the same rows, in the same order, every run",
    )
    p.add_argument("--draft-num-hidden-layers", type=int, default=5,
                   help="how many layers NeMo's spread picks when --target-layer-ids is not given")
    p.add_argument("--target-layer-ids", type=_int_list("layer ids", "1,9,17"), nargs="+", action=_Joined,
                   default=None, metavar="ID",
                   help="explicit layer ids (NeMo convention), as 1 9 17 or 1,9,17 (--target-layer-ids=-1,3 "
                   "when a comma list starts with -1); may be more than one drafter uses: training takes any "
                   "subset (build_dataloader(..., target_layer_ids=...), or NeMo's recipe)")
    p.add_argument(
        "--for-draft-layers",
        type=_depths,
        default=None,
        metavar="D1,D2,...",
        help="capture the union of NeMo's default layer spreads for drafters of these depths (e.g. "
        "1,2,3,5), so that one cache trains each of them; the log and --dry-run say what it costs",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        help="inline Jinja, a template file or a tokenizer_config.json (default: the tokenizer's own)",
    )
    p.add_argument("--mask-reasoning-content", action="store_true", help="do not supervise reasoning_content")
    p.add_argument("--mask-generation-prompt", action="store_true",
                   help="do not supervise the tokens the generation prompt supplies in each assistant turn "
                   "(role header, template-inserted empty think block), as NeMo 0.7.0")
    p.add_argument("--target-attn-implementation", default=None, help="attn_implementation for the target")
    p.add_argument(
        "--target-force-hf", action="store_true", help="accepted for NeMo compatibility (always HF here)"
    )
    p.add_argument("--trust-remote-code", action="store_true", help="allow the target's own Python code")
    p.add_argument(
        "--allow-pickle-weights",
        action="store_true",
        help="load a target whose weights are only pickles (pytorch_model.bin): unpickling runs "
        "arbitrary code from the checkpoint, so only for one you trust (default: safetensors only)",
    )
    p.add_argument(
        "--resume", action="store_true", help="accepted for NeMo compatibility: resume is automatic"
    )
    p.add_argument("--compute-dtype", choices=["auto", *COMPUTE_DTYPES], default="auto",
                   help="target compute dtype; auto = bf16 on CUDA, fp32 on CPU (as NeMo)")
    p.add_argument("--max-batch-tokens", type=int, default=None,
                   help="padded-token budget per batch (default batch-size x seq-length)")
    p.add_argument("--max-inflight-bytes", type=int, default=1 << 30,
                   help="bytes the host ring holds between device and writers before the device waits, all "
                   "writers' batches together (default 1 GiB)")
    p.add_argument("--writer-threads", type=int, default=None,
                   help="shards written at once, each by its own thread (default: one per core this rank "
                   f"has, at most {MAX_WRITER_THREADS}; here {default_writer_threads()}); the cache's bytes "
                   "do not depend on it; --max-inflight-bytes should hold a batch for each, and one more")
    p.add_argument("--on-invalid", choices=["error", "skip"], default="error",
                   help="invalid input rows: stop during planning (default) or skip and count them")
    p.add_argument(
        "--max-row-bytes",
        type=int,
        default=1 << 28,
        help="a JSONL row longer than this is an invalid row (default 256 MiB; memory per row is a few "
        "times its size, the tokens of a row are bounded by --seq-length)",
    )
    p.add_argument(
        "--on-nonfinite",
        choices=["error", "skip"],
        default="error",
        help="NaN/inf hidden states: stop (default) or drop the sample and list it in the manifest",
    )
    p.add_argument("--rank-timeout", type=float, default=RANK_TIMEOUT_S,
                   help="seconds without a heartbeat after which a finished rank stops waiting for another")
    p.add_argument(
        "--overwrite", action="store_true", help="delete an existing cache in --output-dir and start over"
    )
    p.add_argument(
        "--force", action="store_true", help="start even when the projected cache exceeds free disk space"
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="encode and plan the input, print what the cache would hold (samples, tokens, padding, "
        "shards, exact bytes) and exit without loading the target; only the plan is written (in "
        "OUTPUT_DIR/plan/), and the real run reuses it",
    )


def _int_list(what: str, example: str) -> Callable[[str], list[int]]:
    """A parser of ``1,2,3,5`` -> ``[1, 2, 3, 5]`` (argparse names the option when it raises)."""

    def parse(text: str) -> list[int]:
        try:
            return [int(part) for part in text.split(",") if part.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a comma-separated list of {what}, e.g. {example}") from None

    return parse


_depths = _int_list("drafter depths", "1,2,3,5")


class _Joined(argparse.Action):
    """Values given apart (``1 5 9``), with commas (``1,5,9``) or both, as one list."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, [item for part in values for item in part])


def cache_output_options(cfg: ProduceConfig) -> dict[str, Any]:
    """``open_output``'s keyword arguments for an --output-dir on object storage; ``ConfigError`` on bad values."""
    from dspark_cache.storage.backing import StorageOptions, parse_size, parse_storage_options

    try:
        options = None if cfg.storage_options is None else parse_storage_options(cfg.storage_options,
                                                                                  "--storage-options")
        limit = None if cfg.staging_limit is None else parse_size(cfg.staging_limit, "--staging-limit")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.lease_wait is not None and not cfg.lease_wait >= 0:
        raise ConfigError(f"--lease-wait {cfg.lease_wait}: give seconds, 0 or more")
    return {"storage": StorageOptions(options), "staging_dir": cfg.staging_dir, "staging_limit": limit,
            "lease_wait": cfg.lease_wait}


def cache_output(cfg: ProduceConfig, rank: int = 0) -> "CacheOutput":
    """The write side of --output-dir: a directory, or a cache on object storage staged on this node."""
    from dspark_cache.storage.destination import open_output

    if not is_remote(cfg.output_dir):
        return open_output(cfg.output_dir)
    return open_output(cfg.output_dir, rank=rank, **cache_output_options(cfg))


def config_from_args(args: argparse.Namespace) -> ProduceConfig:
    """The settings from parsed options (options that are not settings, such as ``--tui``, are left out)."""
    names = {f.name for f in fields(ProduceConfig)}
    return ProduceConfig(**{k: v for k, v in vars(args).items() if k in names})


class ConfigError(ValueError):
    """Settings that cannot work together or that the cache format cannot hold: a usage error."""


def validate_config(cfg: ProduceConfig) -> None:
    """Cheap checks that run before anything is loaded; :class:`ConfigError` names the option and the fix."""
    remote_only = ("storage_options", "staging_dir", "staging_limit", "lease_wait")
    if not is_remote(cfg.output_dir) and any(getattr(cfg, n) is not None for n in remote_only):
        given = [f"--{n.replace('_', '-')}" for n in remote_only if getattr(cfg, n) is not None]
        raise ConfigError(
            f"{', '.join(given)} apply to an --output-dir on object storage (s3://bucket/prefix), not to "
            f"the directory {cfg.output_dir}; leave them out"
        )
    cache_output_options(cfg)  # malformed JSON or size: named now
    for name in ("seq_length", "batch_size", "shard_size", "draft_num_hidden_layers", "max_inflight_bytes",
                 "max_row_bytes", "writer_threads"):
        if getattr(cfg, name) is not None and getattr(cfg, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    if cfg.compression_level is not None and cfg.compression == "none":
        raise ConfigError(f"--compression-level {cfg.compression_level} needs --compression zstd (nothing is "
                          "compressed by default); add it, or leave the level out")
    if cfg.compression_level is not None and not LEVELS[0] <= cfg.compression_level <= LEVELS[1]:
        raise ConfigError(f"--compression-level {cfg.compression_level} is not in "
                          f"[{LEVELS[0]}, {LEVELS[1]}], the zstd levels a cache records; pass one of them "
                          f"(default {DEFAULT_LEVEL})")
    if cfg.writer_threads is not None and cfg.writer_threads > WRITER_THREADS_LIMIT:
        raise ConfigError(f"--writer-threads {cfg.writer_threads} is over {WRITER_THREADS_LIMIT} (a thread "
                          f"and an open shard each); {MAX_WRITER_THREADS} keep up with any one GPU: pass "
                          "fewer")
    # The readers refuse what the format cannot hold (format/validate.py): refuse it here, not after hours.
    if cfg.seq_length > MAX_SEQ_LENGTH:
        raise ConfigError(
            f"--seq-length {cfg.seq_length} is over {MAX_SEQ_LENGTH}, the longest sample a cache's "
            "index and readers accept; pass a smaller --seq-length"
        )
    if cfg.shard_size > MAX_SHARD_SIZE:
        raise ConfigError(
            f"--shard-size {cfg.shard_size} is over {MAX_SHARD_SIZE}, the most samples a shard index "
            f"can list within the {MAX_INDEX_BYTES >> 20} MiB its readers accept; pass a smaller "
            "--shard-size"
        )
    problem = device_problem(cfg.device)
    if problem:
        raise ConfigError(problem)
    if os.path.isfile(cfg.target_model):
        raise ConfigError(
            f"--target-model {cfg.target_model} is a file; pass the checkpoint's directory (the one "
            "holding config.json and the weights) or a hub id"
        )
    if cfg.max_batch_tokens is not None and cfg.max_batch_tokens < cfg.seq_length:
        raise ConfigError(
            f"--max-batch-tokens {cfg.max_batch_tokens} is below --seq-length {cfg.seq_length}: a "
            "sample that long would not fit one batch; pass at least the sequence length, or a "
            "smaller --seq-length"
        )
    if cfg.num_workers is not None and cfg.num_workers < 0:
        raise ConfigError(f"--num-workers must be >= 0 (0 = tokenise in process), got {cfg.num_workers}")
    if not (math.isfinite(cfg.rank_timeout) and cfg.rank_timeout > 0):
        raise ConfigError(f"--rank-timeout must be a positive number of seconds, got {cfg.rank_timeout}")
    if cfg.shuffle_seed < 0:
        raise ConfigError(f"--shuffle-seed must be >= 0, got {cfg.shuffle_seed}")
    if cfg.for_draft_layers is not None and cfg.target_layer_ids is not None:
        raise ConfigError(
            "--for-draft-layers and --target-layer-ids both choose the layers captured; give one"
        )
    if cfg.for_draft_layers is not None and (not cfg.for_draft_layers or min(cfg.for_draft_layers) < 1):
        raise ConfigError(
            f"--for-draft-layers {cfg.for_draft_layers}: give drafter depths of 1 or more, e.g. 1,2,3,5"
        )
    # order and the lower bound need no target; its depth is checked later
    if cfg.target_layer_ids is not None:
        ids = list(cfg.target_layer_ids)
        if min(ids, default=0) < EMBEDDING_LAYER:
            raise ConfigError(f"--target-layer-ids {ids}: ids start at {EMBEDDING_LAYER} (the embeddings); "
                              "i = the output of decoder layer i")
        try:
            validate_target_layer_ids(ids, max([*ids, 0]) + 1)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
