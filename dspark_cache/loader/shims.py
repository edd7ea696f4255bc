"""What NeMo's training loop expects of a ``DataLoader``, on top of ours.

NeMo logs ``len(loader.dataset)`` and calls ``loader.sampler.set_epoch(epoch)`` every epoch;
our loader is its own sampler (it computes the order), so both are thin views of it.
"""

from __future__ import annotations

from typing import Protocol


class _Loader(Protocol):
    def num_samples(self) -> int: ...

    def set_epoch(self, epoch: int) -> None: ...


class SizedView:
    """``len(loader.dataset)``: the samples of the loader's current epoch."""

    def __init__(self, loader: _Loader) -> None:
        self._loader = loader

    def __len__(self) -> int:
        return self._loader.num_samples()


def attach(loader: _Loader) -> None:
    """Give ``loader`` the ``dataset`` and ``sampler`` attributes NeMo's loop uses."""
    loader.dataset = SizedView(loader)  # type: ignore[attr-defined]
    loader.sampler = loader  # type: ignore[attr-defined]  # set_epoch is the loader's own
