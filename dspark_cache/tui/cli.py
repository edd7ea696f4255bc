"""``dspark-monitor CACHE_DIR``: the options and the run (start-up well under a second: no torch, no transformers).

The parser's conventions and the exit codes come from ``dspark_cache.cli`` (which dispatches the
console script to :func:`run`).
"""

from __future__ import annotations

import argparse
import os

from dspark_cache.cli.conventions import EXIT_ERROR, EXIT_OK, EXIT_USAGE, UsageError, exit_codes_epilog
from dspark_cache.format.remote.url import is_remote

PROG = "dspark-monitor"
DESCRIPTION = ("Watch a dspark cache: a live producer run, a finished cache, or one on a shared filesystem. "
               "Without a terminal (a job script's log, a pipe) it prints one plain report and exits.")
EPILOG = exit_codes_epilog(EXIT_OK, EXIT_ERROR, EXIT_USAGE) + " (1 and 2: the plain report's)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The monitor's options (``--version``, ``--log-level`` come from the shared parser in ``dspark_cache.cli``)."""
    parser.add_argument("cache_dir", help="the --output-dir of a dspark-produce run; if it does not exist yet, "
                        "the monitor waits for it")
    parser.add_argument("--refresh", type=float, default=1.0, help="seconds between refreshes (default 1)")
    parser.add_argument("--no-wait", action="store_true",
                        help="exit with code 2 when CACHE_DIR does not exist, instead of waiting for it (for scripts)")
    parser.add_argument("--once", action="store_true",
                        help="print one plain report and exit, as without a terminal: exit 1 when a rank failed or "
                        "fell silent before the cache completed")


def run(args: argparse.Namespace) -> int:
    """Show the monitor until the user quits (a directory not there yet is waited for, on screen), or
    print one plain report without a terminal or with ``--once``."""
    from dspark_cache.tui.report import has_terminal, print_report

    once = args.once or not has_terminal()
    if is_remote(args.cache_dir):
        raise UsageError(f"{args.cache_dir} is on object storage, where no run writes heartbeats yet (dspark-produce "
                         "writes to local directories only); run dspark-monitor on the producer's --output-dir, and "
                         f"dspark-verify {args.cache_dir} to check the cache there")
    if os.path.exists(args.cache_dir) and not os.path.isdir(args.cache_dir):
        raise UsageError(f"{args.cache_dir} is not a directory; pass the --output-dir of a dspark-produce run")
    if (args.no_wait or once) and not os.path.exists(args.cache_dir):
        raise UsageError(f"{args.cache_dir} does not exist; pass the --output-dir of a dspark-produce run "
                         "(only on a terminal and without --no-wait or --once does the monitor wait for it)")
    if args.refresh <= 0:
        raise UsageError("--refresh must be > 0")
    if once:
        return print_report(args.cache_dir, args.refresh)
    from dspark_cache.tui.app import MonitorApp

    MonitorApp(args.cache_dir, refresh=args.refresh).run()
    return EXIT_OK


if __name__ == "__main__":  # the entry's path in scripts written for an earlier release
    from dspark_cache.cli.conventions import not_an_entry

    not_an_entry(PROG, "dspark_cache.tui.cli", "dspark_cache.tui")
