"""How long a NeMo row really is: NeMo stores every row right-padded to ``seq_length``.

NeMo pads with the tokenizer's pad token (its eos when it has none) and derives the attention
mask by stripping the trailing run of pad ids, keeping one trailing eos when pad == eos. That
attention mask decided what the target saw as content, so it is the rule here too, with one
addition: a pad-id token that carries ``loss_mask`` 1 was supervised, so it is real.

A wrong pad id strips nothing, so padding would pass for real tokens: the pad id must lie in the
target's vocabulary, and the rows' own tails must not point at another one (:class:`PadEvidence`).
"""

from __future__ import annotations

import collections
import os
from dataclasses import dataclass, field

import torch

from dspark_cache.nemo.convert.common import ConvertUsageError


@dataclass(frozen=True)
class PadRule:
    """The pad id NeMo padded with, the eos id when known, and where they came from."""

    pad_id: int
    eos_id: int | None
    source: str

    @property
    def pad_is_eos(self) -> bool:
        return self.eos_id is not None and self.eos_id == self.pad_id


def _tokenizer_ids(target_model: str) -> tuple[int | None, int | None, str]:
    """``(pad, eos, why_not)`` of the tokenizer in a local directory; ``why_not`` says why none loaded."""
    if not os.path.isdir(target_model):
        return None, None, f"target_model {target_model!r} is not a local directory"
    from transformers import AutoTokenizer  # only here: importing transformers takes a second

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            target_model, local_files_only=True, trust_remote_code=False
        )
    except Exception as exc:  # any failure means the same thing to the user: pass the ids
        return None, None, f"its tokenizer in {target_model} did not load ({type(exc).__name__}: {exc})"
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    if pad is None and eos is None:
        return None, None, f"the tokenizer in {target_model} has neither a pad nor an eos token"
    return (eos if pad is None else pad), eos, ""


def resolve_pad_rule(target_model: str, manifest_path: str, pad_token_id: int | None,
                     eos_token_id: int | None, vocab_size: int) -> PadRule:
    """The pad/eos ids: given ones win; the rest come from the tokenizer the manifest names. Both
    must be token ids of the target (``[0, vocab_size)``)."""
    rule = _pad_rule(target_model, manifest_path, pad_token_id, eos_token_id)
    for name, value in (("pad", rule.pad_id), ("eos", rule.eos_id)):
        if value is not None and not 0 <= value < vocab_size:
            raise ConvertUsageError(
                f"the {name} id {value} ({rule.source}) is not a token of the target: {manifest_path} says "
                f"target_vocab_size {vocab_size}, so ids lie in [0, {vocab_size}). Pass --{name}-token-id with the "
                f"id NeMo's tokenizer uses"
            )
    return rule


def _pad_rule(
    target_model: str, manifest_path: str, pad_token_id: int | None, eos_token_id: int | None
) -> PadRule:
    if pad_token_id is not None and eos_token_id is not None:
        return PadRule(pad_token_id, eos_token_id, "--pad-token-id/--eos-token-id")
    tok_pad, tok_eos, why_not = _tokenizer_ids(target_model)
    if pad_token_id is not None:
        return PadRule(pad_token_id, eos_token_id if eos_token_id is not None else tok_eos, "--pad-token-id")
    if tok_pad is None:
        raise ConvertUsageError(
            f"--pad-token-id is required: {manifest_path} names {why_not}, so the pad id NeMo padded rows "
            "with is unknown (it is the tokenizer's pad token, or its eos token when it has none; add "
            "--eos-token-id too when pad == eos)"
        )
    return PadRule(
        tok_pad, eos_token_id if eos_token_id is not None else tok_eos, f"the tokenizer in {target_model}"
    )


@dataclass
class PadEvidence:
    """What the rows' ends say about the pad id. NeMo pads every short row's tail with one id at
    ``loss_mask`` 0, so a tail of two or more equal unsupervised ids looks like padding; content
    (a truncated row) seldom ends that way. More rows padded-looking with another id than with
    ours means ours is wrong: with it nothing would be stripped."""

    rows: int = 0
    # id -> rows ending in a run of it
    tails: collections.Counter = field(default_factory=collections.Counter)

    def add(self, ids: torch.Tensor, loss_mask: torch.Tensor) -> None:
        self.rows += 1
        if ids.shape[0] >= 2 and not bool(loss_mask[-2:].any()) and int(ids[-1]) == int(ids[-2]):
            self.tails[int(ids[-1])] += 1

    def check(self, rule: PadRule, src: str) -> None:
        """Refuse the conversion when another id pads more rows than ``rule``'s (see the class doc)."""
        others = [(count, token) for token, count in self.tails.items() if token != rule.pad_id]
        if not others:
            return
        count, token = max(others)
        ours = self.tails[rule.pad_id]
        if count > ours:
            raise ConvertUsageError(
                f"the pad id {rule.pad_id} ({rule.source}) pads {ours} of the {self.rows} rows of {src}, but {count} "
                f"end in a run of unsupervised token {token}, the way NeMo pads: with {rule.pad_id} that padding "
                f"would be kept as real tokens. Pass --pad-token-id {token} if NeMo padded with it (check the "
                "tokenizer it used)"
            )


def real_length(ids: torch.Tensor, loss_mask: torch.Tensor, rule: PadRule) -> tuple[int, bool]:
    """``(length, ambiguous)`` of one padded row.

    ``length`` is NeMo's content length (trailing pad ids stripped, one kept back when pad ==
    eos), extended to the last supervised token. ``ambiguous`` marks a row whose pad run starts
    with an unsupervised pad == eos token: whether that token (or more of the run) was the
    sample's own eos cannot be told from the row; NeMo's rule keeps exactly one.
    """
    size = int(ids.shape[0])
    content = (ids != rule.pad_id).nonzero()
    end = int(content[-1]) + 1 if content.numel() else 0
    length = min(end + 1, size) if rule.pad_is_eos else end
    supervised = loss_mask.nonzero()
    if supervised.numel():
        length = max(length, int(supervised[-1]) + 1)
    ambiguous = rule.pad_is_eos and end < size and not bool(loss_mask[end])
    return length, ambiguous
