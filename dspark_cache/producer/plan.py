"""The plan: which samples go in which shard, in which batches, and the exact bytes on disk.

Names, one per idea: a row is *encoded* into a sample (``chat.ChatEncoder``, run over the input
by ``encode_pool``); :func:`collect_samples` gathers the encoded rows (and the skipped ones);
:func:`build_plan` turns the samples into the :class:`Plan` (``ShardPlan`` per shard,
``PlannedSample`` per sample); ``prepare.plan_input`` does both for an input source.

The plan is a pure function of the input and the settings, so every rank (and every rerun)
computes the same one: same shards, same batches, same bytes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from dspark_cache.format.geometry import SampleShape
from dspark_cache.format.schema import SkippedRow
from dspark_cache.format.tar.writer import predict_shard_bytes
from dspark_cache.producer.chat import EncodedRow
from dspark_cache.producer.inputs import RawRow
from dspark_cache.producer.messages import InvalidRow

log = logging.getLogger(__name__)

NO_SUPERVISED_TOKEN = "no supervised token"


class InvalidInputError(Exception):
    """A row is invalid and the policy is ``error``; raised while planning, before device work."""


@dataclass
class PlannedSample:
    """One sample of the plan: its id (the input row's index), token ids and loss mask."""

    sample_id: int
    input_ids: np.ndarray
    loss_mask: np.ndarray

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def loss_tokens(self) -> int:
        return int(self.loss_mask.sum())


@dataclass
class ShardPlan:
    """One shard of the plan: its samples, batched in write order, and its exact size on disk."""

    shard_id: int
    batches: list[list[PlannedSample]]  # in write order
    num_bytes: int = 0

    @property
    def samples(self) -> list[PlannedSample]:
        return [s for batch in self.batches for s in batch]

    @property
    def num_tokens(self) -> int:
        return sum(s.length for s in self.samples)


@dataclass
class Plan:
    """The whole run: the shards, the rows that give no sample, and the totals the manifest records."""

    num_rows: int
    shards: list[ShardPlan]
    skipped: list[SkippedRow] = field(default_factory=list)

    @property
    def num_samples(self) -> int:
        return sum(len(s.samples) for s in self.shards)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.shards)

    @property
    def num_loss_tokens(self) -> int:
        return sum(x.loss_tokens for s in self.shards for x in s.samples)

    @property
    def num_bytes(self) -> int:
        return sum(s.num_bytes for s in self.shards)

    def skipped_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for row in self.skipped:
            counts[row.reason] = counts.get(row.reason, 0) + 1
        return dict(sorted(counts.items()))


def length_grouped_batches(samples: list[PlannedSample], batch_size: int, max_batch_tokens: int) -> list[list[PlannedSample]]:
    """Longest first; a batch grows while it has room in samples and in padded tokens."""
    ordered = sorted(samples, key=lambda s: (-s.length, s.sample_id))
    batches: list[list[PlannedSample]] = []
    for sample in ordered:
        current = batches[-1] if batches else None
        if current and len(current) < batch_size and current[0].length * (len(current) + 1) <= max_batch_tokens:
            current.append(sample)
        else:
            batches.append([sample])
    return batches


def collect_samples(
    encoded: Iterable[tuple[RawRow, EncodedRow | InvalidRow]],
    on_invalid: str,
) -> tuple[int, list[PlannedSample], list[SkippedRow]]:
    """Gather encoded rows; invalid rows raise or are skipped (and listed) by policy."""
    samples: list[PlannedSample] = []
    skipped: list[SkippedRow] = []
    num_rows = 0
    for row, result in encoded:
        num_rows += 1
        if isinstance(result, InvalidRow):
            exc = result
            if on_invalid == "error":
                raise InvalidInputError(
                    f"{row.where}: {exc.detail}. Fix or remove this row, or pass --on-invalid skip "
                    "to skip invalid rows (they are counted and listed in the manifest)"
                ) from exc
            skipped.append(SkippedRow(row=row.index, reason=exc.reason, where=row.where))
            continue
        sample = PlannedSample(row.index, result.input_ids, result.loss_mask)
        if sample.loss_tokens == 0:
            skipped.append(SkippedRow(row=row.index, reason=NO_SUPERVISED_TOKEN, where=row.where))
            continue
        samples.append(sample)
        if num_rows % 10000 == 0:
            log.info("tokenised %d rows", num_rows)
    return num_rows, samples, skipped


def build_plan(
    num_rows: int,
    samples: list[PlannedSample],
    skipped: list[SkippedRow],
    shape: SampleShape,
    *,
    shard_size: int,
    batch_size: int,
    max_batch_tokens: int,
) -> Plan:
    """Split samples (ascending id) into shards, batch each shard, and size every shard."""
    shards = []
    for shard_id, start in enumerate(range(0, len(samples), shard_size)):
        members = samples[start : start + shard_size]
        shard = ShardPlan(shard_id, length_grouped_batches(members, batch_size, max_batch_tokens))
        shard.num_bytes = predict_shard_bytes([(shape.specs(s.length), shape.metadata(s.sample_id)) for s in shard.samples])
        shards.append(shard)
    return Plan(num_rows=num_rows, shards=shards, skipped=skipped)
