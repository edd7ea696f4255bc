"""Reading caches from object storage: a real S3-compatible server (moto, started by the suite on
127.0.0.1), our fault-injecting proxy in front of it, and the node-local copy the readers use."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time

import pytest
import torch

import dspark_cache
from dspark_cache.cli import verify as verify_main
from dspark_cache.format.errors import CorruptShardError, NotACacheError
from dspark_cache.format.paths import CachePaths
from dspark_cache.nemo.dataset import DSparkMapDataset
from dspark_cache.storage.backing import StorageOptions
from dspark_cache.storage.cache import CacheDir, CacheReplacedError
from dspark_cache.storage.remote.store import (
    AccessDeniedError,
    NoSuchBucketError,
    ObjectStore,
    ObjectStoreError,
)
from dspark_cache.storage.remote.url import RemoteURL, is_remote
from tests.support.faultproxy import FaultProxy, matching
from dspark_cache.storage.remote.localdir import LocalCopyError
from dspark_cache.storage.remote.staging import default_staging_dir
from dspark_cache.tui.remote.monitorcopy import MonitorCopy
from tests.support.proc import assert_same_samples, run, start
from tests.support.remote import KEYS, publish_shard, upload_cache
from tests.support.s3server import S3Server, unique_bucket_name

ARGS = ("--shard-size", "6")  # 47 samples in 10 shards of ~0.85 MB
TARS = matching(method="GET", suffix=".tar")


@pytest.fixture
def local(produced) -> str:
    return produced(*ARGS)


@pytest.fixture
def remote(local, s3_bucket, s3_env) -> str:
    url = f"{s3_bucket}/runs/cache"
    upload_cache(local, url)
    return url


def _via(proxy: FaultProxy, **extra) -> dict:
    return {"endpoint": proxy.endpoint, **extra}


def _cache_bytes(local: str) -> list[int]:
    paths = CachePaths(local)
    return [os.path.getsize(paths.shard_tar(s)) for s in paths.indexed_shard_ids()]


def _epochs(loader, n: int) -> list[list[dict[str, torch.Tensor]]]:
    return [list(loader) for _ in range(n)]


def test_urls_are_remote_and_plain_paths_are_not():
    assert is_remote("s3://bucket/a/b") and is_remote("gs://b") and not is_remote("/data/cache")
    assert not is_remote("file:///data/cache") and not is_remote("relative/dir")
    url = RemoteURL.parse("s3://bucket/a/b/")
    key = KEYS.shard_index(1)
    assert (url.bucket, url.prefix, url.key(key)) == ("bucket", "a/b", "a/b/" + key)
    for bad, said in [
        ("s3:///x", "no bucket"),
        ("ftp://b/x", "not an object store"),
        ("s3://b/a/../c", "'..'"),
    ]:
        with pytest.raises(ValueError, match=said):
            RemoteURL.parse(bad)


def test_loader_over_s3_gives_the_local_batches_within_a_small_local_cache(local, remote, tmp_path):
    """Two epochs with room for a third of the shards on this node: the same batches as the local
    cache's, every sample once per epoch, the node's copy never far over its limit."""
    sizes = _cache_bytes(local)
    limit = sum(sizes) // 3
    options = dict(batch_size=4, shuffle=True, seed=7, num_workers=2, window=2)
    expected = _epochs(dspark_cache.build_dataloader(local, **options), 2)
    loader = dspark_cache.build_dataloader(
        remote, local_cache_dir=str(tmp_path / "node"), cache_limit=limit, **options
    )
    got = _epochs(loader, 2)
    mirror = loader.cache.backing
    assert [len(e) for e in got] == [len(e) for e in expected]
    for epoch, (ours, theirs) in enumerate(zip(got, expected)):
        for a, b in zip(ours, theirs):
            assert a.keys() == b.keys()
            for key in a:
                assert torch.equal(a[key], b[key]), (epoch, key)
        ids = [
            int(i)
            for batch in ours
            for i, repeat in zip(batch["sample_ids"], batch["is_repeat"])
            if not repeat
        ]
        assert sorted(ids) == sorted(dspark_cache.open_cache(local).sample_ids)
    # A third of the cache fits: the second epoch downloads again what was evicted.
    assert mirror.downloads > len(sizes)
    loader.close()


def test_open_cache_and_the_nemo_dataset_read_s3(local, remote, tmp_path):
    storage = dict(local_cache_dir=str(tmp_path / "node"))
    with dspark_cache.open_cache(local) as a, dspark_cache.open_cache(remote, **storage) as b:
        assert len(a) == len(b) and a.sample_ids == b.sample_ids
        for x, y in zip(a.samples(), b.samples()):
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x if k != "sample_id")
    ours = DSparkMapDataset(remote, storage=StorageOptions(local_cache_dir=str(tmp_path / "node")))
    theirs = DSparkMapDataset(local)
    picks = [len(theirs) - 1, 0, 5, 17]
    a, b = ours.__getitems__(picks), theirs.__getitems__(picks)
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_transient_faults_are_retried_and_every_sample_still_read(local, remote, proxy, tmp_path):
    proxy.fail_next(2, "503", match=TARS)
    proxy.fail_next(2, "reset", match=TARS)
    proxy.fail_next(1, "500", match=TARS)
    proxy.fail_next(1, "cut", match=TARS, cut_after=100_000)
    with (
        dspark_cache.open_cache(
            remote, storage_options=_via(proxy), local_cache_dir=str(tmp_path / "n")
        ) as cache,
        dspark_cache.open_cache(local) as reference,
    ):
        assert [s["sample_id"] for s in cache.samples()] == reference.sample_ids
    assert proxy.faults["503"] == 2 and proxy.faults["reset"] == 2 and proxy.faults["500"] == 1
    assert proxy.faults["cut"] == 1


@pytest.mark.slow
def test_a_store_that_stops_answering_ends_in_an_error_naming_the_object(remote, proxy, tmp_path):
    proxy.fail_next(None, "stall", match=TARS, stall_s=30)
    options = _via(proxy, client_options={"timeout": "1s"}, retry_config={"max_retries": 1})
    started = time.monotonic()
    with dspark_cache.open_cache(
        remote, storage_options=options, local_cache_dir=str(tmp_path / "n")
    ) as cache:
        with pytest.raises(ObjectStoreError, match=r"reading s3://.*/runs/cache/shards/shard-\d{6}\.tar"):
            cache.read(0)
    assert time.monotonic() - started < 25


def test_a_corrupted_object_is_fetched_again_once_then_named(local, remote, proxy, tmp_path):
    paths = CachePaths(local)
    store = ObjectStore(remote)
    damaged = bytearray(open(paths.shard_tar(3), "rb").read())
    damaged[len(damaged) // 2] ^= 0xFF
    store.put(KEYS.shard_tar(3), bytes(damaged))
    node = str(tmp_path / "n")
    with dspark_cache.open_cache(remote, storage_options=_via(proxy), local_cache_dir=node) as cache:
        first = next(i for i, (shard, _) in enumerate(cache._order) if shard == 3)
        with pytest.raises(
            CorruptShardError, match=r"s3://.*/runs/cache/shards/shard-000003\.tar.*downloaded twice"
        ):
            cache.read(first)
        root = cache.cache.backing.root
    assert len(_tar_gets(proxy, os.path.basename(KEYS.shard_tar(3)))) == 2
    assert os.path.isdir(CachePaths(root).shards_dir)
    assert not os.path.exists(CachePaths(root).shard_tar(3))  # never kept on the node


# -- the node's local copy: only the store's bytes are served ---------------------------------

def _plant(root: str, local: str) -> dict[str, bytes]:
    """Doctor the node's copy of a remote cache in place of the store's files: the manifest (another
    train_data_path), shard 2's index (its last sample dropped) and shard 0's tar (a byte flipped, its size
    kept). Returns what was planted, by path."""
    paths, theirs = CachePaths(root), CachePaths(local)
    manifest = json.loads(open(theirs.manifest).read())
    index = json.loads(open(theirs.shard_index(2)).read())
    index["samples"] = index["samples"][:-1]
    tar = bytearray(open(theirs.shard_tar(0), "rb").read())
    tar[len(tar) // 2] ^= 0xFF
    planted = {paths.manifest: json.dumps({**manifest, "train_data_path": "planted"}).encode(),
               paths.shard_index(2): json.dumps(index).encode(), paths.shard_tar(0): bytes(tar)}
    for path, data in planted.items():
        with open(path, "wb") as handle:  # written over, as anyone who may write the directory could
            handle.write(data)
    # The index's record made to name the planted file: only the store's ETag (the MD5 of its bytes) tells.
    seen = os.path.join(root, ".mirror", "seen", "shards%shard-000002.idx")
    record = json.loads(open(seen).read())
    assert record["md5"], record
    st = os.stat(paths.shard_index(2))
    with open(seen, "w") as handle:
        json.dump({**record, "inode": st.st_ino, "ctime_ns": st.st_ctime_ns}, handle)
    return planted


def test_a_doctored_local_copy_is_never_served_as_the_stores(local, remote, tmp_path, capsys):
    """The manifest, an index and a tar of the node's copy written over after a first reader filled it: the
    next reader (the loader, open_cache) and dspark-verify read the store's, never the planted bytes."""
    node = str(tmp_path / "node")
    with dspark_cache.open_cache(remote, local_cache_dir=node) as cache:
        root = cache.cache.backing.root
        list(cache.samples())  # every tar downloaded
    planted = _plant(root, local)
    with dspark_cache.open_cache(remote, local_cache_dir=node) as ours, \
            dspark_cache.open_cache(local) as theirs:
        assert ours.manifest.train_data_path == theirs.manifest.train_data_path != "planted"
        assert ours.sample_ids == theirs.sample_ids
        assert assert_same_samples(ours, theirs, True, (0.0, 0.0)) == len(theirs)
    for path, data in planted.items():
        assert open(path, "rb").read() != data, path  # replaced by the store's
    _plant(root, local)
    loader = dspark_cache.build_dataloader(remote, local_cache_dir=node, batch_size=4)
    assert loader.cache.manifest.train_data_path != "planted"
    ids = [int(i) for b in loader for i, again in zip(b["sample_ids"], b["is_repeat"]) if not again]
    assert sorted(ids) == sorted(dspark_cache.open_cache(local).sample_ids)
    loader.close()
    _plant(root, local)
    capsys.readouterr()
    assert verify_main([remote, "--local-cache-dir", node]) == 0
    assert "10/10 shards verified" in capsys.readouterr().out


def test_a_local_copy_others_may_write_or_own_is_refused_naming_it(remote, tmp_path, capsys):
    node = str(tmp_path / "node")
    with dspark_cache.open_cache(remote, local_cache_dir=node) as cache:
        root = cache.cache.backing.root
    os.chmod(root, 0o777)
    with pytest.raises(LocalCopyError, match=rf"{re.escape(root)} is writable by other users \(mode 777\).*"
                                             rf"chmod go-w {re.escape(root)}"):
        dspark_cache.open_cache(remote, local_cache_dir=node)
    assert verify_main([remote, "--local-cache-dir", node]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{root} is writable by other users" in err, err
    os.chmod(root, 0o755)
    os.chmod(node, 0o775)  # the local cache directory itself: a group could plant a whole copy
    with pytest.raises(LocalCopyError, match=f"{re.escape(node)} is writable by other users"):
        dspark_cache.open_cache(remote, local_cache_dir=node)
    os.chmod(node, 0o755)
    if os.geteuid() == 0:  # only root can give a directory away
        os.chown(root, 4242, -1)
        with pytest.raises(LocalCopyError, match=rf"{re.escape(root)} belongs to another user \(uid 4242"):
            dspark_cache.open_cache(remote, local_cache_dir=node)
        os.chown(root, 0, -1)
    with dspark_cache.open_cache(remote, local_cache_dir=node) as cache:
        assert cache.cache.backing.root == root
    # A record others may write (a umask of 002, say) vouches for nothing: one rewritten to name a planted
    # index (and to waive the ETag check) is not believed.
    index = CachePaths(root).shard_index(3)
    store_bytes = open(index, "rb").read()
    with open(index, "r+b") as handle:
        handle.write(store_bytes.replace(b"0", b"1", 1))
    seen = os.path.join(root, ".mirror", "seen", "shards%shard-000003.idx")
    st = os.stat(index)
    record = {**json.loads(open(seen).read()), "inode": st.st_ino, "ctime_ns": st.st_ctime_ns, "md5": False}
    with open(seen, "w") as handle:
        json.dump(record, handle)
    os.chmod(seen, 0o664)
    with dspark_cache.open_cache(remote, local_cache_dir=node):
        assert open(index, "rb").read() == store_bytes


# Holds an flock on a file as a download in progress does (as if in another pid namespace, or on another
# host sharing the directory: the pid in the name is none of this machine's), until its stdin closes.
_HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()
"""


def test_a_download_temporary_is_removed_only_once_no_process_holds_it(remote, tmp_path):
    node = str(tmp_path / "node")
    with dspark_cache.open_cache(remote, local_cache_dir=node) as cache:
        tmp_dir = os.path.join(cache.cache.backing.root, ".mirror", "tmp")
    held = os.path.join(tmp_dir, "shard-000001.tar.4194999.1")  # above any pid_max: no such pid here
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, held], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        left = os.path.join(tmp_dir, f"shard-000002.tar.{os.getpid()}.1")  # its pid alive, its writer gone
        with open(left, "wb") as handle:
            handle.write(b"partial")
        with dspark_cache.open_cache(remote, local_cache_dir=node):  # each open cleans the temporaries
            assert os.path.exists(held) and not os.path.exists(left)
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    with dspark_cache.open_cache(remote, local_cache_dir=node):  # its holder died: its lock with it
        assert not os.path.exists(held)


def test_a_local_copy_removed_under_a_reader_is_named_not_blamed_on_the_store(remote, tmp_path):
    node = str(tmp_path / "node")
    with dspark_cache.open_cache(remote, local_cache_dir=node) as cache:
        root = cache.cache.backing.root
        shutil.rmtree(os.path.join(root, ".mirror", "tmp"))  # a cleaner of the node's disk, say
        said = rf"the local copy of s3://\S+/runs/cache at {re.escape(root)} lost \S+ while it was in use"
        with pytest.raises(LocalCopyError, match=said) as lost:
            cache.read(0)
        assert "not in the store" not in str(lost.value) and "rerun" in str(lost.value)
        shutil.rmtree(node)
        with pytest.raises(LocalCopyError, match=said):
            cache.read(len(cache) - 1)

def test_two_endpoints_with_the_same_bucket_and_prefix_never_share_a_local_copy(local, s3_env, tmp_path):
    """Two stores (two servers) each hold a cache at s3://same-bucket/runs/cache, different caches: readers
    of both on one node, with one local cache directory, each read their own."""
    bucket, node = unique_bucket_name(), str(tmp_path / "node")
    manifest = json.loads(open(CachePaths(local).manifest).read())
    with S3Server() as a, S3Server() as b:
        for server in (a, b):
            server.make_bucket(bucket)
            store = upload_cache(local, f"s3://{bucket}/runs/cache", manifest=False,
                                 storage_options={"endpoint": server.endpoint})
            changed = {**manifest, "train_data_path": f"on-{server.port}"}
            store.put(KEYS.manifest, json.dumps(changed).encode())
        url = f"s3://{bucket}/runs/cache"
        with dspark_cache.open_cache(url, storage_options={"endpoint": a.endpoint},
                                     local_cache_dir=node) as on_a, \
                dspark_cache.open_cache(url, storage_options={"endpoint": b.endpoint},
                                        local_cache_dir=node) as on_b:
            assert on_a.cache.backing.root != on_b.cache.backing.root
            assert on_a.manifest.train_data_path == f"on-{a.port}"
            assert on_b.manifest.train_data_path == f"on-{b.port}"
            with open(CachePaths(on_a.cache.backing.root).manifest) as handle:
                assert json.load(handle)["train_data_path"] == f"on-{a.port}"
        # The producer's staging directory and the monitor's copy are keyed alike.
        dirs = {default_staging_dir(RemoteURL.parse(url), node, {"endpoint": s.endpoint}) for s in (a, b)}
        assert len(dirs) == 2
        copies = [MonitorCopy(url, StorageOptions({"endpoint": s.endpoint}, node)) for s in (a, b)]
        assert copies[0].root != copies[1].root and not any(v._private for v in copies)
        for copy in copies:
            copy.close()


def _node_tar_bytes(node: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(node) for f in files
               if f.endswith(".tar") and os.path.basename(d) == KEYS.shards_dir)


def test_verify_streams_a_remote_cache_and_names_a_damaged_object(local, remote, tmp_path, capsys):
    node = ["--local-cache-dir", str(tmp_path / "n"), "--cache-limit", "2M"]
    assert verify_main([remote, *node]) == 0
    assert "10/10 shards verified" in capsys.readouterr().out
    # Shard by shard within the limit (8.4 MB of shards went through a 2 MiB local cache).
    assert 0 < _node_tar_bytes(str(tmp_path / "n")) <= (2 << 20) + max(_cache_bytes(local))
    store = ObjectStore(remote)
    data = bytearray(open(CachePaths(local).shard_tar(8), "rb").read())
    data[-2000] ^= 1
    store.put(KEYS.shard_tar(8), bytes(data))
    store.delete(KEYS.shard_index(5))  # unpublished: its tar is a leftover
    assert verify_main([remote, *node, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["missing"] == [5] and [c["shard"] for c in report["corrupt"]] == [8]
    assert report["corrupt"][0]["path"].endswith("/runs/cache/" + KEYS.shard_tar(8))
    assert report["corrupt"][0]["path"].startswith("s3://")
    assert any(p.endswith("/runs/cache/" + KEYS.shard_tar(5)) for p in report["leftovers"])
    # --repair: an index whose tar is intact is rebuilt on the store, a damaged tar is unpublished there
    # (index first), and the tar without an index is removed; the repair holds the cache's lease.
    original = store.get(KEYS.shard_index(3))[0]
    index = json.loads(original)
    index["samples"][1][1] += 1  # the second sample's length: the index no longer matches its tar
    store.put(KEYS.shard_index(3), json.dumps(index).encode())
    staging = ["--local-cache-dir", str(tmp_path / "repair")]
    assert verify_main([remote, *node, "--repair"]) == 1
    out = capsys.readouterr().out
    assert "index rebuilt" in out and "deleted" in out, out
    assert store.get(KEYS.shard_index(3))[0] == original
    assert store.head(KEYS.shard_index(8)) is None and store.head(KEYS.shard_tar(8)) is None
    assert store.head(KEYS.shard_tar(5)) is None
    assert store.head(KEYS.lease) is None  # given back
    wids = json.loads(store.get(KEYS.wids_index)[0])
    assert [e["url"] for e in wids["shardlist"]] == [os.path.basename(KEYS.shard_tar(k))
                                                    for k in range(10) if k not in (5, 8)]
    assert verify_main([remote, *staging, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["missing"] == [5, 8] and report["corrupt"] == [] and report["shards_ok"] == 8


def test_processes_of_one_node_download_each_shard_once(local, remote, proxy, tmp_path, s3_env):
    """Two processes read every shard at the same time through one local cache directory."""
    script = (
        "import sys\n"
        "from dspark_cache.storage.backing import StorageOptions\n"
        "from dspark_cache.storage.cache import CacheDir\n"
        "cache = CacheDir(sys.argv[1], storage=StorageOptions({'endpoint': sys.argv[2]}, sys.argv[3]))\n"
        "for index in cache.load_all():\n"
        "    cache.hold(index)\n"
        "    assert len(open(cache.paths.shard_tar(index.shard_id), 'rb').read()) == index.tar_bytes\n"
        "    cache.let_go(index.shard_id)\n"
        "print(cache.backing.downloads)\n"
    )
    node = str(tmp_path / "node")
    procs = [start([sys.executable, "-c", script, remote, proxy.endpoint, node], env=dict(os.environ))
             for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    shards = len(_cache_bytes(local))
    assert sum(int(out.strip().splitlines()[-1]) for out, _ in outs) == shards
    assert len(_tar_gets(proxy)) == shards


def _tar_gets(proxy: FaultProxy, name: str = ".tar") -> list:
    return [s for s in proxy.log if s.method == "GET" and s.target.split("?")[0].endswith(name)]


@pytest.mark.slow
def test_follow_mode_reads_a_cache_while_it_is_published_to_s3(local, s3_bucket, s3_env, proxy, tmp_path):
    url = f"{s3_bucket}/growing"
    paths = CachePaths(local)
    manifest = json.loads(open(paths.manifest).read())
    manifest.update(complete=False, completed_at=None)
    store = upload_cache(local, url, shards=[], manifest=False)
    store.put(KEYS.manifest, json.dumps(manifest).encode())
    shard_ids = paths.indexed_shard_ids()

    def publish() -> None:
        for shard_id in shard_ids:
            time.sleep(0.3)
            publish_shard(store, local, shard_id)
        store.upload(KEYS.manifest, paths.manifest)  # complete

    writer = threading.Thread(target=publish)
    started = time.monotonic()
    writer.start()
    loader = dspark_cache.build_dataloader(
        url,
        batch_size=4,
        follow=True,
        poll_interval=0.2,
        follow_timeout=60,
        storage_options=_via(proxy),
        local_cache_dir=str(tmp_path / "n"),
    )
    ids = [int(i) for batch in loader for i, r in zip(batch["sample_ids"], batch["is_repeat"]) if not r]
    writer.join()
    elapsed = time.monotonic() - started
    assert sorted(ids) == sorted(dspark_cache.open_cache(local).sample_ids)
    lists = [s for s in proxy.log if "list-type" in s.target]
    assert len(lists) <= elapsed / 1.0 + 3  # polled at most once a second
    loader.close()


def test_access_denied_missing_bucket_and_missing_client_are_one_line(remote, tmp_path, capsys, monkeypatch):
    with S3Server(check_credentials=True) as strict:
        bucket = unique_bucket_name()
        strict.make_bucket(bucket)
        options = {
            "endpoint": strict.endpoint,
            "access_key_id": "AKIAWRONG0000000",
            "secret_access_key": "nope",
        }
        with pytest.raises(AccessDeniedError, match=r"access denied \(403\).*AWS_ACCESS_KEY_ID") as denied:
            CacheDir(f"s3://{bucket}/c", storage=StorageOptions(options, str(tmp_path / "n")))
        assert "nope" not in str(denied.value) and "\n" not in str(denied.value)
    with pytest.raises(NoSuchBucketError, match="the bucket no-such-bucket-here does not exist"):
        CacheDir("s3://no-such-bucket-here/c", storage=StorageOptions(local_cache_dir=str(tmp_path / "n")))
    with pytest.raises(NotACacheError, match=r"s3://.*/nothing/here is not a dspark cache"):
        CacheDir(
            remote.replace("runs/cache", "nothing/here"),
            storage=StorageOptions(local_cache_dir=str(tmp_path)),
        )
    assert verify_main(["s3://no-such-bucket-here/c", "--local-cache-dir", str(tmp_path / "n")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "does not exist" in err
    code = ("import sys; sys.modules['obstore'] = None\n"
            "from dspark_cache.cli import verify\n"
            "sys.exit(verify(sys.argv[1:]))\n")
    done = run([sys.executable, "-c", code, remote], env=dict(os.environ), timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        'dspark-verify: error: caches on object storage need the optional client: pip install '
        '"dspark-cache[s3]" (obstore), then rerun']


def test_a_cache_replaced_in_the_store_stops_the_reader(local, remote, tmp_path):
    cache = CacheDir(remote, storage=StorageOptions(local_cache_dir=str(tmp_path / "n")), poll=0.0)
    assert cache.load_all()
    other = {**json.loads(open(CachePaths(local).manifest).read()), "cache_id": "another-run"}
    ObjectStore(remote).put(KEYS.manifest, json.dumps(other).encode())
    with pytest.raises(CacheReplacedError, match="replaced"):
        cache.pin({0})


def test_convert_exports_a_remote_cache_to_nemo_as_it_exports_the_local_one(local, remote, tmp_path):
    from dspark_cache.cli import convert as convert_main
    from dspark_cache.nemo import nemo_format

    node = ["--local-cache-dir", str(tmp_path / "n"), "--cache-limit", "3M", "--quiet"]
    assert convert_main(["--to", "nemo", local, str(tmp_path / "a"), "--quiet"]) == 0
    assert convert_main(["--to", "nemo", remote, str(tmp_path / "b"), *node]) == 0
    for k in nemo_format.shard_indices(str(tmp_path / "a")):
        a, b = (open(nemo_format.shard_path(str(tmp_path / d), k), "rb").read() for d in "ab")
        assert a == b, k
    weights = [open(nemo_format.target_weights_path(str(tmp_path / d)), "rb").read() for d in "ab"]
    assert weights[0] == weights[1]
    assert convert_main(["--to", "dspark", remote, str(tmp_path / "c")]) == 2


def test_staging_options_on_a_local_output_dir_are_a_usage_error(embedded, tmp_path, capsys):
    from dspark_cache.cli import produce as produce_main

    out = str(tmp_path / "cache")
    args = ["--target-model", embedded.stock, "--input-data", embedded.data, "--output-dir", out]
    assert produce_main([*args, "--staging-dir", str(tmp_path / "s"), "--staging-limit", "1G"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and "--staging-dir, --staging-limit apply to an --output-dir on object storage" in err[0]
    )
    assert produce_main([*args.copy()[:-1], "s3://some-bucket/cache", "--staging-limit", "lots"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--staging-limit='lots' is not a size" in err[0], err
    assert not os.path.exists(out) and not os.path.exists("s3:")  # nothing made


def test_an_index_object_over_the_readers_limit_is_refused_not_held_whole(remote, tmp_path, monkeypatch):
    from dspark_cache.storage.remote import copies
    from dspark_cache.format.tar import reader

    limit = 512  # stands for MAX_INDEX_BYTES (256 MiB): the same rule at a size a test can afford
    monkeypatch.setitem(copies._MAX_SMALL, False, limit)
    monkeypatch.setattr(reader, "MAX_INDEX_BYTES", limit)
    ObjectStore(remote).put(KEYS.shard_index(2), b"[" + b" " * 100_000 + b"]")
    node = tmp_path / "n"
    cache = CacheDir(remote, storage=StorageOptions(local_cache_dir=str(node)))
    copied = next(node.rglob(os.path.basename(KEYS.shard_index(2))))
    assert copied.stat().st_size == limit + 1  # cut one byte past the limit
    with pytest.raises(CorruptShardError, match=os.path.basename(KEYS.shard_index(2))):
        cache.load_all()


def test_a_forked_worker_does_not_keep_the_parents_shards_held(remote, tmp_path):
    """DataLoader workers fork: the parent's use locks must not make its shards unevictable for the
    worker's life (flocks belong to the open file, which a fork shares)."""
    import fcntl

    from dspark_cache.storage.remote.node import hold_lock

    cache = CacheDir(remote, storage=StorageOptions(local_cache_dir=str(tmp_path / "n")))
    index = cache.require(0)
    cache.hold(index)
    use = cache.backing._lock_file("use", 0)
    reader, writer = os.pipe()
    started_r, started_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the worker: lives on while the parent lets go
        os.close(writer)
        try:  # the client's runtime does not survive fork: a request must fail at once, not hang
            cache.backing.store.head(KEYS.manifest)
            said = b"n"
        except ObjectStoreError as exc:
            said = b"s" if "forked process" in str(exc) and "spawn" in str(exc) else b"n"
        os.write(started_w, said)
        os.read(reader, 1)
        os._exit(0)
    os.close(reader)
    assert os.read(started_r, 1) == b"s"
    try:
        assert hold_lock(use, fcntl.LOCK_EX | fcntl.LOCK_NB) is None  # the parent holds it
        cache.let_go(0)
        fd = hold_lock(use, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert fd is not None  # evictable now, although the forked worker still runs
        os.close(fd)
    finally:
        os.write(writer, b"x")
        os.waitpid(pid, 0)
        cache.close()


def test_a_tar_object_larger_than_its_index_says_is_cut_not_streamed_whole(local, remote, proxy, tmp_path):
    """Replaced after the listing was read (which would have refused its size at once)."""
    node = tmp_path / "n"
    cache = CacheDir(remote, storage=StorageOptions({"endpoint": proxy.endpoint}, str(node)))
    index = cache.require(1)
    ObjectStore(remote).put(KEYS.shard_tar(1), b"\0" * (40 << 20))  # 40 MiB; the index says < 1 MB
    with pytest.raises(CorruptShardError, match=r"s3://.*shard-000001\.tar.*downloaded twice") as refused:
        cache.hold(index)
    got = int(re.search(r"\((\d+) bytes, the index says", str(refused.value)).group(1))
    assert index.tar_bytes < got <= index.tar_bytes + (8 << 20)  # cut one chunk past the index's size
    tar = os.path.basename(KEYS.shard_tar(1))
    assert not [p for p in node.rglob(tar) if p.parent.name == KEYS.shards_dir]  # never kept


def test_a_full_local_disk_is_named_at_once_not_retried_as_the_network(remote):
    store = ObjectStore(remote)
    started = time.monotonic()
    with pytest.raises(
        ObjectStoreError, match=r"the local file /dev/full could not be written \(No space left"
    ):
        store.download(KEYS.shard_tar(0), "/dev/full")  # every write there fails with ENOSPC
    assert time.monotonic() - started < 5  # no backoff: no retry mends a full disk


def test_resuming_aborts_only_the_caches_own_unfinished_uploads(s3_server, s3_bucket, s3_env):
    import boto3

    from dspark_cache.storage.ours import is_written_name
    from dspark_cache.storage.remote.multipart import abort_unfinished_uploads

    url = RemoteURL.parse(f"{s3_bucket}/caches/run1")
    client = boto3.client("s3", endpoint_url=s3_server.endpoint)
    keys = ["caches/run1/" + KEYS.shard_tar(3),  # ours: a producer killed mid-upload
            "caches/run1/sub/" + KEYS.shard_tar(0),  # a cache nested under ours
            "caches/run1-other/" + KEYS.shard_tar(0),  # a neighbour whose name starts like ours
            "other-app/backup.bin"]
    for key in keys:
        client.create_multipart_upload(Bucket=url.bucket, Key=key)
    paths = CachePaths("")
    assert abort_unfinished_uploads(url, None, lambda relative: is_written_name(paths, relative)) == 1
    left = sorted(u["Key"] for u in client.list_multipart_uploads(Bucket=url.bucket).get("Uploads", []))
    assert left == sorted(keys[1:])
