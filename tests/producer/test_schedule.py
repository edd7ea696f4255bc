"""The order batches are computed in with several shards in flight: every batch once, each shard's in
plan order, at most ``lanes`` shards open, lanes balanced, and a drain that finishes what is open."""

from __future__ import annotations

import random

import numpy as np
import pytest

from dspark_cache.producer.pipeline.schedule import ShardSchedule
from dspark_cache.producer.plan.batches import PlannedSample, ShardPlan


def _shards(rng: random.Random, count: int) -> list[ShardPlan]:
    sid, shards = 0, []
    for shard_id in range(count):
        batches = []
        for _ in range(rng.randint(0 if shard_id == 3 else 1, 5)):  # shard 3 may have no batch at all
            batch = []
            for _ in range(rng.randint(1, 3)):
                n = rng.randint(1, 300)
                batch.append(PlannedSample(sid, np.zeros(n, np.int32), np.ones(n, np.uint8)))
                sid += 1
            batches.append(batch)
        shards.append(ShardPlan(shard_id, batches))
    return shards


@pytest.mark.parametrize("lanes", [1, 2, 3, 8])
@pytest.mark.parametrize("seed", range(4))
def test_every_batch_once_in_plan_order_within_its_shard(lanes, seed):
    shards = _shards(random.Random(seed), 11)
    steps = list(ShardSchedule(shards, lanes))
    assert sorted((s.shard.shard_id, s.index) for s in steps) == [
        (shard.shard_id, i) for shard in shards for i in range(len(shard.batches))]
    open_now: dict[int, int] = {}  # shard -> lane
    for step in steps:
        if step.opens:
            assert step.lane not in open_now.values()  # a lane writes one shard at a time
            open_now[step.shard.shard_id] = step.lane
        assert open_now[step.shard.shard_id] == step.lane  # every batch of a shard goes to its lane
        assert len(open_now) <= lanes
        if step.closes:
            del open_now[step.shard.shard_id]
    assert not open_now
    # Shards are taken in plan order: one opens at most lanes - 1 places from where the plan has it.
    planned = [s.shard_id for s in shards if s.batches]
    opened = [s.shard.shard_id for s in steps if s.opens]
    assert all(abs(planned.index(shard) - k) < lanes for k, shard in enumerate(opened))
    if lanes == 1:
        assert [(s.shard.shard_id, s.index) for s in steps] == [
            (shard.shard_id, i) for shard in shards for i in range(len(shard.batches))]


def test_lanes_take_turns_by_tokens_so_each_writer_has_work():
    shards = [ShardPlan(i, [[PlannedSample(10 * i + j, np.zeros(100, np.int32), np.ones(100, np.uint8))]
                            for j in range(6)]) for i in range(4)]
    steps = list(ShardSchedule(shards, 2))
    assert [s.lane for s in steps[:6]] == [0, 1, 0, 1, 0, 1]  # equal batches: strictly alternating


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("taken", [1, 2, 4, 7])
def test_a_drain_opens_no_shard_and_finishes_the_open_ones(seed, taken):
    shards = _shards(random.Random(seed), 10)
    schedule = ShardSchedule(shards, 3)
    seen = [step for step in (schedule.next() for _ in range(taken)) if step is not None]
    schedule.drain()
    rest = list(schedule)
    assert not [s for s in rest if s.opens]  # a shard assigned to a lane but not begun is let go too
    begun = {s.shard.shard_id for s in seen if s.opens}
    done = {s.shard.shard_id for s in seen + rest if s.closes}
    assert done == begun  # every shard begun is finished, no other
    assert schedule.next() is None


def test_the_order_is_a_pure_function_of_the_plan_and_lanes():
    shards = _shards(random.Random(2), 9)
    first = [(s.shard.shard_id, s.index, s.lane) for s in ShardSchedule(shards, 3)]
    assert first == [(s.shard.shard_id, s.index, s.lane) for s in ShardSchedule(shards, 3)]
    with pytest.raises(ValueError, match="at least one lane"):
        ShardSchedule(shards, 0)


def test_the_default_writer_count_follows_the_cores_this_rank_has(monkeypatch):
    from dspark_cache.producer import config

    monkeypatch.setattr(config.os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert config.default_writer_threads() == 8  # capped
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert config.default_writer_threads() == 4  # four ranks on the node share its cores
    monkeypatch.setattr(config.os, "sched_getaffinity", lambda pid: {0})
    assert config.default_writer_threads() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "")  # not torchrun's: not a reason for --help to fail
    assert config.default_writer_threads() == 1
