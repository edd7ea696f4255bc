"""``python -m dspark_cache.producer``: ``dspark-produce`` as a module, one process per torchrun rank.

The command itself (options, run, summary, exit codes) is ``producer/cli.py``, dispatched by
``dspark_cache.cli`` as the console script is; this module is only the ``-m`` entry point that
torchrun and the monitor's ``--tui`` child start.
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> int:
    """Run ``dspark-produce`` with ``argv`` (not ``--tui``: this is what ``--tui`` starts as its child)."""
    from dspark_cache.cli import produce_rank

    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun rank: its agent is our parent
        from dspark_cache.cli.lifetime import PARENT_DEATH_SIGNAL, die_with_parent

        # An agent SIGKILLed by a scheduler cannot forward its signal: the rank would run on, or wait in
        # a collective for a partner, forever. The notice stops it at a shard boundary, resumable.
        die_with_parent(os.getppid(), PARENT_DEATH_SIGNAL)
    return produce_rank(argv)


if __name__ == "__main__":
    sys.exit(main())
