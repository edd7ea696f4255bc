"""Text laid out to a width by the monitor itself, so that no value is ever broken across lines.

Textual wraps a line at its spaces and folds a word wider than the line mid-word: ``880.0 MB``
could end one line and start the next as ``MB``, a path or a long number be cut anywhere. So a
widget says what may not be broken: a :class:`Para` is a list of pieces (a value with its label, a
word of a sentence), lines break only between pieces, and a piece wider than a whole line is
shortened in its middle with an ellipsis, which keeps both a path's start and its file name.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from rich.cells import cell_len, get_character_cell_size
from rich.text import Text

from dspark_cache.tui.display import clip

ELLIPSIS = "…"
MAX_PIECE = 600  # characters kept of one piece: a file may hold megabytes on one line


@dataclass(frozen=True)
class Para:
    """Pieces on as many lines as the width needs, ``sep`` between two on one line; continuation
    lines start ``indent`` cells in (at most half the width)."""

    pieces: Sequence[Text]
    sep: str = "  "
    indent: int = 0


def piece(value: object, style: str = "") -> Text:
    """One unbreakable piece: ``value`` as plain text on one line (never read as markup)."""
    return Text(clip(str(value), MAX_PIECE), style=style)


def words(template: str, style: str = "", **values: object) -> list[Text]:
    """The words of ``template`` as pieces; a word holding ``$name`` takes ``values[name]`` whole,
    so ``"the rest ($rest) will not fit"`` never breaks inside ``(1.5 GB)``."""
    out = []
    for word in template.split():
        for name, value in values.items():
            word = word.replace(f"${name}", str(value))
        out.append(piece(word, style))
    return out


def shorten(text: Text, width: int) -> Text:
    """``text`` in at most ``width`` cells: its start and end with an ellipsis between."""
    if text.cell_len <= width:
        return text
    room = max(0, width - cell_len(ELLIPSIS))
    head = _cells_from_start(text.plain, room - room // 2)
    tail = len(text.plain) - _cells_from_start(text.plain[::-1], room // 2)
    out = text[:head]
    out.append(ELLIPSIS, style=text.style)
    out.append_text(text[tail:])
    return out


def _cells_from_start(plain: str, cells: int) -> int:
    """How many characters from the start of ``plain`` fit in ``cells`` cells."""
    used = 0
    for count, char in enumerate(plain):
        used += get_character_cell_size(char)
        if used > cells:
            return count
    return len(plain)


def flow(para: Para, width: int | None) -> list[Text]:
    """The lines of ``para``: each at most ``width`` cells (None: one line, however long)."""
    indent = 0 if width is None else min(para.indent, width // 2)
    lines: list[Text] = []
    line: Text | None = None
    for p in para.pieces:
        if line is not None and width is not None and line.cell_len + cell_len(para.sep) + p.cell_len > width:
            lines.append(line)
            line = None
        if line is None:
            line = Text(" " * indent) if lines else Text()
            if width is not None:
                p = shorten(p, max(1, width - line.cell_len))
        else:
            line.append(para.sep)
        line.append_text(p)
    if line is not None:
        lines.append(line)
    return lines


def fit(paras: Iterable[Para], width: int | None) -> Text:
    """Every paragraph laid out to ``width``, one after the other."""
    return Text("\n").join(line for para in paras for line in flow(para, width))
