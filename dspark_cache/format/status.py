"""Reading the producer ranks' heartbeat files (shared by the producer's waiters and the TUI)."""

from __future__ import annotations

import os

import msgspec

from dspark_cache.format.paths import CachePaths
from dspark_cache.format.schema import RankStatus

# States in which a rank claims to be working: silence in one of them means it died or hangs.
ACTIVE_RANK_STATES = ("planning", "loading", "running", "waiting", "stopping")


def read_rank_statuses(paths: CachePaths) -> list[RankStatus]:
    """Every readable ``status/rank-N.json``, in rank order (a file mid-replace is skipped)."""
    out = []
    try:
        names = sorted(os.listdir(paths.status_dir))
    except FileNotFoundError:
        return out
    for name in names:
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(paths.status_dir, name), "rb") as handle:
                out.append(msgspec.json.decode(handle.read(), type=RankStatus))
        except (OSError, msgspec.DecodeError):
            continue
    return out
