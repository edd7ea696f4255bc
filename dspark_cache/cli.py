"""Console entry points that compose the parts (producer, TUI) without them importing each other."""

from __future__ import annotations

import sys


def produce(argv: list[str] | None = None) -> int:
    """``dspark-produce``; with ``--tui``, the producer runs as a child under the monitor."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--tui" not in argv:
        from dspark_cache.producer.cli import main

        return main(argv)
    rest = [a for a in argv if a != "--tui"]
    from dspark_cache.producer.config import parse_config

    cfg = parse_config(rest)  # usage errors surface here, before the screen takes over
    from dspark_cache.tui.foreground import run_with_monitor

    return run_with_monitor(rest, cfg.output_dir)


def monitor(argv: list[str] | None = None) -> int:
    from dspark_cache.tui.cli import main

    return main(argv)


def verify(argv: list[str] | None = None) -> int:
    from dspark_cache.verify import main

    return main(argv)


def convert(argv: list[str] | None = None) -> int:
    from dspark_cache.nemo.convert.cli import main

    return main(argv)
