"""The plan: which samples go in which shard, in which batches, and the exact bytes on disk.

Names, one per idea: a row is *encoded* into a sample (``chat.ChatEncoder``, run over the input
by ``encode_pool``); :func:`collect_samples` gathers the encoded rows (and the skipped ones);
:func:`build_plan` turns the samples into the :class:`Plan` (``ShardPlan`` per shard,
``PlannedSample`` per sample); ``prepare.plan_input`` does both for an input source.

The plan is a pure function of the input and the settings, so every rank (and every rerun)
computes the same one: same shards, same batches, same bytes.
"""

from __future__ import annotations

import hashlib
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
# A sample joins a batch only if padding it to the batch's width costs at most this fraction of
# the width: a large budget over a small dataset would otherwise batch lengths 60..30 together
# (measured: 20% padding for 500 long-tail samples at 16k tokens; 3% with this rule).
MAX_PAD_FRACTION = 1 / 16


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

    @property
    def padded_tokens(self) -> int:
        """Tokens the device computes, padding included (the real ones are ``num_tokens``)."""
        return padding_waste(b for s in self.shards for b in s.batches)[1]

    @property
    def padding_waste(self) -> float:
        """Padded tokens computed per real token, minus one (0.02 = 2% of the work is padding)."""
        return self.padded_tokens / max(1, self.num_tokens) - 1

    def layout_sha256(self) -> str:
        """A fingerprint of which samples each shard holds: a resume may reuse a shard only if
        the new plan puts exactly the same samples in it (a planner or budget change would not)."""
        digest = hashlib.sha256()
        for shard in self.shards:
            ids = np.array([s.sample_id for s in shard.samples], dtype="<i8")
            digest.update(np.array([shard.shard_id, ids.size], dtype="<i8").tobytes() + ids.tobytes())
        return digest.hexdigest()

    def skipped_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for row in self.skipped:
            counts[row.reason] = counts.get(row.reason, 0) + 1
        return dict(sorted(counts.items()))


def length_grouped_batches(samples: list[PlannedSample], max_batch_tokens: int,
                           max_batch_samples: int | None = None) -> list[list[PlannedSample]]:
    """Longest first; a batch grows while its padded tokens (longest x count) stay within
    ``max_batch_tokens`` (and its count within ``max_batch_samples``, if given) and the next
    sample is within ``MAX_PAD_FRACTION`` of the batch's width.

    Over the whole dataset this pads almost nothing: neighbours in length order differ by a few
    tokens. Long batches hold few samples, short ones many, all within the same memory.
    """
    ordered = sorted(samples, key=lambda s: (-s.length, s.sample_id))
    cap = max_batch_samples or len(ordered) or 1
    batches: list[list[PlannedSample]] = []
    for sample in ordered:
        current = batches[-1] if batches else None
        if (current and len(current) < cap and current[0].length * (len(current) + 1) <= max_batch_tokens
                and current[0].length - sample.length <= current[0].length * MAX_PAD_FRACTION):
            current.append(sample)
        else:
            batches.append([sample])
    return batches


def whole_batch_shards(batches: list[list[PlannedSample]], shard_size: int) -> list[list[list[PlannedSample]]]:
    """Consecutive batches grouped into shards of at most ``shard_size`` samples (a batch larger
    than that, which :func:`build_plan` never makes, would be a shard of its own): a shard holds
    samples of similar length."""
    shards: list[list[list[PlannedSample]]] = []
    count = shard_size  # forces a first shard
    for batch in batches:
        if count + len(batch) > shard_size:
            shards.append([])
            count = 0
        shards[-1].append(batch)
        count += len(batch)
    return shards


def padding_waste(batches: Iterable[list[PlannedSample]]) -> tuple[int, int]:
    """``(real tokens, padded tokens)`` the device computes for these batches."""
    real = padded = 0
    for batch in batches:
        real += sum(s.length for s in batch)
        padded += max(s.length for s in batch) * len(batch)
    return real, padded


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
    max_batch_tokens: int,
    max_batch_samples: int | None = None,
) -> Plan:
    """Batch all samples by length (globally), cut shards of whole batches, size every shard.

    Sample ids inside a shard are not contiguous: the shard index carries them, and every
    reader goes by sample id.
    """
    # A batch never holds more than a shard, so every shard stays within shard_size samples.
    cap = min(max_batch_samples or shard_size, shard_size)
    batches = length_grouped_batches(samples, max_batch_tokens, cap)
    shards = []
    for shard_id, members in enumerate(whole_batch_shards(batches, shard_size)):
        shard = ShardPlan(shard_id, members)
        shard.num_bytes = predict_shard_bytes([(shape.specs(s.length), shape.metadata(s.sample_id)) for s in shard.samples])
        shards.append(shard)
    return Plan(num_rows=num_rows, shards=shards, skipped=skipped)
