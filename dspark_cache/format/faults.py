"""Fault injection for the crash-safety tests; without the variables every call is a no-op.

``DSPARK_CRASH_AT=point:n`` SIGKILLs this process the n-th time ``point`` is reached.
``DSPARK_FAIL_WRITES_AFTER=bytes`` makes shard writes (and ``dspark-regenerate``'s output writes)
fail with ENOSPC past that many bytes (for machines where a small filesystem cannot be mounted).

The points sit at the boundaries that matter for atomic publication (a shard half written,
renamed but not yet indexed, indexed but not yet reported). Without the variable this is a
no-op, so production runs never pay more than a dictionary lookup per shard.
"""

from __future__ import annotations

import errno
import os
import signal
import threading

_counts: dict[str, int] = {}
_counting = threading.Lock()


def crash_point(name: str) -> None:
    """SIGKILL ourselves the n-th time ``name`` is reached, if the environment asks for it."""
    spec = os.environ.get("DSPARK_CRASH_AT")
    if not spec:
        return
    point, _, nth = spec.partition(":")
    if point != name:
        return
    with _counting:  # writer threads reach the same point side by side
        _counts[name] = count = _counts.get(name, 0) + 1
    if count == int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)


def check_write_budget(bytes_written: int) -> None:
    """Raise ENOSPC once this process has written more bytes (a writer's count) than allowed."""
    limit = os.environ.get("DSPARK_FAIL_WRITES_AFTER")
    if limit is not None and bytes_written > int(limit):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
