"""``dspark-monitor CACHE_DIR``: start-up stays well under a second (no torch, no transformers)."""

from __future__ import annotations

import argparse
import os
import sys

from dspark_cache import add_version_argument


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dspark-monitor", description="Watch a dspark cache: a live "
                                     "producer run, a finished cache, or one on a shared filesystem.")
    add_version_argument(parser)
    parser.add_argument("cache_dir")
    parser.add_argument("--refresh", type=float, default=1.0, help="seconds between refreshes (default 1)")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.cache_dir):
        print(f"dspark-monitor: {args.cache_dir} is not a directory; pass the --output-dir of a "
              "dspark-produce run", file=sys.stderr)
        return 2
    if args.refresh <= 0:
        print("dspark-monitor: --refresh must be > 0", file=sys.stderr)
        return 2
    from dspark_cache.tui.app import MonitorApp

    MonitorApp(args.cache_dir, refresh=args.refresh).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
