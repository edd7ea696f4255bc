"""The sample order: a pure function of (seed, epoch, shard sequence) and nothing else.

No process ids, no time, no ``hash()`` of strings: every rank, every worker count and every
restart computes the same order. Shuffling keeps locality: the shard sequence is permuted, and
samples are permuted only within windows of ``window`` consecutive shards, so reads stay within
a few shards at a time. Ranks get *samples*, not shards: global batch ``j`` is the slice
``[j * B * W, (j + 1) * B * W)`` of the order, and rank ``r`` takes its ``r``-th ``B`` samples, so
every rank gets the same number of batches whatever the shard sizes.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence

import numpy as np

# A constant mixed into every seed so our streams never coincide with a user's own RNG use.
_SALT = 0x5DA4C


@dataclass(frozen=True)
class SampleRef:
    """One sample of the order: which shard, which index entry."""

    shard_id: int
    entry: int  # position in the shard index's sample list


def seeded(*keys: int) -> np.random.Generator:
    """The generator of one draw, keyed by integers only (the salt first)."""
    return np.random.default_rng([_SALT, *[int(k) & 0xFFFFFFFF for k in keys]])


_rng = seeded


def shard_sequence(shard_ids: list[int], seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The order in which shards are visited this epoch."""
    ordered = sorted(shard_ids)
    if not shuffle:
        return ordered
    return [ordered[i] for i in _rng(seed, epoch).permutation(len(ordered))]


def windows(sequence: list[int], window: int) -> list[list[int]]:
    return [sequence[i : i + window] for i in range(0, len(sequence), window)]


def window_order(shards: list[int], order_ids: dict[int, list[int]], seed: int, epoch: int, index: int,
                 shuffle: bool) -> list[SampleRef]:
    """The samples of one window: ascending sample id, or permuted with (seed, epoch, window)."""
    refs = [SampleRef(s, e) for s in shards for e in order_ids[s]]
    if not shuffle:
        return refs
    return [refs[i] for i in _rng(seed, epoch, index + 1).permutation(len(refs))]


class _Entry(Protocol):
    sample_id: int


class IndexLike(Protocol):
    """What the order needs of a shard index: its entries' sample ids, in index order."""

    @property
    def samples(self) -> Sequence[_Entry]: ...


class EpochOrder:
    """One epoch's sample order, extended window by window as their shards are published.

    Pure: the caller looks the shards of :meth:`next_shards` up (waiting for them while it
    follows a producer) and hands their indexes to :meth:`add_window`.
    """

    def __init__(
        self, num_shards: int, seed: int, epoch: int, shuffle: bool, window: int, streaming: bool
    ) -> None:
        shard_ids = list(range(num_shards))
        # While following a producer, visit shards in id order (the order they are produced in);
        # otherwise in the permuted order. Either way the order depends on shard ids only.
        sequence = shard_ids if streaming else shard_sequence(shard_ids, seed, epoch, shuffle)
        self.seed, self.epoch, self.shuffle = seed, epoch, shuffle
        self.windows = windows(sequence, window)
        self.refs: list[SampleRef] = []
        self.loaded = 0
        self._ends: list[int] = []  # len(refs) after each window added

    @property
    def complete(self) -> bool:
        return self.loaded == len(self.windows)

    @property
    def total(self) -> int | None:
        """The epoch's size once every window is in."""
        return len(self.refs) if self.complete else None

    def next_shards(self) -> list[int]:
        """The shards of the window to add next (none once the order is complete)."""
        return [] if self.complete else self.windows[self.loaded]

    def add_window(self, indexes: Mapping[int, IndexLike]) -> None:
        """Add the next window, given the index of each of its shards."""
        shards = self.next_shards()
        by_id = {s: sorted(range(len(indexes[s].samples)), key=lambda k, i=indexes[s]: i.samples[k].sample_id)
                 for s in shards}
        self.refs += window_order(shards, by_id, self.seed, self.epoch, self.loaded, self.shuffle)
        self._ends.append(len(self.refs))
        self.loaded += 1

    def shards_from(self, position: int, limit: int) -> list[int]:
        """Up to ``limit`` shard ids in the order they are read from ``position`` on: the window
        holding that sample, then the later ones (known in advance: what a remote cache fetches ahead)."""
        window = bisect.bisect_right(self._ends, position)
        return [s for w in self.windows[window:] for s in w][:limit]


@dataclass(frozen=True)
class RankBatch:
    """What one rank reads for one step: ``B`` refs, and which of them repeat earlier samples."""

    step: int
    refs: tuple[SampleRef, ...]
    repeat: tuple[bool, ...]


def epoch_steps(
    available: int, total: int | None, offset: int, batch_size: int, world_size: int, drop_last: bool
) -> int:
    """Global steps from ``offset``: complete ones while the epoch grows, the tail policy at its end.

    ``available`` samples of the order are known; ``total`` is the epoch's size once known.
    """
    per_step = batch_size * world_size
    if total is None:
        return max(0, (available - offset) // per_step)
    remaining = max(0, total - offset)
    return remaining // per_step if drop_last else -(-remaining // per_step)


def rank_batch(order: list[SampleRef], total: int, offset: int, step: int, batch_size: int,
               world_size: int, rank: int, partial_last: bool = False) -> RankBatch:
    """Rank ``rank``'s part of global step ``step`` counted from ``offset``.

    Positions past the end of the epoch wrap to the start of the epoch's order (whatever the
    resume point, so a resumed run repeats the same samples): those are the flagged repeats that
    keep every rank's batch count equal when ``drop_last`` is off. With
    ``partial_last`` the last step is shared evenly instead (as ``DistributedSampler`` does):
    every rank gets ``ceil(rest / world_size)`` samples, so at most ``world_size - 1`` repeats.
    """
    step_start = offset + step * batch_size * world_size
    size = batch_size
    if partial_last and step_start + batch_size * world_size > total:
        size = -(-(total - step_start) // world_size)
    start = step_start + rank * size
    refs, repeat = [], []
    for position in range(start, start + size):
        refs.append(order[position % total])
        repeat.append(position >= total)
    return RankBatch(step, tuple(refs), tuple(repeat))
