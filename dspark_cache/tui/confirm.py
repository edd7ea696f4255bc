"""The question ``dspark-produce --tui`` asks before ``q`` stops the producer it runs."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen

from dspark_cache.tui.fit import Para, piece, words
from dspark_cache.tui.widgets.fitted import Fitted

QUESTION = ("Stop it gracefully and quit? It finishes the shards in flight and exits with code 3; rerun the "
            "same dspark-produce command to resume. Its log: $log")


def question(log_path: str) -> list[Para]:
    """The question, its words laid out to the dialog's width (the log path is shortened, never folded)."""
    blank = Para([piece("")])
    return [
        Para([piece("The producer is still running.", "bold")]),
        blank,
        Para(words(QUESTION, log=log_path), " "),
        blank,
        Para([piece("  y", "bold"), piece("stop the producer and quit")]),
        Para([piece("  n", "bold"), piece("keep watching (escape too)")]),
    ]


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
            yield Fitted(id="question")

    def on_mount(self) -> None:
        self.query_one("#question", Fitted).show_paras(question(self.log_path))

    def action_answer(self, stop: bool) -> None:
        """Close with the answer."""
        self.dismiss(stop)
