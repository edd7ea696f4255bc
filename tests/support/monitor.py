"""The monitor on a hand-made cache directory (:mod:`tests.support.tui_states`), and what it shows read
back as its user reads it."""

from __future__ import annotations

from textual.widget import Widget

from dspark_cache.tui.app import MonitorApp
from tests.support import tui_states


def app_for(root: str, free: int = 10**12) -> MonitorApp:
    """The monitor of ``root`` on :data:`tui_states.NOW`'s clock, refreshed only when a test asks,
    seeing ``free`` bytes free on the disk."""
    return MonitorApp(root, refresh=3600, clock=lambda: tui_states.NOW, disk_free=lambda _: free)


def plain(widget: Widget) -> str:
    """The text ``widget`` shows: a rich ``Text``'s or a ``Content``'s own; a string as the widget renders
    it, markup applied only where the widget applies markup (a hostile name's brackets read as written)."""
    content = widget.content
    if hasattr(content, "plain"):
        return content.plain
    return widget.visual.plain
