"""A ``Static`` whose paragraphs (:mod:`dspark_cache.tui.fit`) are laid out to its own width."""

from __future__ import annotations

from collections.abc import Iterable

from textual.widgets import Static

from dspark_cache.tui.fit import Para, fit


class Fitted(Static):
    """Shows paragraphs fitted to its content width, and fits them again whenever that width changes."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._paras: tuple[Para, ...] = ()

    def show_paras(self, paras: Iterable[Para]) -> None:
        self._paras = tuple(paras)
        self._refit()

    def _refit(self) -> None:
        self.update(fit(self._paras, self.content_region.width or None))  # 0 before the first layout

    def on_resize(self) -> None:
        self._refit()
