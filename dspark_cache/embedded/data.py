"""A deterministic sample chat dataset: the embedded default input of ``make demo`` and tests.

It mixes what real SFT data holds: OpenAI ``messages`` and ShareGPT ``conversations`` rows,
single and multi-turn, optional system prompts, ``reasoning_content`` on some assistant turns,
and lengths drawn from a skewed distribution with a long tail past 2048 tokens. Two rows have
no assistant turn (nothing to supervise): the producer must skip and count them.
"""

from __future__ import annotations

import json
import random
from typing import Any

_SYLLABLES = (
    "ka ri to na mo le su vi pa de ro ma ne ti lo ra se mi ku ba do fe gu ha ji ke lu "
    "mu no pe qui sa te vo wa xe yo zu al en in on un ar er ir or ur"
).split()
_STOCK = (
    "the of and to in is that for it as with was on be by this are or at from an not which "
    "model token layer state cache shard draft target train speed memory disk write read"
).split()


def _word(rng: random.Random) -> str:
    if rng.random() < 0.45:
        return rng.choice(_STOCK)
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3)))


def _text(rng: random.Random, words: int) -> str:
    out = []
    for i in range(max(1, words)):
        w = _word(rng)
        out.append(w.capitalize() if i == 0 or out[-1].endswith(".") else w)
        if rng.random() < 0.08:
            out[-1] += rng.choice([".", ",", "?", "!"])
    return " ".join(out) + "."


def _length(rng: random.Random) -> int:
    """Skewed turn length in words: mostly short, a long tail (a few past 2048 tokens)."""
    if rng.random() < 0.02:
        return rng.randint(1600, 2600)
    return int(min(900, rng.lognormvariate(3.6, 0.9)))


def sample_row(rng: random.Random, index: int) -> dict[str, Any]:
    turns = 1 if rng.random() < 0.6 else rng.randint(2, 4)
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": _text(rng, rng.randint(4, 20))})
    for _ in range(turns):
        messages.append({"role": "user", "content": _text(rng, _length(rng) // 3 + 2)})
        reply: dict[str, Any] = {"role": "assistant", "content": _text(rng, _length(rng))}
        if rng.random() < 0.25:
            reply["reasoning_content"] = _text(rng, rng.randint(8, 60))
        messages.append(reply)
    if index % 97 == 13:  # a prompt with no answer yet: zero supervised tokens
        messages = [m for m in messages if m["role"] != "assistant"]
    if index % 7 == 3:
        names = {"system": "system", "user": "human", "assistant": "gpt"}
        return {"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in messages]}
    return {"messages": messages}


# Words per token of the embedded tokenizer on this text, measured: turns word counts into
# token lengths for the long-tail profile.
_TOKENS_PER_WORD = 1.6
LONG_TAIL_MEAN_TOKENS = 400
LONG_TAIL_FRACTION = 0.10  # rows at or past seq_length (truncated there)


def long_tail_row(rng: random.Random, index: int, seq_length: int = 2048) -> dict[str, Any]:
    """One chat whose token length follows users' data: a log-normal body (median ~150 tokens,
    mean ~400 over all rows) and ``LONG_TAIL_FRACTION`` of rows at or past ``seq_length``."""
    if rng.random() < LONG_TAIL_FRACTION:
        tokens = rng.randint(int(seq_length * 1.1), int(seq_length * 1.5))
    else:
        tokens = int(min(seq_length * 0.9, rng.lognormvariate(5.1, 0.8)))
    prompt = max(4, int(tokens * rng.uniform(0.1, 0.4)))
    messages = [{"role": "user", "content": _text(rng, int(prompt / _TOKENS_PER_WORD))},
                {"role": "assistant", "content": _text(rng, int((tokens - prompt) / _TOKENS_PER_WORD))}]
    return {"messages": messages}


def sample_rows(num_rows: int, seed: int = 0, profile: str = "default") -> list[dict[str, Any]]:
    """``profile``: ``default`` (mixed forms and turn counts) or ``long-tail`` (see :func:`long_tail_row`)."""
    rng = random.Random(seed)
    if profile == "long-tail":
        return [long_tail_row(rng, i) for i in range(num_rows)]
    if profile != "default":
        raise ValueError(f"unknown sample data profile {profile!r}: use 'default' or 'long-tail'")
    return [sample_row(rng, i) for i in range(num_rows)]


def write_sample_data(path: str, num_rows: int = 600, seed: int = 0, profile: str = "default") -> str:
    """Write the sample dataset as JSONL and return its path."""
    with open(path, "w", encoding="utf-8") as handle:
        for row in sample_rows(num_rows, seed, profile):
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def corpus(num_rows: int = 300, seed: int = 1) -> list[str]:
    """Text to train the embedded tokenizer on (same distribution as the sample data)."""
    texts = ["system user assistant tool think call response"] * 20
    for row in sample_rows(num_rows, seed):
        for m in row.get("messages") or row.get("conversations"):
            texts.append(m.get("content") or m.get("value"))
            if m.get("reasoning_content"):
                texts.append(m["reasoning_content"])
    return texts
