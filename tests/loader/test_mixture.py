"""build_dataloader on a mixture of real caches: weights, order, ranks, resume, refusals, source_ids."""

from __future__ import annotations

import itertools
import json
import os
from collections import Counter

import pytest
import torch

import dspark_cache
from dspark_cache import Source
from dspark_cache.loader.compat import MixtureMismatchError
from dspark_cache.loader.sources import epoch_counts
from dspark_cache.loader.validate import CacheMismatchError
from tests.support.produce import write_jsonl

SHARED = ("--seq-length", "512", "--shard-size", "4", "--batch-size", "4")
# Rows of the sample data in each source: a (bf16), b (bf16), c (fp8); the sample data has 48 rows.
SPLITS = {"a": (0, 20), "b": (20, 36), "c": (36, 48)}


@pytest.fixture(scope="module")
def sources(embedded, tmp_path_factory) -> dict[str, str]:
    """Three caches of disjoint rows of the sample data (c in FP8), made once for this module."""
    from tests.support.produce import run_produce

    rows = open(embedded.data, encoding="utf-8").read().splitlines()
    root = tmp_path_factory.mktemp("mixture")
    out = {}
    for name, (start, end) in SPLITS.items():
        data = write_jsonl(root / f"{name}.jsonl", rows[start:end])
        extra = ("--dtype", "fp8") if name == "c" else ()
        assert run_produce(embedded.stock, data, str(root / name), *SHARED, *extra) == 0
        out[name] = str(root / name)
    return out


def sizes(sources) -> dict[str, int]:
    return {name: len(dspark_cache.open_cache(path)) for name, path in sources.items()}


def keys_of(loader, limit=None) -> list[tuple[int, int]]:
    """``(source, sample id)`` of every non-repeat row of the next ``limit`` batches."""
    out = []
    for batch in itertools.islice(loader, limit):
        out += [(s, i) for s, i, rep in zip(batch["source_ids"].tolist(), batch["sample_ids"].tolist(),
                                            batch["is_repeat"].tolist()) if not rep]
    return out


def test_one_unweighted_source_is_that_cache(sources):
    """A mixture of one source without a weight yields exactly that cache's batches."""
    plain = dspark_cache.build_dataloader(sources["a"], 3, seed=7, pad_to="longest")
    mixed = dspark_cache.build_dataloader([Source(sources["a"])], 3, seed=7, pad_to="longest")
    for epoch in range(2):
        for one, two in itertools.zip_longest(plain, mixed):
            assert one.keys() - two.keys() == set() and two.keys() - one.keys() == {"source_ids"}
            for key in one:
                assert torch.equal(one[key], two[key]), (epoch, key)
            assert two["source_ids"].tolist() == [0] * len(two["source_ids"])


def test_batches_mix_sources_and_carry_their_rows(sources):
    """Rows of bf16 and FP8 sources in one batch, each equal to the sample its cache holds."""
    loader = dspark_cache.build_dataloader([Source(p) for p in sources.values()], 6, seed=1, window=8)
    caches = [dspark_cache.open_cache(p) for p in sources.values()]
    by_id = [{c.entry(k)[1].sample_id: k for k in range(len(c))} for c in caches]
    mixed = 0
    for batch in loader:
        assert batch["target_hidden_states"].dtype == torch.bfloat16
        mixed += len(set(batch["source_ids"].tolist())) > 1
        rows = zip(batch["source_ids"].tolist(), batch["sample_ids"].tolist())
        for row, (source, sample) in enumerate(rows):
            want = caches[source].read(by_id[source][sample])
            n = len(want["input_ids"])
            assert torch.equal(batch["input_ids"][row, :n], want["input_ids"])
            assert torch.equal(batch["target_hidden_states"][row, :n], want["target_hidden_states"])
            assert torch.equal(batch["target_last_hidden_states"][row, :n], want["target_last_hidden_states"])
            assert not batch["target_hidden_states"][row, n:].any()
            assert not batch["attention_mask"][row, n:].any()
    assert mixed > 0


@pytest.mark.parametrize("weights", [{"a": {"repeat": 2.0}, "b": {"repeat": 0.5}, "c": {}},
                                     {"a": {"choose": 7}, "b": {"choose": 30}, "c": {"repeat": 1.25}},
                                     {"a": {"proportion": 1}, "b": {"proportion": 2},
                                      "c": {"proportion": 3}}])
def test_exact_counts_per_source_per_epoch(sources, weights):
    n = sizes(sources)
    mixture = [Source(sources[name], **weights[name]) for name in sources]
    loader = dspark_cache.build_dataloader(mixture, 4, seed=3, drop_last=False)
    want = epoch_counts(mixture, list(n.values()), None, 3)
    if "proportion" in weights["a"]:
        total = sum(n.values())
        assert sum(want) == total and all(abs(w - total * p / 6) < 1 for w, p in zip(want, (1, 2, 3)))
    else:  # Stream's absolute weights: floor(repeat * n), choose, or n
        assert want == [int(w["repeat"] * n[name]) if "repeat" in w else w.get("choose", n[name])
                        for name, w in weights.items()]
    subsets = []
    for epoch in range(3):
        seen = Counter(keys_of(loader))
        per_source = Counter()
        for (source, _), times in seen.items():
            per_source[source] += times
        assert [per_source[s] for s in range(3)] == want, epoch
        for s, (name, count) in enumerate(zip(sources, want)):  # each sample count // n times, or once more
            times = [seen.get((s, sample), 0) for sample in dspark_cache.open_cache(sources[name]).sample_ids]
            assert set(times) <= {count // n[name], count // n[name] + 1}
        subsets.append(sorted(seen))
    if "proportion" not in weights["a"]:  # a down- or up-sampled source draws another subset each epoch
        assert subsets[0] != subsets[1] or subsets[1] != subsets[2]


def test_order_is_a_pure_function_of_seed_epoch_and_mixture(sources):
    mixture = [Source(sources["a"], repeat=1.5), Source(sources["c"], choose=5)]
    runs = [keys_of(dspark_cache.build_dataloader(mixture, 4, seed=11, num_workers=w)) for w in (1, 3)]
    assert runs[0] == runs[1]
    assert keys_of(dspark_cache.build_dataloader(mixture, 4, seed=12)) != runs[0]
    later = dspark_cache.build_dataloader(mixture, 4, seed=11, epoch=1)
    assert keys_of(later) != runs[0]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_world_sizes_cover_the_epoch_with_equal_batches(sources, world):
    mixture = [Source(sources["a"], repeat=0.5), Source(sources["b"]), Source(sources["c"], repeat=2)]
    single = Counter(keys_of(dspark_cache.build_dataloader(mixture, 3, seed=5)))
    union, lengths = Counter(), set()
    for rank in range(world):
        loader = dspark_cache.build_dataloader(mixture, 3, seed=5, rank=rank, world_size=world)
        batches = list(loader)
        lengths.add(len(batches))
        assert len(batches) == len(loader)
        for batch in batches:
            rows = zip(*(batch[key].tolist() for key in ("source_ids", "sample_ids", "is_repeat")))
            union.update((s, i) for s, i, rep in rows if not rep)
    assert len(lengths) == 1
    assert union == single


@pytest.mark.parametrize("k", [0, 1, 2, 3])  # the epoch has 4 global steps
def test_resume_mid_epoch_on_other_world_sizes(sources, k):
    mixture = [Source(sources["a"], choose=13), Source(sources["b"], repeat=1.5), Source(sources["c"])]
    full = Counter(keys_of(dspark_cache.build_dataloader(mixture, 8, seed=2, world_size=2, rank=0))
                   + keys_of(dspark_cache.build_dataloader(mixture, 8, seed=2, world_size=2, rank=1)))
    ranks = [dspark_cache.build_dataloader(mixture, 8, seed=2, world_size=2, rank=r) for r in range(2)]
    head = keys_of(ranks[0], k) + keys_of(ranks[1], k)
    state = json.loads(json.dumps(ranks[0].state_dict()))
    assert state == ranks[1].state_dict()
    resumed = dspark_cache.build_dataloader(mixture, 16, seed=2)  # 2 x 8 -> 1 x 16
    resumed.load_state_dict(state)
    assert Counter(head + keys_of(resumed)) == full


def test_resume_with_a_changed_mixture_is_refused_naming_the_change(sources):
    mixture = [Source(sources["a"], repeat=2), Source(sources["b"])]
    loader = dspark_cache.build_dataloader(mixture, 4, seed=1)
    keys_of(loader, 2)
    state = loader.state_dict()
    other = dspark_cache.build_dataloader([Source(sources["a"], repeat=3), Source(sources["b"])], 4, seed=1)
    with pytest.raises(ValueError, match=r"source 0: repeat was 2.0, is 3.0"):
        other.load_state_dict(state)
    added = dspark_cache.build_dataloader([*mixture, Source(sources["c"])], 4, seed=1)
    with pytest.raises(ValueError, match=r"source 2: added"):
        added.load_state_dict(state)
    single = dspark_cache.build_dataloader(sources["a"], 4, seed=1)
    with pytest.raises(ValueError, match="taken on a mixture"):
        single.load_state_dict(state)
    with pytest.raises(ValueError, match="taken on one cache"):
        loader.load_state_dict(single.state_dict())


def test_a_mixture_file_json_and_yaml(sources, tmp_path):
    spec = {"sources": [{"path": sources["a"], "repeat": 2.0}, {"path": sources["c"], "choose": 5}]}
    (tmp_path / "mix.json").write_text(json.dumps(spec))
    (tmp_path / "mix.yaml").write_text(
        f"sources:\n  - path: {sources['a']}\n    repeat: 2.0\n  - path: {sources['c']}\n    choose: 5\n")
    mixture = [Source(sources["a"], repeat=2.0), Source(sources["c"], choose=5)]
    want = keys_of(dspark_cache.build_dataloader(mixture, 4, seed=1))
    assert keys_of(dspark_cache.build_dataloader(str(tmp_path / "mix.json"), 4, seed=1)) == want
    assert keys_of(dspark_cache.build_dataloader(tmp_path / "mix.yaml", 4, seed=1)) == want


@pytest.mark.parametrize("text,match", [
    ('{"sources": [{"path": "x", "repeat": 2, "choose": 3}]}', "give at most one of repeat, choose, "),
    ('{"sources": [{"path": "x", "repeat": -1}]}', r"repeat=-1.0 must be a number >= 0"),
    ('{"sources": [{"path": "x", "weight": 1}]}', "weight"),
    ('{"sources": [{"path": "x"}', "mix.json"),
    (None, "No such file or directory"),
])
def test_a_bad_mixture_file_is_one_line_naming_it(tmp_path, text, match):
    if text is not None:
        (tmp_path / "mix.json").write_text(text)
    with pytest.raises(ValueError, match=match) as info:
        dspark_cache.build_dataloader(str(tmp_path / "mix.json"), 4)
    assert str(tmp_path / "mix.json") in str(info.value)


def test_relative_weights_with_an_epoch_size(sources):
    n = sizes(sources)
    mixture = [Source(sources["a"], proportion=0.5), Source(sources["b"], proportion=0.5)]
    loader = dspark_cache.build_dataloader(mixture, 4, seed=1, epoch_size=11, drop_last=True)
    assert loader.num_samples() == 11 and sorted(loader.counts) == [5, 6]
    assert len(loader) == 11 // 4
    with pytest.raises(ValueError, match=r"epoch_size=2.5 must be a whole number"):
        dspark_cache.build_dataloader(mixture, 4, epoch_size=2.5)
    with pytest.raises(ValueError, match="epoch_size is for relative weights"):
        dspark_cache.build_dataloader([Source(sources["a"])], 4, epoch_size=3)
    assert n["a"] > 5


def test_relative_and_absolute_weights_do_not_mix(sources):
    with pytest.raises(ValueError, match=r"source 1 .*give every source a proportion, or none"):
        dspark_cache.build_dataloader([Source(sources["a"], proportion=1), Source(sources["b"], repeat=1)], 4)


def test_incompatible_sources_are_refused_naming_source_and_field(sources, produced):
    other_seq = produced("--seq-length", "256", "--shard-size", "8", "--batch-size", "4")
    with pytest.raises(MixtureMismatchError, match=r"source 1 \(.*\): seq_length is 256 but source 0 .* 512"):
        dspark_cache.build_dataloader([Source(sources["a"]), Source(other_seq)], 4)
    # pad_to="longest" mixes them
    loader = dspark_cache.build_dataloader([Source(sources["a"]), Source(other_seq)], 4, pad_to="longest")
    assert sum(len(b["sample_ids"]) for b in loader) >= len(loader) * 4
    layers = produced("--seq-length", "512", "--shard-size", "8", "--batch-size", "4",
                      "--target-layer-ids", "1,2")
    with pytest.raises(MixtureMismatchError, match=r"source 1 .*target_layer_ids is \[1, 2\] but source 0"):
        dspark_cache.build_dataloader([Source(sources["a"]), Source(layers)], 4)
    # the layers every source holds can be asked for
    batch = next(iter(dspark_cache.build_dataloader([Source(sources["a"]), Source(layers)], 4,
                                                    target_layer_ids=[2, 1])))
    hidden = dspark_cache.open_cache(sources["a"]).manifest.hidden_size
    assert batch["target_hidden_states"].shape[-1] == 2 * hidden
    with pytest.raises(ValueError, match=r"asks source 1 .*layer ids \[4\] that it does not hold"):
        dspark_cache.build_dataloader([Source(sources["a"]), Source(layers)], 4, target_layer_ids=[4, 1])
    with pytest.raises(MixtureMismatchError, match=r"source 1 .*dtype: it hands out F8_E4M3 states"):
        dspark_cache.build_dataloader([Source(sources["a"]), Source(sources["c"])], 4, dtype="raw")


def test_expect_checks_every_source(sources):
    m = dspark_cache.open_cache(sources["a"]).manifest
    loader = dspark_cache.build_dataloader([Source(sources["a"]), Source(sources["c"])], 4,
                                           expect={"hidden_size": m.hidden_size, "dtype": "bf16"})
    assert loader.manifest.hidden_size == m.hidden_size
    mixture = [Source(sources["a"]), Source(sources["c"])]
    with pytest.raises(
        CacheMismatchError, match=r"(?s)source 0 .* does not match.*seq_length: the cache has"
    ):
        dspark_cache.build_dataloader(mixture, 4, expect={"seq_length": 1024})


def test_follow_on_a_mixture_is_refused(sources):
    with pytest.raises(ValueError, match="follow=True reads one cache"):
        dspark_cache.build_dataloader([Source(sources["a"])], 4, follow=True)


def test_a_remote_source_mixes_with_local_ones(sources, s3_bucket, s3_env, tmp_path):
    """An s3:// source (read through the node-local copy) gives the batches its local twin gives."""
    from tests.support.remote import upload_cache

    url = f"{s3_bucket}/mix/b"
    upload_cache(sources["b"], url)
    local = [Source(sources["a"]), Source(sources["b"], repeat=1.5), Source(sources["c"])]
    remote = [Source(sources["a"]), Source(url, repeat=1.5), Source(sources["c"])]
    want = list(dspark_cache.build_dataloader(local, 5, seed=4))
    got = list(dspark_cache.build_dataloader(remote, 5, seed=4, local_cache_dir=str(tmp_path / "node")))
    assert len(got) == len(want)
    for a, b in zip(want, got):
        for key in a:
            assert torch.equal(a[key], b[key]), key


def test_verify_checks_every_sources_samples(sources, tmp_path):
    """A flipped byte in the second source's shard is named, shard and sample, by the mixture's loader."""
    import shutil

    from dspark_cache.format.errors import CorruptShardError
    from dspark_cache.format.paths import CachePaths

    damaged = str(tmp_path / "b")
    shutil.copytree(sources["b"], damaged)
    cache = dspark_cache.open_cache(damaged)
    shard, entry = cache.entry(0)
    tar = CachePaths(damaged).shard_tar(shard.shard_id)
    with open(tar, "r+b") as handle:
        handle.seek(entry.offset + entry.size - 3)
        byte = handle.read(1)
        handle.seek(entry.offset + entry.size - 3)
        handle.write(bytes([byte[0] ^ 0x40]))
    loader = dspark_cache.build_dataloader([Source(sources["a"]), Source(damaged)], 4, seed=0)
    with pytest.raises(CorruptShardError, match=rf"{tar}.*sample {entry.sample_id}.*checksum"):
        list(loader)


def test_many_sources_share_one_caches_budget_of_open_files(produced):
    """40 sources of 46 one-sample shards read whole: the idle descriptors kept open stay near one
    cache's budget (128), not 40 times it."""
    many = produced("--seq-length", "512", "--shard-size", "1", "--batch-size", "1")
    before = len(os.listdir("/proc/self/fd"))
    loader = dspark_cache.build_dataloader([Source(many)] * 40, 8, seed=0, pad_to="longest")
    for _ in loader:
        pass
    assert len(os.listdir("/proc/self/fd")) - before <= 40 * 4 + 16
    loader.close()


def test_a_compressed_source_mixes_bit_for_bit(sources, embedded, tmp_path):
    """A source stored with ``--compression zstd`` hands out the same batches, bit for bit, as the same
    rows stored plain: the codec is storage, like FP8 or object storage, not what the drafter sees."""
    from tests.support.produce import run_produce

    start, end = SPLITS["b"]
    data = write_jsonl(
        tmp_path / "b.jsonl", open(embedded.data, encoding="utf-8").read().splitlines()[start:end]
    )
    packed = str(tmp_path / "b-zstd")
    assert run_produce(embedded.stock, data, packed, *SHARED, "--compression", "zstd") == 0
    plain = [Source(sources["a"]), Source(sources["b"], repeat=1.5), Source(sources["c"])]
    zstd = [Source(sources["a"]), Source(packed, repeat=1.5), Source(sources["c"])]
    one = dspark_cache.build_dataloader(plain, 5, seed=3, window=8, pad_to="longest")
    two = dspark_cache.build_dataloader(zstd, 5, seed=3, window=8, pad_to="longest")
    batches = 0
    for a, b in itertools.zip_longest(one, two):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), key
        batches += 1
    assert batches == len(one) > 3
