"""``dspark-verify CACHE_DIR [--json] [--repair]``: the options, the output and the exit code.

The checks are :mod:`.checks`; the parser's conventions and the exit codes come from
``dspark_cache.cli`` (which dispatches the console script to :func:`run`).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict

import msgspec

from dspark_cache.cli.conventions import (
    EXIT_ERROR, EXIT_NOT_A_CACHE, EXIT_OK, EXIT_USAGE, add_storage_arguments, exit_codes_epilog,
    reader_failure_code, storage_from_args,
)
from dspark_cache.format.errors import CacheError, NotACacheError
from dspark_cache.format.schema import FORMAT_ID
from dspark_cache.format.validate import InvalidManifestError

PROG = "dspark-verify"
DESCRIPTION = (
    f"Verify a dspark cache ({FORMAT_ID}): manifest, every shard index, every shard, sample checksum "
    "and header."
)
EPILOG = exit_codes_epilog(EXIT_OK, EXIT_ERROR, EXIT_USAGE)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``CACHE_DIR``, ``--json``, ``--repair``."""
    parser.add_argument("cache_dir")
    parser.add_argument("--json", action="store_true", help="print one JSON object for machines")
    parser.add_argument(
        "--repair",
        action="store_true",
        help="rebuild a damaged index from its intact tar; delete other corrupt shards (tar and "
        "index) so that a dspark-produce rerun recomputes them",
    )
    add_storage_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Verify (and repair), print the report; 0 when the cache is complete and intact, 1 when not."""
    from dspark_cache.verify.checks import verdict, print_report, repair, verify_cache

    storage = storage_from_args(args)
    try:
        report = verify_cache(args.cache_dir, storage)
        if args.repair:
            repair(args.cache_dir, report, storage)
    except InvalidManifestError as exc:  # a cache, but its manifest is damaged: a problem found
        print(f"{PROG}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except (NotACacheError, CacheError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return reader_failure_code(exc)
    except OSError as exc:
        print(f"{PROG}: error: {exc}; check the path and its permissions", file=sys.stderr)
        return EXIT_NOT_A_CACHE
    if args.json:
        print(
            msgspec.json.encode({**asdict(report), "ok": report.ok, "state": verdict(report)}).decode()
        )
    else:
        print_report(report)
    return EXIT_OK if report.ok else EXIT_ERROR
