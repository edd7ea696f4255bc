"""The console scripts: one place for exit codes, argparse conventions and dispatch to each part.

* ``dspark-produce``: options in ``producer/config.py`` (+ ``--tui``), run in ``cli/produce_command.py``
* ``dspark-monitor``: options and run in ``tui/cli.py`` (the app is ``tui.app.MonitorApp``)
* ``dspark-verify``: options and run in ``verify/cli.py`` (the checks are ``verify/checks.py``)
* ``dspark-convert``: options and run in ``nemo/convert/cli.py``

The shared conventions (the exit-code table, ``--version``, ``--log-level``, one-line usage
errors) are ``cli/conventions.py``. A part's module is imported only when its script runs, so
the parts never import each other through here and ``dspark-monitor`` never imports torch.
``--tui`` is handled in ``cli/produce_command.py`` only. A part never imports this package: only
its ``python -m`` entry (``dspark_cache.tui``, ``dspark_cache.verify``: their ``__main__.py``)
starts from here, as the console script does.
"""

from __future__ import annotations

import importlib


def _dispatch(module: str, argv: list[str] | None, **parser_options: bool) -> int:
    """Build the script's parser (conventions + the part's options), parse ``argv``, run the part."""
    from dspark_cache.cli.conventions import new_parser, run_script

    part = importlib.import_module(module)
    parser = new_parser(part.PROG, part.DESCRIPTION, epilog=part.EPILOG, **parser_options)
    part.add_arguments(parser)
    return run_script(parser, part.run, argv)


def produce(argv: list[str] | None = None) -> int:
    """``dspark-produce``; with ``--tui``, the producer runs as a child under the monitor."""
    from dspark_cache.cli.produce_command import main

    return main(argv)


def monitor(argv: list[str] | None = None) -> int:
    """``dspark-monitor CACHE_DIR``."""
    return _dispatch("dspark_cache.tui.cli", argv)


def verify(argv: list[str] | None = None) -> int:
    """``dspark-verify CACHE_DIR [--json] [--repair]``."""
    return _dispatch("dspark_cache.verify.cli", argv)


def convert(argv: list[str] | None = None) -> int:
    """``dspark-convert SRC DST --to {dspark,nemo}``."""
    return _dispatch("dspark_cache.nemo.convert.cli", argv, raw_description=True)
