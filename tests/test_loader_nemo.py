"""The NeMo-compatible builder: keys, dtypes, shapes, zero padding, order, len, weights."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

import dspark_cache
from dspark_cache.format.errors import IncompleteCacheError, NotACacheError
from dspark_cache.producer.manifest import read_manifest_file, write_manifest


def test_batches_have_nemo_contract(small_cache):
    cache = dspark_cache.open_cache(small_cache)
    m = cache.manifest
    loader = dspark_cache.build_cached_dspark_dataloader(cache_dir=small_cache, batch_size=4, shuffle=False)
    assert len(loader) == math.ceil(len(cache) / 4)
    expected = list(cache.samples())
    batches = list(loader)
    assert len(batches) == len(loader)
    row = 0
    for batch in batches:
        assert set(batch) == {"input_ids", "loss_mask", "target_hidden_states", "target_last_hidden_states"}
        b = batch["input_ids"].shape[0]
        assert batch["input_ids"].dtype == batch["loss_mask"].dtype == torch.int64
        assert batch["input_ids"].shape == batch["loss_mask"].shape == (b, m.seq_length)
        assert batch["target_hidden_states"].shape == (b, m.seq_length, m.target_hidden_dim)
        assert batch["target_last_hidden_states"].shape == (b, m.seq_length, m.target_last_hidden_dim)
        assert batch["target_hidden_states"].dtype == torch.bfloat16
        for i in range(b):
            want = expected[row]
            n = want["input_ids"].shape[0]
            assert torch.equal(batch["input_ids"][i, :n], want["input_ids"].long())  # ascending id order
            assert torch.equal(batch["target_hidden_states"][i, :n], want["target_hidden_states"])
            assert (batch["input_ids"][i, n:] == m.pad_token_id).all()
            for key in ("loss_mask", "target_hidden_states", "target_last_hidden_states"):
                assert not batch[key][i, n:].any()  # padding is zeros: finite
            row += 1
    assert row == len(cache)


def test_shuffle_is_a_permutation(small_cache):
    loader = dspark_cache.build_cached_dspark_dataloader(cache_dir=small_cache, batch_size=5, shuffle=True, seed=1)
    firsts = [tuple(b["input_ids"][:, :8].flatten().tolist()) for b in loader]
    ordered = [tuple(b["input_ids"][:, :8].flatten().tolist()) for b in
               dspark_cache.build_cached_dspark_dataloader(cache_dir=small_cache, batch_size=5, shuffle=False)]
    assert firsts != ordered and sum(len(f) for f in firsts) == sum(len(o) for o in ordered)


def test_target_weights_are_the_targets(small_cache, embedded):
    weights = dspark_cache.read_target_weights(small_cache)
    model = AutoModelForCausalLM.from_pretrained(embedded.stock, dtype=torch.float32)
    assert torch.equal(weights["embed_tokens.weight"], model.get_input_embeddings().weight.to(torch.bfloat16))
    assert torch.equal(weights["lm_head.weight"], model.get_output_embeddings().weight.to(torch.bfloat16))


def test_incomplete_cache_is_refused(small_cache, tmp_path):
    copy = tmp_path / "c"
    shutil.copytree(small_cache, copy)
    from dspark_cache.format.paths import CachePaths

    paths = CachePaths(str(copy))
    manifest = read_manifest_file(paths)
    manifest.complete = False
    write_manifest(paths, manifest)
    with pytest.raises(IncompleteCacheError, match="rerun dspark-produce|Rerun"):
        dspark_cache.build_cached_dspark_dataloader(cache_dir=str(copy), batch_size=2)
    assert len(dspark_cache.open_cache(str(copy), allow_incomplete=True)) == manifest.num_samples
    with pytest.raises(NotACacheError, match="not a dspark cache"):
        dspark_cache.open_cache(str(tmp_path))
