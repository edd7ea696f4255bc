"""NaN/inf hidden states are caught before writing: an error naming the sample, or a listed skip."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import dspark_cache
from dspark_cache.embedded.target import build_target
from dspark_cache.verify import verify_cache
from tests.support.produce import run_produce, write_jsonl


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory):
    """A target whose embedding row for one word is NaN, and rows with and without that word."""
    root = tmp_path_factory.mktemp("poison")
    target = build_target(str(root / "target"))
    tok = AutoTokenizer.from_pretrained(target)
    poison = tok.convert_tokens_to_ids("<tool_response>")
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    with torch.no_grad():
        model.get_input_embeddings().weight[poison] = float("nan")
    model.save_pretrained(target)
    rows = []
    for i in range(10):
        text = "<tool_response>" if i in (3, 7) else "fine"
        rows.append({"messages": [{"role": "user", "content": f"{text} question {i}"},
                                  {"role": "assistant", "content": f"answer {i}"}]})
    return target, write_jsonl(root / "d.jsonl", [json.dumps(r) for r in rows])


def test_error_policy_names_the_sample(poisoned, tmp_path, capsys):
    target, data = poisoned
    out = str(tmp_path / "c")
    assert run_produce(target, data, out, "--seq-length", "64", "--shard-size", "2") == 1
    err = capsys.readouterr().err
    assert "non-finite hidden states for sample 3" in err and "--on-nonfinite skip" in err
    assert not verify_cache(out).corrupt  # earlier shards stay published and valid


def test_skip_policy_lists_and_resumes(poisoned, tmp_path):
    target, data = poisoned
    out = str(tmp_path / "c")
    args = ("--seq-length", "64", "--shard-size", "2", "--on-nonfinite", "skip")
    assert run_produce(target, data, out, *args) == 0
    cache = dspark_cache.open_cache(out)
    assert cache.manifest.nonfinite_samples == [3, 7]
    assert cache.manifest.num_samples == 8 and cache.manifest.planned_samples == 10
    samples = list(cache.samples())
    assert [s["sample_id"] for s in samples] == [0, 1, 2, 4, 5, 6, 8, 9]
    assert all(torch.isfinite(s["target_hidden_states"].float()).all() for s in samples)
    loader = dspark_cache.build_cached_dspark_dataloader(cache_dir=out, batch_size=3, shuffle=False)
    assert sum(b["input_ids"].shape[0] for b in loader) == 8
    # A rerun accepts the shards with dropped samples instead of recomputing them forever.
    stamps = {i: os.path.getmtime(cache.paths.shard_tar(i)) for i in cache.paths.indexed_shard_ids()}
    assert run_produce(target, data, out, *args) == 0
    assert {i: os.path.getmtime(cache.paths.shard_tar(i)) for i in stamps} == stamps
    assert verify_cache(out).ok
