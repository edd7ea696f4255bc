"""A produced cache equals an independent reference: HF chat template, mask rules, HF forward."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import dspark_cache
from dspark_cache.format.layers import build_target_layer_ids
from tests.support.produce import run_produce
from tests.support.reference import chatml_mask, generation_mask, normalise, reference_hidden

TOLERANCE = {"bf16": dict(rtol=1.6e-2, atol=2e-2), "fp32": dict(rtol=1e-4, atol=1e-5)}


def _rows(path):
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _check_cache(cache_dir, target, data, seq_length, masker, dtype):
    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    cache = dspark_cache.open_cache(cache_dir)
    m = cache.manifest
    assert m.target_layer_ids == build_target_layer_ids(8, 5) == [1, 2, 4, 6, 7]
    rows = _rows(data)
    expected_ids = []
    truncated = 0
    for sample in cache.samples():
        sid = sample["sample_id"]
        ids, mask = masker(tok, normalise(rows[sid]))
        truncated += len(ids) > seq_length
        ids, mask = ids[:seq_length], mask[:seq_length]
        assert sample["input_ids"].tolist() == ids, sid
        assert sample["loss_mask"].tolist() == mask, sid
        hidden, last = reference_hidden(model, ids, m.target_layer_ids)
        cast = sample["target_hidden_states"].dtype
        torch.testing.assert_close(
            sample["target_hidden_states"].float(), hidden.to(cast).float(), **TOLERANCE[dtype]
        )
        torch.testing.assert_close(
            sample["target_last_hidden_states"].float(), last.to(cast).float(), **TOLERANCE[dtype]
        )
        expected_ids.append(sid)
    # Every row with a supervised token (after truncation) is stored, in ascending id; the
    # others (no assistant turn, or the answer truncated away) are skipped and counted.
    unsupervised = [i for i, r in enumerate(rows) if sum(masker(tok, normalise(r))[1][:seq_length]) == 0]
    assert any(not any(t["role"] == "assistant" for t in normalise(rows[i])) for i in unsupervised)
    assert expected_ids == [i for i in range(len(rows)) if i not in unsupervised]
    assert m.skipped_rows == {"no supervised token": len(unsupervised)}
    assert m.num_samples == len(expected_ids) and m.complete
    return truncated


@pytest.mark.parametrize("variant,masker", [("stock", chatml_mask), ("generation", generation_mask)])
def test_cache_equals_reference(embedded, tmp_path, variant, masker):
    target = getattr(embedded, variant)
    out = str(tmp_path / "cache")
    assert (
        run_produce(
            target, embedded.data, out, "--seq-length", "384", "--shard-size", "8", "--batch-size", "4"
        )
        == 0
    )
    truncated = _check_cache(out, target, embedded.data, 384, masker, "bf16")
    assert truncated > 0  # the sample data has a long tail past seq_length


def test_fp32_cache_matches_tightly(embedded, tmp_path):
    out = str(tmp_path / "cache")
    assert run_produce(embedded.stock, embedded.data, out, "--seq-length", "256", "--dtype", "fp32",
                       "--shard-size", "16", "--batch-size", "8") == 0
    _check_cache(out, embedded.stock, embedded.data, 256, chatml_mask, "fp32")


def test_layer_ids_with_embedding_and_no_final(embedded, tmp_path):
    """-1 is the embedding output; without N-1 the final state is still stored (separately)."""
    rows = _rows(embedded.data)[:6]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = str(tmp_path / "cache")
    assert run_produce(embedded.stock, str(data), out, "--target-layer-ids", "-1", "3", "--dtype", "fp32",
                       "--seq-length", "256") == 0
    model = AutoModelForCausalLM.from_pretrained(embedded.stock, dtype=torch.float32).eval()
    cache = dspark_cache.open_cache(out)
    assert cache.manifest.target_hidden_dim == 2 * 64
    for sample in cache.samples():
        hidden, last = reference_hidden(model, sample["input_ids"].tolist(), [-1, 3])
        torch.testing.assert_close(sample["target_hidden_states"], hidden, **TOLERANCE["fp32"])
        torch.testing.assert_close(sample["target_last_hidden_states"], last, **TOLERANCE["fp32"])
