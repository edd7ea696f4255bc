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

Memory per row is bounded by ``seq_length``, not by the row: a render longer than
``EXACT_CHARS`` (and than ``seq_length`` tokens could span) is tokenised only as far as the
kept tokens need. A cut text's tokens are the full text's except in its last few pre-tokenizer
words (byte-level BPE merges never cross a word), so the prefix grows until ``seq_length``
tokens lie before those words; ids and mask are then the ones the whole text gives. The rules
that compare two renders token by token (reasoning, generation prompt) do the same on prefixes
and, for the reasoning rule's common suffix, on windows cut where both renders re-align.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from dspark_cache.producer.encode.rules import MaskRules
from dspark_cache.producer.encode.text import SURROGATE, common_prefix, find_surrogate, turn_end
from dspark_cache.producer.encode.messages import InvalidRow
from dspark_cache.producer.encode.template import (
    GENERATION_BLOCK, RENDER_CHARS_FLOOR, RENDER_CHARS_PER_ROW_CHAR, RENDER_SECONDS, ChatTemplateError, RenderBudget,
    bounded_template, render_bounded,
)
from dspark_cache.producer.encode.tokens import (
    CHARS_PER_TOKEN_GUESS, EXACT_CHARS, MAX_CHARS_PER_TOKEN, Tokens, kept_end, stable_count,
)


log = logging.getLogger(__name__)

try:  # transformers 5 passes a message's reasoning under several names
    from transformers.utils.chat_template_utils import _alias_reasoning_fields as _alias_reasoning
except ImportError:  # pragma: no cover - older transformers
    def _alias_reasoning(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return chat


def text_size(value: Any) -> int:
    """Characters in the strings of a JSON-like value (walked without recursion)."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


@dataclass(frozen=True)
class EncodedRow:
    """One row's sample: its kept tokens and their loss mask."""

    input_ids: np.ndarray  # int32 [L], L <= seq_length
    loss_mask: np.ndarray  # uint8 [L]
    full_length: int  # tokens before truncation; a lower bound (> seq_length) when not full_length_exact
    full_length_exact: bool = True  # False: the row was too long to tokenise whole


class ChatEncoder(MaskRules):
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
        # An added token cut by the end of a prefix is text there: no token from that far back is certain.
        self.guard_chars = max((len(t) for t in tokenizer.get_added_vocab()), default=0)
        # Bounds of the prefix tokenisation (attributes, so that tests can force the bounded path).
        self.exact_chars = EXACT_CHARS
        self.chars_per_token_guess = CHARS_PER_TOKEN_GUESS
        # Bounds of each render (template.py): the size follows the row being encoded.
        self.render_seconds = RENDER_SECONDS
        self.render_chars = RENDER_CHARS_FLOOR
        self.template = bounded_template(tokenizer.chat_template)
        self._check_bounded_render()

    def _check_bounded_render(self) -> None:
        """Our renders must hand a template what ``apply_chat_template`` does; a transformers that prepares
        messages differently is used as it is (checked with a template that prints everything it is given)."""
        if self.template is None:
            return
        names = sorted(self.tokenizer.special_tokens_map)
        probe_template = ("{{ messages|tojson }}|{{ tools|tojson }}|{{ documents|tojson }}|{{ add_generation_prompt }}"
                          "|{{ enable_thinking }}" + "".join("|{{ %s }}" % name for name in names))
        probe = [{"role": "user", "content": "Hi", "name": None},
                 {"role": "assistant", "content": "Hello", "reasoning_content": "A greeting.",
                  "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        template, self.template = self.template, bounded_template(probe_template)
        try:
            ours = self.render(probe, tools, add_generation_prompt=True, enable_thinking=False)
        finally:
            self.template = template
        theirs = self.tokenizer.apply_chat_template(probe, tools=tools, tokenize=False, chat_template=probe_template,
                                                    add_generation_prompt=True, enable_thinking=False)
        if ours != theirs:
            log.warning("this transformers hands chat templates other data than our bounded render does; rendering "
                        "with its own (a template that loops or renders gigabytes is then not stopped)")
            self.template = None

    def render(self, messages: list[dict[str, Any]], tools: list[Any] | None, spans: list | None = None,
               add_generation_prompt: bool = False, **kwargs: Any) -> str:
        """``apply_chat_template(messages, tools=tools, tokenize=False, ...)``, within this row's bounds.

        ``spans`` (a list) receives the ``{% generation %}`` blocks' character spans.
        """
        if not messages:
            return ""
        if self.template is None:
            return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt, **kwargs)
        # What apply_chat_template hands the template: no None-valued keys, reasoning under its aliases.
        chat = _alias_reasoning([{k: v for k, v in m.items() if v is not None} for m in messages])
        budget = RenderBudget(self.render_chars, self.render_seconds)
        return render_bounded(self.template, budget, spans, messages=chat, tools=tools, documents=None,
                              add_generation_prompt=add_generation_prompt,
                              **{**self.tokenizer.special_tokens_map, **kwargs})

    def _tokenize(self, text: str, offsets: bool = False) -> Any:
        return self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=offsets)

    def _encode_text(self, text: str) -> Tokens:
        enc = self._tokenize(text, offsets=True)
        starts = [a for a, _ in enc["offset_mapping"]]
        ends = [b for _, b in enc["offset_mapping"]]
        return Tokens(list(enc["input_ids"]), starts, ends, complete=True, word_ids=enc.word_ids())

    def _cut_tokens(self, text: str, n: int) -> Tokens:
        """Tokens of ``text[:n]``, with how many of them lead ``text``'s own tokens (``stable``)."""
        if n >= len(text):
            toks = self._encode_text(text)
            toks.stable = len(toks)
            return toks
        toks = self._encode_text(text[:n])
        toks.complete = False
        toks.stable = stable_count(toks.word_ids or [], toks.ends, n - self.guard_chars)
        return toks

    def tokens(self, text: str, limit: int) -> Tokens:
        """At least the first ``limit`` tokens of ``text`` (all, when it has no more), bounded memory.

        Short texts are tokenised whole. A longer one is tokenised by prefixes, doubled until
        ``limit`` tokens precede its last ``UNSTABLE_WORDS`` words; those tokens are the whole
        text's. Past ``(limit + 1) * MAX_CHARS_PER_TOKEN`` characters (a single unbroken word
        that long at the cut) the prefix's first tokens are taken as they are.
        """
        n = max(self.exact_chars, limit * self.chars_per_token_guess)
        cap = max(n, (limit + 1) * MAX_CHARS_PER_TOKEN)
        while True:
            cut = self._cut_tokens(text, n)
            if cut.complete:
                return cut
            if cut.stable >= limit or n >= cap:
                keep = cut.stable if cut.stable >= limit else min(limit, len(cut))
                return Tokens(cut.ids[:keep], cut.starts[:keep], cut.ends[:keep], complete=False,
                              word_ids=(cut.word_ids or [])[:keep], stable=keep)
            n = min(2 * n, cap)

    def _assistant_spans(self, messages: list[dict[str, Any]], tools: Any, full: str,
                         until: int | None = None) -> list[tuple[int, int]]:
        """Character spans of the assistant turns in ``full``; those starting at ``until`` or later are left out."""
        spans = []
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:k], tools)
            start = len(before) if full.startswith(before) else common_prefix(before, full)
            if until is not None and start >= until:
                continue  # supervises no kept token
            end = turn_end(self.render(messages[: k + 1], tools), full, start)
            spans.append((start, end))
        return spans

    def check_text(self, messages: list[dict[str, Any]], text: str) -> None:
        """Refuse text that no tokenizer can take (lone surrogates from JSON escapes like \\ud800)."""
        if not text.isascii() and SURROGATE.search(text):
            raise InvalidRow("lone surrogate", find_surrogate(messages, text) + ", which is not valid Unicode text")

    def encode(self, messages: list[dict[str, Any]], tools: list[Any] | None = None) -> EncodedRow:
        """Token ids and loss mask for one conversation (may have zero supervised tokens)."""
        keep = self.seq_length
        self.render_chars = RENDER_CHARS_PER_ROW_CHAR * text_size([messages, tools]) + RENDER_CHARS_FLOOR
        full = self.render(messages, tools)
        self.check_text(messages, full)
        turns = self._generation_prompt_turns(messages, tools, keep) if self.mask_generation_prompt else []
        # The generation-prompt rule compares a turn's whole opening block, which may reach past keep.
        limit = max([keep] + [len(base) + max((len(p) - len(base) for p in prompts), default=0)
                              for base, prompts in turns])
        if self.has_generation_blocks and full:
            toks, mask = self._generation_mask(messages, tools, full, limit)
        else:
            toks = self.tokens(full, limit)
            starts = np.asarray(toks.starts, dtype=np.int64)
            mask = np.zeros(len(toks), dtype=np.uint8)
            until = None if toks.complete else kept_end(toks, keep)
            for start, end in self._assistant_spans(messages, tools, full, until):
                mask[(starts >= start) & (starts < end)] = 1
        if self.mask_generation_prompt:
            self._mask_generation_prompt(turns, toks.ids, mask)
        if self.mask_reasoning_content:
            self._mask_reasoning(messages, tools, full, toks, mask, keep)
        return EncodedRow(
            input_ids=np.asarray(toks.ids[:keep], dtype=np.int32),
            loss_mask=(mask[:keep] > 0).astype(np.uint8),
            full_length=len(toks) if toks.complete else len(toks) + 1,
            full_length_exact=toks.complete,
        )
