"""``dspark-monitor CACHE_DIR``: start-up stays well under a second (no torch, no transformers)."""

from __future__ import annotations

import argparse
import os
import sys

from dspark_cache.cli.conventions import EXIT_OK, EXIT_USAGE, UsageError, exit_codes_epilog

PROG = "dspark-monitor"
DESCRIPTION = "Watch a dspark cache: a live producer run, a finished cache, or one on a shared filesystem."
EPILOG = exit_codes_epilog(EXIT_OK, EXIT_USAGE)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The monitor's options (``--version``, ``--log-level`` come from the shared parser in ``dspark_cache.cli``)."""
    parser.add_argument("cache_dir", help="the --output-dir of a dspark-produce run; if it does not exist yet, "
                        "the monitor waits for it")
    parser.add_argument("--refresh", type=float, default=1.0, help="seconds between refreshes (default 1)")
    parser.add_argument("--no-wait", action="store_true",
                        help="exit with code 2 when CACHE_DIR does not exist, instead of waiting for it (for scripts)")


def run(args: argparse.Namespace) -> int:
    """Show the monitor until the user quits (a directory not there yet is waited for, on screen)."""
    if os.path.exists(args.cache_dir) and not os.path.isdir(args.cache_dir):
        raise UsageError(f"{args.cache_dir} is not a directory; pass the --output-dir of a dspark-produce run")
    if args.no_wait and not os.path.exists(args.cache_dir):
        raise UsageError(f"{args.cache_dir} does not exist; pass the --output-dir of a dspark-produce run "
                         "(without --no-wait the monitor waits for it)")
    if args.refresh <= 0:
        raise UsageError("--refresh must be > 0")
    from dspark_cache.tui.app import MonitorApp

    MonitorApp(args.cache_dir, refresh=args.refresh).run()
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """``dspark-monitor``: parsed with the shared conventions (``dspark_cache.cli``)."""
    from dspark_cache.cli import monitor

    return monitor(argv)


if __name__ == "__main__":
    sys.exit(main())
