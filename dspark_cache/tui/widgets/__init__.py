"""One widget per file, each rendering a part of a :class:`~dspark_cache.tui.snapshot.Snapshot`.

Each such widget has the CSS class :data:`SHOWS_SNAPSHOT` and a ``show(snapshot)`` method: the app lists
the widgets once, in its layout, and renders every snapshot in whatever carries the class.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from dspark_cache.tui.snapshot import Snapshot

SHOWS_SNAPSHOT = "shows-snapshot"


class ShowsSnapshot(Protocol):
    """A widget that renders (its part of) a snapshot; it reads no file."""

    def show(self, snap: Snapshot) -> None: ...
