"""Length-grouped batching: deterministic, within budget, and invisible in the cached tensors."""

from __future__ import annotations

import numpy as np
import torch

import dspark_cache
from dspark_cache.producer.plan.batches import PlannedSample
from tests.support.batching import length_grouped_batches, padding_waste, whole_batch_shards
from tests.support.produce import run_produce


def _samples(lengths):
    return [PlannedSample(i, np.zeros(n, np.int32), np.ones(n, np.uint8)) for i, n in enumerate(lengths)]


def test_batches_respect_budget_and_are_deterministic():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 700, size=200).tolist()
    batches = length_grouped_batches(_samples(lengths), max_batch_tokens=2048, max_batch_samples=8)
    again = length_grouped_batches(
        list(reversed(_samples(lengths))), max_batch_tokens=2048, max_batch_samples=8
    )
    assert [[s.sample_id for s in b] for b in batches] == [[s.sample_id for s in b] for b in again]
    assert sorted(s.sample_id for b in batches for s in b) == list(range(200))
    for batch in batches:
        assert len(batch) <= 8
        assert max(s.length for s in batch) * len(batch) <= 2048 or len(batch) == 1
    padded = sum(max(s.length for s in b) * len(b) for b in batches)
    assert padded < 1.1 * sum(lengths)  # grouping by length keeps padding compute small


def test_short_batches_hold_more_samples_within_the_same_tokens():
    lengths = [2000, 1990, 1500, 700, 690] + [64] * 12 + [63] * 12 + [40] * 3
    batches = length_grouped_batches(_samples(lengths), max_batch_tokens=2048)
    sizes = [len(b) for b in batches]
    assert sizes[:3] == [1, 1, 1] and sizes[-2] == 24  # one long sample alone, many short ones together
    assert sizes[-1] == 3  # 40 is too far below 64 to be padded to it (MAX_PAD_FRACTION)
    assert all(max(s.length for s in b) * len(b) <= 2048 for b in batches)


def test_shards_are_whole_batches_of_similar_length():
    rng = np.random.default_rng(1)
    lengths = np.clip(rng.lognormal(5.2, 0.9, 500), 4, 2048).astype(int).tolist()
    batches = length_grouped_batches(_samples(lengths), max_batch_tokens=4096)
    shards = whole_batch_shards(batches, shard_size=32)
    assert sorted(s.sample_id for sh in shards for b in sh for s in b) == list(range(500))
    for shard in shards:
        assert sum(len(b) for b in shard) <= 32 or len(shard) == 1
    real, padded = padding_waste(batches)
    assert padded < 1.03 * real  # global grouping: almost no padding even with a long tail
    # Per shard, lengths are a narrow band of the whole range: shards are built in length order.
    firsts = [max(s.length for b in sh for s in b) for sh in shards]
    assert firsts == sorted(firsts, reverse=True)


def test_different_batch_budgets_give_identical_samples(embedded, tmp_path):
    outs = []
    for budget in ("300", "6000"):
        out = str(tmp_path / f"cache-{budget}")
        assert run_produce(embedded.stock, embedded.data, out, "--seq-length", "300", "--dtype", "fp32",
                           "--batch-size", "16", "--max-batch-tokens", budget, "--shard-size", "12") == 0
        outs.append(dspark_cache.open_cache(out))
    a, b = outs
    # The budget changes which samples share a shard (so a resume must not mix the two plans) ...
    differs = {k for k in a.manifest.identity() if a.manifest.identity()[k] != b.manifest.identity()[k]}
    assert "plan_sha256" in differs and differs <= {
        "plan_sha256",
        "planned_padded_tokens",
        "num_shards",
        "planned_bytes",
    }
    # ... and nothing about the samples themselves, which every reader yields in ascending id.
    ids = [x["sample_id"] for x in a.samples()]
    assert ids == sorted(ids) and len(ids) == a.manifest.num_samples
    for x, y in zip(a.samples(), b.samples(), strict=True):
        assert x["sample_id"] == y["sample_id"]
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
        torch.testing.assert_close(x["target_hidden_states"], y["target_hidden_states"], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(
            x["target_last_hidden_states"], y["target_last_hidden_states"], rtol=1e-4, atol=1e-5
        )
