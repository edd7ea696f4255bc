"""``CacheOutput``, the write side of a cache directory, on real directories."""

from __future__ import annotations

import os

import numpy as np
import pytest

from dspark_cache.format.geometry import SampleShape
from dspark_cache.format.manifest import read_manifest
from dspark_cache.format.sample import INPUT_IDS, LOSS_MASK
from dspark_cache.format.schema import Manifest
from dspark_cache.format.tar.writer import ShardWriter
from dspark_cache.storage.cache import CacheDir
from dspark_cache.storage.lock import CacheLockedError
from dspark_cache.storage.ours import CacheDirectoryError
from dspark_cache.storage.output import CacheOutput

SHAPE = SampleShape((0, 1), 2, 8, "BF16")
LENGTHS = {0: [3, 5], 1: [4, 2], 2: [6]}  # shard id -> its samples' lengths


def _manifest() -> Manifest:
    samples = sum(len(v) for v in LENGTHS.values())
    return Manifest(
        complete=False,
        target_model="t",
        target_model_type="qwen3",
        target_vocab_size=100,
        hidden_size=SHAPE.hidden_size,
        num_hidden_layers=SHAPE.num_layers,
        seq_length=16,
        dtype="bf16",
        num_samples=samples,
        planned_samples=samples,
        shard_size=2,
        target_hidden_dim=SHAPE.hidden_size * len(SHAPE.layer_ids),
        target_last_hidden_dim=SHAPE.hidden_size,
        target_layer_ids=list(SHAPE.layer_ids),
        train_data_path="d",
        num_shards=len(LENGTHS),
        cache_id="cache-a",
    )


def _writer(output: CacheOutput, shard_id: int) -> ShardWriter:
    """Shard ``shard_id`` written, not published yet."""
    writer = ShardWriter(output.paths, shard_id, durable=False, cache_id=output.cache_id)
    first = sum(len(LENGTHS[s]) for s in range(shard_id))
    for k, n in enumerate(LENGTHS[shard_id]):
        specs = SHAPE.specs(n)
        buffers = {s.name: np.zeros(s.nbytes, np.uint8) for s in specs}
        buffers.update({INPUT_IDS: np.arange(n, dtype=np.int32), LOSS_MASK: np.ones(n, np.uint8)})
        writer.append(first + k, n, specs, SHAPE.metadata(first + k), buffers)
    return writer


@pytest.fixture
def output(tmp_path) -> CacheOutput:
    """A new cache directory with its manifest (incomplete) and no shard."""
    out = CacheOutput(str(tmp_path / "cache"))
    out.check()
    out.create()
    out.write_manifest(_manifest())
    return out


def test_a_second_writer_is_refused_naming_the_holder(output):
    output.lock("run-a", 1)
    try:
        second = CacheOutput(output.root)
        with pytest.raises(CacheLockedError, match=f"pid {os.getpid()} on host .*, run run-a"):
            second.lock("run-b", 1)
    finally:
        output.release()
    second.lock("run-b", 1)  # released: the directory is free
    second.release()


def test_a_dropped_lock_leaves_no_lock_file(output):
    output.lock("dry-run", 1)
    assert os.path.exists(output.paths.lock)
    output.drop_lock()
    assert not os.path.exists(output.paths.lock)


def test_publish_makes_a_shard_visible_and_unpublish_removes_it(output):
    assert output.published() == frozenset()
    index = output.publish(_writer(output, 0))
    assert index.cache_id == "cache-a" and [e.sample_id for e in index.samples] == [0, 1]
    with CacheDir(output.root, allow_incomplete=True) as cache:
        assert cache.indexed_ids() == [0] and cache.require(0).tar_bytes == index.tar_bytes
    output.unpublish(0)
    assert not os.path.exists(output.paths.shard_index(0)) and not os.path.exists(output.paths.shard_tar(0))
    with CacheDir(output.root, allow_incomplete=True) as cache:
        assert cache.indexed_ids() == [] and cache.published(0) is None


def test_the_published_set_stays_current(output):
    output.publish(_writer(output, 0))
    output.publish(_writer(output, 1))
    assert output.published() == {0, 1}
    output.unpublish(0)
    assert output.published() == {1}
    CacheOutput(output.root).publish(_writer(output, 2))  # another process publishes
    assert output.published() == {1}  # as this object knows it
    assert output.scan() == output.published() == {1, 2}


def test_complete_records_every_published_shard(output):
    for shard_id in LENGTHS:
        output.publish(_writer(output, shard_id))
    output.complete(read_manifest(output.root, allow_incomplete=True))
    manifest = read_manifest(output.root)
    assert manifest.complete and manifest.cache_id == "cache-a" and manifest.num_samples == 5
    with CacheDir(output.root) as cache:
        assert len(cache.load_all()) == len(LENGTHS)


def test_overwrite_clears_only_our_files(output):
    output.publish(_writer(output, 0))
    _writer(output, 1)  # left half-written
    paths = output.paths
    mine = [paths.status(0), paths.events(0), paths.stop_request]
    theirs = [os.path.join(paths.shards_dir, "notes.txt"), os.path.join(paths.root, "README"),
              os.path.join(paths.status_dir, "rank-x.json")]
    os.makedirs(paths.control_dir, exist_ok=True)
    for path in mine + theirs:
        with open(path, "w") as handle:
            handle.write("{}")
    output.lock("run-a", 1)
    try:
        output.check()
        output.clear()
    finally:
        output.release()
    assert sorted(p for p in theirs if os.path.exists(p)) == sorted(theirs)
    left = {os.path.join(d, n) for d, _, names in os.walk(paths.root) for n in names}
    assert left == set(theirs) | {paths.lock}
    assert output.published() == frozenset() and output.read_manifest() is None


@pytest.mark.parametrize("sub", ["shards_dir", "status_dir", "events_dir", "control_dir", "plan_dir"])
def test_a_symlinked_sub_directory_is_refused(tmp_path, sub):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious").write_text("not the cache's")
    output = CacheOutput(str(tmp_path / "cache"))
    os.makedirs(output.root)
    os.symlink(elsewhere, getattr(output.paths, sub), target_is_directory=True)
    with pytest.raises(CacheDirectoryError, match="is a symbolic link"):
        output.check()
    assert (elsewhere / "precious").read_text() == "not the cache's"


def test_a_missing_manifest_reads_as_none_or_as_not_a_cache(tmp_path):
    from dspark_cache.format.errors import NotACacheError

    output = CacheOutput(str(tmp_path))
    assert output.read_manifest() is None and output.cache_id == ""
    assert read_manifest(str(tmp_path), missing_ok=True) is None
    with pytest.raises(NotACacheError):
        read_manifest(str(tmp_path))


def test_a_held_lock_whose_record_is_nested_past_the_parser_still_says_in_use(tmp_path):
    """Issue 41, item 12: the record is only a description; the lock held is what refuses a second run."""
    import subprocess
    import sys

    output = CacheOutput(str(tmp_path / "cache"))
    output.create()
    os.makedirs(output.paths.control_dir, exist_ok=True)
    with open(output.paths.lock, "w") as handle:
        handle.write("[" * 60000 + "]" * 60000)
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'r+'); "
                               "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)",
                               output.paths.lock], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(CacheLockedError, match="in use by another dspark-produce run .holder unknown"):
            output.lock("run-2")
    finally:
        holder.kill()
        holder.wait()
