"""NeMo's recipe on a mixture: ``recipe_args.cached_target_path`` names a mixture file.

NeMo's own sampler orders a map-style dataset, so a mixture is laid out as positions: source 0's
samples, then source 1's, ..., each source's in ascending sample id, ``count // n`` times over
(``count``: what its weight gives an epoch, :mod:`dspark_cache.loader.sources`), then the
``count % n`` drawn for the remainder, in ascending id. A mixture of unweighted sources is thus
the concatenation of their rows in order: one cache produced from those rows, in that order,
trains the same run. The draws use seed 0 and epoch 0: NeMo's sampler, not the dataset, sees the
epoch, so a down- or up-sampled source gives the same subset every epoch (mosaicml/streaming's
``sampling_method="fixed"``); ``build_dataloader`` draws a new one each epoch.

The recipe's manifest checks see the fields every source shares (:func:`mixture_manifest`): the
target's, the layers every source holds, the dtype handed out and ``num_samples`` the epoch's.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import msgspec
import numpy as np

from dspark_cache.format.errors import CacheError
from dspark_cache.format.manifest import read_manifest as read_dspark_manifest
from dspark_cache.format.schema import FP8_DTYPES, Manifest
from dspark_cache.loader.compat import check_sources
from dspark_cache.loader.config import LoaderConfig
from dspark_cache.loader.mixreader import MixtureReader
from dspark_cache.loader.mixture import OpenSources, source_name
from dspark_cache.loader.sources import MixtureFile, epoch_counts, epoch_subset, read_mixture
from dspark_cache.nemo import nemo_format
from dspark_cache.nemo.dataset import DSparkMapDataset

SEED = 0  # the draws of a mixture's positions (see the module docstring)


def source_manifests(mixture: MixtureFile) -> list[Manifest]:
    """Each source's manifest (a complete dspark cache each; a NeMo cache is refused by name)."""
    out = []
    for i, source in enumerate(mixture.sources):
        if "://" not in source.path and nemo_format.is_nemo_cache(source.path):
            raise ValueError(f"{source_name(i, source.path)} is a NeMo cache; a mixture reads dspark caches: "
                             "convert it with dspark-convert --to dspark")
        out.append(read_dspark_manifest(source.path))
    return out


def mixture_manifest(path: str, recipe_dtype: Any) -> dict[str, Any]:
    """NeMo's manifest dict for a mixture file: the first source's fields where every source shares
    them; ``target_layer_ids`` those every source holds; ``num_samples`` the epoch's;
    ``cache_id`` names the sources' caches. ``recipe_dtype(stored)``: what an FP8 source is read as."""
    mixture = read_mixture(path)
    manifests = source_manifests(mixture)
    names = [source_name(i, s.path) for i, s in enumerate(mixture.sources)]
    check_sources(manifests, names, layers_given=True, same_seq_length=True)
    first = manifests[0]
    delivered = [recipe_dtype(m.dtype) or m.dtype for m in manifests]
    for name, dtype in zip(names[1:], delivered[1:]):
        if dtype != delivered[0]:
            raise ValueError(f"{name}: dtype: training reads it as {dtype} but {names[0]} as "
                             f"{delivered[0]}; mix caches of one dtype, or FP8 ones with caches of the "
                             "dtype training computes in")
    held = [layer for layer in first.target_layer_ids if all(layer in m.target_layer_ids for m in manifests)]
    counts = epoch_counts(mixture.sources, [m.num_samples for m in manifests], mixture.epoch_size, SEED)
    fields = {**nemo_format.MANIFEST_DEFAULTS, **msgspec.to_builtins(first)}
    fields.update(target_layer_ids=held, target_hidden_dim=len(held) * first.hidden_size,
                  num_samples=sum(counts), cache_id=mixture_id(manifests),
                  sources=[s.path for s in mixture.sources], dtype=delivered[0])
    if first.dtype in FP8_DTYPES or any(m.dtype in FP8_DTYPES for m in manifests):
        fields["stored_dtype"] = [m.dtype for m in manifests]
    return fields


def mixture_id(manifests: Sequence[Manifest]) -> str:
    """The mixture's caches, as one id (what a recipe's layer choice is remembered by)."""
    return "mixture:" + ",".join(m.cache_id for m in manifests)


def nemo_positions(sources: OpenSources) -> tuple[np.ndarray, np.ndarray]:
    """(global shard id, entry) at each position (module docstring)."""
    shard, entry = [], []
    for index, (samples, count) in enumerate(zip(sources.samples, sources.counts)):
        times = epoch_subset(count, len(samples), SEED, 0, index)
        whole = count // len(samples) if samples else 0
        chosen = [samples] * whole + [[ref for ref, t in zip(samples, times.tolist()) if t > whole]]
        for refs in chosen:
            shard += [s for s, _ in refs]
            entry += [k for _, k in refs]
    return np.asarray(shard, dtype=np.int64), np.asarray(entry, dtype=np.int64)


class MixtureMapDataset(DSparkMapDataset):
    """A mixture as NeMo's map-style dataset: positions as the module docstring says, batches read
    by every source into one (:class:`~dspark_cache.loader.mixreader.MixtureReader`)."""

    def __init__(self, path: str | os.PathLike, *, batch_size: int = 1, native: bool | None = None,
                 dtype: object = None, target_layer_ids: Sequence[int] | None = None) -> None:
        self.cache_dir = os.fspath(path)
        self.batch_size = max(1, batch_size)
        self.native = native
        self.mixture = read_mixture(self.cache_dir)
        self.config = LoaderConfig(1, dtype=dtype, target_layer_ids=target_layer_ids, pad_to="seq_length",
                                   nemo_keys_only=True, seed=SEED)
        sources = OpenSources(self.mixture, self.config)
        self.manifest = sources.caches[0].manifest
        self.fingerprint = sources.fingerprint()
        self._shard, self._entry = nemo_positions(sources)
        self._cache: OpenSources | None = sources  # type: ignore[assignment]
        self._reader: MixtureReader | None = None  # type: ignore[assignment]
        self._pid = os.getpid()

    @property
    def sample_ids(self) -> list[int]:
        """Sample id at each position (ids repeat across sources: :attr:`source_ids` tells them apart)."""
        sources = self._open_cache()
        out = []
        for shard, entry in zip(self._shard.tolist(), self._entry.tolist()):
            source, local = _locate(sources.bases, shard)
            out.append(sources.caches[source].require(local).samples[entry].sample_id)
        return out

    @property
    def source_ids(self) -> list[int]:
        bases = self._open_cache().bases
        return [_locate(bases, shard)[0] for shard in self._shard.tolist()]

    def _open_cache(self) -> OpenSources:  # type: ignore[override]
        if self._pid != os.getpid() or self._cache is None:
            # A forked DataLoader worker: reader threads and descriptors belong to the parent.
            self._cache = OpenSources(self.mixture, self.config)  # type: ignore[assignment]
            self._reader, self._pid = None, os.getpid()
            if self._cache.fingerprint() != self.fingerprint:  # type: ignore[union-attr]
                raise CacheError(f"a source of {self.cache_dir} was replaced by a different cache while "
                                 "training read it; restart training")
        return self._cache  # type: ignore[return-value]

    def _batch_reader(self, rows: int) -> MixtureReader:  # type: ignore[override]
        import torch

        sources = self._open_cache()
        if self._reader is None or rows > self.batch_size:
            if self._reader is not None:
                self._reader.close()
            self.batch_size = max(self.batch_size, rows)
            pinned = torch.cuda.is_available() and torch.utils.data.get_worker_info() is None
            self._reader = MixtureReader(sources.caches, sources.layouts, sources.bases,
                                         batch_size=self.batch_size, num_threads=1, pad_to="seq_length",
                                         pin_memory=pinned, nemo_keys_only=True, keep=4, native=self.native)
        return self._reader

def _locate(bases: list[int], shard: int) -> tuple[int, int]:
    source = int(np.searchsorted(bases, shard, side="right")) - 1
    return source, shard - bases[source]
