"""Which files of a cache are this tool's, and the checks before any of them is deleted.

The producer deletes files in ``shards/``, ``status/``, ``events/``, ``control/`` and ``plan/``
(leftovers on resume, earlier runs' heartbeats, everything it wrote on ``--overwrite``). Through
a symlink that would delete files outside the cache, so a cache whose sub-directories are not
real directories is refused before anything is deleted or written. Deletion is file by file, of
names this tool writes (as :class:`CachePaths` spells them), never a tree and never through a link.
:func:`is_written_name` is the same rule for a cache whose files are objects.
"""

from __future__ import annotations

import os
import re
import stat
from typing import Callable, Iterable, Iterator

from dspark_cache.format.errors import CacheError
from dspark_cache.format.files import kind_of
from dspark_cache.format.paths import PLAN_ARRAYS, PLAN_PART_KINDS, CachePaths, temporary_base
from dspark_cache.storage.lock import check_lock_file

_NUMBER = re.compile(r"\d+")


class CacheDirectoryError(CacheError):
    """A directory of the cache is a symlink or not a directory at all, or a name of ours is not a file."""


def _cache_dirs(paths: CachePaths) -> list[str]:
    return [paths.shards_dir, paths.status_dir, paths.events_dir, paths.control_dir, paths.plan_dir]


def _nearest_existing_parent(path: str) -> str:
    """The closest of ``path``'s parents that exists (``/`` at the end of the walk)."""
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    return parent


def check_directories(paths: CachePaths) -> None:
    """Refuse a cache whose own directories are symlinks or other non-directories.

    The output directory itself may be a symlink (the user chose where the cache lives); its
    sub-directories may not: the producer deletes files in them.
    """
    if os.path.lexists(paths.root) and not os.path.isdir(paths.root):
        raise CacheDirectoryError(
            f"--output-dir {paths.root} exists and is not a directory; choose another --output-dir"
        )
    blocker = _nearest_existing_parent(paths.root)
    if not os.path.isdir(blocker):  # no directory can be made under a file
        raise CacheDirectoryError(f"--output-dir {paths.root} cannot hold a cache: {blocker} is a file, not "
                                  "a directory; choose another --output-dir")
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


def check_written_names(paths: CachePaths) -> None:
    """The producer, before planning: anything but a file (or a link) under a name it writes, replaces
    or appends to in a sub-directory (a published shard, an index, a heartbeat, the event log, the stop
    request) is refused: reached mid-run it would hang the run (a FIFO as the event log) or stop it
    with a bare errno after hours. The top level's manifest and target weights have their own rules (a
    reader refuses a manifest that is not a file; a rerun replaces damaged weights and names a
    directory there); dspark-convert checks its destination its own way."""
    _refuse_odd([path for path in written_files(paths, dirs=True)
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


def heartbeat_files(paths: CachePaths, dirs: bool = False) -> list[str]:
    """Status files and completion claims of earlier runs (never the lock, never events)."""
    out = [p for n, p in _entries(paths.status_dir, dirs) if _made_by(n, [paths.status])]
    stop = os.path.basename(paths.stop_request)
    out += [p for n, p in _entries(paths.control_dir, dirs) if n == stop or paths.is_completion_claim(n)]
    return out


def written_files(paths: CachePaths, dirs: bool = False) -> list[str]:
    """Every file this tool writes in the cache, except the lock: what ``--overwrite`` deletes
    (``dirs``: with whatever else, directories included, stands under such a name)."""
    out = [p for n, p in _entries(paths.shards_dir, dirs)
           if _made_by(n, [paths.shard_index, paths.shard_tar, paths.shard_partial])]
    out += paths.partial_files() if not os.path.islink(paths.shards_dir) else []
    out += [p for n, p in _entries(paths.events_dir, dirs) if _made_by(n, [paths.events])]
    out += heartbeat_files(paths, dirs)
    out += [p for n, p in _entries(paths.shards_dir, dirs)
            if n == os.path.basename(paths.wids_index) or _is_temporary_of(n, paths.wids_index)]
    for n, p in _entries(paths.root, dirs):
        if any(
            n == os.path.basename(f) or _is_temporary_of(n, f) for f in (paths.manifest, paths.target_weights)
        ):
            out.append(p)
    return sorted(set(out))


def is_written_name(paths: CachePaths, relative: str) -> bool:
    """Whether ``relative`` (a path under the cache's root, with ``/``) names a file that ``--overwrite``
    deletes: the rules of :func:`written_files`, for a cache whose files are objects (no directories
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


def plan_files(paths: CachePaths) -> list[str]:
    """The saved plan's files and their temporaries."""
    fixed = [os.path.basename(p) for p in (paths.plan_header, *(paths.plan_array(n) for n in PLAN_ARRAYS))]
    parts = [paths.plan_part_header] + [
        lambda k, kind=kind: paths.plan_part(k, kind) for kind in PLAN_PART_KINDS
    ]
    return sorted(p for n, p in _entries(paths.plan_dir)
                  if _made_by(n, parts) or n in fixed or temporary_base(n) in fixed)


def remove_files(files: Iterable[str]) -> None:
    """Unlink each path (a symlink is removed itself, its target never touched)."""
    for path in files:
        if os.path.isdir(path) and not os.path.islink(path):
            continue  # a directory where a file of ours would be is not ours
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
