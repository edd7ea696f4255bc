"""Following an append-only log from its tail, never holding more than a bounded window of it."""

from __future__ import annotations

import os
from typing import BinaryIO

TAIL_WINDOW = 256 * 1024  # bytes read per log per scan, at most


class LogTail:
    """The read position in one log; each :meth:`read` returns the complete lines added since.

    The first look at a log, or a log that grew by more than ``window`` since the last scan,
    starts ``window`` bytes before its end: older lines are never read, and the line cut by that
    jump is dropped. A line still being written (no newline yet) waits for the next scan.
    """

    def __init__(self, window: int = TAIL_WINDOW) -> None:
        self.window = window
        self.identity: tuple[int, int] | None = None  # (device, inode) of the file followed
        self.offset = 0
        self.aligned = True  # offset is at the start of a line

    def read(self, handle: BinaryIO, st: os.stat_result) -> list[bytes]:
        """Complete lines appended since the last call (at most ``window`` bytes of them)."""
        self._realign(st)
        handle.seek(self.offset)
        # + the byte before a jump, which tells if a line starts there; sized to the file, as
        # read(n) reserves n bytes up front
        data = handle.read(min(self.window, st.st_size - self.offset) + 1)
        start = 0
        if not self.aligned:  # the jump may have landed inside a line: drop up to its end
            newline = data.find(b"\n")
            if newline < 0:
                self.offset += len(data)
                return []
            start, self.aligned = newline + 1, True
        end = max(start, data.rfind(b"\n") + 1)
        self.offset += end
        return data[start:end].splitlines()

    def _realign(self, st: os.stat_result) -> None:
        identity = (st.st_dev, st.st_ino)
        if identity != self.identity or st.st_size < self.offset:  # a new, replaced or truncated log
            self.identity, self.offset, self.aligned = identity, 0, True
        if st.st_size - self.offset > self.window:  # too far behind: only the newest window matters
            self.offset, self.aligned = st.st_size - self.window - 1, False
