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

import copy
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from dspark_cache.producer.encode.text import (
    SURROGATE, appended_block, common_prefix, common_suffix, find_surrogate, turn_end, warn_once,
)
from dspark_cache.producer.encode.template import (
    GENERATION_BLOCK,
    RENDER_CHARS_FLOOR,
    RENDER_CHARS_PER_ROW_CHAR,
    RENDER_SECONDS,
    ChatTemplateError,
    RenderBudget,
    bounded_template,
    render_bounded,
)
from dspark_cache.producer.encode.tokens import (
    CHARS_PER_TOKEN_GUESS, EXACT_CHARS, MAX_CHARS_PER_TOKEN, Tokens, kept_end, realign, stable_count,
)
from dspark_cache.producer.inputs.rows import InvalidRow


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


class ChatEncoder:
    """Turns normalised messages into right-truncated ``input_ids`` and ``loss_mask``."""

    def __init__(self, tokenizer: Any, seq_length: int, mask_reasoning_content: bool = False,
                 mask_generation_prompt: bool = False) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateError(
                "the tokenizer has no chat template and --chat-template was not set; pass one"
            )
        if not isinstance(tokenizer.chat_template, str):
            raise ChatTemplateError(
                "the tokenizer's chat_template is not a single string; pass --chat-template"
            )
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
        probe_template = (
            "{{ messages|tojson }}|{{ tools|tojson }}|{{ documents|tojson }}|{{ add_generation_prompt }}"
            "|{{ enable_thinking }}" + "".join("|{{ %s }}" % name for name in names)
        )
        probe = [
            {"role": "user", "content": "Hi", "name": None},
            {
                "role": "assistant",
                "content": "Hello",
                "reasoning_content": "A greeting.",
                "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
            },
        ]
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        template, self.template = self.template, bounded_template(probe_template)
        try:
            ours = self.render(probe, tools, add_generation_prompt=True, enable_thinking=False)
        finally:
            self.template = template
        theirs = self.tokenizer.apply_chat_template(
            probe,
            tools=tools,
            tokenize=False,
            chat_template=probe_template,
            add_generation_prompt=True,
            enable_thinking=False,
        )
        if ours != theirs:
            log.warning(
                "this transformers hands chat templates other data than our bounded render does; rendering "
                "with its own (a template that loops or renders gigabytes is then not stopped)"
            )
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
            raise InvalidRow(
                "lone surrogate", find_surrogate(messages, text) + ", which is not valid Unicode text"
            )

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

    # -- NeMo's optional loss-mask rules (each bounded as ``tokens`` is) ---------------------------

    def _render_with_generation_spans(
        self, messages: list[dict[str, Any]], tools: Any
    ) -> tuple[str, list] | None:
        """What ``apply_chat_template(..., return_assistant_tokens_mask=True)`` renders, and its spans (None when
        only transformers can render it)."""
        if self.template is None:
            return None
        spans: list[tuple[int, int]] = []
        return self.render(messages, tools, spans=spans), spans

    def _generation_mask(self, messages: list[dict[str, Any]], tools: Any, full: str,
                         limit: int) -> tuple[Tokens, np.ndarray]:
        """Tokens inside ``{% generation %}`` blocks, as transformers marks them (a token overlapping a block)."""
        rendered = self._render_with_generation_spans(messages, tools)
        if rendered is None or rendered[0] != full:
            warn_once("render generation blocks with bounds")
            enc = self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            mask = np.asarray(enc["assistant_masks"], dtype=np.uint8)
            return Tokens(list(enc["input_ids"]), [], [], complete=True), mask
        spans = rendered[1]
        toks = self.tokens(full, limit)
        mask = np.zeros(len(toks), dtype=np.uint8)
        span = 0
        for i, (start, end) in enumerate(zip(toks.starts, toks.ends)):
            while span < len(spans) and start >= spans[span][1]:
                span += 1
            if span == len(spans):
                break
            if end > spans[span][0]:
                mask[i] = 1
        return toks, mask

    def _mask_reasoning(self, messages: list[dict[str, Any]], tools: Any, full: str, toks: Tokens,
                        mask: np.ndarray, keep: int) -> None:
        """Unsupervise each non-empty ``reasoning_content``: the tokens that differ from the render without it."""
        for k, message in enumerate(messages):
            if message["role"] != "assistant" or not message.get("reasoning_content"):
                continue
            cleared = copy.deepcopy(messages)
            cleared[k]["reasoning_content"] = ""
            other_text = self.render(cleared, tools)
            if other_text == full:  # the template does not render this turn's reasoning
                continue
            if toks.complete:
                head, end = self._reasoning_range(toks.ids, self._tokenize(other_text)["input_ids"])
            else:
                head, end = self._reasoning_range_bounded(full, other_text, toks, keep)
            mask[head:end] = 0

    @staticmethod
    def _reasoning_range(ids: list[int], other: list[int]) -> tuple[int, int]:
        """The tokens of ``ids`` outside the longest common token prefix and suffix with ``other``."""
        head = common_prefix(ids, other)
        tail = common_prefix(ids[::-1], other[::-1])
        tail = min(tail, len(ids) - head, len(other) - head)
        return head, len(ids) - tail

    def _reasoning_range_bounded(self, full: str, other: str, toks: Tokens, keep: int) -> tuple[int, int]:
        """``_reasoning_range`` of the whole texts' tokens, within the kept ones, from bounded tokenisations."""
        kept_chars = kept_end(toks, keep)  # character where the kept tokens end
        suffix = common_suffix(full, other)
        same_from = len(full) - suffix  # full[same_from:] == other[same_from - shift:]
        if same_from >= kept_chars:
            # The common token suffix covers only text from same_from on: no kept token is in it.
            other_toks = self.tokens(other, keep)
            return common_prefix(toks.ids[:keep], other_toks.ids[:keep]), keep
        # The renders differ inside the kept text: tokenise both up to the same point past the
        # difference and find a word boundary where both tokenisations re-align; from there on
        # both are the tokens of the same text.
        shift = len(full) - len(other)
        margin = max(4096, self.chars_per_token_guess * 64)
        cap = max(margin, keep * MAX_CHARS_PER_TOKEN)
        while True:
            z = min(len(full), kept_chars + margin)
            a = self._cut_tokens(full, z)
            b = self._cut_tokens(other, z - shift)
            found = realign(a, b, same_from, shift)
            if found is not None:
                # full = a[:i] + T and other = b[:j] + T token-wise, T the tokens of full[start_i:].
                i, j = found
                head = common_prefix(a.ids[: a.stable], b.ids[: b.stable])
                xa, xb = a.ids[:i], b.ids[:j]
                tail = min(common_prefix(xa[::-1], xb[::-1]), len(xa) - head, len(xb) - head)
                return head, len(xa) - tail
            if z == len(full) or margin >= cap:
                warn_once("align the reasoning of a long row on a word boundary (masked by characters)")
                after = [t for t, start in enumerate(toks.starts) if start >= same_from]
                other_toks = self.tokens(other, keep)
                return common_prefix(toks.ids[:keep], other_toks.ids[:keep]), (
                    after[0] if after else len(toks)
                )
            margin *= 2

    def _prompt_ids(self, messages: list[dict[str, Any]], tools: Any, **kwargs: Any) -> list[int]:
        return self._tokenize(self.render(messages, tools, **kwargs))["input_ids"]

    def _generation_prompt_turns(self, messages: list[dict[str, Any]], tools: Any,
                                 keep: int) -> list[tuple[list[int], list[list[int]]]]:
        """(plain prefix ids, generation-prompt ids per mode) of each assistant turn opening among the kept tokens.

        A turn whose prefix render has ``keep`` tokens or more opens past the kept tokens: what
        the rule would unsupervise there is cut anyway, so it is left out (and its prefix is
        never tokenised further than ``keep`` tokens).
        """
        turns = []
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            if not k:  # no conversation before it to render a generation prompt after
                warn_once("render the generation prompt of a leading assistant turn")
                continue
            base = self.tokens(self.render(messages[:k], tools), keep)
            if not base.complete or len(base) >= keep:
                continue
            prompts = [self._prompt_ids(messages[:k], tools, add_generation_prompt=True, **mode)
                       for mode in self.prompt_modes]
            turns.append((base.ids, prompts))
        return turns

    @staticmethod
    def _mask_generation_prompt(turns: list[tuple[list[int], list[list[int]]]], ids: list[int],
                                mask: np.ndarray) -> None:
        """Unsupervise each assistant turn's opening that ``add_generation_prompt`` would emit.

        A turn counts only when the plain prefix render is an exact token prefix of the full
        render, the prompt render appends a block to it, and the turn opens with that whole block;
        anything else leaves the turn supervised (fails closed, as NeMo).
        """
        for base, prompts in turns:
            if ids[: len(base)] != base:
                warn_once("align the generation prompt")
                continue
            turn = ids[len(base):]
            block = max((appended_block(base, p, turn) for p in prompts), default=0)
            mask[len(base) : len(base) + block] = 0

