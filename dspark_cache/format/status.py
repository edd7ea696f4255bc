"""The producer ranks' heartbeat files: reading them, and the one rule for when a rank is live.

A working rank rewrites ``status/rank-N.json`` every :data:`HEARTBEAT_EVERY_S`. Whoever asks
whether it is still there (the monitor's STALE mark, a finished rank waiting for the others)
asks :func:`rank_is_live`, each with its own patience: the monitor flags a rank after
:data:`STALE_AFTER_S`, a waiting rank gives up after ``--rank-timeout`` (default
:data:`RANK_TIMEOUT_S`), since giving up early costs a rerun while a flag costs nothing.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable

import msgspec

from dspark_cache.format.errors import CacheError
from dspark_cache.format.files import read_regular
from dspark_cache.format.paths import CachePaths
from dspark_cache.format.schema import RankPhase, RankStatus, decode_json

# Phases in which a rank claims to be working: silence in one of them means it died or hangs.
ACTIVE_PHASES = RankPhase.ACTIVE  # phases whose heartbeat a live rank keeps fresh
MAX_STATUS_BYTES = 1 << 20  # a heartbeat is a few hundred bytes
HEARTBEAT_EVERY_S = 1.0  # a working rank rewrites its status this often, even during a long step
STALE_AFTER_S = 10.0  # ten missed heartbeats: the monitor shows the rank as STALE
RANK_TIMEOUT_S = 300.0  # default --rank-timeout: a finished rank stops waiting for a silent one


def process_gone(status: RankStatus) -> bool:
    """Whether the rank's process is known to be gone: it ran on this host, and its pid is free, a
    zombie, or another process's (one started after the rank's). Elsewhere, only its heartbeat tells."""
    if status.host != socket.gethostname():
        return False
    import psutil

    try:
        proc = psutil.Process(status.pid)
        # A killed child stays a zombie until reaped; a newer process may have taken its pid.
        return proc.status() == psutil.STATUS_ZOMBIE or proc.create_time() > status.started_at + 1.0
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:  # not ours to inspect: its heartbeat decides
        return False


def rank_is_live(status: RankStatus, now: float, timeout: float = STALE_AFTER_S, *,
                 processes: bool = False) -> bool:
    """Whether the rank claims to be working and its heartbeat is at most ``timeout`` s old; with
    ``processes``, also that its process is not known gone (:func:`process_gone`: a SIGKILLed rank on
    this host is seen at once, not ``timeout`` s later).

    A heartbeat from the future (clocks of two hosts disagree) counts as fresh.
    """
    return (status.phase in ACTIVE_PHASES and now - status.updated_at <= timeout
            and not (processes and process_gone(status)))


def rank_is_stale(status: RankStatus, now: float, timeout: float = STALE_AFTER_S, *,
                  processes: bool = False) -> bool:
    """Whether the rank claims to be working but has been silent for more than ``timeout`` s (or, with
    ``processes``, its process is known gone)."""
    return status.phase in ACTIVE_PHASES and not rank_is_live(status, now, timeout, processes=processes)


def partial_is_written(shard: int, modified_at: float, statuses: Iterable[RankStatus], now: float,
                       timeout: float = STALE_AFTER_S) -> bool:
    """Whether shard ``shard``'s ``.partial`` (last modified at ``modified_at``) has a live writer.

    A live rank says it writes the shard (or, from an older producer, computes it), or some rank is
    live and the file changed within ``timeout``: the writer thread trails the device by up to the
    host ring. A killed run's ``.partial`` is neither (resume deletes it).
    """
    live = [s for s in statuses if rank_is_live(s, now, timeout)]
    if any(s.shard == shard or shard in s.writing for s in live):
        return True
    return bool(live) and now - modified_at <= timeout


def read_rank_status(path: str, within: str | None = None) -> RankStatus:
    """One heartbeat file: a small regular file (``within``: refused if it leads out of that directory).

    Raises ``OSError`` (``FileNotFoundError`` when it is gone), :class:`CacheError` (not a small
    regular file) or ``msgspec.DecodeError`` (mid-replace or damaged).
    """
    return decode_json(read_regular(path, MAX_STATUS_BYTES, within), RankStatus)


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
            out.append(read_rank_status(os.path.join(paths.status_dir, name)))
        except (OSError, CacheError, msgspec.DecodeError):
            continue
    return out
