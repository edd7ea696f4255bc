"""``python -m dspark_cache.tui``: ``dspark-monitor`` where no console script is installed."""

from __future__ import annotations

import sys

from dspark_cache.cli import monitor

if __name__ == "__main__":
    sys.exit(monitor())
