"""The writer that appends a run's rows to its output in input order, and the appends themselves.

Rows are appended in input order (a row that finishes early waits for those before it), so a run
killed at any instant leaves a prefix of the rows (see :mod:`.output` for the files and the resume).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import msgspec

from dspark_cache.format.atomic import fsync_dir
from dspark_cache.regenerate.output import (
    REJECTED, OutputError, OutputFiles, Skipped, failed_write, spent, write_lines,
)


class Appender:
    """Whole lines appended to one file, fsynced every ``every`` lines and on :meth:`sync`."""

    def __init__(self, path: str, every: int) -> None:
        self.path = path
        self.every = every
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self._not_durable = 0

    def append(self, line: bytes) -> None:
        """Append ``line``; :class:`OutputError` naming the file when it cannot be (a full disk): what is
        left is whole lines and at most a torn last one, which a resume cuts off."""
        view = memoryview(line)
        try:
            spent(len(line))
            while view:  # a short write (a signal, a full pipe) must not leave half a line before the next
                view = view[os.write(self._fd, view):]
        except OSError as exc:
            raise failed_write(self.path, exc, "appending a row") from None
        self._not_durable += 1
        if self._not_durable >= self.every:
            self.make_durable()

    def make_durable(self) -> None:
        """fsync the rows appended since the last time (every ``every`` rows, and at close)."""
        if self._not_durable:
            try:
                os.fsync(self._fd)
            except OSError as exc:
                raise failed_write(self.path, exc, "making the rows appended durable (fsync)") from None
            self._not_durable = 0

    def close(self) -> None:
        if self._fd >= 0:
            try:
                self.make_durable()
            finally:
                os.close(self._fd)
                self._fd = -1


@dataclass
class Finished:
    """A row's outcome, for the writer: a line for the output, a line for ``skipped``, or a failure."""

    row: bytes | None = None
    skipped: Skipped | None = None
    failed: Skipped | None = None
    tokens: int = 0
    answered: bool = False  # the server answered the row (written, or dropped as truncated)


class OrderedWriter:
    """Appends outcomes in the order rows were handed out (``seq``), whatever order they finish in."""

    def __init__(self, files: OutputFiles, fsync_rows: int, proven: bool = True) -> None:
        self.files = files
        self._rows = Appender(files.path, fsync_rows)
        self._skipped = Appender(files.skipped, fsync_rows)
        self._waiting: dict[int, Finished] = {}
        self.next_seq = 0
        self.written = self.skipped = 0
        self.failed: list[Skipped] = []
        # Whether a row of the output got an answer (a resumed output holding rows: one did): until then a
        # rejection may be the endpoint's fault, so it is held back, not recorded as done (the module's doc).
        self.proven = proven
        self._held: list[Skipped] = []
        self.unanswered: list[Skipped] = []  # rows failed or held before the first answer, in order

    @property
    def waiting(self) -> int:
        """Outcomes held back for an earlier row still in flight."""
        return len(self._waiting)

    def put(self, seq: int, outcome: Finished) -> list[Finished]:
        """Hand over row ``seq``'s outcome; the outcomes written now (in order)."""
        self._waiting[seq] = outcome
        out = []
        while self.next_seq in self._waiting:
            done = self._waiting.pop(self.next_seq)
            self.next_seq += 1
            if done.answered and not self.proven:
                self.proven = True
                for entry in self._held:  # rejections of rows, then: now they are recorded as done
                    self._skip(entry)
                self._held.clear()
            if done.row is not None:
                self._rows.append(done.row)
                self.written += 1
            elif done.skipped is not None:
                if done.skipped.reason == REJECTED and not self.proven:
                    self._held.append(done.skipped)
                    self.unanswered.append(done.skipped)
                else:
                    self._skip(done.skipped)
            elif done.failed is not None:
                self.failed.append(done.failed)
                if not self.proven:
                    self.unanswered.append(done.failed)
            out.append(done)
        return out

    def _skip(self, entry: Skipped) -> None:
        self._skipped.append(msgspec.json.encode(entry) + b"\n")
        self.skipped += 1

    def close(self) -> None:
        """fsync and close the appended files, and write this run's failed rows (none: no file); rejections
        still held (no row answered) are listed there too, not recorded as done. Every step is tried; the
        first that fails is raised (:class:`OutputError`, naming its file)."""
        self.failed.extend(self._held)
        self._held.clear()
        first: OutputError | None = None
        for step in (self._rows.close, self._skipped.close, self._write_failed, self._fsync_dir):
            try:
                step()
            except OutputError as exc:
                first = first or exc
        if first is not None:
            raise first

    def _write_failed(self) -> None:
        if self.failed:
            write_lines(self.files.failed, [msgspec.json.encode(e) + b"\n" for e in self.failed],
                         "listing the failed rows")
        elif os.path.exists(self.files.failed):
            os.unlink(self.files.failed)

    def _fsync_dir(self) -> None:
        """The appended files' creation (and the old failed list's removal) made durable."""
        folder = os.path.dirname(self.files.path)
        try:
            fsync_dir(folder)
        except OSError as exc:
            raise failed_write(folder, exc, "making the output's directory durable (fsync)") from None
