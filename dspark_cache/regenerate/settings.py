"""``dspark-regenerate``'s settings, the run's identity (what a resume must match) and the per-row seed.

Parsing imports nothing heavy: ``--help`` and usage errors stay instant.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
from dataclasses import dataclass, field, fields
from typing import Any

import msgspec

from dspark_cache.format.schema import TURN_MODES, Regeneration

DESCRIPTION = (
    "Regenerate the assistant turns of chat rows with the target itself, through one or more running "
    "OpenAI-compatible servers (vLLM, SGLang, transformers serve), and write them as JSONL that "
    "dspark-produce reads: the step before dspark-produce. Resumable: rerun the same command."
)
MAX_ROW_BYTES = 1 << 28  # as dspark-produce's --max-row-bytes
API_KEY_ENV = ("DSPARK_API_KEY", "OPENAI_API_KEY")


@dataclass
class RegenerateConfig:
    """Every ``dspark-regenerate`` setting (the command line's options, by their dest names)."""

    input_data: str
    output: str
    endpoint: list[str] = field(default_factory=list)
    model: str | None = None
    api_key: str | None = None
    concurrency: int = 8
    turns: str = "all"
    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 2048
    seed: int = 0
    chat_template_kwargs: str | None = None
    on_truncated: str = "keep"
    on_invalid: str = "error"
    on_failed: str = "skip"
    retries: int = 6
    request_timeout: float = 600.0
    give_up_after: float = 300.0
    split: str | None = None
    shuffle_seed: int = 42
    max_row_bytes: int = MAX_ROW_BYTES
    fsync_rows: int = 64
    overwrite: bool = False
    dry_run: bool = False
    log_level: str = "INFO"

    @property
    def template_kwargs(self) -> dict[str, Any]:
        """``--chat-template-kwargs`` as a dict (checked by :func:`validate_config`)."""
        return json.loads(self.chat_template_kwargs) if self.chat_template_kwargs else {}

    @property
    def key(self) -> str | None:
        """The API key: ``--api-key``, else the first of :data:`API_KEY_ENV` set. Never recorded."""
        return self.api_key or next((os.environ[n] for n in API_KEY_ENV if os.environ.get(n)), None)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options (``--log-level`` and ``--version`` come with the shared parser)."""
    p.add_argument(
        "--input-data",
        required=True,
        help="what dspark-produce reads: JSONL/JSON/Parquet file, a directory of them, a save_to_disk "
        "directory or an HF dataset id",
    )
    p.add_argument("--output", required=True, help="the JSONL file written (resumed when it matches)")
    p.add_argument(
        "--endpoint",
        action="append",
        required=True,
        metavar="URL",
        help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000 (or .../v1); repeat for several: "
        "requests are spread over them",
    )
    p.add_argument(
        "--model",
        default=None,
        help="the served model to use when an endpoint serves several (default: the one it serves)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help=f"bearer token for the endpoints (default ${API_KEY_ENV[0]}, then ${API_KEY_ENV[1]}); never "
        "written anywhere",
    )
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight, over all endpoints")
    p.add_argument(
        "--turns",
        choices=TURN_MODES,
        default="all",
        help="all: regenerate every assistant turn in order, each given the regenerated history; last: "
        "only the last one (earlier turns kept as they are)",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling")
    p.add_argument("--max-tokens", type=int, default=2048, help="tokens generated at most per assistant turn")
    p.add_argument("--seed", type=int, default=0,
                   help="each row's requests carry a seed derived from this and the row's position")
    p.add_argument("--chat-template-kwargs", metavar="JSON", default=None,
                   help="sent with every request, e.g. '{\"enable_thinking\": false}' to turn a template's "
                   "reasoning off (vLLM, SGLang and transformers serve read it)")
    p.add_argument(
        "--on-truncated",
        choices=["keep", "drop"],
        default="keep",
        help="a turn cut at --max-tokens (finish_reason length): keep the row, or drop it (listed in "
        "OUTPUT.skipped)",
    )
    p.add_argument("--on-invalid", choices=["error", "skip"], default="error",
                   help="invalid input rows (as dspark-produce judges them): stop, or skip them (listed in "
                   "OUTPUT.skipped)")
    p.add_argument(
        "--on-failed",
        choices=["skip", "error"],
        default="skip",
        help="a row whose request still fails after --retries: list it in OUTPUT.failed, go on and exit 4 "
        "(a rerun tries it again); a row the server rejects (4xx, or an answer no line can hold): list "
        "it in OUTPUT.skipped. Or stop on either",
    )
    p.add_argument(
        "--retries",
        type=int,
        default=6,
        help="retries of a request answered 429/5xx or not a chat completion, timed out or reset, with "
        "exponential backoff (an endpoint that refuses connections costs no retry: it leaves the "
        "rotation instead, as does one failing 3 requests in a row while another is up)",
    )
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds one request may take in all, its answer read (however slowly it comes)")
    p.add_argument("--give-up-after", type=float, default=300.0,
                   help="seconds with no endpoint answering before the run stops (rerun to resume)")
    p.add_argument("--split", default=None, help="as dspark-produce's --split (HF split syntax)")
    p.add_argument("--shuffle-seed", type=int, default=42, help="as dspark-produce's --shuffle-seed")
    p.add_argument("--max-row-bytes", type=int, default=MAX_ROW_BYTES,
                   help="a JSONL row longer than this is an invalid row (as dspark-produce)")
    p.add_argument(
        "--fsync-rows",
        type=int,
        default=64,
        help="rows appended between two fsyncs of the output (a crash of the machine loses at most "
        "these; a killed process loses only the rows in flight)",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="delete an existing OUTPUT and its sidecars and start over"
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="check the endpoints, the input (read whole, for its hash) and the output (settings a run "
        "would refuse are refused), count the rows and those already done; write nothing",
    )
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (log lines at INFO instead); a bar is drawn only when stderr is a terminal",
    )


def config_from_args(args: argparse.Namespace) -> RegenerateConfig:
    names = {f.name for f in fields(RegenerateConfig)}
    return RegenerateConfig(**{k: v for k, v in vars(args).items() if k in names})


class ConfigError(ValueError):
    """Settings that cannot work: a usage error."""


def validate_config(cfg: RegenerateConfig) -> None:
    """Cheap checks before anything is read or asked; :class:`ConfigError` names the option and the fix."""
    for name in ("concurrency", "max_tokens", "fsync_rows", "max_row_bytes"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    if cfg.retries < 0:
        raise ConfigError(f"--retries must be >= 0, got {cfg.retries}")
    for name in ("request_timeout", "give_up_after"):
        value = getattr(cfg, name)
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"--{name.replace('_', '-')} must be a positive number of seconds, got {value}")
    if not (math.isfinite(cfg.temperature) and cfg.temperature >= 0):
        raise ConfigError(f"--temperature must be >= 0, got {cfg.temperature}")
    if not (math.isfinite(cfg.top_p) and 0 < cfg.top_p <= 1):
        raise ConfigError(f"--top-p must be in (0, 1], got {cfg.top_p}")
    if cfg.seed < 0 or cfg.shuffle_seed < 0:
        raise ConfigError("--seed and --shuffle-seed must be >= 0")
    if cfg.chat_template_kwargs is not None:
        try:
            kwargs = json.loads(cfg.chat_template_kwargs)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--chat-template-kwargs is not JSON ({exc}); pass an object such as "
                              "'{\"enable_thinking\": false}'") from None
        if not isinstance(kwargs, dict):
            raise ConfigError(
                "--chat-template-kwargs must be a JSON object, e.g. '{\"enable_thinking\": false}'"
            )
    if os.path.isdir(cfg.output):
        raise ConfigError(f"--output {cfg.output} is a directory; pass the JSONL file to write, e.g. "
                          f"{os.path.join(cfg.output, 'regenerated.jsonl')}")


def row_seed(seed: int, index: int) -> int:
    """The seed of every request for the row at ``index`` (its position in the selected input): the one rule.

    A hash, not ``seed + index``, so that runs with nearby ``--seed`` values share no row seeds; 31 bits,
    the widest every engine accepts."""
    digest = hashlib.sha256(f"dspark-regenerate/{seed}/{index}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFF_FFFF


def regeneration(cfg: RegenerateConfig, model: str) -> Regeneration:
    """The run's model and sampling settings, as every output row and the cache's manifest record them."""
    return Regeneration(model=model, turns=cfg.turns, temperature=cfg.temperature, top_p=cfg.top_p,
                        max_tokens=cfg.max_tokens, seed=cfg.seed, chat_template_kwargs=cfg.template_kwargs)


class Identity(msgspec.Struct, kw_only=True, frozen=True):
    """What an output was made from and how: a resume must match every field (``identity_diff``).

    Not identity: the endpoints (a server may move), ``--concurrency``, retries and timeouts (they change
    when a row is written, never what), ``--on-failed`` (failed rows are not in the output; a rerun
    retries them), ``--on-invalid`` (under ``error`` no invalid row is ever recorded, so a rerun with
    ``skip`` after a stop on one continues the same output) and the API key."""

    input_data: str
    input_sha256: str
    split: str | None
    shuffle_seed: int
    max_row_bytes: int
    regeneration: Regeneration
    on_truncated: str


def identity(cfg: RegenerateConfig, input_sha256: str, model: str) -> Identity:
    # A local input by its absolute path: a rerun from another directory, or spelling it another way, resumes.
    where = os.path.abspath(cfg.input_data) if os.path.exists(cfg.input_data) else cfg.input_data
    return Identity(input_data=where, input_sha256=input_sha256, split=cfg.split,
                    shuffle_seed=cfg.shuffle_seed, max_row_bytes=cfg.max_row_bytes,
                    regeneration=regeneration(cfg, model), on_truncated=cfg.on_truncated)


def identity_diff(old: Identity, new: Identity) -> list[tuple[str, Any, Any]]:
    """Every field that differs, as ``(option-like name, old, new)``; the run's settings field by field."""
    def flat(ident: Identity) -> dict[str, Any]:
        out = msgspec.to_builtins(ident)
        out.update({f"regeneration.{k}": v for k, v in out.pop("regeneration").items()})
        return out

    a, b = flat(old), flat(new)
    return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
