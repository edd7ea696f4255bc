"""The plan: which samples go in which shard, in which batches, and the exact bytes on disk.

Names, one per idea: a row is *encoded* into a sample (``encode.chat.ChatEncoder``, run over the
input by ``encode.pool`` into the parts of ``plan.parts``); :func:`plan_from_rows` orders the
samples, cuts batches and shards and sizes every shard (``format.tar.writer.predict_shard_bytes``);
the :class:`Plan` holds the result as a few flat arrays (a few tens of bytes per sample,
memory-mapped from ``plan/`` by ``plan.store``) and hands out :class:`ShardPlan` /
:class:`PlannedSample` views one shard at a time.

The plan is a pure function of the input and the settings, so every rank (and every rerun)
gets the same one: same shards, same batches, same bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Iterable

import numpy as np

from dspark_cache.format.geometry import SampleShape
from dspark_cache.format.plan import PLAN_SAMPLE
from dspark_cache.format.schema import SkippedRow
from dspark_cache.format.tar.writer import predict_shard_bytes

# A sample joins a batch only if padding it to the batch's width costs at most this fraction of
# the width: a large budget over a small dataset would otherwise batch lengths 60..30 together
# (measured: 20% padding for 500 long-tail samples at 16k tokens; 3% with this rule).
MAX_PAD_FRACTION = 1 / 16


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


class TokenStore:
    """Where the samples' tokens are: one ``(ids, mask)`` pair of flat arrays per part
    (memory-mapped plan files)."""

    def __init__(self, parts: list[tuple[np.ndarray, np.ndarray]]) -> None:
        self.parts = parts

    def sample(self, record: np.void) -> PlannedSample:
        """The sample a ``PLAN_SAMPLE`` record points at (views, no copy)."""
        ids, mask = self.parts[int(record["part"])]
        start = int(record["offset"])
        end = start + int(record["length"])
        return PlannedSample(int(record["sample_id"]), ids[start:end], mask[start:end])


class ShardBatches(Sequence):
    """A shard's batches, made from the plan's arrays when asked for (one shard at a time in memory)."""

    def __init__(self, store: TokenStore, records: np.ndarray, starts: np.ndarray) -> None:
        # starts: len(batches) + 1, shard-relative
        self.store, self.records, self.starts = store, records, starts

    def __len__(self) -> int:
        return len(self.starts) - 1

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        return [self.store.sample(r) for r in self.records[self.starts[i]:self.starts[i + 1]]]


def _records_of(batches: Sequence[list[PlannedSample]]) -> np.ndarray:
    if isinstance(batches, ShardBatches):
        return batches.records
    samples = [s for batch in batches for s in batch]
    out = np.zeros(len(samples), dtype=PLAN_SAMPLE)
    out["sample_id"] = [s.sample_id for s in samples]
    out["length"] = [s.length for s in samples]
    out["loss_tokens"] = [s.loss_tokens for s in samples]
    return out


@dataclass
class ShardPlan:
    """One shard of the plan: its samples, batched in write order, and its exact size on disk.

    ``batches`` is a list (plans built in tests and benches) or the plan's lazy
    :class:`ShardBatches`; the totals come from the plan's arrays without making samples.
    """

    shard_id: int
    batches: Sequence[list[PlannedSample]]  # in write order
    num_bytes: int = 0

    @cached_property
    def records(self) -> np.ndarray:
        """``PLAN_SAMPLE`` records of the shard's samples, in write order."""
        return _records_of(self.batches)

    @property
    def sample_ids(self) -> np.ndarray:
        return self.records["sample_id"]

    @property
    def lengths(self) -> np.ndarray:
        return self.records["length"]

    @property
    def num_samples(self) -> int:
        return int(self.records.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def samples(self) -> list[PlannedSample]:
        return [s for batch in self.batches for s in batch]


@dataclass
class Plan:
    """The whole run as flat arrays: samples in write order, batch and shard boundaries, sizes.

    ``samples`` holds ``PLAN_SAMPLE`` records; batch ``b`` is ``samples[batch_starts[b]:
    batch_starts[b + 1]]`` and shard ``s`` is batches ``shard_starts[s]:shard_starts[s + 1]``.
    """

    num_rows: int
    samples: np.ndarray
    batch_starts: np.ndarray
    shard_starts: np.ndarray
    shard_bytes: np.ndarray
    store: TokenStore
    skipped: list[SkippedRow] = field(default_factory=list)

    @cached_property
    def shards(self) -> list[ShardPlan]:
        out = []
        for s in range(len(self.shard_bytes)):
            first, last = int(self.shard_starts[s]), int(self.shard_starts[s + 1])
            starts = np.asarray(self.batch_starts[first:last + 1])
            records = self.samples[starts[0]:starts[-1]]
            out.append(
                ShardPlan(s, ShardBatches(self.store, records, starts - starts[0]), int(self.shard_bytes[s]))
            )
        return out

    @property
    def num_samples(self) -> int:
        return int(self.samples.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.samples["length"].sum(dtype=np.int64))

    @property
    def num_loss_tokens(self) -> int:
        return int(self.samples["loss_tokens"].sum(dtype=np.int64))

    @property
    def num_bytes(self) -> int:
        return int(self.shard_bytes.sum(dtype=np.int64))

    def bytes_missing(self, published: Collection[int]) -> list[int]:
        """What each planned shard not in ``published`` will take on disk."""
        return [s.num_bytes for s in self.shards if s.shard_id not in published]

    @property
    def padded_tokens(self) -> int:
        """Tokens the device computes, padding included (the real ones are ``num_tokens``)."""
        if not self.num_samples:
            return 0
        lengths = self.samples["length"].astype(np.int64)
        starts = np.asarray(self.batch_starts[:-1], dtype=np.int64)
        return int((np.maximum.reduceat(lengths, starts) * np.diff(self.batch_starts)).sum())

    @property
    def padding_waste(self) -> float:
        """Padded tokens computed per real token, minus one (0.02 = 2% of the work is padding)."""
        return self.padded_tokens / max(1, self.num_tokens) - 1

    def shard_samples_sha256(self) -> str:
        """A fingerprint of which samples each shard holds: a resume may reuse a shard only if
        the new plan puts exactly the same samples in it (a planner or budget change would not)."""
        digest = hashlib.sha256()
        for shard in self.shards:
            ids = np.ascontiguousarray(shard.sample_ids, dtype="<i8")
            digest.update(np.array([shard.shard_id, ids.size], dtype="<i8").tobytes() + ids.tobytes())
        return digest.hexdigest()

    def skipped_counts(self) -> dict[str, int]:
        return reason_counts(self.skipped)


def reason_counts(rows: Iterable[SkippedRow]) -> dict[str, int]:
    """How many rows were skipped for each reason, by reason (the manifest's ``skipped_rows``)."""
    counts: dict[str, int] = {}
    for row in rows:
        counts[row.reason] = counts.get(row.reason, 0) + 1
    return dict(sorted(counts.items()))


# -- batching and shards over arrays ------------------------------------------------------------

def write_order(sample_ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The permutation that puts samples in write order: longest first, then by sample id."""
    return np.lexsort((np.asarray(sample_ids), -np.asarray(lengths, dtype=np.int64)))


def batch_starts_of(lengths: np.ndarray, max_batch_tokens: int, cap: int) -> np.ndarray:
    """Batch boundaries over lengths in write order: a batch grows while its padded tokens
    (first length x count) stay within ``max_batch_tokens``, its count within ``cap`` and the
    next sample is within ``MAX_PAD_FRACTION`` of its width.

    Over the whole dataset this pads almost nothing: neighbours in length order differ by a
    few tokens. Long batches hold few samples, short ones many, all within the same memory.
    """
    starts = [0]
    width = count = 0
    for i, n in enumerate(lengths.tolist()):
        if (
            count
            and count < cap
            and width * (count + 1) <= max_batch_tokens
            and width - n <= width * MAX_PAD_FRACTION
        ):
            count += 1
            continue
        if count:
            starts.append(i)
        width, count = n, 1
    starts.append(len(lengths))
    return np.asarray(starts if len(lengths) else [0], dtype=np.int64)


def shard_starts_of(batch_sizes: np.ndarray, shard_size: int) -> np.ndarray:
    """Consecutive batches grouped into shards of at most ``shard_size`` samples (a batch larger
    than that, which :func:`plan_from_rows` never makes, is a shard of its own)."""
    starts = [0]
    count = 0
    for b, size in enumerate(batch_sizes.tolist()):
        if count and count + size > shard_size:
            starts.append(b)
            count = 0
        count += size
    starts.append(len(batch_sizes))
    return np.asarray(starts if len(batch_sizes) else [0], dtype=np.int64)


def plan_from_rows(num_rows: int, rows: np.ndarray, store: TokenStore, skipped: list[SkippedRow],
                   shape: SampleShape, *, shard_size: int, max_batch_tokens: int,
                   max_batch_samples: int | None = None) -> Plan:
    """Batch all samples by length (globally), cut shards of whole batches, size every shard.

    ``rows``: ``PLAN_SAMPLE`` records in any order. Sample ids inside a shard are not
    contiguous: the shard index carries them, and every reader goes by sample id.
    """
    samples = np.ascontiguousarray(rows[write_order(rows["sample_id"], rows["length"])])
    # A batch never holds more than a shard, so every shard stays within shard_size samples.
    cap = min(max_batch_samples or shard_size, shard_size)
    batch_starts = batch_starts_of(samples["length"], max_batch_tokens, cap)
    shard_starts = shard_starts_of(np.diff(batch_starts), shard_size)
    bounds = batch_starts[shard_starts]
    ids, lengths = samples["sample_id"], samples["length"]
    sizes = np.array([predict_shard_bytes(shape, ids[a:b].tolist(), lengths[a:b].tolist())
                      for a, b in zip(bounds[:-1], bounds[1:])], dtype=np.int64)
    return Plan(
        num_rows, samples, batch_starts, shard_starts, sizes, store, sorted(skipped, key=lambda r: r.row)
    )
