"""The output file, its sidecars and the resume index (the writer that appends rows: :mod:`.writer`).

``OUTPUT`` (e.g. ``regen.jsonl``) holds one JSON object per line, what ``dspark-produce`` reads;
next to it:

* ``OUTPUT.run``: the run record, the run's :class:`~dspark_cache.regenerate.settings.Identity`
  (msgspec JSON), written before the first row; a rerun with other settings is refused. (Earlier
  builds named it ``OUTPUT.state``; a rerun finds it under that name and renames it, after which
  those builds no longer resume the output.)
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

from dspark_cache.format.atomic import atomic_write_with
from dspark_cache.format.errors import CacheError
from dspark_cache.format.faults import check_write_budget
from dspark_cache.format.schema import REGENERATED_KEY, RowSource
from dspark_cache.regenerate.settings import Identity, identity_diff
from dspark_cache.storage.lock import DirectoryLock, hold_exclusive

log = logging.getLogger(__name__)

# /2: the row's source moved inside its ``regenerated`` record, a local input is named by its absolute path.
RECORD_FORMAT = "dspark-regenerate/2"
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


class RunRecord(msgspec.Struct, kw_only=True):
    """``OUTPUT.run``: how the output's rows are made."""

    format: str = RECORD_FORMAT
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
    def run(self) -> str:
        return self.path + ".run"

    @property
    def legacy_run(self) -> str:
        """Where earlier builds kept the run record (the name is read, never written)."""
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
        return [self.path, self.run, self.legacy_run, self.skipped, self.failed]

    @classmethod
    def of(cls, output: str) -> OutputFiles:
        """The files of ``--output``, named after its real path: a symlink and its target are one output
        (one lock, one run record), whichever a run is given."""
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


def failed_write(path: str, exc: OSError, what: str) -> OutputError:
    """One line for a write to ``path`` that failed: the file, the reason, and what to do."""
    if exc.errno in _FULL:
        return OutputError(f"{path}: the disk is full ({exc.strerror}) while {what}: free space on that "
                           "filesystem, then rerun the same command to resume (the rows written are kept)")
    return OutputError(f"{path}: cannot be written ({exc.strerror or exc}) while {what}: fix the file or its "
                       "directory, then rerun the same command to resume")


def spent(size: int) -> None:
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
            raise failed_write(files.lock, exc, "taking the output's lock") from None
        raise


def _read_record_bytes(files: OutputFiles) -> tuple[str, bytes] | None:
    """The run record's file and bytes: ``OUTPUT.run``, else an earlier build's ``OUTPUT.state``, else
    ``OUTPUT.run`` again (a run holding the lock may rename one to the other while a dry run looks)."""
    for path in (files.run, files.legacy_run, files.run):
        try:
            with open(path, "rb") as handle:
                return path, handle.read()
        except FileNotFoundError:
            continue
    return None


def read_record(files: OutputFiles) -> RunRecord | None:
    found = _read_record_bytes(files)
    if found is None:
        return None
    path, data = found
    try:
        record = msgspec.json.decode(data, type=RunRecord)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise OutputError(
            f"{path} is not a dspark-regenerate run record ({exc}); pass --overwrite to start "
            "over, or choose another --output"
        ) from None
    if record.format != RECORD_FORMAT:
        raise OutputError(
            f"{files.path} was written by another version of dspark-regenerate ({record.format}, this "
            f"one writes {RECORD_FORMAT}): resume it with that version, pass --overwrite to start over, "
            "or choose another --output"
        )
    return record


def check_identity(files: OutputFiles, new: Identity) -> RunRecord | None:
    """The output's run record when a run of ``new`` may resume it, None when there is nothing to resume;
    raises :class:`OutputError` when the output was made otherwise, or holds rows no record explains."""
    old = read_record(files)
    if old is None:
        # Rows without a record: not ours, or ours with the record deleted. Either way nothing says how they
        # were made, and a run must not count them (a leftover OUTPUT.skipped would silently drop its rows).
        leftovers = [p for p in (files.path, files.skipped) if os.path.exists(p) and os.path.getsize(p) > 0]
        if leftovers:
            raise OutputError(
                f"{' and '.join(leftovers)} exist{'s' if len(leftovers) == 1 else ''} but {files.run} "
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
        _write_record(files, RunRecord(identity=new, created_at=time.time()))
        return False
    if not os.path.exists(files.run):  # an earlier build's record, resumed: its name from now on
        try:
            os.replace(files.legacy_run, files.run)
        except OSError as exc:
            raise failed_write(files.legacy_run, exc, "renaming the run record") from None
    return True


def write_lines(path: str, lines: list[bytes], what: str) -> None:
    """Replace ``path`` with ``lines`` atomically; :class:`OutputError` naming it when it cannot be."""
    def fill(handle) -> None:
        for line in lines:
            spent(len(line))
            handle.write(line)

    try:
        atomic_write_with(path, fill)
    except OSError as exc:
        raise failed_write(path, exc, what) from None


def _write_record(files: OutputFiles, record: RunRecord) -> None:
    write_lines(files.run, [msgspec.json.encode(record) + b"\n"], "writing the run record")


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
