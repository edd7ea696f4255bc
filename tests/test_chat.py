"""Loss-mask rules on hand-written conversations, both template variants."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from dspark_cache.producer.chat import ChatEncoder
from dspark_cache.producer.template import ChatTemplateError, resolve_chat_template
from tests.reference import chatml_mask, generation_mask

MULTI_TURN = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "Four.", "reasoning_content": "Add the numbers."},
    {"role": "user", "content": "And three plus three?"},
    {"role": "assistant", "content": "Six.", "reasoning_content": "Again add them up."},
]


def _supervised(tok, row) -> str:
    return tok.decode([i for i, m in zip(row.input_ids.tolist(), row.loss_mask.tolist()) if m])


@pytest.fixture(scope="module")
def tokenizers(embedded):
    return AutoTokenizer.from_pretrained(embedded.stock), AutoTokenizer.from_pretrained(embedded.generation)


def test_stock_multi_turn_gets_history_aware_mask(tokenizers):
    """Stock Qwen3 rewrites earlier turns (NeMo's prefix rule raises); we mask the real render."""
    tok, _ = tokenizers
    full = tok.apply_chat_template(MULTI_TURN, tokenize=False)
    prefix = tok.apply_chat_template(MULTI_TURN[:3], tokenize=False)
    assert not full.startswith(prefix)  # the case NeMo's rule rejects
    row = ChatEncoder(tok, 4096).encode(MULTI_TURN)
    ids, mask = chatml_mask(tok, MULTI_TURN)
    assert row.input_ids.tolist() == ids and row.loss_mask.tolist() == mask
    assert _supervised(tok, row) == (
        "<|im_start|>assistant\nFour.<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nAgain add them up.\n</think>\n\nSix.<|im_end|>\n"
    )


def test_generation_blocks_decide_the_mask(tokenizers):
    _, tok = tokenizers
    row = ChatEncoder(tok, 4096).encode(MULTI_TURN)
    ids, mask = generation_mask(tok, MULTI_TURN)
    assert row.input_ids.tolist() == ids and row.loss_mask.tolist() == mask
    assert "<|im_start|>" not in _supervised(tok, row)  # headers outside the blocks


@pytest.mark.parametrize("variant", [0, 1])
def test_mask_reasoning_content(tokenizers, variant):
    tok = tokenizers[variant]
    plain = ChatEncoder(tok, 4096).encode(MULTI_TURN)
    masked = ChatEncoder(tok, 4096, mask_reasoning_content=True).encode(MULTI_TURN)
    assert masked.input_ids.tolist() == plain.input_ids.tolist()  # tokens stay; only supervision goes
    text = _supervised(tok, masked)
    assert "Again add them up" not in text and "Six." in text
    assert "<think>" in text and "</think>" in text  # the tags stay supervised
    # Only the rendered reasoning (last turn) changed; the history turn's was never rendered.
    dropped = [i for i, (a, b) in enumerate(zip(plain.loss_mask, masked.loss_mask)) if a != b]
    assert tok.decode(plain.input_ids[dropped].tolist()).strip() == "Again add them up."


def test_right_truncation(tokenizers):
    tok, _ = tokenizers
    full = ChatEncoder(tok, 4096).encode(MULTI_TURN)
    cut = ChatEncoder(tok, 20).encode(MULTI_TURN)
    assert cut.input_ids.tolist() == full.input_ids[:20].tolist()
    assert cut.loss_mask.tolist() == full.loss_mask[:20].tolist()
    assert cut.full_length == len(full.input_ids)


def test_single_turn_equals_prefix_rule(tokenizers):
    """Where NeMo's rule applies (the render is prefix-stable) we give exactly its span."""
    tok, _ = tokenizers
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]
    row = ChatEncoder(tok, 4096).encode(msgs)
    start = len(tok.apply_chat_template(msgs[:1], tokenize=True, return_dict=True)["input_ids"])
    assert row.loss_mask.tolist() == [0] * start + [1] * (len(row.input_ids) - start)


def test_chat_template_argument(tmp_path):
    inline = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert resolve_chat_template(inline) == inline
    f = tmp_path / "t.jinja"
    f.write_text(inline)
    assert resolve_chat_template(str(f)) == inline
    j = tmp_path / "t.json"
    j.write_text('{"chat_template": "{{ x }}"}')
    assert resolve_chat_template(str(j)) == "{{ x }}"
    with pytest.raises(ChatTemplateError, match="neither an existing file"):
        resolve_chat_template(str(tmp_path / "missing.jinja"))


NO_REASONING = [
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "Four."},
    {"role": "user", "content": "And three plus three?"},
    {"role": "assistant", "content": "Six."},
]


def _supervised_spans(tok, row) -> list[str]:
    spans, run = [], []
    for token, keep in zip(row.input_ids.tolist(), row.loss_mask.tolist()):
        if keep:
            run.append(token)
        elif run:
            spans.append(tok.decode(run))
            run = []
    return spans + ([tok.decode(run)] if run else [])


@pytest.mark.parametrize("variant", [0, 1])
def test_mask_generation_prompt(tokenizers, variant):
    """NeMo 0.7.0's rule: what add_generation_prompt would emit (role header and, in the Qwen3
    template's non-thinking mode, the empty think block) leaves each assistant turn's loss; a turn
    that carries reasoning keeps its think block (the thinking-mode prompt is the header alone)."""
    tok = tokenizers[variant]
    plain = ChatEncoder(tok, 4096).encode(NO_REASONING)
    masked = ChatEncoder(tok, 4096, mask_generation_prompt=True).encode(NO_REASONING)
    assert masked.input_ids.tolist() == plain.input_ids.tolist()
    ending = "<|im_end|>\n" if variant == 0 else "<|im_end|>"
    assert _supervised_spans(tok, masked) == ["Four." + ending, "Six." + ending]
    assert "<think>\n\n</think>\n\nSix." in _supervised(tok, plain)  # what was removed from the last turn
    reasoning = ChatEncoder(tok, 4096, mask_generation_prompt=True).encode(MULTI_TURN)
    assert _supervised_spans(tok, reasoning)[-1] == "<think>\nAgain add them up.\n</think>\n\nSix." + ending


def test_mask_generation_prompt_counts_truncated_turns_from_the_full_render(tokenizers):
    tok, _ = tokenizers
    full = ChatEncoder(tok, 4096, mask_generation_prompt=True).encode(NO_REASONING)
    cut = ChatEncoder(tok, 12, mask_generation_prompt=True).encode(NO_REASONING)
    assert cut.loss_mask.tolist() == full.loss_mask.tolist()[:12]
