"""Format's bounded readers, confined to one cache and turning every refusal into a warning.

Anyone can drop anything into a cache directory. The readers of :mod:`dspark_cache.format.files`
never open a FIFO or a device, re-check what they opened, and bound what they read; here they
are also confined to the cache (a symlink out of it is not followed), and whatever they refuse
becomes one line of the monitor's warnings instead of an exception, so a hostile cache is shown
with warnings rather than crashing or hanging the monitor.
"""

from __future__ import annotations

import os

from dspark_cache.format.errors import CacheError
from dspark_cache.format.files import FileTooLargeError, NotARegularFileError, check_directory, read_regular
from dspark_cache.tui.display import human_bytes


class CacheReader:
    """Reads files of the cache at ``root``, collecting why it skipped any in :attr:`warnings`.

    Used by the watcher thread only; :meth:`start_scan` resolves the root again (it may be a
    symlink that was repointed) and forgets the last scan's warnings.
    """

    def __init__(self, root: str) -> None:
        self.root = root
        self.root_real = os.path.realpath(root)
        self.warnings: list[str] = []

    def start_scan(self) -> None:
        """Begin a scan: the root resolved afresh, no warnings yet."""
        self.root_real = os.path.realpath(self.root)
        self.warnings = []

    def skip(self, path: str, exc: BaseException, what: str = "file", slash: str = "") -> None:
        """Warn that ``path`` was skipped because of ``exc``."""
        self.warnings.append(f"skipped {os.path.relpath(path, self.root)}{slash}: {reason(exc, what)}")

    def read(self, path: str, limit: int, what: str) -> bytes | None:
        """A whole small file, or None (gone: silently; refused or unreadable: with a warning)."""
        try:
            return read_regular(path, limit, self.root_real)
        except FileNotFoundError:
            return None
        except (CacheError, OSError) as exc:
            self.skip(path, exc, what)
            return None

    def dir_ok(self, directory: str) -> bool:
        """Whether a cache subdirectory exists and may be read (a refusal is warned about)."""
        try:
            check_directory(directory, self.root_real)
        except FileNotFoundError:
            return False
        except (CacheError, OSError) as exc:
            self.skip(directory, exc, slash="/")
            return False
        return True

    def listing(self, directory: str) -> list[str]:
        """Sorted names in a cache subdirectory; none when it is missing or not a directory of the cache."""
        if not self.dir_ok(directory):
            return []
        try:
            return sorted(os.listdir(directory))
        except OSError as exc:
            self.skip(directory, exc, slash="/")
            return []


def reason(exc: BaseException, what: str = "file") -> str:
    """Why a file was skipped, in the few words of a warning line (or of the header)."""
    if isinstance(exc, NotARegularFileError):
        return exc.reason
    if isinstance(exc, FileTooLargeError):
        return (f"unreadable {what}, too large ({human_bytes(exc.size)}; the monitor reads at most "
                f"{human_bytes(exc.limit)})")
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    return str(exc)
