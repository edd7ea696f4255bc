"""The epoch order, simulated for world sizes 1-4 on made-up shard sizes (no processes needed)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest

from dspark_cache.loader.order import EpochOrder, epoch_steps, rank_batch


@dataclass
class _Entry:
    sample_id: int


@dataclass
class _Index:
    samples: list

    @property
    def num_samples(self) -> int:
        return len(self.samples)


class FakeCache:
    """Shards of the given sizes; sample ids ascend across shards, as the producer writes them."""

    def __init__(self, sizes: list[int]) -> None:
        self.indexes, next_id = {}, 0
        for shard, size in enumerate(sizes):
            # Within a shard the tar order is the producer's batch order, not id order.
            ids = list(range(next_id, next_id + size))[::-1]
            self.indexes[shard] = _Index([_Entry(i) for i in ids])
            next_id += size


def epoch_order(sizes, seed=0, epoch=0, shuffle=True, window=2):
    cache = FakeCache(sizes)
    order = EpochOrder(len(sizes), seed, epoch, shuffle, window, streaming=False)
    while not order.complete:
        order.add_window({s: cache.indexes[s] for s in order.next_shards()})
    order.cache = cache  # for rank_view's lookups
    ids = [cache.indexes[r.shard_id].samples[r.entry].sample_id for r in order.refs]
    return order, ids


def rank_view(order, world, rank, batch, drop_last, partial_last=False, offset=0):
    steps = epoch_steps(0, order.total, offset, batch, world, drop_last)
    out = []
    for step in range(steps):
        rb = rank_batch(order.refs, order.total, offset, step, batch, world, rank, partial_last)
        out.append(
            [
                (order.cache.indexes[r.shard_id].samples[r.entry].sample_id, rep)
                for r, rep in zip(rb.refs, rb.repeat)
            ]
        )
    return out


UNEVEN = [7, 1, 12, 3, 9, 2]  # 34 samples in 6 shards of very different sizes


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("sizes", [UNEVEN, [5, 6]], ids=["uneven", "fewer-shards-than-ranks"])
def test_every_rank_gets_equal_batches_and_every_sample_once(world, sizes):
    order, ids = epoch_order(sizes)
    n = sum(sizes)
    assert sorted(ids) == list(range(n))
    for drop_last in (False, True):
        views = [rank_view(order, world, r, 3, drop_last) for r in range(world)]
        assert len({len(v) for v in views}) == 1  # equal batch counts: no DDP hang
        assert all(len(b) == 3 for v in views for b in v)
        seen = Counter(sid for v in views for b in v for sid, rep in b if not rep)
        repeats = sum(rep for v in views for b in v for _, rep in b)
        if drop_last:  # each sample at most once; fewer than one global batch dropped
            assert max(seen.values(), default=1) == 1 and n - len(seen) < 3 * world and repeats == 0
        else:  # each sample exactly once; the flagged repeats only fill the last step
            assert sorted(seen) == list(range(n)) and max(seen.values()) == 1
            assert repeats == -(-n // (3 * world)) * 3 * world - n


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_partial_last_step_is_shared_evenly(world):
    order, _ = epoch_order(UNEVEN)
    views = [rank_view(order, world, r, 4, False, partial_last=True) for r in range(world)]
    assert len({len(v) for v in views}) == 1 and len({len(v[-1]) for v in views}) == 1
    repeats = sum(rep for v in views for b in v for _, rep in b)
    assert repeats < world
    assert {sid for v in views for b in v for sid, rep in b if not rep} == set(range(34))


def test_order_is_a_pure_function_of_seed_and_epoch():
    _, a = epoch_order(UNEVEN, seed=1, epoch=0)
    _, again = epoch_order(UNEVEN, seed=1, epoch=0)
    _, other_epoch = epoch_order(UNEVEN, seed=1, epoch=1)
    _, other_seed = epoch_order(UNEVEN, seed=2, epoch=0)
    assert a == again
    assert a != other_epoch and sorted(a) == sorted(other_epoch)
    assert a != other_seed
    _, plain = epoch_order(UNEVEN, shuffle=False)
    assert plain == list(range(34))


def test_shuffle_keeps_locality_within_windows():
    order, ids = epoch_order([10] * 12, window=3)
    # Any 30 consecutive samples of the order come from at most 2 windows (<= 6 shards).
    shard_of = {i: i // 10 for i in range(120)}
    for start in range(0, 120, 30):
        assert len({shard_of[s] for s in ids[start : start + 30]}) <= 3


@pytest.mark.parametrize("old,new", [(1, 3), (4, 2), (2, 2), (3, 1)])
def test_restriping_after_offset_covers_the_rest_exactly_once(old, new):
    order, _ = epoch_order(UNEVEN)
    consumed_steps = 2
    first = [
        sid for r in range(old) for b in rank_view(order, old, r, 2, False)[:consumed_steps] for sid, _ in b
    ]
    offset = consumed_steps * 2 * old
    rest = [(sid, rep) for r in range(new) for b in rank_view(order, new, r, 2, False, offset=offset)
            for sid, rep in b]
    assert sorted(first + [s for s, rep in rest if not rep]) == list(range(34))
