"""Shards with plain tools: WebDataset's samples (no fill, the final state always there) and the
``wids`` shard index next to the shards (exact once the cache is complete, and after repair)."""

from __future__ import annotations

import json
import os
import shutil
import tarfile

import numpy as np
import pytest
import torch
import webdataset as wds
from safetensors.torch import load as safetensors_load

import dspark_cache
from dspark_cache.format.manifest import read_manifest
from dspark_cache.format.paths import CachePaths
from dspark_cache.format.sample import PAD_PREFIX, sample_metadata, sample_specs
from dspark_cache.format.tar.reader import load_shard_index
from dspark_cache.format.tar.writer import ShardWriter
from dspark_cache.format.wds import decode_dspark_arrays, decode_wids_sample
from dspark_cache.format.wids_index import WIDS_KIND, read_wids_index, write_wids_index
from dspark_cache.loader.tensors import to_torch
from dspark_cache.storage.output import CacheOutput
from tests.support.scripts import convert as convert_main
from dspark_cache.cli import verify as verify_main
from tests.support.produce import run_produce
from tests.support.convert_fixture import write_tiny_nemo

NEMO_KEYS = {"input_ids", "loss_mask", "target_hidden_states", "target_last_hidden_states"}


@pytest.fixture(scope="module")
def final_apart_cache(embedded, tmp_path_factory) -> str:
    """Layer ids without the final state (N - 1 = 7): target_last_hidden_states is stored apart."""
    out = str(tmp_path_factory.mktemp("apart") / "cache")
    assert run_produce(embedded.stock, embedded.data, out, "--seq-length", "64", "--shard-size", "12",
                       "--target-layer-ids", "1", "3") == 0
    return out


def _urls(root: str) -> list[str]:
    paths = CachePaths(root)
    return [paths.shard_tar(i) for i in paths.indexed_shard_ids()]


def _raw_blobs(root: str) -> list[bytes]:
    """Every sample blob as a generic tool sees it: WebDataset without our decoder."""
    return [s["safetensors"] for s in wds.WebDataset(_urls(root), shardshuffle=False)]


def _shard_order(root: str) -> list[int]:
    """Sample ids in shard order, then tar order: the order wids numbers samples in."""
    paths = CachePaths(root)
    return [e.sample_id for i in paths.indexed_shard_ids() for e in load_shard_index(paths, i).samples]


def _listed(root: str) -> dict[str, int]:
    return {e["url"]: e["nsamples"] for e in read_wids_index(CachePaths(root))["shardlist"]}


def _url(root: str, shard_id: int) -> str:
    """A shard's url in the wids list: its tar's name, relative to the list."""
    return os.path.basename(CachePaths(root).shard_tar(shard_id))


def test_webdataset_sample_has_the_final_state_as_a_view_and_no_fill(small_cache):
    hidden_size = read_manifest(small_cache).hidden_size
    raw = [safetensors_load(blob) for blob in _raw_blobs(small_cache)]
    # What the issue saw: a generic reader gets the alignment fill and no separate final state.
    assert any(name.startswith(PAD_PREFIX) for tensors in raw for name in tensors)
    assert not any("target_last_hidden_states" in tensors for tensors in raw)
    decoded = [s["safetensors"] for s in wds.WebDataset(_urls(small_cache), shardshuffle=False)
               .decode(decode_dspark_arrays)]
    assert len(decoded) == len(raw) == read_manifest(small_cache).num_samples
    for sample, stored in zip(decoded, raw):
        assert set(sample) == NEMO_KEYS | {"sample_id"}
        hidden, last = sample["target_hidden_states"].array, sample["target_last_hidden_states"].array
        assert last.shape == (hidden.shape[0], hidden_size)
        assert np.shares_memory(last, hidden)  # a view of the stored columns, not a copy
        assert np.array_equal(last, hidden[:, -hidden_size:])
        assert torch.equal(torch.from_numpy(hidden).view(torch.bfloat16), stored["target_hidden_states"])


def test_webdataset_sample_reads_a_separately_stored_final_state(final_apart_cache):
    raw = [safetensors_load(blob) for blob in _raw_blobs(final_apart_cache)]
    expected = {s["sample_id"]: s for s in dspark_cache.open_cache(final_apart_cache).samples()}
    decoded = [s["safetensors"] for s in wds.WebDataset(_urls(final_apart_cache), shardshuffle=False)
               .decode(decode_dspark_arrays)]
    assert len(decoded) == len(expected) > 0
    for sample, stored in zip(decoded, raw):
        assert set(sample) == NEMO_KEYS | {"sample_id"}
        last = sample["target_last_hidden_states"].array
        assert not np.shares_memory(last, sample["target_hidden_states"].array)
        got = torch.from_numpy(last).view(torch.bfloat16)
        assert torch.equal(got, stored["target_last_hidden_states"])
        assert torch.equal(got, expected[sample["sample_id"]]["target_last_hidden_states"])


def test_wids_index_lists_every_shard_with_its_sample_count(small_cache, capsys):
    paths = CachePaths(small_cache)
    manifest = read_manifest(small_cache)
    with open(paths.wids_index, encoding="utf-8") as handle:
        data = json.load(handle)
    assert data["__kind__"] == WIDS_KIND == "wids-shard-index-v1" and data["wids_version"] == 1
    assert os.path.dirname(paths.wids_index) == paths.shards_dir
    shards = data["shardlist"]
    assert [e["url"] for e in shards] == [
        os.path.basename(paths.shard_tar(i)) for i in range(manifest.num_shards)
    ]
    for entry in shards:
        tar_path = os.path.join(paths.shards_dir, entry["url"])  # relative to the index, as wids resolves it
        with tarfile.open(tar_path) as tar:
            assert entry["nsamples"] == len(tar.getmembers())
        assert entry["filesize"] == os.path.getsize(tar_path)
    assert sum(e["nsamples"] for e in shards) == manifest.num_samples
    # dspark-verify does not take it for a leftover or a stray file.
    assert verify_main([small_cache, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and not report["leftovers"] and not report["problems"]


def test_wids_reads_the_cache_by_position(small_cache, tmp_path, monkeypatch):
    wids = pytest.importorskip("wids")  # a package of its own since webdataset 1.0
    monkeypatch.setenv("WIDS_CACHE", str(tmp_path / "wids-cache"))  # where wids would copy shards
    paths = CachePaths(small_cache)
    before = sorted(os.listdir(paths.shards_dir))
    # The README's lines: cache_dir= the shards' own directory reads them in place, never copied.
    dataset = wids.ShardListDataset(
        paths.wids_index, cache_dir=paths.shards_dir, transformations=[decode_wids_sample]
    )
    expected = {s["sample_id"]: s for s in dspark_cache.open_cache(small_cache).samples()}
    order = _shard_order(small_cache)
    assert len(dataset) == len(expected) == len(order)
    for position in (0, len(order) // 2, len(order) - 1):
        sample = dataset[position][".safetensors"]
        assert sample["sample_id"] == order[position]
        for key in NEMO_KEYS:
            got = to_torch(sample[key])  # the stored dtype; handed-out ids and masks are int64 (one rule)
            want = expected[order[position]][key]
            assert torch.equal(got.to(want.dtype), want) and got.element_size() <= want.element_size()
    dataset.close()
    assert sorted(os.listdir(paths.shards_dir)) == before and not os.path.exists(tmp_path / "wids-cache")


def _publish(paths: CachePaths, shard_id: int, count: int) -> None:
    writer = ShardWriter(paths, shard_id, durable=False)
    for sid in range(shard_id * 10, shard_id * 10 + count):
        n = 5 + sid % 7
        tensors = {"target_hidden_states": np.full((n, 8), sid, dtype=np.int16),
                   "input_ids": np.arange(n, dtype=np.int32), "loss_mask": np.ones(n, dtype=np.uint8)}
        writer.append(
            sid, n, sample_specs(n, 8, 4, "BF16", False), sample_metadata(sid, [0, 1], 2, 4), tensors
        )
    writer.publish()


def test_publication_keeps_the_index_current_and_completion_makes_it_exact(tmp_path):
    paths = CachePaths(str(tmp_path / "c"))
    paths.ensure_dirs()
    _publish(paths, 0, 3)
    assert _listed(paths.root) == {_url(paths.root, 0): 3}
    # Another rank rewrote the file from an older listing: shard 0 missing, a shard 7 never published.
    with open(paths.wids_index, "w", encoding="utf-8") as handle:
        json.dump({"__kind__": WIDS_KIND, "wids_version": 1,
                   "shardlist": [{"url": _url(paths.root, 7), "nsamples": 9, "filesize": 1}]}, handle)
    _publish(paths, 1, 2)
    assert _listed(paths.root) == {_url(paths.root, 0): 3, _url(paths.root, 1): 2}
    with open(paths.wids_index, "wb") as handle:  # torn by a crash: rebuilt from the shard indexes
        handle.write(b'{"__kind__": "wids-sh')
    _publish(paths, 2, 4)
    assert _listed(paths.root) == {_url(paths.root, 0): 3, _url(paths.root, 1): 2, _url(paths.root, 2): 4}
    # Completion (and repair) rewrite from the shard indexes, whatever the file says.
    with open(paths.wids_index, encoding="utf-8") as handle:
        data = json.load(handle)
    data["shardlist"][0]["nsamples"] = 99
    with open(paths.wids_index, "w", encoding="utf-8") as handle:
        json.dump(data, handle)
    CacheOutput(paths.root).unpublish(1)
    entries = write_wids_index(paths)
    assert _listed(paths.root) == {_url(paths.root, 0): 3, _url(paths.root, 2): 4}
    assert entries == read_wids_index(paths)["shardlist"]


def test_completion_rewrites_a_stale_index(small_cache, tmp_path):
    root = str(tmp_path / "c")
    shutil.copytree(small_cache, root)
    paths = CachePaths(root)
    exact = _listed(root)
    with open(paths.wids_index, "w", encoding="utf-8") as handle:
        handle.write("[]")
    CacheOutput(root).complete(read_manifest(root))
    assert _listed(root) == exact


def test_verify_repair_rewrites_the_index_without_unpublished_shards(small_cache, tmp_path, capsys):
    root = str(tmp_path / "c")
    shutil.copytree(small_cache, root)
    paths = CachePaths(root)
    with open(paths.shard_tar(1), "r+b") as handle:  # truncated: cannot be rebuilt, so unpublished
        handle.truncate(1000)
    assert verify_main([root, "--repair"]) == 1
    capsys.readouterr()
    assert not os.path.exists(paths.shard_index(1))
    listed = _listed(root)
    assert _url(root, 1) not in listed
    assert listed == {os.path.basename(paths.shard_tar(i)): load_shard_index(paths, i).num_samples
                      for i in paths.indexed_shard_ids()}


def test_convert_to_dspark_writes_the_index(tmp_path, capsys):
    src, dst = str(tmp_path / "nemo"), str(tmp_path / "ours")
    ids = [[5, 6, 9, 7], [5, 6, 7, 7], [5, 6, 9, 9], [5, 9, 7, 7], [6, 6, 6, 7]]
    write_tiny_nemo(src, ids, [[0, 1, 1, 0]] * 5, shard_size=2)
    assert convert_main([src, dst, "--to", "dspark", "--pad-token-id", "7", "--quiet"]) == 0
    capsys.readouterr()
    assert _listed(dst) == {_url(dst, 0): 2, _url(dst, 1): 2, _url(dst, 2): 1}


def test_overwrite_deletes_the_index_and_its_temporaries(tmp_path):
    paths = CachePaths(str(tmp_path / "c"))
    paths.ensure_dirs()
    for name in (
        paths.wids_index,
        f"{paths.wids_index}.123.456.tmp",
        os.path.join(paths.shards_dir, "notes.json"),
    ):
        with open(name, "w", encoding="utf-8") as handle:
            handle.write("{}")
    listed = CacheOutput(paths.root).written_files()
    assert paths.wids_index in listed and f"{paths.wids_index}.123.456.tmp" in listed
    assert os.path.join(paths.shards_dir, "notes.json") not in listed  # not ours: never deleted
