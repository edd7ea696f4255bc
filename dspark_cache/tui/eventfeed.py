"""The newest events of every rank's log, followed from a bounded tail of each (never whole logs)."""

from __future__ import annotations

import os
from collections import deque

import msgspec

from dspark_cache.format.errors import CacheError
from dspark_cache.format.files import open_regular
from dspark_cache.format.schema import Event, decode_json
from dspark_cache.tui.display import clip
from dspark_cache.tui.reading import CacheReader
from dspark_cache.tui.tail import LogTail

MAX_EVENTS = 500  # events kept in memory, newest last
EVENT_TEXT = 500  # characters of an event's kind and message kept (a line may be 256 KiB)


class EventFeed:
    """Keeps a read position per log in ``events_dir`` and the newest :data:`MAX_EVENTS` events.

    State between scans: only the watcher thread may call :meth:`read`.
    """

    def __init__(self, events_dir: str, reader: CacheReader) -> None:
        self.events_dir = events_dir
        self.reader = reader
        self._tails: dict[str, LogTail] = {}
        self._events: deque[Event] = deque(maxlen=MAX_EVENTS)

    def read(self) -> tuple[Event, ...]:
        """The newest events, oldest first, with the new lines of every log since the last call."""
        names = self.reader.listing(self.events_dir)
        for gone in set(self._tails) - set(names):
            del self._tails[gone]
        fresh: list[Event] = []
        for name in names:
            lines = self._new_lines(name)
            fresh = sorted(fresh + decode_events(lines[-MAX_EVENTS:]), key=lambda e: e.time)[-MAX_EVENTS:]
        self._events.extend(fresh)
        return tuple(self._events)

    def _new_lines(self, name: str) -> list[bytes]:
        """The complete lines added to ``events/name`` since the last scan (see :class:`LogTail`)."""
        path = os.path.join(self.events_dir, name)
        try:
            fd = open_regular(path, self.reader.root_real)
            with os.fdopen(fd, "rb") as handle:
                return self._tails.setdefault(name, LogTail()).read(handle, os.fstat(fd))
        except FileNotFoundError:
            return []
        except (CacheError, OSError) as exc:
            self.reader.skip(path, exc)
            return []


def decode_events(lines: list[bytes]) -> list[Event]:
    """The valid events among ``lines``, trimmed to what the monitor shows (a line may be huge)."""
    out = []
    for line in lines:
        try:
            event = decode_json(line, Event)
        except msgspec.DecodeError:
            continue
        shard = event.data.get("shard")
        data = {"shard": shard} if type(shard) is int else {}  # only a real shard id can mark a shard failed
        out.append(Event(time=event.time, rank=event.rank, kind=clip(event.kind, EVENT_TEXT),
                         message=clip(event.message, EVENT_TEXT), data=data))
    return out


def failed_shards(events: tuple[Event, ...]) -> frozenset[int]:
    """Shards an error event names (the event kept only a real integer shard id)."""
    return frozenset(e.data["shard"] for e in events if e.kind == "error" and "shard" in e.data)
