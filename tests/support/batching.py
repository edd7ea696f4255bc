"""The plan's batching and shard rules over lists of samples, for tests and benches that build
batches by hand (the producer plans over flat arrays: ``producer.plan.batches.plan_from_rows``)."""

from __future__ import annotations

from typing import Iterable

import numpy as np

from dspark_cache.producer.plan.batches import PlannedSample, batch_starts_of, shard_starts_of, write_order


def length_grouped_batches(samples: list[PlannedSample], max_batch_tokens: int,
                           max_batch_samples: int | None = None) -> list[list[PlannedSample]]:
    """The batches ``plan_from_rows`` makes, as lists of the given samples."""
    ordered = [samples[i] for i in write_order([s.sample_id for s in samples], [s.length for s in samples])]
    starts = batch_starts_of(np.array([s.length for s in ordered], dtype=np.int64), max_batch_tokens,
                             max_batch_samples or len(ordered) or 1)
    return [ordered[a:b] for a, b in zip(starts[:-1].tolist(), starts[1:].tolist())]


def whole_batch_shards(
    batches: list[list[PlannedSample]], shard_size: int
) -> list[list[list[PlannedSample]]]:
    """The shards ``plan_from_rows`` cuts from these batches: a shard holds samples of similar length."""
    starts = shard_starts_of(np.array([len(b) for b in batches], dtype=np.int64), shard_size)
    return [batches[a:b] for a, b in zip(starts[:-1].tolist(), starts[1:].tolist())]


def padding_waste(batches: Iterable[list[PlannedSample]]) -> tuple[int, int]:
    """``(real tokens, padded tokens)`` the device computes for these batches."""
    real = padded = 0
    for batch in batches:
        real += sum(s.length for s in batch)
        padded += max(s.length for s in batch) * len(batch)
    return real, padded
