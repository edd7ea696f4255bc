"""``dspark-monitor CACHE_DIR``: the options and the run (start-up well under a second: no torch, no transformers).

The parser's conventions and the exit codes come from ``dspark_cache.cli`` (which dispatches the
console script to :func:`run`).
"""

from __future__ import annotations

import argparse
import os

from dspark_cache.cli.conventions import (
    EXIT_ERROR, EXIT_OK, EXIT_USAGE, UsageError, add_storage_arguments, error, exit_codes_epilog,
    reader_failure_code, storage_from_args,
)
from dspark_cache.storage.remote.url import is_remote

PROG = "dspark-monitor"
DESCRIPTION = (
    "Watch a dspark cache: a live producer run, a finished cache, one on a shared filesystem or on "
    "object storage (s3://bucket/prefix, polled every few seconds). Without a terminal (a job script's "
    "log, a pipe) it prints one plain report and exits."
)
EPILOG = exit_codes_epilog(EXIT_OK, EXIT_ERROR, EXIT_USAGE) + " (1 and 2: the plain report's)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The monitor's options (``--version``, ``--log-level`` come from the shared parser in ``dspark_cache.cli``)."""
    parser.add_argument("cache_dir", help="the --output-dir of a dspark-produce run (a directory, or "
                        "s3://bucket/prefix); if it does not exist yet, the monitor waits for it")
    parser.add_argument("--refresh", type=float, default=1.0,
                        help="seconds between refreshes (default 1; a cache on object storage: at least "
                        "$DSPARK_SYNC_INTERVAL or 5, how often the producer puts its heartbeats)")
    parser.add_argument(
        "--no-wait",
        action="store_true",
        help="exit with code 2 when CACHE_DIR does not exist, instead of waiting for it (for scripts)",
    )
    parser.add_argument(
        "--once",
        action="store_true",
        help="print one plain report and exit, as without a terminal: exit 1 when a rank failed or "
        "fell silent before the cache completed",
    )
    add_storage_arguments(parser, cache_limit=False, local_cache_help=(  # no tar is read: no --cache-limit
        "where the monitor keeps its copy of the cache's small files, under monitor/ (default "
        "$DSPARK_LOCAL_CACHE_DIR or ~/.cache/dspark-cache/remote)"))


def run(args: argparse.Namespace) -> int:
    """Show the monitor until the user quits (a directory not there yet is waited for, on screen), or
    print one plain report without a terminal or with ``--once``."""
    from dspark_cache.tui.report import has_terminal, print_report

    once = args.once or not has_terminal()
    if args.refresh <= 0:
        raise UsageError("--refresh must be > 0")
    if is_remote(args.cache_dir):
        return run_remote(args, once)
    if args.storage_options is not None or args.local_cache_dir is not None:
        given = [
            option
            for option, value in (
                ("--storage-options", args.storage_options),
                ("--local-cache-dir", args.local_cache_dir),
            )
            if value is not None
        ]
        raise UsageError(
            f"{', '.join(given)} apply to a cache on object storage (s3://bucket/prefix), not to the "
            f"directory {args.cache_dir}; leave them out"
        )
    if os.path.exists(args.cache_dir) and not os.path.isdir(args.cache_dir):
        raise UsageError(
            f"{args.cache_dir} is not a directory; pass the --output-dir of a dspark-produce run"
        )
    if (args.no_wait or once) and not os.path.exists(args.cache_dir):
        raise UsageError(f"{args.cache_dir} does not exist; pass the --output-dir of a dspark-produce run "
                         "(only on a terminal and without --no-wait or --once does the monitor wait for it)")
    if once:
        return print_report(args.cache_dir, args.refresh)
    from dspark_cache.tui.app import MonitorApp

    MonitorApp(args.cache_dir, refresh=args.refresh).run()
    return EXIT_OK


def run_remote(args: argparse.Namespace, once: bool) -> int:
    """A cache on object storage: its small files copied to a local directory and shown from there.

    The store is asked first (a missing bucket, refused credentials or a missing client are one line
    and exit 2, before any screen); the plain report refreshes the copy at once, the app on its
    watcher thread."""
    from dspark_cache.format.errors import CacheError
    from dspark_cache.tui.report import print_report

    storage = storage_from_args(args)
    try:
        from dspark_cache.tui.remote.monitorcopy import MonitorCopy

        copy = MonitorCopy(args.cache_dir, storage)
    except ValueError as exc:  # a URL that is not one of a store we read
        raise UsageError(str(exc)) from None
    except (CacheError, OSError) as exc:
        return error(PROG, str(exc), reader_failure_code(exc))
    from dspark_cache.tui.remote.scanner import RemoteScanner, remote_period

    every = remote_period(copy, args.refresh)
    now = once or args.no_wait  # read before anything is shown: what is not there is an error
    scanner: RemoteScanner | None = None
    try:
        try:
            copy.refresh() if now else copy.check()
        except (CacheError, OSError) as exc:
            return error(PROG, str(exc), reader_failure_code(exc))
        if now and not copy.found:
            raise UsageError(
                f"no dspark cache is stored at {copy.remote} (no manifest, shard, heartbeat or event "
                "log there yet); pass the --output-dir of a dspark-produce run (only on a terminal "
                "and without --no-wait or --once does the monitor wait for it)"
            )
        scanner = RemoteScanner(copy, every, refreshed=now)
        if once:
            return print_report(copy.remote, every, scanner=scanner)
        from dspark_cache.tui.app import MonitorApp

        MonitorApp(copy.remote, refresh=every, scanner=scanner).run()
        return EXIT_OK
    finally:
        (scanner or copy).close()  # the scanner first: no refresh of a copy let go


if __name__ == "__main__":  # the entry's path in scripts written for an earlier release
    from dspark_cache.cli.conventions import not_an_entry

    not_an_entry(PROG, "dspark_cache.tui.cli", "dspark_cache.tui")
