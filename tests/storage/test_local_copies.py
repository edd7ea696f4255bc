"""The one local replica (``storage/remote/copies.py``): whether a node-local copy of a store object is the
store's current version (size and ETag, the ``CopiedFrom`` record), and its one download-then-replace,
against the moto S3 server with the fault proxy in front (a download cut midway, every retry too)."""

from __future__ import annotations

import os

import pytest

from dspark_cache.format.paths import CachePaths
from dspark_cache.storage.backing import StorageOptions
from dspark_cache.storage.remote.copies import LocalCopies
from dspark_cache.storage.remote.localdir import Temporaries, own_replica_dirs, replica_dirs
from dspark_cache.storage.remote.output import RemoteOutput
from dspark_cache.storage.remote.store import ObjectStore, ObjectStoreError
from tests.support.faultproxy import matching
from tests.support.remote import KEYS
from tests.support.s3server import client_options

RELATIVE = KEYS.target_weights  # its key under the prefix: names relative to the cache root
FAST_FAILING = {"max_retries": 0, "retry_timeout": 2}  # a cut download fails in about a second, not a minute


@pytest.fixture
def copies(s3_bucket, proxy, tmp_path) -> LocalCopies:
    root, records = str(tmp_path / "copy"), str(tmp_path / "copy" / ".records")
    own_replica_dirs(records, root)
    store = ObjectStore(f"{s3_bucket}/cache", client_options(proxy.endpoint, **FAST_FAILING))
    return LocalCopies(store, root, records)


def _temporaries(directory: str) -> list[str]:
    return [name for name in os.listdir(directory) if not name.startswith(".")]  # ".creating": the guard


def _cut_every_get(proxy) -> None:
    proxy.fail_next(None, "cut", match=matching("GET", suffix=RELATIVE), cut_after=64 << 10)


def test_a_download_cut_midway_leaves_no_temporary_and_keeps_the_old_copy(copies, proxy):
    copies.store.put(RELATIVE, b"old" * 1000)
    old = copies.download(RELATIVE)
    path = copies.local(RELATIVE)
    inode = os.stat(path).st_ino
    copies.store.put(RELATIVE, os.urandom(2 << 20))
    _cut_every_get(proxy)
    with pytest.raises(ObjectStoreError):
        copies.download(RELATIVE)
    assert proxy.faults["cut"] >= 2  # the whole-object retry was cut too
    assert _temporaries(copies.temporaries.directory) == []
    assert open(path, "rb").read() == b"old" * 1000 and os.stat(path).st_ino == inode
    assert copies.unchanged(RELATIVE, old)  # its record still names it


def test_a_copy_whose_record_matches_is_reused_without_a_request(copies, proxy):
    copies.store.put(RELATIVE, b"weights" * 100)
    info = copies.store.head(RELATIVE)
    copies.copy(RELATIVE, info)
    assert copies.unchanged(RELATIVE, info)
    proxy.reset_counters()
    copies.copy(RELATIVE, info)
    assert copies.unchanged(RELATIVE, info) and proxy.requests == 0
    seen = os.path.join(replica_dirs(os.path.dirname(copies.temporaries.directory))[0], RELATIVE)
    assert os.path.exists(seen)  # one record per copied object, the CopiedFrom format


def test_a_changed_etag_is_fetched_again(copies, proxy):
    copies.store.put(RELATIVE, b"a" * 4096)
    first = copies.download(RELATIVE)
    copies.store.put(RELATIVE, b"b" * 4096)  # the same size: only the ETag says it changed
    second = copies.store.head(RELATIVE)
    assert second.size == first.size and second.etag != first.etag
    assert not copies.unchanged(RELATIVE, second)
    proxy.reset_counters()
    copies.copy(RELATIVE, second)
    assert proxy.requests == 1 and open(copies.local(RELATIVE), "rb").read() == b"b" * 4096
    assert copies.unchanged(RELATIVE, second)


def test_a_staging_pull_whose_download_is_cut_leaks_no_temporary(s3_bucket, proxy, tmp_path):
    """A producer resuming brings the store's files into its staging directory: a download that fails
    leaves no partial file behind (it used to leave ``<file>.<pid>.tmp`` beside the copy), and the
    staged copy brought down before is kept."""
    staging = tmp_path / "staging"
    output = RemoteOutput(f"{s3_bucket}/cache", staging_dir=str(staging),
                          storage=StorageOptions(client_options(proxy.endpoint, **FAST_FAILING)))
    output.check()
    output.store.put(RELATIVE, b"old" * 1000)
    output.pull()
    paths = CachePaths(str(staging))
    assert open(paths.target_weights, "rb").read() == b"old" * 1000
    before = sorted(os.listdir(staging))
    output.store.put(RELATIVE, os.urandom(2 << 20))
    _cut_every_get(proxy)
    with pytest.raises(ObjectStoreError):
        output.pull()
    assert sorted(os.listdir(staging)) == before
    assert open(paths.target_weights, "rb").read() == b"old" * 1000


def test_a_staging_download_cut_short_by_a_kill_is_removed_at_the_next_check(s3_bucket, proxy,
                                                                              tmp_path):
    """A producer killed mid-download holds no lock on its temporary any more: the next run's check
    removes it (one of a live download, locked, would stay)."""
    staging = tmp_path / "staging"
    output = RemoteOutput(f"{s3_bucket}/cache", staging_dir=str(staging),
                          storage=StorageOptions(client_options(proxy.endpoint)))
    output.check()
    temporaries = replica_dirs(CachePaths(str(staging)).staging_records)[1]
    left = os.path.join(temporaries, f"{RELATIVE}.0123abcd")
    with open(left, "wb") as handle:
        handle.write(b"partial")
    with Temporaries(temporaries).new(RELATIVE) as live:  # a download in progress, its lock held
        output.check()
        assert os.path.exists(live) and not os.path.exists(left)
