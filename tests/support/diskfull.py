"""A small filesystem for the full-disk tests: a tmpfs mounted under the test's directory when this process
may mount one (root, as in CI's containers), else None and the test injects the failure instead
(``DSPARK_FAIL_WRITES_AFTER``, :mod:`dspark_cache.format.faults`)."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def small_filesystem(parent: str | os.PathLike[str], size: str) -> Iterator[str | None]:
    """A tmpfs of ``size`` (mount's spelling: ``3m``, ``64k``) in a new directory of ``parent``, or None."""
    mount = os.path.join(parent, f"fs-{uuid.uuid4().hex[:6]}")
    os.mkdir(mount)
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", mount],
                        capture_output=True).returncode == 0
    try:
        yield mount if ok else None
    finally:
        if ok:
            subprocess.run(["umount", "-l", mount], capture_output=True)


def grow(mount: str, size: str) -> None:
    """Give the tmpfs at ``mount`` room again (space freed)."""
    subprocess.run(["mount", "-o", f"remount,size={size}", mount], check=True)
