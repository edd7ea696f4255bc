"""``dspark-verify``: check a cache byte for byte, with the same checks the loader relies on.

* :func:`verify_cache` checks every planned shard and returns a :class:`Report`; only a directory
  with no readable manifest raises.
* :func:`repair` rebuilds damaged indexes from intact tars and unpublishes the other corrupt shards.

The command line (options, output, exit codes) is :mod:`.cli`; ``python -m dspark_cache.verify``
runs it.
"""

from __future__ import annotations

from dspark_cache.verify.checks import Report, repair, verify_cache

__all__ = ["Report", "repair", "verify_cache"]
