"""NeMo's optional loss-mask rules, as a mixin of :class:`~dspark_cache.producer.encode.chat.ChatEncoder`.

* ``{% generation %}`` blocks: the tokens inside them are the mask (transformers' rule).
* ``mask_reasoning_content``: each non-empty ``reasoning_content`` span is unsupervised, found by
  re-rendering the conversation without it.
* ``mask_generation_prompt``: in each assistant turn, the tokens the template's generation prompt
  supplies at inference (role header, an inserted empty think block) are unsupervised (NeMo 0.7.0).

Every rule stays within bounded memory on long rows: it works on prefixes of the renders
(``ChatEncoder.tokens``) and, for the reasoning rule's common suffix, on windows cut where both
renders re-align.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

from dspark_cache.producer.encode.text import appended_block, common_prefix, common_suffix, warn_once
from dspark_cache.producer.encode.tokens import MAX_CHARS_PER_TOKEN, Tokens, kept_end, realign


class MaskRules:
    """The rules above; the host class provides ``tokenizer``, ``template``, ``render``, ``tokens``, ``_tokenize``,
    ``_cut_tokens``, ``exact_chars``, ``chars_per_token_guess`` and ``prompt_modes``."""

    def _render_with_generation_spans(self, messages: list[dict[str, Any]], tools: Any) -> tuple[str, list] | None:
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
                return common_prefix(toks.ids[:keep], other_toks.ids[:keep]), (after[0] if after else len(toks))
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

