"""``python -m dspark_cache.producer.cli``: ``dspark-produce`` as a module, one process per torchrun rank.

The command itself (options, summary, exit codes) is defined once, in ``dspark_cache.cli``;
this module is only the ``-m`` entry point torchrun and the monitor's ``--tui`` child start.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Run ``dspark-produce`` with ``argv`` (not ``--tui``: this is what ``--tui`` starts as its child)."""
    from dspark_cache.cli.produce_command import main as produce_main

    return produce_main(argv, allow_tui=False)


if __name__ == "__main__":
    sys.exit(main())
