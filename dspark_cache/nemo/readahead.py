"""NeMo's ``DataLoader``, reading the next batch while training works on the current one.

Without worker processes (NeMo's default) a ``DataLoader`` fetches each batch on the training
thread when training asks for it. Here the next batch's indices are taken from the sampler as
soon as a batch is handed out and its samples are read by the dataset's reader thread meanwhile
(the batch filler runs without the GIL). Taking indices early draws nothing from torch's global
RNG: samplers draw their seed when an epoch starts (its first batch, read ahead or not) and later
indices come from their own generator, so the run stays exactly NeMo's.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader
from torch.utils.data import _utils as data_utils

try:  # a private class of torch; without it, batches are simply read when asked for
    from torch.utils.data.dataloader import _SingleProcessDataLoaderIter
except ImportError:  # pragma: no cover - depends on the torch version
    _SingleProcessDataLoaderIter = None


class ReadAheadDataLoader(DataLoader):
    """A ``DataLoader`` whose single-process iterator reads one batch ahead from a dataset with
    ``submit(indices) -> pending`` (see :class:`~dspark_cache.nemo.dataset.DSparkMapDataset`)."""

    def _get_iterator(self) -> Any:
        if (
            self.num_workers == 0
            and _SingleProcessDataLoaderIter is not None
            and hasattr(self.dataset, "submit")
        ):
            return _ReadAheadIter(self)
        return super()._get_iterator()


if _SingleProcessDataLoaderIter is not None:

    class _ReadAheadIter(_SingleProcessDataLoaderIter):
        def __init__(self, loader: DataLoader) -> None:
            self._ahead = None
            super().__init__(loader)

        def _reset(self, loader: DataLoader, first_iter: bool = False) -> None:
            super()._reset(loader, first_iter)
            self._ahead = None

        def _next_data(self) -> Any:
            pending = self._ahead if self._ahead is not None else self._dataset.submit(self._next_index())
            self._ahead = None
            try:
                self._ahead = self._dataset.submit(self._next_index())
            except StopIteration:
                pass  # the epoch's last batch
            data = self._collate_fn(pending.result())
            if self._pin_memory:
                data = data_utils.pin_memory.pin_memory(data, self._pin_memory_device)
            return data
