"""Crash points for the crash-safety tests: ``DSPARK_CRASH_AT=point:n`` SIGKILLs this process.

The points sit at the boundaries that matter for atomic publication (a shard half written,
renamed but not yet indexed, indexed but not yet reported). Without the variable this is a
no-op, so production runs never pay more than a dictionary lookup per shard.
"""

from __future__ import annotations

import os
import signal

_counts: dict[str, int] = {}


def crash_point(name: str) -> None:
    """SIGKILL ourselves the n-th time ``name`` is reached, if the environment asks for it."""
    spec = os.environ.get("DSPARK_CRASH_AT")
    if not spec:
        return
    point, _, nth = spec.partition(":")
    if point != name:
        return
    _counts[name] = _counts.get(name, 0) + 1
    if _counts[name] == int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)
