"""``build_dataloader`` over a mixture of caches: one deterministic stream, with everything a
single cache's loader has (rank-equal batches, resume on any world size, checks, verify, layers).

Opening checks every source against the first (:mod:`.compat`), loads every shard index (so an
epoch's per-source counts are exact: :mod:`.sources`), and the order is a pure function of
(seed, epoch, the mixture) (:mod:`.mixorder`). Batches are read by :mod:`.mixreader`. A resume
state names the mixture (each source's cache id and weight, and ``epoch_size``); a state of
another mixture is refused, naming what changed. Sources must be complete: ``follow`` is refused.
"""

from __future__ import annotations

from typing import Any

from dspark_cache.format.schema import Manifest
from dspark_cache.loader.compat import check_handed_out, check_sources
from dspark_cache.loader.config import LoaderConfig
from dspark_cache.loader.dataloader import DSparkLoader
from dspark_cache.loader.mixorder import MixtureOrder, epoch_units
from dspark_cache.loader.mixreader import MixtureReader
from dspark_cache.loader.reader import BatchLayout
from dspark_cache.loader.sources import WEIGHTS, MixtureFile, epoch_counts
from dspark_cache.loader.validate import check_expectations
from dspark_cache.storage.cache import MAX_OPEN_FILES, CacheDir

_PREFETCH_SHARDS = 64
_MIN_OPEN_FILES = 4  # a window's shards (order.py: 4 by default) stay open


def source_name(index: int, path: str) -> str:
    return f"source {index} ({path})"


def _layout(manifest: Manifest, config: LoaderConfig, name: str) -> BatchLayout:
    """A source's batch layout; a dtype it cannot hand out is named with the source."""
    try:
        return BatchLayout.from_manifest(manifest, config.dtype, config.target_layer_ids, where=name)
    except ValueError as exc:
        if name in str(exc):
            raise
        raise ValueError(f"{name}: {exc}") from None


class OpenSources:
    """A mixture's caches, opened and checked together; closed together on any failure."""

    def __init__(self, mixture: MixtureFile, config: LoaderConfig) -> None:
        self.mixture = mixture
        self.names = [source_name(i, s.path) for i, s in enumerate(mixture.sources)]
        self.caches: list[CacheDir] = []
        # One cache's budget of idle descriptors, shared: 100 sources must not keep 100 times as many.
        files = max(_MIN_OPEN_FILES, MAX_OPEN_FILES // len(mixture.sources))
        try:
            for source in mixture.sources:
                self.caches.append(CacheDir(source.path, storage=config.storage, max_open_files=files))
            manifests = [cache.manifest for cache in self.caches]
            check_sources(manifests, self.names, layers_given=config.target_layer_ids is not None,
                          same_seq_length=config.pad_to == "seq_length")
            self.layouts = [_layout(m, config, name) for m, name in zip(manifests, self.names)]
            check_handed_out([lay.states_code for lay in self.layouts], self.names)
            if config.expect:
                for m, name, lay in zip(manifests, self.names, self.layouts):
                    check_expectations(m, config.expect, where=name, delivered=lay.states_code,
                                       layers=lay.delivered_layer_ids)
            self.bases, base = [], 0
            for m in manifests:
                self.bases.append(base)
                base += m.num_shards
            # Every index, loaded and checked once: (global shard id, entry) in ascending sample id.
            self.samples = [[(b + shard, k) for shard, k in cache.sample_order()]
                            for b, cache in zip(self.bases, self.caches)]
            self.shards = [[b + k for k in range(m.num_shards)] for b, m in zip(self.bases, manifests)]
            self.counts = epoch_counts(mixture.sources, [len(s) for s in self.samples], mixture.epoch_size,
                                       config.seed)
        except BaseException:
            self.close()
            raise

    def fingerprint(self) -> dict[str, Any]:
        """What a resume state records of the mixture: each source's cache and weight."""
        return {"mixture": [{"cache_id": cache.cache_id, **{w: getattr(s, w) for w in WEIGHTS}}
                            for s, cache in zip(self.mixture.sources, self.caches)],
                "epoch_size": self.mixture.epoch_size}

    def close(self) -> None:
        for cache in self.caches:
            cache.close()


class MixtureLoader(DSparkLoader):
    """:class:`~.dataloader.DSparkLoader` over a mixture; batches also carry ``source_ids`` ``[B]``
    (each row's source, its index in the mixture's list). ``manifest`` is the first source's.

    The epoch loop, ``len()`` and the resume state's checks are the base class's; what touches the
    one cache there (its order, size, prefetch, identity, closing) is overridden here, so the base's
    ``__init__`` (which opens one cache) is not run."""

    def __init__(self, mixture: MixtureFile, batch_size: int, **options: Any) -> None:
        self.config = config = LoaderConfig(batch_size, **options)
        if config.follow:
            raise ValueError("follow=True reads one cache while it is produced; a mixture's per-source "
                             "counts need every source complete: train on the mixture once its producers "
                             "are done, or follow one growing cache on its own")
        self.sources = OpenSources(mixture, config)
        self.rank, self.world_size = config.ranks()
        self.epoch, self.offset = config.epoch, 0
        self._orders: dict[int, MixtureOrder] = {}  # type: ignore[assignment]
        self.reader = MixtureReader(  # type: ignore[assignment]
            self.sources.caches, self.sources.layouts, self.sources.bases, batch_size=batch_size,
            num_threads=config.threads, pad_to=config.pad_to, pin_memory=config.pinned,
            nemo_keys_only=config.nemo_keys_only, verify_mode=config.verify, keep=config.read_ahead + 2)

    @property
    def manifest(self) -> Manifest:
        return self.sources.caches[0].manifest

    @property
    def counts(self) -> list[int]:
        """Samples each source gives to every epoch."""
        return list(self.sources.counts)

    def _order(self, epoch: int) -> MixtureOrder:  # type: ignore[override]
        order = self._orders.get(epoch)
        if order is None:
            s, c = self.sources, self.config
            units = epoch_units(s.samples, s.shards, s.counts, c.seed, epoch)
            order = MixtureOrder(units, c.seed, epoch, c.shuffle, c.window)
            self._orders = {epoch: order}
        return order

    def num_samples(self) -> int:
        return sum(self.sources.counts)

    def _prefetch(self, order: MixtureOrder, position: int) -> None:  # type: ignore[override]
        wanted: dict[int, list[int]] = {}
        for shard in order.shards_from(position, _PREFETCH_SHARDS):
            source, local = self.reader.locate(shard)
            wanted.setdefault(source, []).append(local)
        for source, shards in wanted.items():
            cache = self.sources.caches[source]
            if cache.remote is not None:
                cache.prefetch(shards)

    def _identity(self) -> dict[str, Any]:
        return self.sources.fingerprint()

    def _check_identity(self, state: dict[str, Any]) -> None:
        if "mixture" not in state:
            raise ValueError("cannot restore a loader state taken on one cache into a loader of a mixture; "
                             "build the loader on that cache, or start the mixture from the beginning")
        changes = mixture_changes(state, self.sources.fingerprint())
        if changes:
            raise ValueError("cannot restore a loader state taken on another mixture (its order is of other "
                             "samples); start this mixture's first epoch from the beginning instead:\n  "
                             + "\n  ".join(changes))

    def close(self) -> None:
        self.reader.close()
        self.sources.close()


def mixture_changes(state: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What differs between the mixture a state was taken on and this one, one line each."""
    old, new = state.get("mixture") or [], now["mixture"]
    out = []
    for i in range(max(len(old), len(new))):
        if i >= len(old):
            out.append(f"source {i}: added (cache {new[i]['cache_id']})")
        elif i >= len(new):
            out.append(f"source {i}: removed (was cache {old[i].get('cache_id')})")
        else:
            for key in ("cache_id", *WEIGHTS):
                if old[i].get(key) != new[i][key]:
                    what = "cache" if key == "cache_id" else key
                    out.append(f"source {i}: {what} was {old[i].get(key)!r}, is {new[i][key]!r}")
    if state.get("epoch_size") != now["epoch_size"]:
        out.append(f"epoch_size was {state.get('epoch_size')!r}, is {now['epoch_size']!r}")
    return out

