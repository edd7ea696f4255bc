"""``python -m dspark_cache.verify``: ``dspark-verify`` where no console script is installed."""

from __future__ import annotations

import sys

from dspark_cache.cli import verify

if __name__ == "__main__":
    sys.exit(verify())
