"""build_dataloader on real caches: determinism, rank equality, resume, validation, corruption."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dspark_cache
from dspark_cache.format.errors import CorruptShardError, IncompleteCacheError
from dspark_cache.format.paths import CachePaths
from dspark_cache.loader.validate import CacheMismatchError
from tests.support.ports import free_port
from tests.support import warm


def ids_of(loader, limit=None):
    """Sample ids of the next ``limit`` batches (all when None), consuming exactly that many."""
    return [batch["sample_ids"].tolist() for batch in itertools.islice(loader, limit)]


def test_batches_carry_nemo_keys_plus_attention_mask(small_cache):
    loader = dspark_cache.build_dataloader(small_cache, 3, shuffle=True, seed=5)
    cache = dspark_cache.open_cache(small_cache)
    by_id = {s["sample_id"]: s for s in cache.samples()}
    m = cache.manifest
    count = 0
    for batch in loader:
        assert batch["input_ids"].shape == batch["attention_mask"].shape == (3, m.seq_length)
        assert batch["target_hidden_states"].shape == (3, m.seq_length, m.target_hidden_dim)
        for row, sid in enumerate(batch["sample_ids"].tolist()):
            want = by_id[sid]
            n = want["input_ids"].shape[0]
            assert torch.equal(batch["input_ids"][row, :n], want["input_ids"].long())
            assert torch.equal(batch["loss_mask"][row, :n], want["loss_mask"].long())
            assert torch.equal(batch["target_hidden_states"][row, :n], want["target_hidden_states"])
            assert torch.equal(batch["target_last_hidden_states"][row, :n], want["target_last_hidden_states"])
            assert batch["attention_mask"][row].sum() == n
            assert not batch["target_hidden_states"][row, n:].any() and not batch["loss_mask"][row, n:].any()
        count += 1
    assert count == len(loader) == -(-len(cache) // 3)


def test_pad_to_longest(small_cache):
    loader = dspark_cache.build_dataloader(small_cache, 4, shuffle=False, pad_to="longest")
    for batch in loader:
        assert batch["input_ids"].shape[1] == int(batch["attention_mask"].sum(1).max())


def test_same_order_across_runs_and_reader_threads(small_cache):
    a = ids_of(dspark_cache.build_dataloader(small_cache, 4, seed=3, num_workers=1))
    b = ids_of(dspark_cache.build_dataloader(small_cache, 4, seed=3, num_workers=4, prefetch=4))
    assert a == b


def test_epochs_differ_and_continue(small_cache):
    loader = dspark_cache.build_dataloader(small_cache, 4, seed=3)
    first, second = ids_of(loader), ids_of(loader)  # iterating again is the next epoch
    assert first != second and set(sum(first, [])) == set(sum(second, []))  # repeats pad the last step
    assert loader.epoch == 2
    again = dspark_cache.build_dataloader(small_cache, 4, seed=3, epoch=1)
    assert ids_of(again) == second


def test_iterating_again_mid_epoch_continues_and_set_epoch_restarts(small_cache):
    whole = ids_of(dspark_cache.build_dataloader(small_cache, 4, seed=3))
    loader = dspark_cache.build_dataloader(small_cache, 4, seed=3, prefetch=3)
    head = ids_of(loader, 2)  # a break after two batches: the batches read ahead are not lost
    rest = ids_of(loader)  # a new iteration continues the epoch at its next unread batch
    assert head + rest == whole and loader.epoch == 1
    loader.set_epoch(0)  # the DistributedSampler idiom: that epoch again, from its first batch
    assert ids_of(loader, 3) == whole[:3]
    loader.set_epoch(0)
    assert ids_of(loader) == whole
    loader.close()


def test_resume_at_every_step_and_resume_of_resume(small_cache):
    full = ids_of(dspark_cache.build_dataloader(small_cache, 4, seed=9, world_size=2, rank=1))
    for k in range(len(full) + 1):
        loader = dspark_cache.build_dataloader(small_cache, 4, seed=9, world_size=2, rank=1)
        head = ids_of(loader, limit=k)
        state = loader.state_dict()
        assert json.loads(json.dumps(state)) == state  # a few plain integers
        restored = dspark_cache.build_dataloader(small_cache, 4, seed=9, world_size=2, rank=1)
        restored.load_state_dict(state)
        if k + 2 <= len(full):  # resume of a resume
            mid = ids_of(restored, limit=1)
            again = dspark_cache.build_dataloader(small_cache, 4, seed=9, world_size=2, rank=1)
            again.load_state_dict(restored.state_dict())
            assert head + mid + ids_of(again) == full
        else:
            assert head + ids_of(restored) == full


def test_resume_with_another_world_size_covers_the_rest_once(small_cache):
    n = len(dspark_cache.open_cache(small_cache))
    ranks = [dspark_cache.build_dataloader(small_cache, 2, seed=4, world_size=3, rank=r) for r in range(3)]
    first = []
    for loader in ranks:
        first += sum(ids_of(loader, limit=2), [])
    state = ranks[0].state_dict()
    assert all(r.state_dict() == state for r in ranks)  # lockstep: one state serves every rank
    rest = []
    for r in range(2):
        loader = dspark_cache.build_dataloader(small_cache, 2, seed=4, world_size=2, rank=r)
        loader.load_state_dict(state)
        for batch in loader:
            rest += [
                s for s, rep in zip(batch["sample_ids"].tolist(), batch["is_repeat"].tolist()) if not rep
            ]
    assert sorted(first + rest) == list(dspark_cache.open_cache(small_cache).sample_ids)
    assert len(first) + len(rest) == n


@pytest.mark.parametrize("k", [1, 2])
def test_resume_keeps_the_global_batch_across_world_sizes(small_cache, k):
    """Issue 41, item 15: 2 ranks x 8 continue as 1 rank x 16 (and 4 x 4): the same global batches,
    every sample of the epoch once, none twice (another global batch: the same samples, other batches)."""
    def rows(loader, limit=None):
        return [[s for s, rep in zip(b["sample_ids"].tolist(), b["is_repeat"].tolist()) if not rep]
                for b in itertools.islice(loader, limit)]

    full = rows(dspark_cache.build_dataloader(small_cache, 16, seed=6))
    ranks = [dspark_cache.build_dataloader(small_cache, 8, seed=6, world_size=2, rank=r) for r in range(2)]
    head = [sorted(a + b) for a, b in zip(*(rows(loader, k) for loader in ranks))]
    state = ranks[0].state_dict()
    one = dspark_cache.build_dataloader(small_cache, 16, seed=6)
    one.load_state_dict(state)
    assert head == [sorted(b) for b in full[:k]]
    assert rows(one) == full[k:]  # the uninterrupted run's global batches, in its order
    four = [dspark_cache.build_dataloader(small_cache, 4, seed=6, world_size=4, rank=r) for r in range(4)]
    for loader in four:
        loader.load_state_dict(state)
    assert [sorted(sum(parts, [])) for parts in zip(*(rows(loader) for loader in four))] == \
        [sorted(b) for b in full[k:]]
    other = dspark_cache.build_dataloader(small_cache, 8, seed=6)  # another global batch: the same samples
    other.load_state_dict(state)
    assert sorted(sum(rows(other), [])) == sorted(sum(full[k:], []))


def test_state_from_other_settings_is_refused(small_cache):
    state = dspark_cache.build_dataloader(small_cache, 4, seed=1).state_dict()
    other = dspark_cache.build_dataloader(small_cache, 4, seed=2)
    with pytest.raises(ValueError, match="seed: state has 1, this loader has 2"):
        other.load_state_dict(state)


@pytest.mark.parametrize("field,value", [("offset", -4), ("offset", 2.5), ("offset", "8"), ("epoch", -1),
                                         ("epoch", True), ("offset", None)])
def test_a_state_with_a_bad_epoch_or_offset_is_refused(small_cache, field, value):
    """Issue 41, item 15: a negative offset used to shift the epoch silently; int() took 2.5 and "8"."""
    loader = dspark_cache.build_dataloader(small_cache, 4, seed=1)
    state = {**loader.state_dict(), field: value}
    with pytest.raises(ValueError, match=f"{field}={value!r}"):
        loader.load_state_dict(state)
    assert loader.state_dict()["offset"] == 0  # unchanged


def test_expect_names_every_mismatch(small_cache):
    m = dspark_cache.open_cache(small_cache).manifest
    ok = {
        "model_type": "qwen3",
        "vocab_size": m.target_vocab_size,
        "hidden_size": 64,
        "num_hidden_layers": 8,
        "seq_length": m.seq_length,
        "dtype": "bf16",
        "target_layer_ids": m.target_layer_ids,
        "compute_dtype": "bf16",
    }
    dspark_cache.build_dataloader(small_cache, 2, expect=ok)
    bad = {
        **ok,
        "hidden_size": 128,
        "seq_length": 1024,
        "target_layer_ids": [1, 2, 3],
        "compute_dtype": "fp32",
    }
    with pytest.raises(CacheMismatchError) as err:
        dspark_cache.build_dataloader(small_cache, 2, expect=bad)
    text = str(err.value)
    for needle in ("hidden_size: the cache has 64, training expects 128", "seq_length: the cache has 512",
                   "target_layer_ids", "target_hidden_dim: the cache has 320, training expects 384",
                   "fp32"):
        assert needle in text, text
    with pytest.raises(CacheMismatchError, match="fp32"):  # a torch dtype, as training code holds it
        dspark_cache.build_dataloader(small_cache, 2, expect={**ok, "compute_dtype": torch.float32})


def test_incomplete_cache_needs_follow(small_cache, tmp_path):
    copy = tmp_path / "c"
    shutil.copytree(small_cache, copy)
    path = Path(CachePaths(str(copy)).manifest)
    manifest = json.loads(path.read_text())
    manifest["complete"] = False
    path.write_text(json.dumps(manifest))
    with pytest.raises(IncompleteCacheError, match="follow=True"):
        dspark_cache.build_dataloader(str(copy), 2)


def test_flipped_byte_names_shard_and_sample(small_cache, tmp_path, executor):
    copy = tmp_path / "c"
    shutil.copytree(small_cache, copy)
    cache = dspark_cache.open_cache(str(copy))
    victim = cache.shards[1].samples[0]
    with open(cache.paths.shard_tar(1), "r+b") as handle:
        handle.seek(victim.offset + victim.size // 2)
        byte = handle.read(1)
        handle.seek(victim.offset + victim.size // 2)
        handle.write(bytes([byte[0] ^ 0x10]))
    loader = dspark_cache.build_dataloader(str(copy), 4, shuffle=False)
    with pytest.raises(CorruptShardError, match=rf"shard-000001\.tar \(sample {victim.sample_id}\)"):
        list(loader)


def test_shard_truncated_while_training_names_shard_and_sample(small_cache, tmp_path, executor):
    copy = tmp_path / "c"
    shutil.copytree(small_cache, copy)
    loader = dspark_cache.build_dataloader(str(copy), 4, shuffle=False)
    len(loader)  # every index is loaded and checked against its tar now
    cache = dspark_cache.open_cache(str(copy))
    victim = cache.shards[0].samples[-1]
    os.truncate(cache.paths.shard_tar(0), victim.offset + 100)  # cut inside the last sample
    with pytest.raises(
        CorruptShardError,
        match=rf"shard-000000\.tar \(sample {victim.sample_id}\).*short read "
        rf"\(100 of {victim.size} bytes\)",
    ):
        list(loader)


WORKER = r"""
import json, sys, torch.distributed as dist
import dspark_cache
dist.init_process_group("gloo")
loader = dspark_cache.build_dataloader(sys.argv[1], 3, seed=11, drop_last=True)
out = {"rank": loader.rank, "world": loader.world_size, "len": len(loader),
       "ids": [b["sample_ids"].tolist() for b in loader]}
dist.barrier()
print(json.dumps(out))
"""


def test_real_gloo_ranks_take_rank_and_world_from_torch_distributed(small_cache):
    port = str(free_port())
    procs = [
        warm.popen(
            [sys.executable, "-c", WORKER, small_cache],
            code=True,
            stdout=subprocess.PIPE,
            text=True,
            env={
                **os.environ,
                "RANK": str(r),
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
            },
        )
        for r in range(2)
    ]
    outs = [json.loads(p.communicate(timeout=120)[0].strip().splitlines()[-1]) for p in procs]
    assert [o["rank"] for o in outs] == [0, 1] and {o["world"] for o in outs} == {2}
    assert outs[0]["len"] == outs[1]["len"] == len(outs[0]["ids"]) == len(outs[1]["ids"])
    seen = sum(outs[0]["ids"], []) + sum(outs[1]["ids"], [])
    assert len(seen) == len(set(seen))  # no sample twice under drop_last
    n = len(dspark_cache.open_cache(small_cache))
    assert n - len(seen) < 6


def expected_rows(cache_path):
    cache = dspark_cache.open_cache(cache_path)
    return cache.manifest, {s["sample_id"]: s for s in cache.samples()}


def assert_batch_is_exact(batch, manifest, by_id):
    """Every row equals its sample, and every pad slot is zero (pad id for input_ids)."""
    for row, sid in enumerate(batch["sample_ids"].tolist()):
        want = by_id[sid]
        n = want["input_ids"].shape[0]
        for key in ("target_hidden_states", "target_last_hidden_states"):
            assert torch.equal(batch[key][row, :n], want[key]), (sid, key)
            assert not batch[key][row, n:].any(), (sid, key)
        assert torch.equal(batch["input_ids"][row, :n], want["input_ids"].long())
        assert (batch["input_ids"][row, n:] == manifest.pad_token_id).all()
        assert (
            torch.equal(batch["loss_mask"][row, :n], want["loss_mask"].long())
            and not batch["loss_mask"][row, n:].any()
        )
        assert batch["attention_mask"][row, :n].all() and not batch["attention_mask"][row, n:].any()


@pytest.mark.parametrize("pad_to", ["seq_length", "longest"])
def test_recycled_batch_memory_is_exact_and_never_overwrites_a_kept_batch(small_cache, pad_to, executor):
    manifest, by_id = expected_rows(small_cache)
    loader = dspark_cache.build_dataloader(small_cache, 3, seed=6, pad_to=pad_to, prefetch=2)
    assert loader.reader.native == (executor == "native")
    # Streaming (nothing kept): memory is recycled, so pads must be re-zeroed where longer
    # samples of earlier batches wrote; three epochs mix many lengths into the same rows.
    addresses = set()
    for _ in range(3):
        for batch in loader:
            assert_batch_is_exact(batch, manifest, by_id)
            addresses.add(batch["target_hidden_states"].data_ptr())
    assert len(addresses) <= 4  # prefetch + 2 slabs, reused across 48 batches
    # Kept (a list of every batch): no batch memory may be handed out again while it is held.
    kept = list(loader)
    assert len({b["target_hidden_states"].data_ptr() for b in kept}) == len(kept)
    for batch in kept:
        assert_batch_is_exact(batch, manifest, by_id)
    # A view outside the loader is enough to hold a batch's memory.
    held = next(iter(loader))["loss_mask"][0]
    snapshot = held.clone()
    for _ in loader:
        pass
    assert torch.equal(held, snapshot)


def test_the_public_api_is_listed_and_shows_its_options():
    """Issue 41, item 15: dir() lists the lazily imported API, the errors a reader catches come from the
    package itself, and build_dataloader's signature names every option."""
    import dataclasses
    import inspect

    from dspark_cache.format.errors import CacheError, CorruptShardError
    from dspark_cache.loader.config import LoaderConfig

    names = dir(dspark_cache)
    for name in ("build_dataloader", "open_cache", "CacheDir", "CacheError", "CorruptShardError",
                 "IncompleteCacheError", "NotACacheError", "CacheLockedError", "dequantize"):
        assert name in names and name in dspark_cache.__all__, name
    assert "importlib" not in names and "Any" not in names
    assert dspark_cache.CorruptShardError is CorruptShardError and issubclass(
        dspark_cache.CorruptShardError, CacheError
    )
    params = inspect.signature(dspark_cache.build_dataloader).parameters
    assert list(params)[:2] == ["cached_target_path", "batch_size"]
    for option in dataclasses.fields(LoaderConfig):
        assert option.name in params, option.name
        if option.name != "batch_size":
            assert params[option.name].default == option.default, option.name


def test_a_damaged_sample_raises_the_packages_own_error(small_cache, tmp_path):
    import shutil

    from dspark_cache.format.paths import CachePaths

    copy = str(tmp_path / "cache")
    shutil.copytree(small_cache, copy)
    first = dspark_cache.open_cache(copy).shards[0].samples[0]
    with open(CachePaths(copy).shard_tar(0), "r+b") as handle:  # the last byte of the first sample's payload
        handle.seek(first.offset + first.size - 1)
        byte = handle.read(1)
        handle.seek(first.offset + first.size - 1)
        handle.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(dspark_cache.CorruptShardError, match="shard-000000"):
        for _ in dspark_cache.build_dataloader(copy, 4, verify="always"):
            pass
