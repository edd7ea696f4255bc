"""The question ``dspark-produce --tui`` asks before ``q`` stops the producer it runs."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Static

from dspark_cache.tui.display import markup

QUESTION = """[b]The producer is still running.[/]

Stop it gracefully and quit? It finishes the shard in flight and exits with code 3;
rerun the same dspark-produce command to resume. Its log: $log

  [b]y[/]  stop the producer and quit
  [b]n[/]  keep watching (escape too)
"""


class ConfirmStop(ModalScreen[bool]):
    """Dismissed with True (``y``: stop and quit) or False (``n``, escape, or ``q`` again: keep watching)."""

    # q again must not stop a run by accident: it keeps watching, like n.
    BINDINGS = [Binding("y", "answer(True)", "stop and quit"),
                Binding("n,escape,q", "answer(False)", "keep watching")]
    DEFAULT_CSS = """
    ConfirmStop { align: center middle; }
    ConfirmStop > Vertical { width: 90; max-width: 100%; height: auto; border: thick $warning;
                             background: $surface; padding: 1 2; }
    """

    def __init__(self, log_path: str) -> None:
        super().__init__()
        self.log_path = log_path

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(markup(QUESTION, log=self.log_path), id="question")  # a path may hold brackets

    def action_answer(self, stop: bool) -> None:
        """Close with the answer."""
        self.dismiss(stop)
