"""The write side of a cache directory: :class:`CacheOutput`, the twin of ``cache.CacheDir``.

One object owns an output directory's life for the producer and ``dspark-convert``: the lock
and its holder (``lock``), the checks that its directories are real, which files are ours,
clearing for ``--overwrite``, the manifest written and completed, the current ``cache_id``,
shards published and unpublished, and the set of published shards. Its interface is about
objects (a whole file written, a shard published, files listed, read or deleted, the directory
locked), so that a storage backend other than a local directory plugs in here.

The producer deletes files in ``shards/``, ``status/``, ``events/``, ``control/`` and ``plan/``
(leftovers on resume, earlier runs' heartbeats, everything it wrote on ``--overwrite``). Through
a symlink that would delete files outside the cache, so a cache whose sub-directories are not
real directories is refused before anything is deleted or written. Deletion is file by file, of
names this tool writes (as :class:`CachePaths` spells them), never a tree and never through a link.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import time
from typing import Callable, Iterable, Iterator

from dspark_cache.format.errors import CacheError
from dspark_cache.format.files import kind_of
from dspark_cache.format.lock import DirectoryLock, check_lock_file, lock_exclusive, lock_shared
from dspark_cache.format.manifest import read_manifest, write_manifest
from dspark_cache.format.paths import PLAN_ARRAYS, PLAN_PART_KINDS, CachePaths, temporary_base
from dspark_cache.format.schema import Manifest, ShardIndex
from dspark_cache.format.tar.reader import load_shard_index
from dspark_cache.format.tar.writer import ShardWriter, write_index
from dspark_cache.format.wids_index import write_wids_index

_NUMBER = re.compile(r"\d+")


class CacheDirectoryError(CacheError):
    """A directory of the cache is a symlink or not a directory at all, or a name of ours is not a file."""


def _cache_dirs(paths: CachePaths) -> list[str]:
    return [paths.shards_dir, paths.status_dir, paths.events_dir, paths.control_dir, paths.plan_dir]


def _check_directories(paths: CachePaths) -> None:
    """Refuse a cache whose own directories are symlinks or other non-directories.

    The output directory itself may be a symlink (the user chose where the cache lives); its
    sub-directories may not: the producer deletes files in them.
    """
    if os.path.lexists(paths.root) and not os.path.isdir(paths.root):
        raise CacheDirectoryError(f"--output-dir {paths.root} exists and is not a directory; choose another --output-dir")
    for sub in _cache_dirs(paths):
        if os.path.islink(sub):
            raise CacheDirectoryError(
                f"{sub} is a symbolic link (to {os.readlink(sub)}); dspark-produce deletes and replaces files in "
                "this directory, so it refuses to follow a link out of the cache. Replace the link with a real "
                "directory (moving in the files that belong to this cache), or choose another --output-dir"
            )
        if os.path.lexists(sub) and not os.path.isdir(sub):
            raise CacheDirectoryError(
                f"{sub} is not a directory; the cache needs a directory there. Remove or rename it, "
                "or choose another --output-dir"
            )
    check_lock_file(paths.lock)
    _check_leftovers(paths)


def _check_leftovers(paths: CachePaths) -> None:
    """Resume and ``--overwrite`` delete the writer's leftovers: each must be a regular file it could have
    written. Anything else with such a name (a directory, FIFO, device, symlink) is not deleted: refused."""
    if os.path.islink(paths.shards_dir) or not os.path.isdir(paths.shards_dir):
        return
    _refuse_odd([path for path in paths.partial_files() if not _is_regular(path)])


def _check_written_names(paths: CachePaths) -> None:
    """The producer, before planning: anything but a file (or a link) under a name it writes, replaces
    or appends to in a sub-directory (a published shard, an index, a heartbeat, the event log, the stop
    request) is refused: reached mid-run it would hang the run (a FIFO as the event log) or stop it
    with a bare errno after hours. The top level's manifest and target weights have their own rules (a
    reader refuses a manifest that is not a file; a rerun replaces damaged weights and names a
    directory there); dspark-convert checks its destination its own way."""
    _refuse_odd([path for path in _written_files(paths, dirs=True)
                 if os.path.dirname(path) != paths.root and _is_odd(path)])


def _refuse_odd(odd: list[str]) -> None:
    if odd:
        named = "; ".join(f"{path} is {_kind(path)}, not a regular file" for path in odd[:5])
        raise CacheDirectoryError(
            f"{named}{' ...' if len(odd) > 5 else ''}, but named as dspark-produce names the files it writes or "
            "deletes. dspark-produce writes and deletes only its own files: move or rename it, or choose another "
            "--output-dir"
        )


def _kind(path: str) -> str:
    try:
        return kind_of(os.lstat(path).st_mode)
    except FileNotFoundError:
        return "gone"


def _is_odd(path: str) -> bool:
    """Neither a regular file nor a symlink (a link is replaced by the writer's rename, never followed)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISLNK(mode))


def _is_regular(path: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except FileNotFoundError:  # gone since the listing: nothing to refuse
        return True


def _made_by(name: str, makers: list[Callable[[int], str]]) -> bool:
    """``name`` is ``basename(make(n))`` for some number in it, or an atomic-write temporary of one."""
    for digits in set(_NUMBER.findall(name)):
        for make in makers:
            base = os.path.basename(make(int(digits)))
            if name == base or temporary_base(name) == base:
                return True
    return False


def _entries(directory: str, dirs: bool = False) -> Iterator[tuple[str, str]]:
    """(name, path) of the non-directory entries of a real directory (links listed, not followed);
    ``dirs``: directories too."""
    if os.path.islink(directory) or not os.path.isdir(directory):
        return
    for entry in os.scandir(directory):
        if dirs or not entry.is_dir(follow_symlinks=False):
            yield entry.name, entry.path


def _is_temporary_of(name: str, path: str) -> bool:
    return temporary_base(name) == os.path.basename(path)


def _heartbeat_files(paths: CachePaths, dirs: bool = False) -> list[str]:
    """Status files and completion claims of earlier runs (never the lock, never events)."""
    out = [p for n, p in _entries(paths.status_dir, dirs) if _made_by(n, [paths.status])]
    stop = os.path.basename(paths.stop_request)
    out += [p for n, p in _entries(paths.control_dir, dirs) if n == stop or paths.is_completion_claim(n)]
    return out


def _written_files(paths: CachePaths, dirs: bool = False) -> list[str]:
    """Every file this tool writes in the cache, except the lock: what ``--overwrite`` deletes
    (``dirs``: with whatever else, directories included, stands under such a name)."""
    out = [p for n, p in _entries(paths.shards_dir, dirs)
           if _made_by(n, [paths.shard_index, paths.shard_tar, paths.shard_partial])]
    out += paths.partial_files() if not os.path.islink(paths.shards_dir) else []
    out += [p for n, p in _entries(paths.events_dir, dirs) if _made_by(n, [paths.events])]
    out += _heartbeat_files(paths, dirs)
    out += [p for n, p in _entries(paths.shards_dir, dirs)
            if n == os.path.basename(paths.wids_index) or _is_temporary_of(n, paths.wids_index)]
    for n, p in _entries(paths.root, dirs):
        if any(n == os.path.basename(f) or _is_temporary_of(n, f) for f in (paths.manifest, paths.target_weights)):
            out.append(p)
    return sorted(set(out))


def is_written_name(paths: CachePaths, relative: str) -> bool:
    """Whether ``relative`` (a path under the cache's root, with ``/``) names a file that ``--overwrite``
    deletes: the rules of :func:`_written_files`, for a cache whose files are objects (no directories
    to check). The event log's segments count; the lock, the lease and the saved plan do not."""
    directory, _, name = relative.rpartition("/")
    if directory == os.path.basename(paths.shards_dir):
        return (paths.shard_file(name) is not None or paths.is_leftover(name)
                or _made_by(name, [paths.shard_partial]) or name == os.path.basename(paths.wids_index))
    if directory == os.path.basename(paths.events_dir):
        return _made_by(name, [paths.events]) or paths.events_segment_of(name) is not None
    if directory == os.path.basename(paths.status_dir):
        return _made_by(name, [paths.status])
    if directory == os.path.basename(paths.control_dir):
        return name == os.path.basename(paths.stop_request) or paths.is_completion_claim(name)
    if directory == "":
        return name in (os.path.basename(paths.manifest), os.path.basename(paths.target_weights))
    return False


def _plan_files(paths: CachePaths) -> list[str]:
    """The saved plan's files and their temporaries."""
    fixed = [os.path.basename(p) for p in (paths.plan_header, *(paths.plan_array(n) for n in PLAN_ARRAYS))]
    parts = [paths.plan_part_header] + [lambda k, kind=kind: paths.plan_part(k, kind) for kind in PLAN_PART_KINDS]
    return sorted(p for n, p in _entries(paths.plan_dir)
                  if _made_by(n, parts) or n in fixed or temporary_base(n) in fixed)


def _remove_files(files: Iterable[str]) -> None:
    """Unlink each path (a symlink is removed itself, its target never touched)."""
    for path in files:
        if os.path.isdir(path) and not os.path.islink(path):
            continue  # a directory where a file of ours would be is not ours
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


class CacheOutput:
    """One cache directory being written. Nothing is touched until a method is called.

    * ``check(written_names=False)`` refuses a directory that is not one, sub-directories that are
      links or not directories, a lock file that is not a file, leftovers that are not files
      (``written_names``: anything but a file or link under a name the producer writes);
      ``create()`` makes the directories shards are published in.
    * ``lock(run_id, world_size)`` holds it exclusively (or raises ``CacheLockedError`` naming the
      holder), ``share()`` lets a job's other ranks ``join()``, ``release()`` lets go, and
      ``drop_lock()`` also deletes the lock file (a failed dry run that created it).
    * ``written_files()``, ``heartbeat_files()``, ``plan_files()``, ``leftovers()``: which files
      are ours; ``remove(files)`` deletes some, ``clear()`` every one (``--overwrite``),
      ``forget_heartbeats()`` earlier runs' heartbeats, stop requests and completion claims.
    * ``read_manifest()`` (``None`` when there is none), ``write_manifest(m)``, ``cache_id``, and
      ``complete(m)`` (the manifest of a cache whose every shard is published).
    * ``published()``: the published shard ids, listed once and kept current by this object's
      ``publish(writer)`` and ``unpublish(id)``; ``scan()`` lists them again, to see what other
      processes (the job's other ranks, its pipeline's writer) published; ``shard_index(id)``.
    """

    def __init__(self, root: str | os.PathLike) -> None:
        self.paths = CachePaths(os.fspath(root))
        self.root = self.paths.root
        self.shown = self.root  # what messages call the cache (a remote one's URL; ``root`` is then its staging)
        self._lock: DirectoryLock | None = None
        self._locked = False  # taken (the lock is None where the filesystem has no locks)
        self._published: set[int] | None = None

    # -- the directory ------------------------------------------------------------------------

    def check(self, *, written_names: bool = False) -> None:
        """Refuse a cache whose own directories or files are not what this tool would write there."""
        _check_directories(self.paths)
        if written_names:
            _check_written_names(self.paths)

    def create(self) -> None:
        """The directory and the sub-directories shards, heartbeats and events are written in."""
        self.paths.ensure_dirs()

    # -- the lock -----------------------------------------------------------------------------

    def lock(self, run_id: str, world_size: int = 1, *, overwrite: bool = False) -> None:
        """Hold the directory exclusively (its ``control/`` made first), or raise naming who holds it."""
        os.makedirs(self.paths.control_dir, exist_ok=True)
        self._lock = lock_exclusive(self.paths, run_id, world_size, overwrite)
        self._locked = True

    def share(self) -> None:
        """Exclusive -> shared, so that the job's other ranks can :meth:`join` it."""
        if self._lock is not None:
            self._lock.share()

    def join(self) -> None:
        """Hold the directory shared with the job's rank 0, once it has shared its lock."""
        self._lock = lock_shared(self.paths)
        self._locked = True

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()
        self._lock, self._locked = None, False

    def drop_lock(self) -> None:
        """Release the lock and delete its file: a failed dry run leaves no lock file it did not find."""
        if self._lock is not None:
            self._lock.remove()
        elif self._locked:  # a filesystem without locks: nobody can hold it
            _remove_files([self.paths.lock])
        self._lock, self._locked = None, False

    # -- our files ----------------------------------------------------------------------------

    def written_files(self) -> list[str]:
        """Every file this tool writes in the cache, except the lock and the saved plan."""
        return _written_files(self.paths)

    def heartbeat_files(self) -> list[str]:
        """Status files, stop requests and completion claims (never the lock, never events)."""
        return _heartbeat_files(self.paths)

    def plan_files(self) -> list[str]:
        """The saved plan's files and their temporaries (``--overwrite`` leaves them to the plan
        store: they are rebuilt before the cache is cleared)."""
        return _plan_files(self.paths)

    def leftovers(self) -> list[str]:
        """What an interrupted writer left half-written in ``shards/`` (never read)."""
        return self.paths.partial_files()

    def remove(self, files: Iterable[str]) -> None:
        """Delete each of ``files`` (a symlink itself, never its target; a directory never)."""
        _remove_files(files)

    def clear(self) -> None:
        """What ``--overwrite`` deletes: the files this tool writes, one by one; not the lock, nothing
        else. The caller holds the lock and has checked the directory."""
        _remove_files(self.written_files())
        self._published = set()

    def forget_heartbeats(self) -> None:
        """Earlier runs' heartbeats, stop requests and completion claims describe no live process
        (the caller holds the lock)."""
        _remove_files(self.heartbeat_files())

    # -- the manifest -------------------------------------------------------------------------

    def read_manifest(self) -> Manifest | None:
        """The manifest on disk, complete or not; ``None`` when there is none yet."""
        return read_manifest(self.root, missing_ok=True, allow_incomplete=True)

    def write_manifest(self, manifest: Manifest) -> None:
        write_manifest(self.paths, manifest)

    @property
    def cache_id(self) -> str:
        """The ``cache_id`` of the manifest on disk (every index published carries it); ``""`` where
        there is no manifest (a bare pipeline)."""
        manifest = self.read_manifest()
        return manifest.cache_id if manifest is not None else ""

    def complete(self, manifest: Manifest) -> None:
        """Record what was stored (samples dropped as non-finite included) and flip ``complete``."""
        self.flush()
        nonfinite = sorted(sid for i in sorted(self.scan()) for sid in self.shard_index(i).nonfinite)
        manifest.nonfinite_samples = nonfinite
        manifest.cache_id = self.cache_id  # another rank's manifest was built without rank 0's id
        manifest.num_samples = manifest.planned_samples - len(nonfinite)
        manifest.complete = True
        manifest.completed_at = time.time()
        self.write_wids_index()  # exact now that every shard is published (ranks' updates could race)
        self.write_manifest(manifest)

    def write_wids_index(self) -> None:
        """Rewrite wids' shard list from every published shard."""
        write_wids_index(self.paths)

    def space_needed(self, missing_bytes: int) -> int:
        """Bytes this machine's disk must have free for the shards still to be written."""
        return missing_bytes

    # -- shards -------------------------------------------------------------------------------

    def published(self) -> frozenset[int]:
        """The shard ids whose index is published, as this object knows them (listed on first use)."""
        if self._published is None:
            return self.scan()
        return frozenset(self._published)

    def scan(self) -> frozenset[int]:
        """List the published shards again (other processes publish too)."""
        self._published = set(self.paths.indexed_shard_ids())
        return frozenset(self._published)

    def shard_index(self, shard_id: int) -> ShardIndex:
        """A published shard's index, checked (``CorruptShardError`` when it is damaged)."""
        return load_shard_index(self.paths, shard_id)

    def publish(self, writer: ShardWriter, nonfinite: list[int] | None = None) -> ShardIndex:
        """Publish the shard ``writer`` wrote: its tar, then its index (the commit)."""
        index = writer.publish(nonfinite=nonfinite)
        if self._published is not None:
            self._published.add(index.shard_id)
        return index

    def flush(self) -> None:
        """Wait until every shard handed to :meth:`publish` is published (a directory's are at once)."""

    # -- the job's ranks ----------------------------------------------------------------------
    # Every rank of a job writes this one directory, so they read each other's files in it; a
    # backend where ranks on other nodes write other directories (``remote.output``) exchanges
    # them here, and these are its hooks.

    def identity(self) -> str:
        """Equal for the ranks that write one directory (all of them, for a directory)."""
        return ""

    def spread(self, identities: list[str], rank: int) -> None:
        """Every rank's :meth:`identity`, in rank order."""

    def put_files(self, files: Iterable[str]) -> None:
        """Make these files of this rank's readable by the job's other ranks."""

    def fetch(self, directory: str) -> None:
        """Read the other ranks' files of ``directory`` from here on."""

    def fetch_file(self, path: str) -> None:
        """Read the leader's latest ``path`` from here on."""

    def refresh(self) -> None:
        """See the shards and heartbeats the other ranks wrote since (called while waiting for them)."""

    def claim_completion(self, run_id: str) -> bool:
        """True for exactly one caller of a run: the one that creates the run's claim first (``O_EXCL``)."""
        os.makedirs(self.paths.control_dir, exist_ok=True)
        try:
            fd = os.open(self.paths.completion_claim(run_id), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        os.close(fd)
        return True

    def replace_index(self, index: ShardIndex) -> None:
        """Publish a rebuilt index over a published shard's damaged one (``dspark-verify --repair``)."""
        write_index(self.paths, index)

    @contextlib.contextmanager
    def shard_tar(self, shard_id: int) -> Iterator[str]:
        """A published shard's tar as a local file, for as long as the block runs (a remote one is downloaded)."""
        yield self.paths.shard_tar(shard_id)

    def unpublish(self, shard_id: int) -> None:
        """Remove a shard's index, then its tar: readers stop seeing it first, and a rerun recomputes
        it. A symlink is removed itself, never its target."""
        for file in (self.paths.shard_index(shard_id), self.paths.shard_tar(shard_id)):
            if os.path.lexists(file):
                os.unlink(file)
        if self._published is not None:
            self._published.discard(shard_id)

