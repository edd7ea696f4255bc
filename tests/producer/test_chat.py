"""Loss-mask rules on hand-written conversations, both template variants."""

from __future__ import annotations

import os

import pytest

from dspark_cache.format.paths import CachePaths
from dspark_cache.producer.encode.chat import ChatEncoder
from dspark_cache.producer.encode.template import ChatTemplateError, resolve_chat_template
from tests.support.reference import chatml_mask, generation_mask

MULTI_TURN = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "Four.", "reasoning_content": "Add the numbers."},
    {"role": "user", "content": "And three plus three?"},
    {"role": "assistant", "content": "Six.", "reasoning_content": "Again add them up."},
]


def _supervised(tok, row) -> str:
    return tok.decode([i for i, m in zip(row.input_ids.tolist(), row.loss_mask.tolist()) if m])


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


# --- templates that loop or render gigabytes: each render of a row is bounded -----------------

_TURN = "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
HOSTILE = {  # a body run for a message whose content is "bad"; what the render must be stopped for
    "nested range": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "slow",
    ),
    "loops over a string": (
        "{% set s = m.role * 1000 %}{% for a in s %}{% for b in s %}{% for c in s %}{% endfor %}"
        # no call or attribute inside: only the alarm
        "{% endfor %}{% endfor %}",
        "slow",
    ),
    "nested output": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{{ m.role * 1000 }}{% endfor %}{% endfor %}",
        "large",
    ),
    "string repeat": ("{{ m.role * 1000000000 }}", "large"),
    "center": ("{{ m.role | center(100000 * 100000) }}", "large"),
    "method width": ("{{ m.role.ljust(100000 * 100000) }}", "large"),
    "power": ("{{ 7 ** 10000000 }}", "large"),
    "percent width": ("{{ '%1000000000s' % m.role }}", "large"),
    "format width": ("{{ '{:>1000000000}'.format(m.role) }}", "large"),
    "replace": ("{{ m.role.replace('', 'y' * 1000000) }}", "large"),
    "constant": ("{{ 'x' | center(10000000000) }}", "large"),  # folded while compiling: left to the render
    "append": (
        "{% set ns = namespace(s='y' * 100000) %}{% for i in range(100) %}{% set ns.s = ns.s + ns.s %}"
        "{% endfor %}{{ ns.s }}",
        "large",
    ),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_template_that_loops_or_explodes_on_a_row_makes_it_invalid_quickly(tokenizers, name):
    import time

    from dspark_cache.producer.encode.template import TemplateLimitError

    body, kind = HOSTILE[name]
    tok, _ = tokenizers
    tok = copy_with_template(tok, "{% for m in messages %}{% if m.content == 'bad' %}" + body + "{% endif %}"
                             + _TURN + "{% endfor %}")
    encoder = ChatEncoder(tok, 512)
    encoder.render_seconds = 1.0
    good = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    # an ordinary row renders as transformers renders the template without the trap
    row = encoder.encode(good)
    plain = copy_with_template(tok, "{% for m in messages %}" + _TURN + "{% endfor %}")
    assert (
        row.input_ids.tolist()
        == plain.apply_chat_template(good, tokenize=True, return_dict=True)["input_ids"]
    )
    started = time.monotonic()
    with pytest.raises(TemplateLimitError) as caught:
        encoder.encode([{"role": "user", "content": "bad"}, {"role": "assistant", "content": "ok"}])
    took = time.monotonic() - started
    assert took < 4, took
    if kind == "slow":
        assert caught.value.reason == "template too slow" and "took over 1 s" in caught.value.detail
    else:
        assert caught.value.reason == "template output too large" and caught.value.detail.startswith(
            "template "
        )
    assert encoder.encode(good).input_ids.tolist() == row.input_ids.tolist()  # the encoder still works


def copy_with_template(tok, template: str):
    import copy

    other = copy.deepcopy(tok)
    other.chat_template = template
    return other


@pytest.mark.slow
def test_hostile_template_rows_follow_on_invalid_in_process_and_in_workers(embedded, tmp_path, capsys):
    import json

    import dspark_cache
    from tests.support.produce import run_produce, write_jsonl

    template = (
        "{% for m in messages %}{% if m.content == 'loop' %}" + HOSTILE["nested range"][0] + "{% endif %}"
        "{% if m.content == 'huge' %}" + HOSTILE["nested output"][0] + "{% endif %}" + _TURN + "{% endfor %}"
    )
    rows = [
        [{"role": "user", "content": c}, {"role": "assistant", "content": "ok"}]
        for c in ("hi", "loop", "huge")
    ]
    data = write_jsonl(tmp_path / "d.jsonl", [{"messages": m} for m in rows])
    out = str(tmp_path / "out")
    args = ("--seq-length", "64", "--chat-template", template)
    assert run_produce(embedded.stock, data, out, *args, "--num-workers", "0") == 1
    err = capsys.readouterr().err
    assert f"{data}:2: template rendering took over 5 s on this row" in err, err
    assert f"{data}:3: template rendering passed" in err and "--on-invalid skip" in err
    assert run_produce(embedded.stock, data, out, *args, "--num-workers", "2", "--on-invalid", "skip") == 0
    manifest = dspark_cache.open_cache(out).manifest
    assert manifest.skipped_rows == {"template output too large": 1, "template too slow": 1}
    assert manifest.num_samples == 1, json.dumps(manifest.skipped_rows)


def test_a_chat_template_path_that_is_a_fifo_or_huge_is_refused_unread(tmp_path):
    import os

    fifo = tmp_path / "template.jinja"
    os.mkfifo(fifo)
    with pytest.raises(
        ChatTemplateError, match=r"template\.jinja is a FIFO, not a regular file; pass a template"
    ):
        resolve_chat_template(str(fifo))
    huge = tmp_path / "huge.jinja"
    with open(huge, "wb") as handle:
        handle.truncate(64 << 20)  # sparse: nothing is written, and nothing must be read
    with pytest.raises(
        ChatTemplateError, match=r"huge\.jinja is 67108864 bytes, more than a chat template can be"
    ):
        resolve_chat_template(str(huge))


def test_a_template_that_loops_on_every_row_stops_the_run_after_a_few(
    embedded, tmp_path, capsys, monkeypatch
):
    """Issue 41, item 12: each looping render costs the whole deadline; a dataset of them would take days to
    report, so a part whose first rows all run out of time stops the run at once."""
    from dspark_cache.producer.encode import chat, template as template_module
    from tests.support.produce import run_produce, write_jsonl

    monkeypatch.setattr(chat, "RENDER_SECONDS", 0.3)  # in this process (the rows are encoded here: 0 workers)
    monkeypatch.setattr(template_module, "RENDER_SECONDS", 0.3)
    looping = "{% for m in messages %}" + HOSTILE["nested range"][0] + _TURN + "{% endfor %}"
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
            for i in range(40)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    out = str(tmp_path / "out")
    code = run_produce(embedded.stock, data, out, "--seq-length", "64", "--chat-template", looping,
                       "--num-workers", "0", "--on-invalid", "skip")
    err = capsys.readouterr().err
    assert code == 1, err
    assert "the chat template loops: 3 of 3 rows took over the render deadline" in err, err
    assert f"first: {data}:1: template rendering took over" in err and "fix the template" in err, err
    assert not os.path.exists(CachePaths(out).manifest)
