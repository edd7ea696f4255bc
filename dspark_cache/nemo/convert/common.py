"""What both directions share: errors, the result, progress lines, atomic copies, cleaning DST."""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
import sys
import time
from dataclasses import dataclass
from typing import BinaryIO, TextIO

from dspark_cache.format.atomic import atomic_write_with
from dspark_cache.format.errors import CacheError
from dspark_cache.format.files import NotARegularFileError, kind_of, open_regular
from dspark_cache.format.paths import CachePaths
from dspark_cache.format.weights import TargetWeightsError, WeightsFile, check_target_weights
from dspark_cache.nemo import nemo_format
from dspark_cache.storage.output import CacheOutput
from dspark_cache.storage.remote.url import is_remote

_COPY_CHUNK = 16 << 20


class ConvertError(CacheError):
    """Bad input, or a destination that may not be touched: exit status 1."""


class ConvertUsageError(ConvertError):
    """A wrong or missing argument: exit status 2."""


@dataclass
class ConvertResult:
    """What a conversion did (the CLI prints it; the bench reads it)."""

    direction: str  # "dspark" or "nemo": the format written
    samples: int
    shards: int
    shards_kept: int  # published by an earlier, interrupted run and kept
    bytes_before: int  # shard bytes of SRC
    bytes_after: int  # shard bytes of DST
    seconds: float
    pad_token_id: int
    ambiguous: int = 0  # rows whose true length the pad rule had to decide (--to dspark)
    skipped: int = 0  # rows without a single real token (--to dspark)
    pad_source: str = ""  # where the pad id came from (--to dspark)
    allocated_after: int = 0  # disk blocks of DST's shards (--to nemo: the zero padding is sparse)

    @property
    def ratio(self) -> float:
        return self.bytes_before / self.bytes_after if self.bytes_after else float("inf")


class Progress:
    """One stderr line per shard: how far, how fast, how long still."""

    def __init__(self, total_shards: int, total_bytes: int, stream: TextIO | None = sys.stderr) -> None:
        self.total_shards, self.total_bytes, self.stream = total_shards, total_bytes, stream
        self.started = time.perf_counter()
        self.bytes_done = 0  # NeMo-format (padded) bytes of the shards converted in this run, either way
        self.bytes_todo = total_bytes

    def kept(self, shards: int, nbytes: int) -> None:
        """Shards an earlier run published: not part of this run's rate."""
        self.bytes_todo -= nbytes
        if shards and self.stream is not None:
            print(f"dspark-convert: keeping {shards} shard(s) published by an earlier run", file=self.stream)

    def shard_done(self, shard: int, samples: int, nbytes: int) -> None:
        self.bytes_done += nbytes
        if self.stream is None:
            return
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        rate = self.bytes_done / elapsed
        eta = (self.bytes_todo - self.bytes_done) / rate if rate else 0.0
        print(f"dspark-convert: shard {shard + 1}/{self.total_shards}: {samples} samples, "
              f"{self.bytes_done / 1e9:.2f}/{self.bytes_todo / 1e9:.2f} GB, {rate / 1e6:.0f} MB/s, "
              f"ETA {eta:.0f} s", file=self.stream, flush=True)


def _copy_contents(reader: BinaryIO, writer: BinaryIO) -> None:
    """In the kernel when it can (``copy_file_range``: no trip through user memory, a reflink on
    filesystems that have them), else in bounded chunks."""
    try:
        while os.copy_file_range(reader.fileno(), writer.fileno(), _COPY_CHUNK):
            pass
        return
    except OSError:  # not supported between these files: start over the plain way
        reader.seek(0)
        writer.seek(0)
        writer.truncate()
    shutil.copyfileobj(reader, writer, _COPY_CHUNK)


def open_source_file(path: str) -> int:
    """A read-only descriptor of a file of SRC, which must be a regular file (a symlink to one is
    fine): a FIFO would block the read and a device (``/dev/zero``) feed it without end."""
    try:
        return open_regular(path)
    except NotARegularFileError as exc:
        raise ConvertError(
            f"{path} is {exc.reason}: a cache file must be a plain file; put the real file "
            "there (copy it again from the producer's output, or re-run the producer)"
        ) from exc


def copy_file_atomic(src: str, dst: str) -> None:
    """Copy ``src`` to ``dst``; ``dst`` appears complete or not at all."""
    with os.fdopen(open_source_file(src), "rb") as reader:
        atomic_write_with(dst, lambda writer: _copy_contents(reader, writer))


def ensure_weights(src: str, dst: str, source: WeightsFile) -> None:
    """Copy the target weights unless an earlier run already published the same file (``source``:
    what :func:`require_weights` found at ``src``)."""
    if _is_regular(dst):
        try:  # written atomically, but an intact file of the right size can still be another target's
            check_target_weights(dst, None, None, source.xxh3)
            return
        except TargetWeightsError:
            pass
    copy_file_atomic(src, dst)


def require_weights(path: str, vocab_size: int | None, hidden_size: int | None,
                    xxh3: int | None = None) -> WeightsFile:
    """Both formats need ``target_weights.safetensors`` (training initialises the draft from it): the
    source's, checked by format's one rule (shapes ``[vocab, hidden]``, the recorded checksum if any)."""
    try:
        return check_target_weights(path, vocab_size, hidden_size, xxh3)
    except TargetWeightsError as exc:
        if exc.reason == "missing":
            raise ConvertError(
                f"{path} is missing: a cache needs its target's embed_tokens and lm_head weights. "
                "Copy it from the producer's output, or re-run the producer to write it"
            ) from exc
        what = (
            f"{path} is {exc.reason}"
            if isinstance(exc.__cause__, NotARegularFileError)
            else f"{path}: {exc.reason}"
        )
        raise ConvertError(
            f"{what}: the source's target weights cannot be used; copy the file again from the "
            "producer's output, or re-run the producer to write it"
        ) from exc


def _is_regular(path: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def _destination_entries(root: str) -> list[os.DirEntry]:
    """DST's entries under the names a conversion reads, keeps, replaces or deletes: the manifest,
    the weights, NeMo's shards and leftovers at the top, our shards' files in a real ``shards/``."""
    paths = CachePaths(root)
    top = {os.path.basename(paths.manifest), os.path.basename(paths.target_weights)}
    out = [
        entry
        for entry in _scan(root)
        if entry.name in top or nemo_format.SHARD_RE.match(entry.name) or nemo_format.is_leftover(entry.name)
    ]
    # a linked shards/ is refused by CacheOutput.check, never entered
    if not os.path.islink(paths.shards_dir):
        out += [entry for entry in _scan(paths.shards_dir) if entry.name.startswith("shard-")]
    return out


def _scan(directory: str) -> list[os.DirEntry]:
    try:
        with os.scandir(directory) as entries:
            return list(entries)
    except (FileNotFoundError, NotADirectoryError):
        return []


def check_destination_files(root: str, overwrite: bool) -> None:
    """Refuse DST files that are not plain files, before anything is read or deleted: a FIFO would
    block the read of an earlier run's manifest or shard, ``/dev/zero`` feed it without end, a
    symlink make a kept file live outside DST, and a directory cannot be replaced. ``--overwrite``
    removes such an entry itself (never what a link points to), except a directory."""
    for entry in _destination_entries(root):
        mode = entry.stat(follow_symlinks=False).st_mode
        if stat.S_ISREG(mode) or (overwrite and not stat.S_ISDIR(mode)):
            continue
        hint = "" if stat.S_ISDIR(mode) else ", pass --overwrite to replace it"
        raise ConvertError(
            f"{entry.path} is {kind_of(mode)}, not a regular file: dspark-convert reads, keeps and "
            f"replaces only plain files in DST. Remove or rename it{hint}, or choose another DST"
        )


def remove_partials(output: CacheOutput) -> None:
    """Delete what a killed conversion left half-written (never read by anything)."""
    for leftover in output.leftovers():
        os.unlink(leftover)
    root = output.root
    names = os.listdir(root) if os.path.isdir(root) else []
    for name in names:
        if nemo_format.is_leftover(name):  # an interrupted conversion's, in DST's top level
            os.unlink(os.path.join(root, name))


def clear_destination(output: CacheOutput) -> None:
    """What ``--overwrite`` deletes: the files of either cache format, one by one, nothing else
    (never the producer's lock file, never through a symlinked directory)."""
    output.check()
    output.clear()
    for index in nemo_format.shard_indices(output.root):
        os.unlink(nemo_format.shard_path(output.root, index))
    remove_partials(output)
    paths = output.paths
    for sub in (paths.shards_dir, paths.status_dir, paths.events_dir):
        try:
            os.rmdir(sub)
        except OSError:  # absent, or holding something we did not write: leave it
            pass


def lock_cache(output: CacheOutput, required: bool) -> None:
    """Take the producer's own lock (``control/lock``): no dspark-produce, and no other conversion,
    writes DST meanwhile (``output.release()`` lets go). Only where DST is (or will be) in our format
    unless ``required``: a NeMo directory gets no ``control/`` of ours."""
    if not required and not os.path.isdir(output.paths.control_dir):
        return
    output.check()
    output.lock(f"dspark-convert-{os.getpid()}", 1)


def check_paths(src: str, dst: str) -> None:
    """SRC must be a directory (or an object-store URL) other than DST."""
    if is_remote(src):
        if os.path.exists(dst) and not os.path.isdir(dst):
            raise ConvertUsageError(f"DST {dst} exists and is not a directory")
        return
    if not os.path.isdir(src):
        raise ConvertUsageError(f"SRC {src} is not a directory")
    if os.path.exists(dst) and not os.path.isdir(dst):
        raise ConvertUsageError(f"DST {dst} exists and is not a directory")
    if os.path.realpath(src) == os.path.realpath(dst):
        raise ConvertUsageError("SRC and DST are the same directory; convert into a new one")


def lock_destination(root: str) -> int:
    """Hold an exclusive lock on DST (the directory itself: no file is added) until the process
    ends; a second conversion into the same directory is refused instead of interleaving."""
    os.makedirs(root, exist_ok=True)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        os.close(fd)
        raise ConvertError(
            f"another dspark-convert is writing {root}; wait for it or choose another DST"
        ) from exc
    return fd


def file_bytes(paths: list[str]) -> int:
    return sum(os.path.getsize(p) for p in paths if os.path.exists(p))
