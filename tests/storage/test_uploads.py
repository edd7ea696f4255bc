"""The upload queue (``storage/remote/uploads.py``) without a producer: sealed shards in a staging
directory, uploaded to obstore's in-memory store by the real :class:`ShardUploads`."""

from __future__ import annotations

import os
import threading
import time

import pytest

from dspark_cache.format.paths import CachePaths
from dspark_cache.format.schema import ShardIndex, decode_json
from dspark_cache.storage.remote.store import ObjectStoreError
from dspark_cache.storage.remote.uploads import ShardUploads
from tests.support.remote import KEYS, memory_store

WAIT_S = 10.0  # the longest a test waits for a transfer thread to reach a point


def _seal(paths: CachePaths, shard: int, size: int) -> ShardIndex:
    """A sealed shard in the staging directory: its tar whole, its index (not yet written)."""
    os.makedirs(paths.shards_dir, exist_ok=True)
    with open(paths.shard_tar(shard), "wb") as tar:
        tar.write(bytes([shard % 256]) * size)
    return ShardIndex(shard_id=shard, tar_bytes=size, tar_xxh3=0, samples=[])


class _Queue:
    """A ShardUploads with what it did recorded: every write's key in order, each commit with the store's
    size of its tar at that moment, each shard reported committed."""

    def __init__(self, tmp_path, limit: int = 1 << 30, threads: int = 4) -> None:
        self.store, self.client = memory_store()
        self.paths = CachePaths(str(tmp_path / "staging"))
        self.writes: list[str] = []
        self.commits: list[tuple[str, int | None]] = []
        self.committed: list[int] = []
        self.client.before_put = self.writes.append
        self.uploads = ShardUploads(self.store, self.paths, limit, self._committed, self._commit,
                                    threads=threads)

    def _commit(self, relative: str, data: bytes, expected: str | None) -> str:
        shard, _ = KEYS.shard_file(os.path.basename(relative))
        info = self.store.head(KEYS.shard_tar(shard))
        self.commits.append((relative, None if info is None else info.size))
        return self.store.put(relative, data, create=True)

    def _committed(self, index: ShardIndex, etag: str) -> None:
        self.committed.append(index.shard_id)

    def key(self, path: str) -> str:
        return self.store.url.key(self.paths.relative(path))


def test_each_shard_is_published_tar_first_then_its_index(tmp_path):
    """Several shards in flight: each one's tar is whole on the store before its index, the commit, is
    written; every index says what its tar holds; each shard reported committed once."""
    q = _Queue(tmp_path)
    indexes = [_seal(q.paths, shard, 1000 + shard) for shard in range(6)]
    for index in indexes:
        q.uploads.submit(index)
    q.uploads.flush()
    q.uploads.close()
    assert sorted(q.committed) == list(range(6)) and q.uploads.error is None
    assert q.uploads.uploaded_bytes == sum(i.tar_bytes for i in indexes) and q.uploads.staged_bytes == 0
    for index in indexes:
        tar, idx = q.key(q.paths.shard_tar(index.shard_id)), q.key(q.paths.shard_index(index.shard_id))
        assert q.writes.index(tar) < q.writes.index(idx)
        committed = q.paths.relative(q.paths.shard_index(index.shard_id))
        assert (committed, index.tar_bytes) in q.commits  # the tar was whole when its index was committed
        assert decode_json(q.store.get(committed)[0], ShardIndex) == index


def test_a_failed_upload_is_reported_and_its_shard_not_published(tmp_path):
    """The store holds other than the index says (here the tar grew after sealing): the shard's index is
    not written, flush raises naming the object, and so does the next submit."""
    q = _Queue(tmp_path)
    good, bad = _seal(q.paths, 0, 100), _seal(q.paths, 1, 100)
    with open(q.paths.shard_tar(1), "ab") as tar:
        tar.write(b"more")
    q.uploads.submit(good)
    q.uploads.flush()
    q.uploads.submit(bad)
    with pytest.raises(ObjectStoreError) as failed:
        q.uploads.flush()
    message = str(failed.value)
    assert q.store.name(q.paths.relative(q.paths.shard_tar(1))) in message
    assert "104 bytes, its index says 100" in message and "not published" in message
    assert q.store.head(q.paths.relative(q.paths.shard_index(1))) is None and q.committed == [0]
    with pytest.raises(ObjectStoreError):
        q.uploads.submit(_seal(q.paths, 2, 100))
    q.uploads.close()


class _Held:
    """Tar writes held until released, counted: how many are in flight now and at most."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self._lock = threading.Lock()
        self.now = self.most = 0

    def __call__(self, key: str) -> None:
        if not key.endswith(".tar"):
            return
        with self._lock:
            self.now += 1
            self.most = max(self.most, self.now)
        self.release.wait(WAIT_S)
        with self._lock:
            self.now -= 1

    def reach(self, count: int) -> None:
        deadline = time.monotonic() + WAIT_S
        while self.now < count and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.now == count


def test_no_more_than_threads_uploads_are_in_flight(tmp_path):
    q = _Queue(tmp_path, threads=2)
    q.client.before_put = held = _Held()
    for shard in range(4):
        q.uploads.submit(_seal(q.paths, shard, 100))  # returns at once: staging has room
    held.reach(2)
    time.sleep(0.3)  # time for a third to start, were it let
    assert held.now == 2 and q.uploads.staged_bytes == 400
    held.release.set()
    q.uploads.flush()
    q.uploads.close()
    assert held.most == 2 and sorted(q.committed) == [0, 1, 2, 3]


def test_a_submit_past_the_staging_limit_waits_for_an_upload_to_end(tmp_path):
    q = _Queue(tmp_path, limit=250)
    q.client.before_put = held = _Held()
    for shard in range(2):
        q.uploads.submit(_seal(q.paths, shard, 100))  # 200 bytes staged: under the limit
    held.reach(2)
    third = threading.Thread(target=q.uploads.submit, args=(_seal(q.paths, 2, 100),))
    third.start()  # 300 bytes would be staged: it waits
    third.join(0.5)
    assert third.is_alive() and q.uploads.staged_bytes == 200
    held.release.set()
    third.join(WAIT_S)
    assert not third.is_alive()
    q.uploads.flush()
    q.uploads.close()
    assert sorted(q.committed) == [0, 1, 2] and q.uploads.stalled_seconds > 0


def test_one_shard_larger_than_the_limit_is_let_through(tmp_path):
    """Else a shard larger than --staging-limit would hold the writer for ever."""
    q = _Queue(tmp_path, limit=10)
    q.uploads.submit(_seal(q.paths, 0, 100))
    q.uploads.flush()
    q.uploads.close()
    assert q.committed == [0]
