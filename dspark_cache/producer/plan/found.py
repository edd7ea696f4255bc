"""A dry run leaves the output directory as it found it, when it fails.

A dry run takes the directory (its lock) and writes only the plan, but a failure must not leave
a half-written plan in place of the one a real run would have reused, nor a lock file or
directories the user never had. So before anything is created the producer notes what is there
(:func:`found_directory`), once the directory is held it keeps a hard link to each plan file
(:func:`keep_plan_files`), and then it either lets them go (:func:`forget_found`) or puts
everything back (:func:`leave_as_found`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

from dspark_cache.storage.output import CacheOutput

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FoundDirectory:
    """What the output directory held before a dry run took it."""

    missing_dirs: tuple[str, ...]  # the directories a dry run may create that were not there, outermost first
    had_lock: bool
    kept: tuple[tuple[str, str], ...]  # (plan file, a hard link to it): what a failed dry run puts back


def found_directory(output: CacheOutput) -> FoundDirectory:
    """Note what is there before the dry run creates anything (it writes nothing)."""
    paths = output.paths
    dirs, up = [paths.control_dir, paths.plan_dir], os.path.abspath(paths.root)
    while up != os.path.dirname(up):  # --output-dir and every parent it makes
        dirs.insert(0, up)
        up = os.path.dirname(up)
    return FoundDirectory(tuple(d for d in dirs if not os.path.lexists(d)), os.path.lexists(paths.lock), ())


def keep_plan_files(output: CacheOutput, found: FoundDirectory) -> FoundDirectory:
    """Once the directory is held: a hard link to every plan file there (no data is copied), so
    that a failed dry run of other input, which replaces them as it tokenises, puts them back."""
    kept = []
    plan_dir = output.paths.plan_dir
    for path in output.plan_files() if os.path.isdir(plan_dir) and not os.path.islink(plan_dir) else []:
        link = f"{path}.{os.getpid()}.found.tmp"  # a temporary of a plan file: cleared by the next plan
        try:
            os.link(path, link, follow_symlinks=False)
        except OSError as exc:  # a filesystem without hard links: that file cannot be put back
            log.debug("cannot keep %s for a failed dry run (%s)", path, exc)
            continue
        kept.append((path, link))
    return dataclasses.replace(found, kept=tuple(kept))


def forget_found(output: CacheOutput, found: FoundDirectory) -> None:
    """The dry run succeeded: its plan stays, the links to the earlier files go."""
    output.remove([link for _, link in found.kept])


def leave_as_found(output: CacheOutput, found: FoundDirectory) -> None:
    """Undo a failed dry run, still holding the directory: the plan files it wrote go, the earlier
    ones come back, and so do the lock file and directories (if empty) it did not find."""
    links = {link for _, link in found.kept}
    output.remove([p for p in output.plan_files() if p not in links])  # plan_files lists names of ours only
    for path, link in found.kept:
        try:
            os.replace(link, path)
        except OSError as exc:
            log.warning(
                "could not put back %s after the failed dry run (%s); the next run rebuilds it", path, exc
            )
    if not found.had_lock:
        output.drop_lock()
    for directory in reversed(found.missing_dirs):
        try:
            os.rmdir(directory)
        except OSError:  # not empty (or not there): something else lives in it
            pass
