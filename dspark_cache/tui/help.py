"""The help screen (``?``)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from dspark_cache.format.status import STALE_AFTER_S
from dspark_cache.tui.display import markup

HELP = f"""[b]dspark-monitor[/] shows a dspark cache, live or finished, from its files.

  [b]q[/]  $quit
  [b]s[/]  (offered while a producer runs) ask it to stop gracefully: it
     finishes the shards in flight and exits with code 3; rerun the same
     dspark-produce command to resume
  [b]?[/]  this help (escape closes it)
  arrows, page keys, mouse wheel: scroll

Work done is counted from the published shards. Rates are measured from
this run's heartbeats (shards resumed from earlier runs never count).
With no producer running, the newest run's average is shown (its bytes
over its time; tokens at the cache's bytes per token).

Shard map: [green]█[/] published  [yellow]▒[/] being written  · pending  [red]✖[/] failed
A rank is [b red]STALE[/] when it claims to work but its heartbeat is over {STALE_AFTER_S:.0f} s old.
"""


class HelpScreen(ModalScreen[None]):
    """The keys and the shard map's legend, over the monitor; escape, ``?`` or ``q`` closes it."""

    BINDINGS = [Binding("escape,question_mark,q", "dismiss", "close")]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 80; max-width: 100%; height: auto; max-height: 100%;
                                  border: thick $primary; background: $surface; padding: 1 2; }
    """

    def __init__(self, quit_help: str) -> None:
        super().__init__()
        self.quit_help = quit_help  # what q does differs under dspark-produce --tui

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Static(markup(HELP, quit=self.quit_help))
