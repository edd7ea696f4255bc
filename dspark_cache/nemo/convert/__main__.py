"""``python -m dspark_cache.nemo.convert``: ``dspark-convert`` where no console script is installed."""

from __future__ import annotations

import sys

from dspark_cache.cli import convert

if __name__ == "__main__":
    sys.exit(convert())
