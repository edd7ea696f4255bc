"""What NeMo's training loop expects of a ``DataLoader``, on top of ours.

NeMo logs ``len(loader.dataset)`` and calls ``loader.sampler.set_epoch(epoch)`` every epoch;
our loader is its own sampler (it computes the order), so both are thin faces of it. They are
properties, not attributes: an attribute pointing back at the loader would make a reference
cycle, and the loader's batch memory (hundreds of MB) would then outlive the last reference to
it until a full garbage collection happens to run.
"""

from __future__ import annotations

from typing import Protocol


class _Loader(Protocol):
    def num_samples(self) -> int: ...

    def set_epoch(self, epoch: int) -> None: ...


class EpochLength:
    """``len(loader.dataset)``: the samples of the loader's current epoch."""

    def __init__(self, loader: _Loader) -> None:
        self._loader = loader

    def __len__(self) -> int:
        return self._loader.num_samples()


class NemoAttributes:
    """``dataset`` and ``sampler`` for a loader class that has ``num_samples`` and ``set_epoch``."""

    @property
    def dataset(self: _Loader) -> EpochLength:
        return EpochLength(self)

    @property
    def sampler(self: _Loader) -> _Loader:
        return self  # set_epoch is the loader's own
