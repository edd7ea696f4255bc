"""Length-grouped batching: deterministic, within budget, and invisible in the cached tensors."""

from __future__ import annotations

import numpy as np
import torch

import dspark_cache
from dspark_cache.producer.plan import PlannedSample, length_grouped_batches
from tests.conftest import run_produce


def _samples(lengths):
    return [PlannedSample(i, np.zeros(n, np.int32), np.ones(n, np.uint8)) for i, n in enumerate(lengths)]


def test_batches_respect_budget_and_are_deterministic():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 700, size=200).tolist()
    batches = length_grouped_batches(_samples(lengths), batch_size=8, max_batch_tokens=2048)
    again = length_grouped_batches(list(reversed(_samples(lengths))), batch_size=8, max_batch_tokens=2048)
    assert [[s.sample_id for s in b] for b in batches] == [[s.sample_id for s in b] for b in again]
    assert sorted(s.sample_id for b in batches for s in b) == list(range(200))
    for batch in batches:
        assert len(batch) <= 8
        assert max(s.length for s in batch) * len(batch) <= 2048 or len(batch) == 1
    padded = sum(max(s.length for s in b) * len(b) for b in batches)
    assert padded < 1.1 * sum(lengths)  # grouping by length keeps padding compute small


def test_different_batch_budgets_give_identical_samples(embedded, tmp_path):
    outs = []
    for budget in ("300", "6000"):
        out = str(tmp_path / f"cache-{budget}")
        assert run_produce(embedded.stock, embedded.data, out, "--seq-length", "300", "--dtype", "fp32",
                           "--batch-size", "16", "--max-batch-tokens", budget, "--shard-size", "12") == 0
        outs.append(dspark_cache.open_cache(out))
    a, b = outs
    assert a.manifest.identity() == b.manifest.identity()
    for x, y in zip(a.samples(), b.samples(), strict=True):
        assert x["sample_id"] == y["sample_id"]
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
        torch.testing.assert_close(x["target_hidden_states"], y["target_hidden_states"], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(x["target_last_hidden_states"], y["target_last_hidden_states"], rtol=1e-4, atol=1e-5)
