"""``python -m dspark_cache.regenerate``: the same as the ``dspark-regenerate`` console script."""

import sys

from dspark_cache.cli import regenerate

if __name__ == "__main__":
    sys.exit(regenerate())
