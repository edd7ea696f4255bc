"""A cache rewritten under its reader (issue 23, item 1): readers stop instead of mixing two caches.

Each cache here is real (the embedded tiny Qwen3 through dspark-produce). A reader opens cache A,
reads a batch, a second ``dspark-produce --overwrite`` with other input rewrites the directory to
completion, and the reader must then raise instead of handing out B's samples under A's ids.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import dspark_cache
from dspark_cache.format.paths import CachePaths
from dspark_cache.format.tar.reader import load_shard_index
from dspark_cache.format.validate import ForeignShardError
from dspark_cache.storage.cache import CacheDir, CacheReplacedError
from dspark_cache.verify import verify_cache
from tests.support.produce import run_produce, write_jsonl

ARGS = ("--seq-length", "128", "--shard-size", "4", "--batch-size", "2")
REPLACED = "was replaced .*restart training on the new cache"


@pytest.fixture(scope="module")
def inputs(embedded, tmp_path_factory) -> tuple[str, str]:
    """Two inputs of the same size: the sample data, and the same rows in reverse order (other
    samples under the same ids)."""
    with open(embedded.data, encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    other = write_jsonl(tmp_path_factory.mktemp("other") / "other.jsonl", rows[::-1])
    return embedded.data, other


@pytest.fixture(scope="module")
def cache_a(embedded, inputs, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("a") / "cache")
    assert run_produce(embedded.stock, inputs[0], out, *ARGS) == 0
    return out


def _fresh_copy(cache_a: str, tmp_path) -> str:
    out = str(tmp_path / "cache")
    shutil.copytree(cache_a, out)
    return out


def _overwrite(embedded, inputs, out: str) -> None:
    assert run_produce(embedded.stock, inputs[1], out, *ARGS, "--overwrite") == 0


def _samples(root: str) -> dict[int, dict]:
    with dspark_cache.open_cache(root) as cache:
        return {s["sample_id"]: s for s in cache.samples()}


def _rows_match(batch: dict, want: dict[int, dict]) -> bool:
    for row, sid in enumerate(batch["sample_ids"].tolist()):
        n = want[sid]["input_ids"].shape[0]
        if int(batch["attention_mask"][row].sum()) != n or not torch.equal(batch["input_ids"][row, :n],
                                                                           want[sid]["input_ids"].long()):
            return False
    return True


def test_the_producer_gives_a_cache_an_id_that_resume_keeps_and_overwrite_renews(embedded, inputs, cache_a,
                                                                                   tmp_path):
    out = _fresh_copy(cache_a, tmp_path)
    paths = CachePaths(out)
    first = CacheDir(out).cache_id
    assert len(first) == 32 and all(
        load_shard_index(paths, s).cache_id == first for s in paths.indexed_shard_ids()
    )
    os.unlink(paths.shard_index(3))  # a resume recomputes it under the same id
    assert run_produce(embedded.stock, inputs[0], out, *ARGS) == 0
    assert CacheDir(out).cache_id == first and load_shard_index(paths, 3).cache_id == first
    _overwrite(embedded, inputs, out)
    second = CacheDir(out).cache_id
    assert second != first and {load_shard_index(paths, s).cache_id for s in paths.indexed_shard_ids()} == {
        second
    }


@pytest.mark.parametrize("follow", [False, True], ids=["complete", "follow"])
def test_a_loader_stops_when_its_cache_is_overwritten_with_other_input(
    embedded, inputs, cache_a, tmp_path, follow, executor
):
    out = _fresh_copy(cache_a, tmp_path)
    old = _samples(out)
    loader = dspark_cache.build_dataloader(out, 2, shuffle=False, follow=follow, num_workers=1, prefetch=1,
                                           pin_memory=False, poll_interval=0.01, follow_timeout=30)
    batches = iter(loader)
    assert _rows_match(next(batches), old)
    _overwrite(embedded, inputs, out)
    new = _samples(out)
    # other samples, same ids
    assert any(not torch.equal(new[s]["input_ids"], old[s]["input_ids"]) for s in old)
    with pytest.raises(CacheReplacedError, match=REPLACED):
        for batch in batches:
            assert _rows_match(batch, old)  # a batch already in flight is still all of the old cache
    loader.close()


def test_open_cache_and_the_nemo_dataset_stop_too(embedded, inputs, cache_a, tmp_path):
    from dspark_cache.nemo.dataset import DSparkMapDataset

    out = _fresh_copy(cache_a, tmp_path)
    cache = dspark_cache.open_cache(out)
    dataset = DSparkMapDataset(out, batch_size=2)
    first = cache.read(0)
    assert torch.equal(dataset[0]["input_ids"][: first["input_ids"].shape[0]], first["input_ids"].long())
    _overwrite(embedded, inputs, out)
    with pytest.raises(CacheReplacedError, match=REPLACED):
        cache.read(len(cache) - 1)
    with pytest.raises(CacheReplacedError, match=REPLACED):
        dataset.__getitems__([len(dataset) - 1])
    # A reader opened on the old cache's id (a forked DataLoader worker of a dataset made before) refuses the new one.
    with pytest.raises(CacheReplacedError, match="it is cache"):
        CacheDir(out, cache_id=cache.cache.cache_id)
    cache.close()


def test_a_shard_of_another_cache_is_refused_and_recomputed(embedded, inputs, cache_a, tmp_path):
    """Same settings, other input: shard 2 of cache B copied into cache A has A's geometry but B's id."""
    out, other = _fresh_copy(cache_a, tmp_path), str(tmp_path / "b")
    assert run_produce(embedded.stock, inputs[1], other, *ARGS) == 0
    paths, theirs = CachePaths(out), CachePaths(other)
    for name in (paths.shard_tar(2), paths.shard_index(2)):
        shutil.copyfile(name.replace(out, other, 1), name)
    assert (
        load_shard_index(paths, 2).cache_id == load_shard_index(theirs, 2).cache_id != CacheDir(out).cache_id
    )
    with pytest.raises(ForeignShardError, match=r"shard-000002.idx.*written for cache"):
        dspark_cache.open_cache(out)
    with pytest.raises(ForeignShardError, match=os.path.basename(paths.shard_index(2))):
        list(dspark_cache.build_dataloader(out, 2, shuffle=False, pin_memory=False))
    report = verify_cache(out)
    assert not report.ok and [p["shard"] for p in report.corrupt] == [2]
    assert run_produce(embedded.stock, inputs[0], out, *ARGS) == 0  # the resume recomputes it as A's
    assert verify_cache(out).ok
    ours, want = _samples(out), _samples(cache_a)
    assert ours.keys() == want.keys()
    assert all(
        torch.equal(ours[s][k], want[s][k]) for s in want for k in ("input_ids", "target_hidden_states")
    )


def test_a_loader_state_of_the_old_cache_is_not_restored_on_the_new_one(embedded, inputs, cache_a, tmp_path):
    """Restarting training from a checkpoint after --overwrite would continue the old cache's epoch
    position in the new cache's order: refused, with what to do instead."""
    out = _fresh_copy(cache_a, tmp_path)
    loader = dspark_cache.build_dataloader(out, 2, shuffle=False, pin_memory=False)
    next(iter(loader))
    state = loader.state_dict()
    loader.close()
    again = dspark_cache.build_dataloader(out, 2, shuffle=False, pin_memory=False)
    again.load_state_dict(state)  # the same cache: fine
    _overwrite(embedded, inputs, out)
    fresh = dspark_cache.build_dataloader(out, 2, shuffle=False, pin_memory=False)
    with pytest.raises(
        ValueError, match="taken on cache .* holds cache .* start its first epoch from the beginning"
    ):
        fresh.load_state_dict(state)
    fresh.load_state_dict({k: v for k, v in state.items() if k != "cache_id"})  # a state from before ids
    again.close(), fresh.close()
