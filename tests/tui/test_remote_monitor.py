"""``dspark-monitor s3://bucket/prefix``: caches a real producer writes to a real S3 server (moto), seen
through the monitor's local copy of their small files (``tui/remote/monitorcopy.py``), polled at a bounded
cost; the stop request put on the store stops a running producer."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import timedelta

import msgspec
import pytest

from dspark_cache.cli import monitor as monitor_main, produce as produce_main, verify as verify_main
from dspark_cache.cli.conventions import EXIT_STOPPED
from dspark_cache.embedded.data import write_sample_data
from dspark_cache.format.paths import MANIFEST, SHARDS_DIR, CachePaths
from dspark_cache.format.schema import Event, RankStatus, decode_json, encode_json
from dspark_cache.storage.backing import StorageOptions
from dspark_cache.storage.remote.localdir import LocalCopyError
from dspark_cache.storage.remote.store import ObjectStore
from dspark_cache.tui.app import MonitorApp
from dspark_cache.tui.remote.scanner import RemoteScanner
from dspark_cache.tui.remote.monitorcopy import MonitorCopy
from dspark_cache.tui.scan import CacheScanner
from tests.support.faultproxy import FaultProxy
from tests.support.monitor import plain
from tests.support.produce import produce_args, run_produce
from tests.support.proc import kill_group, producer_cmd, start, wait_for
from tests.support.s3server import S3Server, unique_bucket_name

KEYS = CachePaths("/cache")  # a cache's names, relative to its root: its object keys
ARGS = ("--seq-length", "256", "--shard-size", "8", "--batch-size", "4")


@pytest.fixture(scope="module")
def complete(s3_server, embedded, tmp_path_factory):
    """A cache a real producer wrote to s3://.../runs/done (the bucket removed after the module)."""
    bucket = unique_bucket_name("monitor")
    url = s3_server.make_bucket(bucket) + "/runs/done"
    staging = tmp_path_factory.mktemp("staging") / "done"
    assert (
        run_produce(
            embedded.stock,
            embedded.data,
            url,
            *ARGS,
            "--storage-options",
            json.dumps(s3_server.options()),
            "--staging-dir",
            str(staging),
        )
        == 0
    )
    yield url
    s3_server.remove_bucket(bucket)


def _num_shards(store: ObjectStore) -> int:
    got = store.get(MANIFEST)
    assert got is not None
    return json.loads(got[0])["num_shards"]


def test_once_reports_a_complete_remote_cache(complete, s3_server, tmp_path, capsys):
    store = ObjectStore(complete, s3_server.options())
    shards = _num_shards(store)
    argv = [
        complete,
        "--once",
        "--local-cache-dir",
        str(tmp_path),
        "--storage-options",
        json.dumps(s3_server.options()),
    ]
    assert monitor_main(argv) == 0
    out = capsys.readouterr().out
    assert f"{complete} (object storage)" in out
    assert "progress: complete" in out and f"{shards} shards" in out
    assert f"shards: {shards} published  0 writing  0 pending  0 failed" in out
    assert "on object storage" in out and "stored " in out and "free " not in out
    assert "rank 0, phase finished" in out and "cache complete" in out
    copied = []
    for _, directories, names in os.walk(tmp_path):
        # the bookkeeping (.monitor): no copy
        directories[:] = [d for d in directories if not d.startswith(".")]
        copied += names
    assert not [name for name in copied if name.endswith(".tar")]  # never a tar
    assert sum(name.endswith(".idx") for name in copied) == shards


def test_a_refresh_makes_five_requests_when_nothing_changed(complete, s3_server, tmp_path):
    """The first look fetches each small object once (never a tar); after it, a refresh is a HEAD of
    the manifest and of the stop request and one LIST of shards/, status/ and events/; a monitor
    started again on the same local copy fetches nothing that did not change."""
    shards = _num_shards(ObjectStore(complete, s3_server.options()))
    with FaultProxy("127.0.0.1", s3_server.port) as proxy:
        storage = StorageOptions(s3_server.options(proxy.endpoint), str(tmp_path))
        copy = MonitorCopy(complete, storage)
        copy.refresh()
        gets = [s.target for s in proxy.log if s.method == "GET" and "list-type" not in s.target]
        assert not [t for t in gets if ".tar" in t]
        assert sum(".idx" in t for t in gets) == shards
        assert len(gets) == shards + 3  # and the manifest, the heartbeat and the event log's segment
        assert copy.requests["get"] == len(gets)
        for again in range(2):  # the same copy, then a new monitor's on the same copy
            if again:
                copy.close()
                copy = MonitorCopy(complete, storage)
            proxy.reset_counters()
            copy.refresh()
            seen = sorted((s.method, "list" if "list-type" in s.target else s.target.rsplit("/", 1)[-1])
                          for s in proxy.log)
            heads = [("HEAD", MANIFEST), ("HEAD", os.path.basename(KEYS.stop_request))]
            assert seen == [("GET", "list")] * 3 + heads, seen
        copy.close()


def test_scans_refresh_at_most_every_period_and_a_failed_refresh_is_a_warning(complete, s3_server, tmp_path):
    with FaultProxy("127.0.0.1", s3_server.port) as proxy:
        # a failure ends the request at once
        quick = {"max_retries": 0, "retry_timeout": timedelta(seconds=5)}
        copy = MonitorCopy(
            complete,
            StorageOptions({**s3_server.options(proxy.endpoint), "retry_config": quick}, str(tmp_path)),
        )
        ticks = [0.0]
        scanner = RemoteScanner(copy, 30.0, monotonic=lambda: ticks[0])
        first = scanner.scan()
        assert first.remote and first.path == complete and first.complete and first.disk_free is None
        made = proxy.requests
        ticks[0] = 29.0
        # within the period: none
        assert scanner.scan().published == first.published and proxy.requests == made
        proxy.fail_next(None, "503")
        ticks[0] = 30.0
        failed = scanner.scan()
        assert failed.published == first.published  # shown as last read
        assert any(w.startswith(f"could not refresh from {complete}") for w in failed.warnings), (
            failed.warnings
        )
        proxy.clear()
        ticks[0] = 60.0
        assert not scanner.scan().warnings
        scanner.close()


def _copy_small_objects(source: ObjectStore, target: ObjectStore) -> None:
    """The objects a monitor reads (not the tars) of one cache under another prefix."""
    for relative, _ in source.walk():
        if not relative.endswith(".tar"):
            got = source.get(relative)
            assert got is not None
            target.put(relative, got[0])


def _event(rank: int, n: int) -> bytes:
    return encode_json(Event(time=1000.0 + n, rank=rank, kind="note", message=f"event {n}")) + b"\n"


def test_removals_are_mirrored_and_event_segments_followed(complete, s3_server, tmp_path):
    url = complete.replace("runs/done", "runs/copy")
    store = ObjectStore(url, s3_server.options())
    _copy_small_objects(ObjectStore(complete, s3_server.options()), store)
    copy = MonitorCopy(url, StorageOptions(s3_server.options(), str(tmp_path)))
    copy.refresh()
    paths = CachePaths(copy.root)
    scanner = CacheScanner(copy.root)
    before = scanner.scan()
    assert before.complete and len(before.published) == _num_shards(store) and before.ranks
    # What is gone from the store is gone from the copy.
    store.delete(paths.relative(paths.shard_index(1)))
    store.delete(paths.relative(paths.status(0)))
    copy.refresh()
    after = scanner.scan()
    assert 1 not in after.published and len(after.published) == len(before.published) - 1 and not after.ranks
    assert not os.path.exists(paths.shard_index(1)) and not os.path.exists(paths.status(0))
    # A log in segments: the local file is their concatenation and only grows while the log does.
    segment = [paths.relative(paths.events_segment(7, k)) for k in range(2)]
    store.put(segment[0], _event(7, 0))
    copy.refresh()
    inode = os.stat(paths.events(7)).st_ino
    store.put(segment[0], _event(7, 0) + _event(7, 1))  # the open segment rewritten, grown
    store.put(segment[1], _event(7, 2))
    copy.refresh()
    assert open(paths.events(7), "rb").read() == _event(7, 0) + _event(7, 1) + _event(7, 2)
    assert os.stat(paths.events(7)).st_ino == inode  # appended in place: the monitor's tail reads on
    shown = [e.message for e in scanner.scan().events if e.rank == 7]
    assert shown == ["event 0", "event 1", "event 2"]
    gets = copy.requests["get"]
    copy.refresh()
    assert copy.requests["get"] == gets  # nothing changed: nothing fetched
    # The log started again (--overwrite): replaced whole.
    store.delete(segment[1])
    store.put(segment[0], _event(7, 9))
    copy.refresh()
    assert open(paths.events(7), "rb").read() == _event(7, 9)
    store.delete(segment[0])
    copy.refresh()
    assert not os.path.exists(paths.events(7))
    # A manifest that is not one is named by its URL.
    store.put(MANIFEST, b"garbage")
    damaged = RemoteScanner(copy, 0.0).scan()
    assert damaged.manifest is None and f"{url}/{MANIFEST}" in damaged.manifest_error, damaged.manifest_error
    assert copy.root not in damaged.manifest_error
    # A second monitor of the same cache on this node gets a directory of its own.
    other = MonitorCopy(url, StorageOptions(s3_server.options(), str(tmp_path)))
    assert other.root != copy.root
    other.refresh()
    assert len(CacheScanner(other.root).scan().published) == len(after.published)
    other.close()
    assert not os.path.exists(other.root)
    copy.close()


def test_a_doctored_or_open_monitor_copy_is_never_shown_as_the_stores(complete, s3_server, tmp_path, capsys):
    """The monitor's copy written over after a monitor left it (the manifest, an index, a heartbeat): the
    next monitor shows the store's; a copy others may write is refused, naming it."""
    store = ObjectStore(complete, s3_server.options())
    storage = StorageOptions(s3_server.options(), str(tmp_path / "node"))
    copy = MonitorCopy(complete, storage)
    copy.refresh()
    root, paths = copy.root, CachePaths(copy.root)
    copy.close()
    planted = [paths.manifest, paths.shard_index(0), paths.status(0)]
    for path in planted:
        with open(path, "r+b") as handle:  # written over in place: same size, same name
            data = handle.read()
            handle.seek(0)
            handle.write(data.replace(b"0", b"1"))
    copy = MonitorCopy(complete, storage)
    assert copy.root == root
    copy.refresh()
    for path in planted:
        assert open(path, "rb").read() == store.get(paths.relative(path))[0], path
    copy.close()
    os.chmod(root, 0o757)
    with pytest.raises(LocalCopyError, match=rf"monitor's copy {re.escape(root)} is writable by other"):
        MonitorCopy(complete, storage)
    argv = [complete, "--once", "--local-cache-dir", str(tmp_path / "node"), "--storage-options",
            json.dumps(s3_server.options())]
    capsys.readouterr()
    assert monitor_main(argv) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{root} is writable by other users" in err, err
    os.chmod(root, 0o755)


def test_an_oversized_segment_is_a_warning_not_a_log(complete, s3_server, tmp_path, monkeypatch):
    from dspark_cache.tui.remote import eventlog

    url = complete.replace("runs/done", "runs/huge-segment")
    store = ObjectStore(url, s3_server.options())
    paths = CachePaths("/cache")
    limit = len(_event(8, 0)) + 1  # one event fits, two do not
    monkeypatch.setattr(eventlog, "MAX_SEGMENT_BYTES", limit)
    store.put(paths.relative(paths.events_segment(8, 0)), _event(8, 0))
    store.put(paths.relative(paths.events_segment(9, 0)), _event(9, 0) + _event(9, 1))
    copy = MonitorCopy(url, StorageOptions(s3_server.options(), str(tmp_path)))
    copy.refresh()
    local = CachePaths(copy.root)
    assert open(local.events(8), "rb").read() == _event(8, 0)
    assert not os.path.exists(local.events(9))
    assert len(copy.warnings) == 1 and "rank 9's events are not shown" in copy.warnings[0], copy.warnings
    assert f"{url}/{paths.relative(paths.events_segment(9, 0))}" in copy.warnings[0]
    # Once the store holds a log that fits, it is shown.
    store.put(paths.relative(paths.events_segment(9, 0)), _event(9, 5))
    copy.refresh()
    assert open(local.events(9), "rb").read() == _event(9, 5) and not copy.warnings
    copy.close()


def test_a_log_stored_whole_is_copied_once_per_version(complete, s3_server, tmp_path, monkeypatch):
    from dspark_cache.tui.remote import monitorcopy

    url = complete.replace("runs/done", "runs/whole-log")
    store = ObjectStore(url, s3_server.options())
    paths = CachePaths("/cache")
    whole = paths.relative(paths.events(3))  # a local cache uploaded as it is: one object per log
    store.put(whole, _event(3, 0) + _event(3, 1))
    copy = MonitorCopy(url, StorageOptions(s3_server.options(), str(tmp_path)))
    copy.refresh()
    local = CachePaths(copy.root)
    assert open(local.events(3), "rb").read() == _event(3, 0) + _event(3, 1)
    gets = copy.requests["get"]
    copy.refresh()
    assert copy.requests["get"] == gets  # the same version: not fetched again
    # The run resumed onto the store: the log goes on in segments, then (uploaded again) whole.
    store.delete(whole)
    store.put(paths.relative(paths.events_segment(3, 0)), _event(3, 7))
    copy.refresh()
    assert open(local.events(3), "rb").read() == _event(3, 7)
    store.delete(paths.relative(paths.events_segment(3, 0)))
    store.put(whole, _event(3, 0) + _event(3, 1))
    copy.refresh()
    assert open(local.events(3), "rb").read() == _event(3, 0) + _event(3, 1)
    # One past the limit is a warning, and no log.
    monkeypatch.setattr(monitorcopy, "MAX_LOG_BYTES", 8)
    store.put(whole, _event(3, 2))
    copy.refresh()
    assert not os.path.exists(local.events(3)) and "rank 3's events are not shown" in copy.warnings[0]
    copy.close()


def test_errors_are_one_line_and_exit_2_or_1_for_a_store_that_refuses(complete, s3_server, tmp_path, capsys):
    """What is not there is a path that is not a cache (2); a store that refuses the credentials failed (1, as
    dspark-produce says it, issue 41 item 14), for dspark-verify too."""
    node = ["--local-cache-dir", str(tmp_path)]
    missing = f"s3://{unique_bucket_name('absent')}/c"
    assert monitor_main([missing, "--once", *node, "--storage-options", json.dumps(s3_server.options())]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dspark-monitor: error:") and "does not exist" in err[0], err
    nothing = complete.replace("runs/done", "nothing/here")
    assert monitor_main([nothing, "--once", *node, "--storage-options", json.dumps(s3_server.options())]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"no dspark cache is stored at {nothing}" in err[0], err
    with S3Server(check_credentials=True) as strict:
        bucket = unique_bucket_name()
        strict.make_bucket(bucket)
        wrong = {**strict.options(), "access_key_id": "AKIAWRONG0000000", "secret_access_key": "nope"}
        assert (
            monitor_main([f"s3://{bucket}/c", "--once", *node, "--storage-options", json.dumps(wrong)]) == 1
        )
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "access denied (403)" in err[0] and "nope" not in err[0], err
        assert verify_main([f"s3://{bucket}/c", "--local-cache-dir", str(tmp_path / "v"),
                            "--storage-options", json.dumps(wrong)]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "access denied (403)" in err[0] and "nope" not in err[0], err
    assert produce_main(["--tui", "--target-model", "m", "--input-data", "d", "--output-dir", missing]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"dspark-monitor {missing} beside it" in err[0], err
    assert monitor_main([str(tmp_path), "--once", "--storage-options", "{}"]) == 2
    assert "apply to a cache on object storage" in capsys.readouterr().err
    code = ("import sys; sys.modules['obstore'] = None\n"
            "from dspark_cache.cli import monitor\n"
            "sys.exit(monitor(sys.argv[1:]))\n")
    done = subprocess.run(
        [sys.executable, "-c", code, complete, "--once", *node], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        'dspark-monitor: error: caches on object storage need the optional client: pip install '
        '"dspark-cache[s3]" (obstore), then rerun']


def _running(store: ObjectStore, paths: CachePaths) -> bool:
    """Whether the producer's heartbeat on the store says it runs, and two shards are published."""
    got = store.get(paths.relative(paths.status(0)))
    if got is None:
        return False
    try:
        status = decode_json(got[0], RankStatus)
    except msgspec.DecodeError:
        return False
    indexes = [n for n in store.list(SHARDS_DIR) if n.endswith(".idx")]
    return status.phase == "running" and len(indexes) >= 2


@pytest.mark.slow
@pytest.mark.anyio
async def test_the_s_key_stops_a_producer_writing_to_s3(
    embedded, s3_server, s3_bucket, tmp_path, monkeypatch
):
    url = f"{s3_bucket}/live"
    monkeypatch.setenv("DSPARK_SYNC_INTERVAL", "0.3")  # the producer's and the monitor's
    storage = s3_server.options()
    # One sample a shard, 240 of them, and staging that holds one shard: the producer computes at most a shard
    # ahead of its uploads, and when the test sees two on the store most of the job is still to do (48 shards
    # were all uploaded, on a loaded machine, in the time the test took to see two and freeze the producer:
    # the stop then found nothing left).
    data = write_sample_data(str(tmp_path / "rows.jsonl"), num_rows=240, seed=3)
    args = produce_args(embedded.stock, data, url, "--seq-length", "256", "--shard-size", "1",
                        "--batch-size", "1", "--storage-options", json.dumps(storage),
                        "--staging-dir", str(tmp_path / "staging"), "--staging-limit", "1K")
    producer = start(producer_cmd(*args))
    store = ObjectStore(url, storage)
    try:
        wait_for(lambda: producer.poll() is not None or _running(store, KEYS), timeout=120, poll=0.2)
        assert producer.poll() is None, producer.communicate()
        # Frozen mid-run, so that it cannot finish before the key is pressed however slow the monitor is.
        os.killpg(producer.pid, signal.SIGSTOP)
        frozen = time.time()  # the monitor's clock stops with the producer: its heartbeat stays fresh
        copy = MonitorCopy(url, StorageOptions(storage, str(tmp_path / "node")))
        scanner = RemoteScanner(copy, 0.3, clock=lambda: frozen)
        app = MonitorApp(url, refresh=0.3, scanner=scanner)
        async with app.run_test(size=(140, 60)) as pilot:
            snap = await app.first_snapshot()
            assert snap.remote and snap.manifest is not None and not snap.complete
            assert [r.phase for r in snap.live_ranks] == ["running"] and len(snap.published) >= 2
            assert f"{url} (object storage)" in plain(app.query_one("#header"))
            assert "on object storage" in plain(app.query_one("#disk"))
            assert app.check_action("request_stop", ())
            await pilot.press("s")
            await pilot.pause()
            snap = await app.refreshed()
            assert snap.stop_requested and "stop requested" in plain(app.query_one("#notice"))
        scanner.close()
        assert store.head(KEYS.relative(KEYS.stop_request)) is not None
        os.killpg(producer.pid, signal.SIGCONT)
        _, err = producer.communicate(timeout=120)
    finally:
        if producer.poll() is None:
            kill_group(producer)
    assert producer.returncode == EXIT_STOPPED, err
    assert "stop requested by the monitor" in err
