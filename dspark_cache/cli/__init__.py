"""The console scripts: one place for exit codes, argparse conventions and dispatch to each part.

Each part exposes ``PROG``, ``DESCRIPTION``, ``EPILOG``, ``add_arguments(parser)`` and
``run(args)`` in its ``cli`` module; this package builds the parser (``cli/conventions.py``: the
exit-code table, ``--version``, ``--log-level``, one-line usage errors) and runs it:

* ``dspark-produce``: ``producer/cli.py``; ``--tui`` (the monitor in the foreground, the producer as
  its child) joins the producer and the monitor, so it is composed here
* ``dspark-monitor``: ``tui/cli.py`` (the app is ``tui.app.MonitorApp``)
* ``dspark-verify``: ``verify/cli.py`` (the checks are ``verify/checks.py``)
* ``dspark-convert``: ``nemo/convert/cli.py``
* ``dspark-regenerate``: ``regenerate/cli.py`` (the run is ``regenerate/run.py``)

A part's module is imported only when its script runs, so the parts never import each other
through here and ``dspark-monitor`` never imports torch. A part never imports this module: only
its ``python -m`` entry (its ``__main__.py``) starts from here, as the console script does. What
every console program shares is in modules of their own that any part may import: ``conventions``
(exit codes, usage errors) and ``lifetime`` (children that end with their parent).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Callable


def _dispatch(module: str, argv: list[str] | None, run: Callable[[argparse.Namespace], int] | None = None,
              **parser_options: bool) -> int:
    """Build the script's parser (conventions + the part's options), parse ``argv``, run the part."""
    from dspark_cache.cli.conventions import new_parser, run_script

    part = importlib.import_module(module)
    parser = new_parser(part.PROG, part.DESCRIPTION, log_level=getattr(part, "LOG_LEVEL", "WARNING"),
                        epilog=part.EPILOG, **parser_options)
    part.add_arguments(parser)
    return run_script(parser, run or part.run, argv)


def produce(argv: list[str] | None = None) -> int:
    """``dspark-produce``; with ``--tui``, the producer runs as a child under the monitor."""
    given = list(sys.argv[1:] if argv is None else argv)

    def foreground(cfg) -> int:
        from dspark_cache.tui.foreground import run_with_monitor

        # The child's output goes to a log file: log lines, never bars, even if the setting were forced.
        child_argv = [a for a in given if a not in ("--tui", "--no-progress")] + ["--no-progress"]
        return run_with_monitor(child_argv, cfg.output_dir)

    part = "dspark_cache.producer.cli"
    return _dispatch(part, argv, lambda args: importlib.import_module(part).run(args, foreground))


def produce_rank(argv: list[str] | None = None) -> int:
    """``python -m dspark_cache.producer``: one torchrun rank, or the child under ``--tui`` (no ``--tui`` itself)."""
    return _dispatch("dspark_cache.producer.cli", argv)


def monitor(argv: list[str] | None = None) -> int:
    """``dspark-monitor CACHE_DIR``."""
    return _dispatch("dspark_cache.tui.cli", argv)


def verify(argv: list[str] | None = None) -> int:
    """``dspark-verify CACHE_DIR [--json] [--repair]``."""
    return _dispatch("dspark_cache.verify.cli", argv)


def convert(argv: list[str] | None = None) -> int:
    """``dspark-convert SRC DST --to {dspark,nemo}``."""
    return _dispatch("dspark_cache.nemo.convert.cli", argv, raw_description=True)


def regenerate(argv: list[str] | None = None) -> int:
    """``dspark-regenerate --input-data ROWS --output OUT.jsonl --endpoint URL [--endpoint URL ...]``."""
    return _dispatch("dspark_cache.regenerate.cli", argv)
