"""Comparing renders: where two texts or token lists agree, where a turn ends, lone surrogates.

Pure helpers of the chat encoder and its loss-mask rules (``chat.py``).
"""

from __future__ import annotations

import logging
import re
from typing import Any

SURROGATE = re.compile("[\ud800-\udfff]")
log = logging.getLogger("dspark_cache.producer.encode.chat")
_warned: set[str] = set()


def find_surrogate(messages: list[dict[str, Any]], text: str) -> str:
    """Where the first lone surrogate is: a message's content if it is there, else the render."""
    where, m = "the rendered conversation", SURROGATE.search(text)
    for i, message in enumerate(messages):
        found = [(key, hit) for key in ("content", "reasoning_content")
                 if isinstance(message.get(key), str) and (hit := SURROGATE.search(message[key]))]
        if found:
            where, m = f"message {i} {found[0][0]}", found[0][1]
            break
    assert m is not None
    return surrogate_at(where, m)


def surrogate_at(where: str, m: re.Match) -> str:
    """The one description of a lone surrogate ``m`` found in ``where``."""
    return f"{where} holds a lone UTF-16 surrogate (\\u{ord(m.group()):04x}) at character {m.start()}"


def common_prefix(a: str | list[int], b: str | list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    if isinstance(a, str) and isinstance(b, str):  # long renders: compare in blocks first
        block = 4096
        while i + block <= n and a[i : i + block] == b[i : i + block]:
            i += block
    while i < n and a[i] == b[i]:
        i += 1
    return i


def common_suffix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i, block = 0, 4096
    while i + block <= n and a[len(a) - i - block : len(a) - i] == b[len(b) - i - block : len(b) - i]:
        i += block
    while i < n and a[len(a) - 1 - i] == b[len(b) - 1 - i]:
        i += 1
    return i


def turn_end(turn_render: str, full: str, start: int) -> int:
    """Where the turn that ends ``turn_render`` ends inside ``full``.

    Equal when ``turn_render`` is a prefix of ``full`` (NeMo's rule). Otherwise the two differ
    inside the turn (e.g. an inserted think block); the turn's ending is the longest suffix of
    the differing tail of ``turn_render`` that continues ``full`` at the divergence point.
    """
    if full.startswith(turn_render):
        return len(turn_render)
    split = max(start, common_prefix(turn_render, full))
    tail = turn_render[split:]
    for cut in range(len(tail) + 1):
        if full.startswith(tail[cut:], split):
            return split + len(tail) - cut
    return split


def appended_block(base: list[int], prompt: list[int], turn: list[int]) -> int:
    """Length of the block ``prompt`` appends to ``base`` when ``turn`` opens with all of it, else 0."""
    if prompt[: len(base)] != base:
        return 0
    block = prompt[len(base):]
    return len(block) if block and turn[: len(block)] == block else 0


def warn_once(what: str) -> None:
    """Warn that a rule fell back to leaving tokens supervised, once per kind of failure."""
    if what not in _warned:
        _warned.add(what)
        log.warning("could not %s; that turn's template-supplied tokens stay supervised (shown once)", what)
