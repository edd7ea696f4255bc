"""The output file, its sidecars, the resume index and the writer that appends rows in input order.

``OUTPUT`` (e.g. ``regen.jsonl``) holds one JSON object per line, what ``dspark-produce`` reads;
next to it:

* ``OUTPUT.state``: the run's :class:`~dspark_cache.regenerate.settings.Identity` (msgspec JSON),
  written before the first row; a rerun with other settings is refused.
* ``OUTPUT.lock``: an flock (``storage.lock``): one run per output.
* ``OUTPUT.skipped``: rows that are done but not in the output (invalid, dropped as truncated, or
  rejected by the server), one JSON object per line: they are not asked again.
* ``OUTPUT.failed``: rows whose requests failed after the retries (rewritten by each run; a rerun
  asks them again and appends them after the rows already written).

Rows are appended in input order (a row that finishes early waits for those before it), so a run
killed at any instant leaves a prefix, and its rerun appends the rest: with no failed row, the same
bytes as an uninterrupted run. Appends go through ``O_APPEND`` writes of whole lines, fsynced every
``fsync_rows`` rows and at the end; a kill can leave at most a torn last line, which resume cuts off.
A write that fails (a full disk) stops the run with one line naming the file; what it left is such a
prefix and a torn line too, so a rerun resumes.

The files are named after the output's real path (``os.path.realpath``): two runs given a symlink and
its target share one lock, and an output that is the input (or lies inside it) is refused before
anything is touched (:func:`overlap`).

A server's rejection of a row is recorded as done (``OUTPUT.skipped``: not asked again) only once some
row of the output got an answer: until then the endpoint is not known to work, and rejecting every row
alike is its fault (a wrong URL or model), not the rows'. Those rejections are held back
(``OrderedWriter.proven``) and listed in ``OUTPUT.failed`` if no answer comes, so a rerun asks them again.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import msgspec

from dspark_cache.format.atomic import atomic_write_with, fsync_dir
from dspark_cache.format.errors import CacheError
from dspark_cache.format.faults import check_write_budget
from dspark_cache.format.schema import REGENERATED_KEY, RowSource
from dspark_cache.regenerate.settings import Identity, identity_diff
from dspark_cache.storage.lock import DirectoryLock, hold_exclusive

log = logging.getLogger(__name__)

# /2: the row's source moved inside its ``regenerated`` record, a local input is named by its absolute path.
STATE_FORMAT = "dspark-regenerate/2"
REJECTED = "rejected"  # a Skipped's reason: the server refused the row's request (a 4xx, an odd answer)
TRUNCATED = "truncated"  # ... the server answered, a turn cut at --max-tokens, and --on-truncated drop
_FULL = (errno.ENOSPC, errno.EDQUOT)
_written = 0  # bytes this process wrote to the output and its sidecars (the fault hook's count)


def _finite(value: Any) -> Any:
    """``value`` with NaN and infinities as null: what JSON holds of them (a float column's missing values)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def encode_line(value: Any, default: Callable[[Any], Any] | None = None) -> bytes:
    """``value`` as one output line: UTF-8 JSON (no ASCII escapes, compact, NaN and infinities as null, which
    strict readers, resume's among them, refuse as numbers), ``default`` for values JSON has no type for.
    TypeError, ValueError or UnicodeEncodeError (a lone surrogate) when it cannot be written."""
    def dump(obj: Any, convert: Callable[[Any], Any] | None) -> str:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), default=convert, allow_nan=False)

    try:
        text = dump(value, default)
    except ValueError as exc:
        if "Out of range float" not in str(exc):
            raise
        text = dump(_finite(value), None if default is None else lambda v: _finite(default(v)))
    return text.encode("utf-8") + b"\n"


class OutputError(CacheError):
    """The output cannot be written or resumed; the message says what to do."""


class State(msgspec.Struct, kw_only=True):
    """``OUTPUT.state``."""

    format: str = STATE_FORMAT
    identity: Identity
    created_at: float = 0.0


class _DoneRecord(msgspec.Struct):
    """The part of a row's ``RowRegeneration`` resume reads."""

    source: RowSource


class _Done(msgspec.Struct):
    """What resume reads of each written line: its input row's position (``regenerated.source.index``)."""

    regenerated: _DoneRecord = msgspec.field(name=REGENERATED_KEY)


class Skipped(msgspec.Struct, kw_only=True):
    """A line of ``OUTPUT.skipped`` or ``OUTPUT.failed``."""

    index: int
    where: str
    reason: str
    detail: str = ""


@dataclass(frozen=True)
class OutputFiles:
    """The output and its sidecars' paths (named here only)."""

    path: str

    @property
    def state(self) -> str:
        return self.path + ".state"

    @property
    def lock(self) -> str:
        return self.path + ".lock"

    @property
    def skipped(self) -> str:
        return self.path + ".skipped"

    @property
    def failed(self) -> str:
        return self.path + ".failed"

    def data_files(self) -> list[str]:
        """What ``--overwrite`` removes (never the lock file: someone may be waiting on it)."""
        return [self.path, self.state, self.skipped, self.failed]

    def exists(self) -> bool:
        return any(os.path.exists(p) for p in (self.path, self.state, self.skipped))

    @classmethod
    def of(cls, output: str) -> OutputFiles:
        """The files of ``--output``, named after its real path: a symlink and its target are one output
        (one lock, one state), whichever a run is given."""
        return cls(os.path.realpath(output))


def overlap(output: str, input_data: str) -> str | None:
    """Why ``output`` (or one of its sidecars) would overwrite the input, or None: it is the input, a
    symlink to it, or inside it when the input is a directory (the real paths compared)."""
    if not os.path.exists(input_data):
        return None  # a hub dataset id: nothing local to overwrite
    source = os.path.realpath(input_data)
    inside = os.path.isdir(source)
    files = OutputFiles.of(output)
    for path in (*files.data_files(), files.lock):
        real = os.path.realpath(path)
        if real == source or (inside and real.startswith(source.rstrip(os.sep) + os.sep)):
            what = "the input" if real == source else "inside the input directory"
            return (f"--output {output} would write {real}, which is {what} --input-data {input_data}: the "
                    "run would overwrite the rows it reads. Choose an --output outside the input")
    return None


def _failed_write(path: str, exc: OSError, what: str) -> OutputError:
    """One line for a write to ``path`` that failed: the file, the reason, and what to do."""
    if exc.errno in _FULL:
        return OutputError(f"{path}: the disk is full ({exc.strerror}) while {what}: free space on that "
                           "filesystem, then rerun the same command to resume (the rows written are kept)")
    return OutputError(f"{path}: cannot be written ({exc.strerror or exc}) while {what}: fix the file or its "
                       "directory, then rerun the same command to resume")


def _spent(size: int) -> None:
    """Count ``size`` bytes written; the fault hook (``DSPARK_FAIL_WRITES_AFTER``) fails a write past its
    budget, as a full disk does, where no small filesystem can be mounted for the tests."""
    global _written
    _written += size
    check_write_budget(_written)


def take_lock(files: OutputFiles) -> DirectoryLock | None:
    """Hold ``OUTPUT.lock`` for this run, or raise naming the run that holds it."""
    def refusal(holder: str) -> CacheError:
        return OutputError(
            f"{files.path} is being written by another dspark-regenerate run ({holder}); wait for it "
            "to finish or stop it (kill -TERM its pid), then rerun; or choose another --output"
        )

    try:
        os.makedirs(os.path.dirname(files.path), exist_ok=True)
        return hold_exclusive(files.lock, {"output": files.path}, refusal)
    except OSError as exc:
        if exc.errno in _FULL:  # else the caller's "choose a writable path"
            raise _failed_write(files.lock, exc, "taking the output's lock") from None
        raise


def read_state(files: OutputFiles) -> State | None:
    try:
        with open(files.state, "rb") as handle:
            state = msgspec.json.decode(handle.read(), type=State)
    except FileNotFoundError:
        return None
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise OutputError(
            f"{files.state} is not a dspark-regenerate state file ({exc}); pass --overwrite to start "
            "over, or choose another --output"
        ) from None
    if state.format != STATE_FORMAT:
        raise OutputError(
            f"{files.path} was written by another version of dspark-regenerate ({state.format}, this "
            f"one writes {STATE_FORMAT}): resume it with that version, pass --overwrite to start over, "
            "or choose another --output"
        )
    return state


def check_identity(files: OutputFiles, new: Identity) -> State | None:
    """The output's state when a run of ``new`` may resume it, None when there is nothing to resume; raises
    :class:`OutputError` when the output was made otherwise, or holds rows with no state to say how."""
    old = read_state(files)
    if old is None:
        # Rows without a state: not ours, or ours with the state deleted. Either way nothing says how they were
        # made, and a run must not count them (a leftover OUTPUT.skipped would silently drop its rows).
        leftovers = [p for p in (files.path, files.skipped) if os.path.exists(p) and os.path.getsize(p) > 0]
        if leftovers:
            raise OutputError(
                f"{' and '.join(leftovers)} exist{'s' if len(leftovers) == 1 else ''} but {files.state} "
                "does not, so nothing says how those rows were made: pass --overwrite to start over, "
                "or choose another --output"
            )
        return None
    diff = identity_diff(old.identity, new)
    if diff:
        lines = "\n".join(f"  {name}: the output has {a!r}, this run has {b!r}" for name, a, b in diff)
        raise OutputError(
            f"{files.path} was made with a different configuration:\n{lines}\nRerun with the "
            "original settings to resume it, pass --overwrite to start over, or choose another --output"
        )
    return old


def check_resume(files: OutputFiles, new: Identity, overwrite: bool) -> bool:
    """Make the output ready for this run (holding its lock); whether earlier rows are resumed."""
    if overwrite:
        for path in files.data_files():
            if os.path.exists(path):
                os.unlink(path)
    if check_identity(files, new) is None:
        _write_state(files, State(identity=new, created_at=time.time()))
        return False
    return True


def _write_lines(path: str, lines: list[bytes], what: str) -> None:
    """Replace ``path`` with ``lines`` atomically; :class:`OutputError` naming it when it cannot be."""
    def fill(handle) -> None:
        for line in lines:
            _spent(len(line))
            handle.write(line)

    try:
        atomic_write_with(path, fill)
    except OSError as exc:
        raise _failed_write(path, exc, what) from None


def _write_state(files: OutputFiles, state: State) -> None:
    _write_lines(files.state, [msgspec.json.encode(state) + b"\n"], "writing the run's state")


def _lines(path: str, cut: bool) -> Iterator[bytes]:
    """Each complete line; a torn last line (no newline: a kill mid-append) is cut off when ``cut`` (a run
    holding the lock), left alone otherwise (a dry run, which may look while a run appends)."""
    try:
        handle = open(path, "rb+" if cut else "rb")
    except FileNotFoundError:
        return
    with handle:
        offset = 0
        for line in handle:
            if not line.endswith(b"\n"):
                if cut:
                    log.info(
                        "%s: cutting off a torn last line (%d bytes) left by an interrupted run",
                        path,
                        len(line),
                    )
                    handle.truncate(offset)
                return
            yield line
            offset += len(line)


def answered_before(files: OutputFiles) -> bool:
    """Whether a row of the output got an answer from a server: a row written, or a line of ``skipped``
    that only an answer (or a rejection recorded after one) puts there."""
    if os.path.exists(files.path) and os.path.getsize(files.path) > 0:
        return True
    return any(msgspec.json.decode(line, type=Skipped).reason in (REJECTED, TRUNCATED)
               for line in _lines(files.skipped, cut=False))  # done_rows has read each: they decode


def done_rows(files: OutputFiles, cut: bool = True) -> set[int]:
    """Positions of the input rows already done: written to the output, or listed as skipped. ``cut``: cut
    off a torn last line (only the run that holds the lock may)."""
    done: set[int] = set()
    decoder = msgspec.json.Decoder(_Done)
    for path, what in ((files.path, "row"), (files.skipped, "skipped row")):
        for number, line in enumerate(_lines(path, cut), 1):
            try:
                index = decoder.decode(line).regenerated.source.index if what == "row" else \
                    msgspec.json.decode(line, type=Skipped).index
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise OutputError(
                    f"{path} line {number} is not a {what} dspark-regenerate wrote ({exc}); the file was "
                    "edited or damaged: pass --overwrite to start over, or choose another --output"
                ) from None
            done.add(index)
    return done


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
            _spent(len(line))
            while view:  # a short write (a signal, a full pipe) must not leave half a line before the next
                view = view[os.write(self._fd, view):]
        except OSError as exc:
            raise _failed_write(self.path, exc, "appending a row") from None
        self._not_durable += 1
        if self._not_durable >= self.every:
            self.make_durable()

    def make_durable(self) -> None:
        """fsync the rows appended since the last time (every ``every`` rows, and at close)."""
        if self._not_durable:
            try:
                os.fsync(self._fd)
            except OSError as exc:
                raise _failed_write(self.path, exc, "making the rows appended durable (fsync)") from None
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
        for step in (self._rows.close, self._skipped.close, self._write_failed, self._sync_dir):
            try:
                step()
            except OutputError as exc:
                first = first or exc
        if first is not None:
            raise first

    def _write_failed(self) -> None:
        if self.failed:
            _write_lines(self.files.failed, [msgspec.json.encode(e) + b"\n" for e in self.failed],
                         "listing the failed rows")
        elif os.path.exists(self.files.failed):
            os.unlink(self.files.failed)

    def _sync_dir(self) -> None:
        """The appended files' creation (and the old failed list's removal) made durable."""
        folder = os.path.dirname(self.files.path)
        try:
            fsync_dir(folder)
        except OSError as exc:
            raise _failed_write(folder, exc, "making the output's directory durable (fsync)") from None
