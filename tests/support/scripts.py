"""A console script called as a function, returning its exit code for ``--help`` and usage errors too
(argparse raises ``SystemExit`` for those, as the script's process exits with them)."""

from __future__ import annotations

from typing import Callable


def exit_code(script: Callable[[list[str] | None], int], argv: list[str]) -> int:
    try:
        return script(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


def convert(argv: list[str]) -> int:
    """``dspark-convert ARGV``'s exit code."""
    from dspark_cache.cli import convert as script

    return exit_code(script, argv)
