"""The order in which a rank computes its batches: several shards in flight, one per writer lane.

A shard is written by one thread from its first byte to its last (its checksum runs through the
whole file), so writing in parallel means several shards open at once. Computing them one after
another would hand a second writer nothing until the first shard's every batch sat in host
memory: the host ring would have to hold whole shards. Instead the device takes the batches
of ``lanes`` open shards in turn: the next batch is the next one of the open shard with the
fewest bytes handed out so far (the lowest lane on a tie), and a lane whose shard is done opens
the next shard of the plan. Each shard's batches stay in plan order, so its bytes, and so the
cache, are the same whatever the lane count; only the order in which shards finish changes.

The order is a pure function of (shards, lanes) and the moments :meth:`ShardSchedule.drain` is
called, so every rank of a model-parallel group, running the same schedule, computes the same
batches. After ``drain`` (a stop request) no shard opens: the open ones are finished.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from dspark_cache.producer.plan.batches import PlannedSample, ShardPlan


@dataclass(frozen=True)
class Step:
    """One batch to compute: batch ``index`` of ``shard``, written by writer ``lane``."""

    shard: ShardPlan
    index: int
    lane: int

    @property
    def batch(self) -> list[PlannedSample]:
        return self.shard.batches[self.index]

    @property
    def opens(self) -> bool:
        return self.index == 0

    @property
    def closes(self) -> bool:
        return self.index == len(self.shard.batches) - 1


def batch_bytes(batch: list[PlannedSample]) -> int:
    """What the schedule balances lanes by: tokens (a batch's bytes are tokens times a constant)."""
    return sum(s.length for s in batch)


class ShardSchedule:
    """Iterate to get :class:`Step` s; ``drain()`` to open no more shards."""

    def __init__(self, shards: list[ShardPlan], lanes: int) -> None:
        if lanes < 1:
            raise ValueError(f"a schedule needs at least one lane, not {lanes}")
        self._waiting = [s for s in shards if s.batches]  # a shard of no batch has nothing to compute
        self._next_shard = 0
        self._lanes: list[tuple[ShardPlan, int] | None] = [None] * lanes  # (shard, next batch index)
        self._handed = [0] * lanes  # tokens handed to each lane so far
        self._draining = False

    def drain(self) -> None:
        """Begin no shard from now on: a lane given a shard of which no batch was handed out lets it go."""
        self._draining = True
        self._lanes = [None if lane is None or lane[1] == 0 else lane for lane in self._lanes]

    def __iter__(self) -> Iterator[Step]:
        while (step := self.next()) is not None:
            yield step

    def next(self) -> Step | None:
        """The next batch, or ``None`` when every shard (after a drain: every open shard) is handed out."""
        if not self._draining:
            for lane, current in enumerate(self._lanes):
                if current is None and self._next_shard < len(self._waiting):
                    self._lanes[lane] = (self._waiting[self._next_shard], 0)
                    self._next_shard += 1
        busy = [lane for lane, current in enumerate(self._lanes) if current is not None]
        if not busy:
            return None
        lane = min(busy, key=lambda i: (self._handed[i], i))
        shard, index = self._lanes[lane]  # type: ignore[misc]
        step = Step(shard, index, lane)
        self._handed[lane] += batch_bytes(step.batch)
        self._lanes[lane] = None if step.closes else (shard, index + 1)
        return step
