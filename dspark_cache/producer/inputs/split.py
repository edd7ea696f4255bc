"""``--split`` in Hugging Face's slice syntax: ``name``, ``name[a:b]`` (negative bounds count
from the end), ``name[a%:b%]``; parsed into a :class:`SplitSpec`, and split names checked against
the splits an input has.

The slice is taken after the rows are shuffled with ``--shuffle-seed``; it means the same for
every kind of input.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dspark_cache.producer.inputs.rows import InputError

SPLIT_FORMS = ("NAME, NAME[a:b] (rows; either bound may be left out, negative counts from the end) "
               "or NAME[a%:b%] (percent), e.g. 'train', 'train[:1000]', 'train[-500:]', 'train[10%:20%]'")
_SPLIT = re.compile(r"^(?P<name>\w+)(?:\[(?:(?P<a>-?\d+)(?P<ap>%)?)?:(?:(?P<b>-?\d+)(?P<bp>%)?)?\])?$")


@dataclass(frozen=True)
class SplitSpec:
    """A parsed ``--split``: a split's name and an optional slice of it (taken after the shuffle)."""

    name: str
    start: int | None = None
    stop: int | None = None
    percent: bool = False

    @property
    def whole(self) -> bool:
        """True when the split is selected entirely (no slice)."""
        return self.start is None and self.stop is None

    def bounds(self, n: int) -> tuple[int, int]:
        """The ``[start, stop)`` positions this selects of ``n`` rows, as ``datasets`` computes them."""
        return self._bound(self.start, 0, n), self._bound(self.stop, n, n)

    def _bound(self, value: int | None, default: int, n: int) -> int:
        if value is None:
            return default
        if self.percent:
            value = int(round(value * n / 100))  # datasets' default "closest" rounding
        if value < 0:
            value = max(n + value, 0)
        return min(value, n)


def parse_split(split: str | None) -> SplitSpec | None:
    """``--split`` as a :class:`SplitSpec` (None when not given); :class:`InputError` when malformed."""
    if split is None:
        return None
    m = _SPLIT.match(split)
    if not m:
        one = re.match(r"^(\w+)\[(-?\d+)\]$", split)  # HF has no single-row form; say how to write it
        stop = int(one[2]) + 1 if one else 0
        hint = f"; for that one row pass '{one[1]}[{one[2]}:{stop or ''}]'" if one else ""
        raise InputError(f"--split {split!r} is not a split{hint}; pass {SPLIT_FORMS}")
    a, b, a_pct, b_pct = m.group("a", "b", "ap", "bp")
    percent = bool(a_pct or b_pct)
    if percent and ((a is not None and not a_pct) or (b is not None and not b_pct)):
        raise InputError(f"--split {split!r} mixes a percentage and a row count; write both bounds the "
                         f"same way, e.g. '{m['name']}[10%:20%]' or '{m['name']}[100:200]'")
    start, stop = (int(x) if x is not None else None for x in (a, b))
    if percent and any(abs(v) > 100 for v in (start, stop) if v is not None):
        raise InputError(f"--split {split!r}: a percentage bound lies between -100% and 100%")
    return SplitSpec(m["name"], start, stop, percent)


def check_split_name(split: str | None, spec: SplitSpec | None, names: list[str], what: str) -> None:
    """:class:`InputError` when ``--split`` names a split that ``what`` (an input) lacks of ``names``."""
    if spec is not None and spec.name not in names:
        have = ", ".join(repr(n) for n in names)
        instead = names[0] + split[len(spec.name):] if split else names[0]  # the same slice of a split it has
        raise InputError(f"--split {split!r}: {what} has no split {spec.name!r} (it has {have}); "
                         f"pass one of those, e.g. --split '{instead}'")
