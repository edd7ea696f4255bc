"""One cache, several drafters: training takes any subset of the cache's layers, in its own order."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

import dspark_cache
from dspark_cache.format.errors import CorruptShardError
from dspark_cache.format.geometry import SampleShape
from dspark_cache.format.manifest import write_manifest
from dspark_cache.format.paths import CachePaths
from dspark_cache.format.sample import (
    CACHE_DTYPES, HIDDEN, HIDDEN_SCALE, INPUT_IDS, LAST_HIDDEN, LAST_HIDDEN_SCALE, LOSS_MASK,
)
from dspark_cache.format.schema import Manifest
from dspark_cache.format.tar.writer import ShardWriter
from dspark_cache.producer.pipeline.tensors import byte_views, quantize_fp8

NUM_LAYERS, HIDDEN_SIZE, LENGTHS = 4, 40, [5, 9, 1, 16, 7]  # H=40: the C filler's 16-wide steps and a tail


def write_cache(root: str, dtype: str, layer_ids: tuple[int, ...]) -> str:
    """A two-shard cache of random states through the real writer; ``layer_ids`` without 3 store
    the final state apart."""
    paths = CachePaths(root)
    paths.ensure_dirs()
    code = CACHE_DTYPES[dtype]
    shape = SampleShape(layer_ids, NUM_LAYERS, HIDDEN_SIZE, code)
    g = torch.Generator().manual_seed(5)
    for shard, ids in enumerate([[0, 1, 2], [3, 4]]):
        writer = ShardWriter(paths, shard, durable=False)
        for sid in ids:
            n = LENGTHS[sid]
            states = torch.randn(n, shape.hidden_dim, generator=g) * 4
            last = torch.randn(n, HIDDEN_SIZE, generator=g)
            tensors = {INPUT_IDS: torch.randint(0, 10, (n,), dtype=torch.int32, generator=g),
                       LOSS_MASK: torch.randint(0, 2, (n,), dtype=torch.uint8, generator=g)}
            if shape.fp8:
                tensors[HIDDEN], tensors[HIDDEN_SCALE] = quantize_fp8(states, HIDDEN_SIZE, code)
                if shape.stores_last:
                    tensors[LAST_HIDDEN], tensors[LAST_HIDDEN_SCALE] = quantize_fp8(last, HIDDEN_SIZE, code)
            else:
                torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
                tensors[HIDDEN] = states.to(torch_dtype)
                if shape.stores_last:
                    tensors[LAST_HIDDEN] = last.to(torch_dtype)
            writer.append(sid, n, shape.specs(n), shape.metadata(sid), byte_views(tensors))
        writer.publish()
    save_file(
        {
            name: torch.randn(10, HIDDEN_SIZE, generator=g)
            for name in ("embed_tokens.weight", "lm_head.weight")
        },
        paths.target_weights,
    )
    write_manifest(
        paths,
        Manifest(
            complete=True,
            target_model="t",
            target_model_type="qwen3",
            target_vocab_size=10,
            hidden_size=HIDDEN_SIZE,
            num_hidden_layers=NUM_LAYERS,
            seq_length=16,
            dtype=dtype,
            num_samples=len(LENGTHS),
            planned_samples=len(LENGTHS),
            shard_size=3,
            target_hidden_dim=HIDDEN_SIZE * len(layer_ids),
            target_last_hidden_dim=HIDDEN_SIZE,
            target_layer_ids=list(layer_ids),
            train_data_path="d",
            num_shards=2,
        ),
    )
    return root


def by_layer(states: torch.Tensor) -> torch.Tensor:
    return states.unflatten(-1, (-1, HIDDEN_SIZE))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def batches(root: str, **options) -> list[dict[str, torch.Tensor]]:
    loader = dspark_cache.build_dataloader(root, 2, shuffle=False, **options)
    try:
        return [{k: v.clone() for k, v in b.items()} for b in loader]
    finally:
        loader.close()


CASES = [("bf16", (-1, 0, 1, 2, 3)), ("bf16", (0, 1, 2)), ("fp32", (-1, 1, 3)),
         ("fp8", (-1, 0, 1, 2, 3)), ("fp8", (0, 1, 2)), ("fp8_e5m2", (-1, 1, 3))]


@pytest.mark.parametrize("pad_to", ["longest", "seq_length"])
@pytest.mark.parametrize("dtype,layer_ids", CASES, ids=[f"{d}-{'final-in' if ids[-1] == 3 else 'final-apart'}"
                                                         for d, ids in CASES])
def test_a_subset_is_the_full_batch_sliced(tmp_path, executor, dtype, layer_ids, pad_to):
    root = write_cache(str(tmp_path / "c"), dtype, layer_ids)
    outs = ["raw", "bf16", "fp32"] if dtype.startswith("fp8") else [None]
    for out in outs:
        full = batches(root, dtype=out, pad_to=pad_to)
        for chosen in ([layer_ids[-1], layer_ids[0]], [layer_ids[1]], list(layer_ids[1:])):
            picked = batches(root, dtype=out, pad_to=pad_to, target_layer_ids=chosen, verify="always")
            where = [layer_ids.index(i) for i in chosen]
            assert len(picked) == len(full)
            for a, b in zip(full, picked):
                assert b[HIDDEN].shape[-1] == len(chosen) * HIDDEN_SIZE
                assert torch.equal(bits(by_layer(a[HIDDEN])[:, :, where]), bits(by_layer(b[HIDDEN])))
                # the final state, whatever the subset
                assert torch.equal(bits(a[LAST_HIDDEN]), bits(b[LAST_HIDDEN]))
                for key in (INPUT_IDS, LOSS_MASK, "attention_mask", "sample_ids"):
                    assert torch.equal(a[key], b[key])
                if out == "raw":
                    assert torch.equal(a[HIDDEN_SCALE][:, :, where], b[HIDDEN_SCALE])
                    assert torch.equal(a[LAST_HIDDEN_SCALE], b[LAST_HIDDEN_SCALE])
        if out == "raw":  # the subset dequantises as the whole does
            picked = batches(root, dtype="raw", target_layer_ids=[layer_ids[-1]], pad_to=pad_to)
            whole = dspark_cache.dequantize(full[0], torch.float32)
            assert torch.equal(dspark_cache.dequantize(picked[0], torch.float32)[HIDDEN],
                               by_layer(whole[HIDDEN])[:, :, -1])


def test_open_cache_takes_the_same_subset(tmp_path):
    root = write_cache(str(tmp_path / "c"), "bf16", (-1, 0, 1, 2, 3))
    full = list(dspark_cache.open_cache(root).samples())
    picked = list(dspark_cache.open_cache(root, target_layer_ids=[2, -1]).samples())
    for a, b in zip(full, picked):
        assert torch.equal(by_layer(a[HIDDEN])[:, [3, 0]], by_layer(b[HIDDEN]))
        assert torch.equal(a[LAST_HIDDEN], b[LAST_HIDDEN])
        assert a[INPUT_IDS].dtype == a[LOSS_MASK].dtype == torch.int64  # one rule with batches


def test_a_byte_of_a_layer_not_taken_still_fails_the_checksum(tmp_path, executor):
    root = write_cache(str(tmp_path / "c"), "bf16", (-1, 0, 1, 2, 3))
    cache = dspark_cache.open_cache(root)
    victim = cache.shards[0].samples[1]
    path = cache.paths.shard_tar(0)
    cache.close()
    data_start = (
        victim.offset + victim.size - SampleShape((-1, 0, 1, 2, 3), 4, 40, "BF16").data_size(victim.length)
    )
    with open(path, "r+b") as handle:  # token 0, layer -1 (stored first): not among the layers taken
        handle.seek(data_start)
        byte = handle.read(1)
        handle.seek(data_start)
        handle.write(bytes([byte[0] ^ 1]))
    with pytest.raises(CorruptShardError, match=rf"sample {victim.sample_id}\).*checksum mismatch"):
        batches(root, target_layer_ids=[1, 2])


@pytest.mark.parametrize("wanted,says", [([5], r"layer ids \[5\] that it does not hold"),
                                         ([1, 1], r"layer ids \[1\] more than once"), ([], "no layer ids")])
def test_layers_the_cache_lacks_are_refused_naming_both(tmp_path, wanted, says):
    root = write_cache(str(tmp_path / "c"), "bf16", (0, 1, 3))
    for opener in (lambda: dspark_cache.build_dataloader(root, 2, target_layer_ids=wanted),
                   lambda: dspark_cache.open_cache(root, target_layer_ids=wanted)):
        with pytest.raises(ValueError, match=rf"the cache at .*\(layers \[0, 1, 3\]\) for {says}"):
            opener()


def test_layer_ids_that_are_not_integers_are_refused(tmp_path):
    root = write_cache(str(tmp_path / "c"), "bf16", (0, 1, 3))
    with pytest.raises(ValueError, match=r"\[1.5\] are not layer ids"):
        dspark_cache.build_dataloader(root, 2, target_layer_ids=[1.5])


def test_expect_compares_the_layers_handed_out(tmp_path):
    from dspark_cache.loader.validate import CacheMismatchError

    root = write_cache(str(tmp_path / "c"), "bf16", (0, 1, 2, 3))
    loader = dspark_cache.build_dataloader(root, 2, target_layer_ids=[1, 3],
                                           expect={"target_layer_ids": [1, 3], "hidden_size": HIDDEN_SIZE})
    loader.close()
    with pytest.raises(CacheMismatchError, match=r"it holds \[0, 1, 2, 3\]: pass target_layer_ids=\[1, 3\]"):
        dspark_cache.build_dataloader(root, 2, expect={"target_layer_ids": [1, 3]})
