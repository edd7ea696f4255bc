"""A rank's event log stored in segments on object storage, followed into one local file that only grows.

Objects cannot be appended to, so a producer puts its event log as segments
(``events/rank-N.jsonl.K``, :mod:`.sync`): each rewritten while it grows, left alone once full. A
monitor (:class:`~.monitorcopy.MonitorCopy`) keeps each rank's log as one local file, the concatenation of
the segments it follows: from the first look on, the newest segments (at least ``events_tail`` bytes
of them), then each segment as it grows or appears, appended. A log that does not continue the
local one (a segment followed is gone or shrank, or its bytes differ: the log was started again on
the store, ``--overwrite``) is replaced whole.
"""

from __future__ import annotations

import os
from typing import Callable

from dspark_cache.format.atomic import atomic_write_bytes
from dspark_cache.format.errors import CacheError
from dspark_cache.format.paths import CachePaths
from dspark_cache.storage.remote.store import ObjectInfo
from dspark_cache.storage.remote.sync import MAX_SEGMENT_BYTES

Seen = tuple[int, str]  # (size, ETag) an object was copied from
Get = Callable[[str, int], "tuple[bytes, ObjectInfo] | None"]  # a GET of at most that many bytes; None: gone


class Refused(CacheError):
    """An object the monitor does not copy (too large): a warning, never the end of the monitor."""


class LogCopy:
    """What the local copy of one rank's event log holds: segments ``first`` on, each as (size, ETag)."""

    def __init__(self, first: int, parts: dict[int, Seen] | None = None) -> None:
        self.first = first
        self.parts: dict[int, Seen] = dict(parts or {})

    def size(self) -> int:
        return sum(size for size, _ in self.parts.values())

    def start_of(self, segment: int) -> int:
        return sum(size for k, (size, _) in self.parts.items() if k < segment)


class SegmentedLogs:
    """The local copies of the ranks' segmented logs under ``paths``; ``copies``: what each holds.

    ``get`` fetches an object (the caller counts its requests), ``name`` names one in messages."""

    def __init__(self, paths: CachePaths, get: Get, name: Callable[[str], str], events_tail: int) -> None:
        self.paths, self._get, self._name, self.events_tail = paths, get, name, events_tail
        self.copies: dict[int, LogCopy] = {}

    def follow(self, rank: int, listed: dict[int, ObjectInfo]) -> None:
        """Make rank ``rank``'s local log the concatenation of the segments it follows (``listed``: the
        rank's segments on the store, by number), appending what is new. Raises :class:`Refused`.

        Only the last segment followed grows (the producer rewrites only its open segment), so the
        local file only grows, unless the log was started again."""
        path = self.paths.events(rank)
        known = self.copies.get(rank)
        if known is None or not os.path.exists(path) or any(k not in listed for k in known.parts):
            self._rebuild(rank, listed)
            return
        changed = [k for k in sorted(listed)
                   if k >= known.first and known.parts.get(k) != (listed[k].size, listed[k].etag)]
        if not changed:
            return
        start, last = changed[0], max(known.parts, default=None)
        if last is not None and (
            start < last or (start == last and listed[start].size < known.parts[start][0])
        ):
            self._rebuild(rank, listed)
            return
        fetched = []
        for k in (k for k in sorted(listed) if k >= start):
            got = self._get_segment(rank, k)
            if got is None:  # deleted since the listing: the next refresh sees what replaced it
                break
            fetched.append((k, got))
        offset = known.start_of(start)
        if (
            start in known.parts
            and fetched
            and not _begins(path, offset, fetched[0][1][0][: known.parts[start][0]])
        ):
            self._rebuild(rank, listed)  # not the same log grown
            return
        with open(path, "r+b") as handle:
            handle.seek(offset)
            parts = {k: v for k, v in known.parts.items() if k < start}
            for k, (data, info) in fetched:
                handle.write(data)
                parts[k] = (len(data), info.etag)
            handle.truncate()
        self.copies[rank] = LogCopy(known.first, parts)

    def _rebuild(self, rank: int, listed: dict[int, ObjectInfo]) -> None:
        """A first look (or a log started again): its newest segments, at least ``events_tail`` bytes of them."""
        order = sorted(listed)
        first, total = order[-1], 0
        for k in reversed(order):
            first, total = k, total + listed[k].size
            if total >= self.events_tail:
                break
        chunks, parts = [], {}
        for k in (k for k in order if k >= first):
            got = self._get_segment(rank, k)
            if got is None:
                break
            chunks.append(got[0])
            parts[k] = (len(got[0]), got[1].etag)
        atomic_write_bytes(self.paths.events(rank), b"".join(chunks), durable=False)
        self.copies[rank] = LogCopy(first, parts)

    def _get_segment(self, rank: int, segment: int) -> tuple[bytes, ObjectInfo] | None:
        relative = self.paths.relative(self.paths.events_segment(rank, segment))
        got = self._get(relative, MAX_SEGMENT_BYTES)
        if got is not None and len(got[0]) > MAX_SEGMENT_BYTES:
            raise Refused(
                f"{self._name(relative)} is over {MAX_SEGMENT_BYTES >> 20} MiB (a segment is cut near "
                f"1 MiB): rank {rank}'s events are not shown"
            )
        return got


def _begins(path: str, offset: int, data: bytes) -> bool:
    """Whether the file at ``path`` holds ``data`` at ``offset``."""
    with open(path, "rb") as handle:
        handle.seek(offset)
        return handle.read(len(data)) == data
