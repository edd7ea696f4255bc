"""The help screen (``?``)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Static

from dspark_cache.format.status import STALE_AFTER_S

HELP = f"""[b]dspark-monitor[/] shows a dspark cache directory, live or finished, read from its files.

  [b]q[/]  quit (the producer keeps running)
  [b]s[/]  ask the producer to stop gracefully: it finishes the shard in flight and exits
     with code 3; rerun the same dspark-produce command to resume
  [b]?[/]  this help (escape closes it)

Shard map: [green]█[/] published  [yellow]▒[/] being written  · pending  [red]✖[/] failed
A rank is [b red]STALE[/] when its heartbeat is older than {STALE_AFTER_S:.0f} s while it claims to be working.
"""


class HelpScreen(ModalScreen[None]):
    """The keys and the shard map's legend, over the monitor; escape, ``?`` or ``q`` closes it."""

    BINDINGS = [Binding("escape,question_mark,q", "dismiss", "close")]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > Vertical { width: 90; height: auto; border: thick $primary; background: $surface; padding: 1 2; }
    """

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(HELP)
