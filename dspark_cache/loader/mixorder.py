"""A mixture's epoch order: a pure function of (seed, epoch, the sources' indexes and counts).

The epoch is cut into units, each one shard's samples read together: every shard of a source
once per whole copy the source's count asks for, then, per shard, the samples drawn for the
count's remainder (:func:`~.sources.epoch_subset`). Units are then ordered exactly as a single
cache's shards are (:mod:`.order`): permuted with (seed, epoch), taken in windows of ``window``
units whose samples are permuted together, so a batch mixes sources and reads stay within a few
shards. A mixture of one source without a weight is therefore that cache's own order. Shard ids
are global: source ``s``'s shard ``k`` is ``base[s] + k``.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from dspark_cache.loader.order import SampleRef, shard_sequence, window_order, windows
from dspark_cache.loader.sources import epoch_subset


@dataclass(frozen=True)
class Unit:
    """One shard's samples in an epoch (all of them, or the ones drawn), by index entry."""

    shard_id: int  # global
    entries: tuple[int, ...]  # ascending sample id


def epoch_units(samples: Sequence[Sequence[tuple[int, int]]], shards: Sequence[Sequence[int]],
                counts: Sequence[int], seed: int, epoch: int) -> list[Unit]:
    """The units of an epoch. ``samples[s]``: source ``s``'s ``(global shard id, entry)`` in ascending
    sample id; ``shards[s]``: its global shard ids; ``counts[s]``: the samples it gives the epoch."""
    units: list[Unit] = []
    for source, (refs, ids, count) in enumerate(zip(samples, shards, counts)):
        times = epoch_subset(count, len(refs), seed, epoch, source)
        whole = count // len(refs) if refs else 0
        by_shard: dict[int, list[int]] = {shard: [] for shard in ids}
        for shard, entry in refs:
            by_shard[shard].append(entry)
        for _ in range(whole):
            units += [Unit(shard, tuple(by_shard[shard])) for shard in ids]
        drawn: dict[int, list[int]] = {}
        for position in np.flatnonzero(times > whole).tolist():
            shard, entry = refs[position]
            drawn.setdefault(shard, []).append(entry)
        units += [Unit(shard, tuple(drawn[shard])) for shard in ids if shard in drawn]
    return units


class MixtureOrder:
    """One epoch of a mixture, complete from the start (every source is a complete cache); the
    interface of :class:`~.order.EpochOrder` that the loader uses."""

    complete = True

    def __init__(self, units: list[Unit], seed: int, epoch: int, shuffle: bool, window: int) -> None:
        sequence = shard_sequence(list(range(len(units))), seed, epoch, shuffle)
        self.windows = [[units[u].shard_id for u in w] for w in windows(sequence, window)]
        entries = {u: list(unit.entries) for u, unit in enumerate(units)}
        self.refs: list[SampleRef] = []
        self._ends: list[int] = []
        for index, group in enumerate(windows(sequence, window)):
            self.refs += [SampleRef(units[r.shard_id].shard_id, r.entry)
                          for r in window_order(group, entries, seed, epoch, index, shuffle)]
            self._ends.append(len(self.refs))

    @property
    def total(self) -> int:
        return len(self.refs)

    def shards_from(self, position: int, limit: int) -> list[int]:
        """Up to ``limit`` global shard ids in the order they are read from ``position`` on."""
        window = bisect.bisect_right(self._ends, position)
        return list(dict.fromkeys(s for w in self.windows[window:] for s in w))[:limit]
