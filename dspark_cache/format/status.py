"""Reading the producer ranks' heartbeat files (shared by the producer's waiters and the TUI)."""

from __future__ import annotations

import os

import msgspec

from dspark_cache.format.errors import CacheError
from dspark_cache.format.files import read_regular
from dspark_cache.format.paths import CachePaths
from dspark_cache.format.schema import RankStatus

# States in which a rank claims to be working: silence in one of them means it died or hangs.
ACTIVE_RANK_STATES = ("planning", "loading", "running", "waiting", "stopping")
MAX_STATUS_BYTES = 1 << 20  # a heartbeat is a few hundred bytes


def read_rank_statuses(paths: CachePaths) -> list[RankStatus]:
    """Every readable ``status/rank-N.json``, in rank order (a file mid-replace is skipped, and so is
    anything that is not a small regular file: a FIFO there must not hang a waiting rank)."""
    out = []
    try:
        names = sorted(os.listdir(paths.status_dir))
    except FileNotFoundError:
        return out
    for name in names:
        if not name.endswith(".json"):
            continue
        try:
            data = read_regular(os.path.join(paths.status_dir, name), MAX_STATUS_BYTES)
            out.append(msgspec.json.decode(data, type=RankStatus))
        except (OSError, CacheError, msgspec.DecodeError):
            continue
    return out
