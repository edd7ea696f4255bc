"""The first tokens of a text, known to equal the whole text's: how memory per row stays bounded.

A cut text's tokens are the full text's except in its last few pre-tokenizer words (byte-level
BPE merges never cross a word), so a prefix long enough for ``seq_length`` tokens before those
words gives exactly the tokens the whole text would. The chat encoder grows such prefixes.
"""

from __future__ import annotations

from dataclasses import dataclass

EXACT_CHARS = 1 << 16  # renders up to this many characters are tokenised whole (exact length)
CHARS_PER_TOKEN_GUESS = 8  # first prefix: this many characters per wanted token
MAX_CHARS_PER_TOKEN = 64  # the prefix stops growing here (an unbroken "word" longer than that at the cut)
UNSTABLE_WORDS = 3  # a cut can change the tokens of its last few pre-tokenizer words, never earlier ones


@dataclass
class Tokens:
    """The first tokens of a text: all of them (``complete``) or a prefix known to equal the full text's."""

    ids: list[int]
    starts: list[int]
    ends: list[int]
    complete: bool
    word_ids: list[int | None] | None = None
    stable: int = 0  # of a cut text's tokens, how many lead the whole text's too

    def __len__(self) -> int:
        return len(self.ids)


def stable_count(word_ids: list[int | None], ends: list[int] | None = None, guard: int | None = None) -> int:
    """Leading tokens of a cut text that the whole text shares: all but its last few words'.

    ``guard``: the first character an added (special) token cut by the end of the text could
    start at; the partial token is ordinary text in the cut, so the words from there are unstable too.
    """
    words = [w for w in word_ids if w is not None]
    if not words:
        return 0
    last_word = words[-1]
    if guard is not None and ends is not None:
        last_word = min(
            last_word, next((w for w, e in zip(word_ids, ends) if w is not None and e > guard), last_word)
        )
    last_stable = last_word - UNSTABLE_WORDS
    for i in range(len(word_ids) - 1, -1, -1):
        if word_ids[i] is not None and word_ids[i] <= last_stable:
            return i + 1
    return 0


def kept_end(toks: Tokens, keep: int) -> int:
    """The character where the first ``keep`` tokens end."""
    return toks.ends[min(keep, len(toks)) - 1] if len(toks) else 0


def realign(a: Tokens, b: Tokens, same_from: int, shift: int) -> tuple[int, int] | None:
    """Token indices ``(i, j)`` where ``a`` and ``b`` both start a word at the same place of their
    common text (``a``'s character ``p >= same_from``, ``b``'s ``p - shift``), both among their
    stable tokens; from there on both texts tokenise alike. Complete texts re-align at their ends.
    """
    wa, wb = a.word_ids or [], b.word_ids or []
    sa, sb = a.stable, b.stable
    starts_b = {b.starts[j]: j for j in range(min(sb, len(wb)))
                if wb[j] is not None and (j == 0 or wb[j] != wb[j - 1])}
    for i in range(min(sa, len(wa))):
        if a.starts[i] < same_from or wa[i] is None or (i and wa[i] == wa[i - 1]):
            continue
        j = starts_b.get(a.starts[i] - shift)
        if j is not None:
            return i, j
    return (len(a), len(b)) if a.complete and b.complete else None
