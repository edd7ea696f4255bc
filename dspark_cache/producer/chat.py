"""Chat template application and NeMo's loss-mask rules, robust to history-rewriting templates.

Rules (NeMo's ``format_chat_template``): the conversation is rendered without a generation
prompt and tokenised as one string. With ``{% generation %}`` blocks in the template the mask
is exactly the tokens inside them. Otherwise each assistant turn ``k`` supervises its
prefix-render span ``[len(render(m[:k])), len(render(m[:k+1])))``: role header, content,
end-of-turn token and the newline after it. Templates like stock Qwen3 render the *last* turn
differently from the same turn in history (think blocks), which makes NeMo raise; here the span
is then aligned on the full render instead (same prefix, same turn ending), which gives the
mask NeMo's rule means. ``mask_reasoning_content`` clears the supervision of each non-empty
``reasoning_content`` span (found by re-rendering without it), as NeMo does.
``mask_generation_prompt`` clears, in each assistant turn, the tokens the template's generation
prompt supplies at inference (role header, an inserted empty think block), with NeMo 0.7.0's rule.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")
log = logging.getLogger(__name__)
_warned: set[str] = set()


class ChatTemplateError(ValueError):
    """The chat template argument or the tokenizer's template is unusable."""


def resolve_chat_template(arg: str) -> str:
    """Inline Jinja is used as is; otherwise ``arg`` must be a file (raw Jinja or JSON)."""
    if "{%" in arg or "{{" in arg:
        return arg
    if not os.path.isfile(arg):
        raise ChatTemplateError(
            f"--chat-template {arg!r} is neither an existing file nor an inline Jinja template "
            "(no '{%' or '{{' in it); fix the path or pass the template text"
        )
    with open(arg, encoding="utf-8") as handle:
        text = handle.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return text
    if isinstance(data, dict) and isinstance(data.get("chat_template"), str):
        return data["chat_template"]
    return text


def sha256_text(text: str | None) -> str:
    return hashlib.sha256((text or "").encode()).hexdigest()


def tokenizer_sha256(tokenizer: Any) -> str:
    """Identity of the tokenizer's vocabulary, merges, normaliser and special tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    specials = json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str)
    return hashlib.sha256((body + specials).encode()).hexdigest()


@dataclass(frozen=True)
class EncodedRow:
    input_ids: np.ndarray  # int32 [L], L <= seq_length
    loss_mask: np.ndarray  # uint8 [L]
    full_length: int  # tokens before truncation


def _common_prefix(a: str | list[int], b: str | list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _turn_end(turn_render: str, full: str, start: int) -> int:
    """Where the turn that ends ``turn_render`` ends inside ``full``.

    Equal when ``turn_render`` is a prefix of ``full`` (NeMo's rule). Otherwise the two differ
    inside the turn (e.g. an inserted think block); the turn's ending is the longest suffix of
    the differing tail of ``turn_render`` that continues ``full`` at the divergence point.
    """
    if full.startswith(turn_render):
        return len(turn_render)
    split = max(start, _common_prefix(turn_render, full))
    tail = turn_render[split:]
    for cut in range(len(tail) + 1):
        if full.startswith(tail[cut:], split):
            return split + len(tail) - cut
    return split


def _appended_block(base: list[int], prompt: list[int], turn: list[int]) -> int:
    """Length of the block ``prompt`` appends to ``base`` when ``turn`` opens with all of it, else 0."""
    if prompt[: len(base)] != base:
        return 0
    block = prompt[len(base):]
    return len(block) if block and turn[: len(block)] == block else 0


def _warn_once(what: str) -> None:
    if what not in _warned:
        _warned.add(what)
        log.warning("could not %s; that turn's template-supplied tokens stay supervised (shown once)", what)


class ChatEncoder:
    """Turns normalised messages into right-truncated ``input_ids`` and ``loss_mask``."""

    def __init__(self, tokenizer: Any, seq_length: int, mask_reasoning_content: bool = False,
                 mask_generation_prompt: bool = False) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateError(
                "the tokenizer has no chat template and --chat-template was not set; pass one"
            )
        if not isinstance(tokenizer.chat_template, str):
            raise ChatTemplateError("the tokenizer's chat_template is not a single string; pass --chat-template")
        self.tokenizer = tokenizer
        self.seq_length = seq_length
        self.mask_reasoning_content = mask_reasoning_content
        self.mask_generation_prompt = mask_generation_prompt
        # A template that reads enable_thinking has two generation prompts; the data cannot say
        # which one a turn was generated with, so both are tried (NeMo's rule).
        self.prompt_modes: list[dict[str, bool]] = (
            [{"enable_thinking": True}, {"enable_thinking": False}]
            if "enable_thinking" in tokenizer.chat_template else [{}]
        )
        self.has_generation_blocks = bool(GENERATION_BLOCK.search(tokenizer.chat_template))

    def render(self, messages: list[dict[str, Any]], tools: list[Any] | None) -> str:
        if not messages:
            return ""
        return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)

    def _tokenize(self, text: str, offsets: bool = False) -> Any:
        return self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=offsets)

    def _assistant_spans(self, messages: list[dict[str, Any]], tools: Any, full: str) -> list[tuple[int, int]]:
        spans = []
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:k], tools)
            start = len(before) if full.startswith(before) else _common_prefix(before, full)
            end = _turn_end(self.render(messages[: k + 1], tools), full, start)
            spans.append((start, end))
        return spans

    def _mask_reasoning(self, messages: list[dict[str, Any]], tools: Any, full: str, ids: list[int], mask: np.ndarray) -> None:
        for k, message in enumerate(messages):
            if message["role"] != "assistant" or not message.get("reasoning_content"):
                continue
            cleared = copy.deepcopy(messages)
            cleared[k]["reasoning_content"] = ""
            other_text = self.render(cleared, tools)
            if other_text == full:  # the template does not render this turn's reasoning
                continue
            other = self._tokenize(other_text)["input_ids"]
            head = _common_prefix(ids, other)
            tail = _common_prefix(ids[::-1], other[::-1])
            tail = min(tail, len(ids) - head, len(other) - head)
            mask[head : len(ids) - tail] = 0

    def _prompt_ids(self, messages: list[dict[str, Any]], tools: Any, **kwargs: Any) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **kwargs)
        return self._tokenize(text)["input_ids"]

    def _mask_generation_prompt(self, messages: list[dict[str, Any]], tools: Any, ids: list[int], mask: np.ndarray) -> None:
        """Unsupervise each assistant turn's opening that ``add_generation_prompt`` would emit.

        A turn counts only when the plain prefix render is an exact token prefix of the full
        render, the prompt render appends a block to it, and the turn opens with that whole block;
        anything else leaves the turn supervised (fails closed, as NeMo).
        """
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            try:
                base = self._prompt_ids(messages[:k], tools)
                prompts = [self._prompt_ids(messages[:k], tools, add_generation_prompt=True, **mode)
                           for mode in self.prompt_modes]
            except Exception:
                if k:
                    raise
                _warn_once("render the generation prompt of a leading assistant turn")
                continue
            if ids[: len(base)] != base:
                _warn_once("align the generation prompt")
                continue
            turn = ids[len(base):]
            block = max((_appended_block(base, p, turn) for p in prompts), default=0)
            mask[len(base) : len(base) + block] = 0

    def encode(self, messages: list[dict[str, Any]], tools: list[Any] | None = None) -> EncodedRow:
        """Token ids and loss mask for one conversation (may have zero supervised tokens)."""
        full = self.render(messages, tools)
        if self.has_generation_blocks and full:
            enc = self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            ids = list(enc["input_ids"])
            mask = np.asarray(enc["assistant_masks"], dtype=np.uint8)
        else:
            enc = self._tokenize(full, offsets=True)
            ids = list(enc["input_ids"])
            starts = np.asarray([s for s, _ in enc["offset_mapping"]], dtype=np.int64)
            mask = np.zeros(len(ids), dtype=np.uint8)
            for start, end in self._assistant_spans(messages, tools, full):
                mask[(starts >= start) & (starts < end)] = 1
        if self.mask_generation_prompt:
            self._mask_generation_prompt(messages, tools, ids, mask)
        if self.mask_reasoning_content:
            self._mask_reasoning(messages, tools, full, ids, mask)
        keep = self.seq_length
        return EncodedRow(
            input_ids=np.asarray(ids[:keep], dtype=np.int32),
            loss_mask=(mask[:keep] > 0).astype(np.uint8),
            full_length=len(ids),
        )
