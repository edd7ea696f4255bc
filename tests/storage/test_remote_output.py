"""dspark-produce to object storage (``--output-dir s3://bucket/prefix``): a real moto S3 server on
127.0.0.1 (``tests.support.s3server``), our fault proxy in front of it where a test needs faults or a
producer held, the embedded target, real producer processes, real SIGKILLs, ranks with torchrun's environment.

The producers get the store through ``--storage-options`` (endpoint and credentials), never the
``AWS_*`` variables: those would make every start a cold interpreter (``tests.support.warm``)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

import dspark_cache
from dspark_cache.cli import produce as produce_main, verify as verify_main
from dspark_cache.format.paths import LEASE, CachePaths
from dspark_cache.storage.remote.store import ObjectInfo, ObjectStore
from dspark_cache.storage.remote.url import RemoteURL
from tests.support.faultproxy import matching
from tests.support.produce import produce_args, write_jsonl
from tests.support.proc import (
    assert_same_samples,
    events,
    kill_group,
    producer_cmd,
    run,
    run_ranks,
    start,
    wait_for,
)
from tests.support.remote import KEYS, upload_cache
from tests.support.s3server import S3Server, client_options, unique_bucket_name

# 46 samples in 19 shards (as test_resume)
ARGS = ("--seq-length", "256", "--shard-size", "3", "--batch-size", "2")
ENV = {"DSPARK_SYNC_INTERVAL": "0.2"}  # the small files go up five times a second
TAR_PUTS = matching(method="PUT", suffix=".tar")


@dataclass
class Remote:
    """One cache URL on the test server, and how to reach it directly."""

    url: str
    options: dict

    @property
    def store(self) -> ObjectStore:
        return ObjectStore(self.url, self.options)

    def listing(self) -> dict[str, ObjectInfo]:
        return dict(self.store.walk())

    def args(self, embedded, staging, *extra: str, options: dict | None = None) -> list[str]:
        """``dspark-produce``'s arguments for this URL (``options``: another route to the store, the proxy)."""
        return produce_args(embedded.stock, embedded.data, self.url, *ARGS, "--storage-options",
                            json.dumps(options or self.options), "--staging-dir", str(staging), *extra)

    def cmd(self, embedded, staging, *extra: str, options: dict | None = None) -> list[str]:
        return producer_cmd(*self.args(embedded, staging, *extra, options=options))

    def shard_ids(self, kind: str) -> set[int]:
        return _shard_ids(self.listing(), kind)

    def manifest(self) -> dict:
        got = self.store.get(KEYS.manifest)
        assert got is not None, f"no manifest on {self.url}"
        return json.loads(got[0])

    def verify(self, node, capsys) -> tuple[int, dict]:
        """``dspark-verify URL --json`` (in this process): its exit code and report."""
        capsys.readouterr()
        code = verify_main([self.url, "--json", "--storage-options", json.dumps(self.options),
                            "--local-cache-dir", str(node)])
        out = capsys.readouterr().out
        return code, json.loads(out.strip().splitlines()[-1])

    def open(self, node):
        return dspark_cache.open_cache(self.url, storage_options=self.options, local_cache_dir=str(node))


def _shard_ids(listing: dict[str, ObjectInfo], kind: str) -> set[int]:
    out = set()
    for relative in listing:
        directory, _, name = relative.rpartition("/")
        found = KEYS.shard_file(name) if directory == KEYS.shards_dir else None
        if found is not None and found[1] == kind:
            out.add(found[0])
    return out


@pytest.fixture
def remote(s3_server, s3_bucket) -> Remote:
    return Remote(f"{s3_bucket}/runs/cache", client_options(s3_server.endpoint))


def _assert_samples_equal(remote: Remote, node, reference: str, exact: bool = True) -> None:
    """Every sample read from the store equals the local cache's, none missing or extra, in a complete cache
    of its own (bf16 states of a 2-rank run within 2e-2)."""
    with remote.open(node) as ours, dspark_cache.open_cache(reference) as theirs:
        assert ours.manifest.num_samples == theirs.manifest.num_samples and ours.manifest.complete
        assert ours.manifest.cache_id != theirs.manifest.cache_id
        assert assert_same_samples(ours, theirs, exact, (2e-2, 2e-2)) == theirs.manifest.num_samples


def _assert_verified(remote: Remote, node, capsys) -> dict:
    code, report = remote.verify(node, capsys)
    assert code == 0 and report["ok"], report
    assert not report["missing"] and not report["corrupt"] and not report["leftovers"], report
    return report


def _after_last_resume(staging) -> list[dict]:
    """The events the last (resuming) run wrote, from its own ``resumed`` event on."""
    log = events(str(staging))
    starts = [i for i, e in enumerate(log) if e["kind"] == "resumed"]
    assert starts, [e["kind"] for e in log]
    return log[starts[-1]:]


def _lease_expiry(remote: Remote) -> tuple[dict, float]:
    """The lease left on the store and when it expires (the rule of ``storage/remote/lease.py``)."""
    got = remote.store.get(LEASE)
    assert got is not None, f"no lease on {remote.url}"
    record = json.loads(got[0])
    return record, max(record["renewed_at"], got[1].modified) + record["ttl"]


def _wait_for_the_lease_to_expire(remote: Remote) -> dict:
    record, expires = _lease_expiry(remote)
    time.sleep(max(0.0, expires - time.time()) + 0.3)
    return record


def _published_ids(log: list[dict]) -> list[int]:
    return [e["data"]["shard"] for e in log if e["kind"] == "shard_published"]


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("dspark-produce: error")]


# -- 1. the same cache as a local run -----------------------------------------------------------

def test_produce_to_s3_equals_produce_to_a_directory(embedded, reference, remote, tmp_path, capsys):
    staging = tmp_path / "staging"
    done = run(remote.cmd(embedded, staging), env=ENV)
    assert done.returncode == 0, done.stderr
    local = CachePaths(reference)
    shards = set(local.indexed_shard_ids())
    listing = remote.listing()
    assert _shard_ids(listing, "tar") == _shard_ids(listing, "idx") == shards
    # The last line counts what the store holds (the output the run wrote, not a directory named s3:/...).
    with dspark_cache.open_cache(reference) as theirs:
        assert f"cache complete: {theirs.manifest.num_samples} samples" in done.stdout, done.stdout
    assert f" {len(shards)} shards, " in done.stdout, done.stdout
    for k in shards:  # every tar whole: the size the local run wrote
        assert listing[KEYS.shard_tar(k)].size == os.path.getsize(local.shard_tar(k)), k
    for name in (KEYS.manifest, KEYS.target_weights, KEYS.wids_index, KEYS.plan_header,
                 KEYS.status(0), KEYS.events_segment(0, 0)):
        assert name in listing, (name, sorted(listing))
    for name in os.listdir(local.plan_dir):  # the saved plan, every file of it
        assert local.relative(os.path.join(local.plan_dir, name)) in listing, name
    assert LEASE not in listing  # given back at the end
    store = remote.store
    with open(local.wids_index, "rb") as handle:
        assert store.get(KEYS.wids_index)[0] == handle.read()
    with open(local.target_weights, "rb") as handle:
        assert store.get(KEYS.target_weights)[0] == handle.read()
    status = json.loads(store.get(KEYS.status(0))[0])
    assert status["state"] == "finished"
    segment = store.get(KEYS.events_segment(0, 0))[0].decode()
    published = [json.loads(line) for line in segment.splitlines() if '"shard_published"' in line]
    assert sorted(e["data"]["shard"] for e in published) == sorted(shards)
    # Staging keeps the indexes (the published set), no tar: each was deleted once committed.
    staged = CachePaths(str(staging))
    assert not [n for n in os.listdir(staged.shards_dir) if n.endswith(".tar")], staged
    assert staged.indexed_shard_ids() == sorted(shards)
    _assert_samples_equal(remote, tmp_path / "node", reference)
    _assert_verified(remote, tmp_path / "node2", capsys)
    # The staged manifest and an index written over in place (same size, same name): a rerun brings the
    # store's down, never resumes from the planted bytes.
    paths = CachePaths(str(staging))
    planted = [paths.manifest, paths.shard_index(1)]
    for path in planted:
        with open(path, "r+b") as handle:
            data = handle.read()
            handle.seek(0)
            handle.write(data.replace(b"0", b"1", 1))
    again = run(remote.cmd(embedded, staging), env=ENV)
    assert again.returncode == 0, again.stderr
    for path in planted:
        assert open(path, "rb").read() == store.get(paths.relative(path))[0], path


# -- 2. SIGKILL between a tar and its index, resumed elsewhere ----------------------------------

@pytest.mark.slow
def test_killed_between_a_tar_and_its_index_then_resumed_from_an_empty_staging_dir(
        embedded, reference, remote, tmp_path, capsys):
    env = {**ENV, "DSPARK_LEASE_TTL": "2"}  # a killed producer's lease lives on until it expires
    killed = run(remote.cmd(embedded, tmp_path / "a"), env={**env, "DSPARK_CRASH_AT": "after_tar_upload:3"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    _wait_for_the_lease_to_expire(remote)
    tars, committed = remote.shard_ids("tar"), remote.shard_ids("idx")
    orphans = tars - committed
    assert orphans and committed <= tars  # a tar uploaded, never committed by its index
    total = len(CachePaths(reference).indexed_shard_ids())
    assert len(committed) < total
    # Another machine, as it were: an empty staging directory; INFO to see what it cleans up.
    resumed = run(remote.cmd(embedded, tmp_path / "b", "--log-level", "INFO"), env=env)
    assert resumed.returncode == 0, resumed.stderr
    for k in orphans:
        assert f"removing {remote.store.name(KEYS.shard_tar(k))}: its upload was never committed" \
            in resumed.stderr, resumed.stderr[-3000:]
    log = _after_last_resume(tmp_path / "b")
    assert log[0]["data"]["published"] == len(committed)
    computed = _published_ids(log)
    assert len(computed) == len(set(computed))  # none twice in this run
    assert set(computed) == set(range(total)) - committed  # and none the killed run had committed
    listing = remote.listing()
    assert _shard_ids(listing, "tar") == _shard_ids(listing, "idx") == set(range(total))
    assert LEASE not in listing
    _assert_verified(remote, tmp_path / "node", capsys)
    _assert_samples_equal(remote, tmp_path / "node2", reference)


# -- 3. one producer per cache ------------------------------------------------------------------

@pytest.mark.slow
def test_a_second_producer_on_the_same_url_is_refused_at_once_naming_the_holder(
        embedded, remote, proxy, tmp_path, capsys):
    # The first producer is held: one tar upload stalls, and a staging limit of one shard holds the writer.
    proxy.fail_next(1, "stall", match=TAR_PUTS, stall_s=5)
    first = start(
        remote.cmd(embedded, tmp_path / "a", "--staging-limit", "1", options=client_options(proxy.endpoint)),
        env=ENV,
    )
    try:
        wait_for(lambda: proxy.faults["stall"] == 1 or first.poll() is not None, timeout=120)
        assert first.poll() is None, first.communicate()
        lease = json.loads(remote.store.get(LEASE)[0])
        assert lease["pid"] == first.pid
        capsys.readouterr()
        began = time.monotonic()
        code = produce_main(remote.args(embedded, tmp_path / "b", "--lease-wait", "0"))
        took = time.monotonic() - began
        err = capsys.readouterr().err
        assert code == 1, err
        lines = _error_lines(err)
        assert len(lines) == 1 and len(err.strip().splitlines()) == 1, err
        assert "in use by another dspark-produce run" in lines[0]
        for holder in (f"pid {first.pid}", f"host {socket.gethostname()}", f"run {lease['run_id']}"):
            assert holder in lines[0], (holder, lines[0])
        assert took < 4, took  # at once: before the input is read or the target loaded
        assert first.poll() is None  # the first goes on, its lease untouched
        assert json.loads(remote.store.get(LEASE)[0])["run_id"] == lease["run_id"]
        out, err1 = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            kill_group(first)
    assert first.returncode == 0, err1
    assert not os.path.exists(CachePaths(str(tmp_path / "b")).shards_dir)  # the second wrote no shard
    _assert_verified(remote, tmp_path / "node", capsys)


# -- 4. a killed producer's lease: taken at once on its host, waited for elsewhere ---------------

@pytest.mark.slow
def test_a_killed_producers_lease_is_taken_at_once_on_its_host(embedded, reference, remote, tmp_path, capsys):
    """A job requeued on the node it was preempted on: the holder's pid is dead here, so the rerun takes
    the lease at once instead of waiting the default 60 s ttl (or refusing, as it once did)."""
    staging = tmp_path / "staging"
    killed = run(remote.cmd(embedded, staging), env={**ENV, "DSPARK_CRASH_AT": "mid_shard:4"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    record, expires = _lease_expiry(remote)  # the killed producer's lease is still there, live for a minute
    assert record["ttl"] == 60.0
    again = run(remote.cmd(embedded, staging), env=ENV)
    assert again.returncode == 0, again.stderr
    assert record["node"]  # where its pid lives (this machine, this pid namespace)
    assert time.time() < expires, "the rerun ended after the killed producer's lease expired: nothing shown"
    took = [line for line in again.stderr.splitlines() if "took over the lease" in line]
    assert len(took) == 1 and f"pid {record['pid']} is dead" in took[0], again.stderr
    assert "waiting up to" not in again.stderr
    assert LEASE not in remote.listing()
    _assert_verified(remote, tmp_path / "node", capsys)
    _assert_samples_equal(remote, tmp_path / "node2", reference)


def test_a_lease_held_on_another_host_is_waited_for_then_refused_naming_it(embedded, remote, tmp_path, capsys,
                                                                          caplog):
    """A live holder elsewhere (a lease renewed just now by a host that is not this one): the producer says
    how long it waits, waits --lease-wait, then exits 1 naming the lease object, not "press s" alone."""
    now = time.time()
    holder = {"host": "elsewhere", "pid": 4242, "run_id": "their-run", "world_size": 1,
              "started_at": now - 100, "renewed_at": now, "ttl": 600.0, "node": "another-boot/pid:[1]"}
    remote.store.put(LEASE, json.dumps(holder).encode())
    capsys.readouterr()
    began = time.monotonic()
    code = produce_main(remote.args(embedded, tmp_path / "staging", "--lease-wait", "2"))
    waited = time.monotonic() - began
    err = capsys.readouterr().err
    assert code == 1, err
    assert waited >= 2, waited
    waiting = [line for line in (err + caplog.text).splitlines() if "waiting up to 2 s" in line]  # in-process
    assert len(waiting) == 1, err
    assert remote.store.name(LEASE) in waiting[0] and "host elsewhere" in waiting[0], waiting
    lines = _error_lines(err)
    assert len(lines) == 1, err
    for said in (remote.store.name(LEASE), "pid 4242 on host elsewhere", "run their-run", "--lease-wait",
                 "expires by itself in"):
        assert said in lines[0], (said, lines[0])
    assert "press s" not in lines[0]
    assert json.loads(remote.store.get(LEASE)[0])["run_id"] == "their-run"  # untouched


def test_lease_wait_is_checked_as_a_setting(embedded, remote, tmp_path, capsys):
    assert produce_main(remote.args(embedded, tmp_path / "s", "--lease-wait", "-1")) == 2
    assert "--lease-wait -1.0: give seconds, 0 or more" in capsys.readouterr().err
    local = produce_args(embedded.stock, embedded.data, str(tmp_path / "local"), "--lease-wait", "5")
    assert produce_main(local) == 2
    assert "--lease-wait apply to an --output-dir on object storage" in capsys.readouterr().err


# -- 4b. a late commit of a producer that lost its lease ----------------------------------------

@pytest.mark.slow
def test_a_late_index_of_a_producer_that_lost_its_lease_never_enters_the_next_runs_cache(
        embedded, reference, remote, proxy, tmp_path, capsys):
    """Producer A's first index PUT is held by the proxy and its lease renewals fail, so its lease lapses;
    B takes the cache over with --overwrite and completes it; then A's index PUT lands. It must fail
    (a conditional create), leaving B's cache whole, and A must stop with a message that says why."""
    env = {**ENV, "DSPARK_LEASE_TTL": "2"}
    proxy.fail_next(1, "hold", match=matching(method="PUT", suffix=".idx"))
    first = start(
        remote.cmd(embedded, tmp_path / "a", "--staging-limit", "1", options=client_options(proxy.endpoint)),
        env=env,
    )
    try:
        wait_for(lambda: proxy.faults["hold"] == 1 or first.poll() is not None, timeout=120)
        assert first.poll() is None, first.communicate()
        proxy.fail_next(None, "reset", match=matching(method="PUT", suffix="/" + LEASE))  # A renews no more
        _wait_for_the_lease_to_expire(remote)
        second = run(remote.cmd(embedded, tmp_path / "b", "--overwrite"), env=env)
        assert second.returncode == 0, second.stderr
        assert "took over the lease" in second.stderr, second.stderr
        indexes = {k: remote.store.get(KEYS.shard_index(k))[0] for k in remote.shard_ids("idx")}
        proxy.release()  # A's index PUT goes on to the store now
        _, err = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            kill_group(first)
    assert [s.fault for s in proxy.log if s.method == "PUT" and s.target.endswith(".idx")][0] == "hold"
    assert first.returncode == 1, err
    lines = _error_lines(err)
    assert len(lines) == 1 and "this producer lost its lease" in lines[0], err
    assert "Traceback" not in err
    # B's cache as B left it: every index B's, readable and verified.
    assert {k: remote.store.get(KEYS.shard_index(k))[0] for k in remote.shard_ids("idx")} == indexes
    _assert_verified(remote, tmp_path / "node", capsys)
    _assert_samples_equal(remote, tmp_path / "node2", reference)


@pytest.mark.slow
def test_an_index_the_run_did_not_write_keeps_the_cache_incomplete_until_a_rerun(
        embedded, reference, remote, proxy, tmp_path, capsys):
    """A late create no condition can stop: an index of a shard id this run never writes appears while it
    runs (a lapsed producer's, of a larger plan). The completing producer checks the store's indexes
    against what it wrote or read and does not mark the cache complete; a rerun resumes and completes it."""
    proxy.fail_next(1, "hold", match=matching(method="PUT", suffix=".idx"))  # the run is past its pull
    running = start(remote.cmd(embedded, tmp_path / "a", options=client_options(proxy.endpoint)), env=ENV)
    try:
        wait_for(lambda: proxy.faults["hold"] == 1 or running.poll() is not None, timeout=120)
        assert running.poll() is None, running.communicate()
        stray = {"format_version": 1, "shard_id": 99, "cache_id": "a-lapsed-run"}
        remote.store.put(KEYS.shard_index(99), json.dumps(stray).encode())
        proxy.release()
        _, err = running.communicate(timeout=180)
    finally:
        if running.poll() is None:
            kill_group(running)
    assert running.returncode == 1, err
    lines = _error_lines(err)
    assert len(lines) == 1 and "shard-000099.idx is on the store, not published by this run" in lines[0], err
    assert not remote.manifest()["complete"]
    again = run(remote.cmd(embedded, tmp_path / "a"), env=ENV)
    assert again.returncode == 0, again.stderr
    assert remote.manifest()["complete"] and KEYS.shard_index(99) not in remote.listing()
    _assert_verified(remote, tmp_path / "node", capsys)
    _assert_samples_equal(remote, tmp_path / "node2", reference)


# -- 4c. keys the client cannot represent beside the cache ---------------------------------------

ODD_KEYS = ("a//b", "./x", "../y", "odd\x01name", "shards/x//y")  # under the cache's prefix, another tool's


@pytest.mark.slow
def test_keys_the_client_cannot_represent_beside_a_cache_are_skipped_and_named(
        embedded, reference, remote, s3_server, tmp_path, capsys):
    """Keys under the cache's prefix that obstore cannot parse (it fails a whole LIST on one) are skipped
    and named: the cache verifies and loads, a rerun from an empty staging directory resumes it, and
    --overwrite remakes it, each without "check the network"; the odd keys are left alone."""
    assert run(remote.cmd(embedded, tmp_path / "a"), env=ENV).returncode == 0
    url = RemoteURL.parse(remote.url)
    client = s3_server.boto3_client()
    for key in ODD_KEYS:
        client.put_object(Bucket=url.bucket, Key=f"{url.prefix}/{key}", Body=b"another tool's")
    code, report = remote.verify(tmp_path / "node", capsys)
    assert code == 0 and report["ok"] and not report["missing"], report
    _assert_samples_equal(remote, tmp_path / "node2", reference)
    for extra in ((), ("--overwrite",)):  # a resume brings the store down (walks it); --overwrite clears it
        again = run(remote.cmd(embedded, tmp_path / "b", *extra), env=ENV)
        assert again.returncode == 0, again.stderr
        assert "check the network" not in again.stderr and "Traceback" not in again.stderr, again.stderr
        named = [line for line in again.stderr.splitlines()
                 if "a key this object-store client cannot represent" in line]
        assert named and all(f"{url.store_url}/{url.prefix}/" in line for line in named), again.stderr
    _assert_verified(remote, tmp_path / "node3", capsys)
    for key in ODD_KEYS:  # not ours: never deleted
        kept = client.get_object(Bucket=url.bucket, Key=f"{url.prefix}/{key}")["Body"].read()
        assert kept == b"another tool's", key


# -- 5. --overwrite ----------------------------------------------------------------------------

@pytest.mark.slow
def test_overwrite_clears_the_stores_files_and_remakes_the_cache(
    embedded, reference, remote, tmp_path, capsys
):
    upload_cache(reference, remote.url, storage_options=remote.options)  # a complete cache is there
    store = remote.store
    old = remote.manifest()["cache_id"]
    store.put(KEYS.shard_tar(99), b"left by someone")  # ours by its name, outside any plan
    store.put(KEYS.status(7), b"{}")  # a heartbeat of a larger job
    store.put("notes/README.txt", b"not ours")
    done = run(remote.cmd(embedded, tmp_path / "staging", "--overwrite"), env=ENV)
    assert done.returncode == 0, done.stderr
    listing = remote.listing()
    assert KEYS.shard_tar(99) not in listing and KEYS.status(7) not in listing
    assert store.get("notes/README.txt")[0] == b"not ours"  # what is not ours is kept
    manifest = remote.manifest()
    assert manifest["complete"] and manifest["cache_id"] != old
    shards = set(CachePaths(reference).indexed_shard_ids())
    assert _shard_ids(listing, "tar") == _shard_ids(listing, "idx") == shards
    for k in shards:  # remade: every index names the new cache
        assert json.loads(store.get(KEYS.shard_index(k))[0])["cache_id"] == manifest["cache_id"], k
    _assert_verified(remote, tmp_path / "node", capsys)
    _assert_samples_equal(remote, tmp_path / "node2", reference)


@pytest.mark.slow
def test_a_reused_staging_dir_follows_the_store_after_another_machines_overwrite(
    embedded, remote, tmp_path, capsys
):
    """Machine A produced the cache; machine B remade it with --overwrite (same settings: every file the
    same size, a new cache_id). A's staging directory, reused, must take B's cache, not resume its own."""
    a, b = tmp_path / "machine-a", tmp_path / "machine-b"
    assert run(remote.cmd(embedded, a), env=ENV).returncode == 0
    first = remote.manifest()["cache_id"]
    assert run(remote.cmd(embedded, b, "--overwrite"), env=ENV).returncode == 0
    second = remote.manifest()["cache_id"]
    assert second != first
    indexes = {k: remote.store.get(KEYS.shard_index(k))[0] for k in remote.shard_ids("idx")}
    tars = {r: i.etag for r, i in remote.listing().items() if r.endswith(".tar")}
    again = run(remote.cmd(embedded, a), env=ENV)
    assert again.returncode == 0, again.stderr
    # nothing recomputed
    assert {r: i.etag for r, i in remote.listing().items() if r.endswith(".tar")} == tars
    assert remote.manifest()["cache_id"] == second
    assert {k: remote.store.get(KEYS.shard_index(k))[0] for k in remote.shard_ids("idx")} == indexes
    assert json.loads(open(CachePaths(a).manifest, "rb").read())["cache_id"] == second
    _assert_verified(remote, tmp_path / "node", capsys)


# -- 6. two ranks on one node ------------------------------------------------------------------

@pytest.mark.slow
def test_two_ranks_produce_to_s3(embedded, reference, remote, tmp_path, capsys):
    """Two ranks with torchrun's environment on one node (one staging directory); the 2-node test runs torchrun."""
    staging = tmp_path / "staging"
    run_ranks(producer_cmd(*remote.args(embedded, staging, "--num-workers", "0")), 2, env=ENV)
    listing = remote.listing()
    for rank in (0, 1):
        assert KEYS.events_segment(rank, 0) in listing, sorted(listing)
        status = json.loads(remote.store.get(KEYS.status(rank))[0])
        assert status["state"] == "finished" and status["shards_owned"] > 0, status  # both ranks worked
    assert LEASE not in listing
    assert not [n for n in os.listdir(CachePaths(str(staging)).shards_dir) if n.endswith(".tar")]
    _assert_verified(remote, tmp_path / "node", capsys)
    _assert_samples_equal(remote, tmp_path / "node2", reference, exact=False)


# -- 7. follow mode over a cache being uploaded ------------------------------------------------

@pytest.mark.slow
def test_a_follow_loader_reads_every_sample_once_while_the_producer_uploads(
        embedded, reference, remote, proxy, tmp_path):
    # Shard 4's upload stalls 3 s and the staging limit holds the writer meanwhile: the loader is
    # certain to read shards before the cache is complete. One writer, so that shards 0-3 (the loader's
    # first window) are up before shard 4 (with several, shard 4 may be sealed first and hold them back).
    proxy.fail_next(1, "stall", match=matching(method="PUT", suffix="/" + KEYS.shard_tar(4)), stall_s=3)
    producer = start(
        remote.cmd(
            embedded,
            tmp_path / "staging",
            "--staging-limit",
            "1",
            "--writer-threads",
            "1",
            options=client_options(proxy.endpoint),
        ),
        env=ENV,
    )
    seen: list[tuple[float, list[int], list[bool]]] = []
    try:
        store = remote.store
        wait_for(lambda: store.head(KEYS.manifest) is not None or producer.poll() is not None, timeout=120)
        assert producer.poll() is None, producer.communicate()
        assert not remote.manifest()["complete"]
        loader = dspark_cache.build_dataloader(remote.url, 3, follow=True, seed=2, poll_interval=0.1,
                                               follow_timeout=120, storage_options=remote.options,
                                               local_cache_dir=str(tmp_path / "node"))
        for batch in loader:
            seen.append((time.time(), batch["sample_ids"].tolist(), batch["is_repeat"].tolist()))
        loader.close()
        _, err = producer.communicate(timeout=120)
    finally:
        if producer.poll() is None:
            kill_group(producer)
    assert producer.returncode == 0, err
    assert proxy.faults["stall"] == 1
    manifest = remote.manifest()
    assert manifest["complete"] and seen and seen[0][0] < manifest["completed_at"]  # read while produced
    got = [s for _, ids, repeats in seen for s, r in zip(ids, repeats) if not r]
    assert sorted(got) == sorted(dspark_cache.open_cache(reference).sample_ids)  # each exactly once


# -- 8. the staging directory ------------------------------------------------------------------

def test_a_run_failing_on_bad_input_leaves_no_staging_directory_behind(
        embedded, remote, tmp_path, capsys, monkeypatch):
    """A real run (not --dry-run) that took the store and began staging, then met a malformed row: the
    staging directory it made goes, lock and mark included, for a given --staging-dir and the default one."""
    good = {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"}]}
    data = write_jsonl(tmp_path / "rows.jsonl", [good, good, '{"messages": [{"role": "user"', good])
    node = tmp_path / "node"
    node.mkdir()
    monkeypatch.setenv("DSPARK_LOCAL_CACHE_DIR", str(node))
    given = tmp_path / "given" / "staging"
    for staging in (["--staging-dir", str(given)], []):
        args = produce_args(embedded.stock, data, remote.url, "--seq-length", "64", "--storage-options",
                            json.dumps(remote.options), *staging)
        assert produce_main(args) == 1
        err = capsys.readouterr().err
        assert "rows.jsonl:3" in err and "malformed JSON" in err, err
    assert not (tmp_path / "given").exists()
    assert os.listdir(node) == []
    assert LEASE not in remote.listing()  # the store's lease given back


def test_a_staging_dir_of_another_url_or_with_other_files_is_refused_in_one_line(
        embedded, s3_bucket, remote, tmp_path, capsys):
    staging = tmp_path / "staging"
    mark = CachePaths(str(staging)).staging_mark
    other = Remote(f"{s3_bucket}/runs/other", remote.options)
    cases = []
    # (a) It stages another URL: a run refused by that cache's live lease has marked it already.
    remote.store.put(LEASE, json.dumps({"host": "elsewhere", "pid": 1, "run_id": "r-live", "world_size": 1,
                                        "started_at": time.time(), "renewed_at": time.time() + 3600,
                                        "ttl": 60.0}).encode())
    assert produce_main(remote.args(embedded, staging)) == 1
    assert "in use by another dspark-produce run" in capsys.readouterr().err
    with open(mark) as handle:
        assert handle.read().strip() == remote.url
    before = sorted(os.listdir(staging))
    code = produce_main(other.args(embedded, staging))
    cases.append((code, capsys.readouterr().err))
    assert sorted(os.listdir(staging)) == before  # nothing changed in it
    with open(mark) as handle:
        assert handle.read().strip() == remote.url
    # (b) A directory with files of its own.
    unrelated = tmp_path / "mine"
    unrelated.mkdir()
    (unrelated / "notes.txt").write_text("mine")
    code = produce_main(other.args(embedded, unrelated))
    cases.append((code, capsys.readouterr().err))
    assert sorted(os.listdir(unrelated)) == ["notes.txt"]
    (stages, not_empty) = cases
    for code, err in cases:
        assert code != 0 and len(err.strip().splitlines()) == 1, err
        assert err.startswith("dspark-produce: error"), err
    assert f"stages {remote.url}, not {other.url}" in stages[1], stages[1]
    assert "is not empty and does not stage a remote cache" in not_empty[1], not_empty[1]
    assert other.listing() == {}  # the refused runs put nothing on the store


_RACER = """
import json, sys, time
from dspark_cache.storage.backing import StorageOptions
from dspark_cache.producer.exchange import StoreExchange
from dspark_cache.storage.remote.output import RemoteOutput
url, staging, options, at, leader = sys.argv[1:6]
output = RemoteOutput(url, storage=StorageOptions(json.loads(options)), staging_dir=staging)
while time.time() < float(at):
    pass
try:
    output.check() if leader == "1" else StoreExchange(output).identity()  # rank 0 takes it; every rank checks it
    print("ok")
except Exception as exc:
    print(f"refused: {exc}")
"""


@pytest.mark.slow
def test_the_ranks_of_one_node_starting_together_on_a_new_staging_dir_are_not_refused(remote, tmp_path):
    """Rank 0 checks the staging directory as it takes it while every other rank of the node checks it too
    (``StoreExchange.identity``, as planning starts): on a new directory, all at the same instant, none is refused."""
    for attempt in range(3):
        staging = str(tmp_path / f"staging-{attempt}")
        at = time.time() + 1.0  # every racer starts its check at this instant
        racers = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    _RACER,
                    remote.url,
                    staging,
                    json.dumps(remote.options),
                    repr(at),
                    leader,
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for leader in ("1", "0", "0", "0")
        ]  # rank 0 and three others
        said = [p.communicate(timeout=60) for p in racers]
        assert [out.strip() for out, _ in said] == ["ok"] * len(racers), (attempt, said)
        with open(CachePaths(staging).staging_mark) as handle:
            assert handle.read().strip() == remote.url


# -- 9. faults ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_transient_faults_on_tar_uploads_are_retried_and_the_run_completes(
        embedded, reference, remote, proxy, tmp_path, capsys):
    proxy.fail_next(2, "503", match=TAR_PUTS)
    proxy.fail_next(2, "reset", match=TAR_PUTS)
    proxy.fail_next(1, "500", match=TAR_PUTS)
    done = run(remote.cmd(embedded, tmp_path / "staging", options=client_options(proxy.endpoint)), env=ENV)
    assert done.returncode == 0, done.stderr
    assert (proxy.faults["503"], proxy.faults["reset"], proxy.faults["500"]) == (2, 2, 1)
    _assert_verified(remote, tmp_path / "node", capsys)
    _assert_samples_equal(remote, tmp_path / "node2", reference)


@pytest.mark.slow
def test_a_store_that_keeps_failing_ends_in_an_error_naming_the_object_and_a_rerun_resumes(
        embedded, reference, remote, proxy, tmp_path, capsys):
    proxy.fail_next(None, "503", match=matching(method="PUT", suffix="/" + KEYS.shard_tar(2)))
    failing = client_options(proxy.endpoint, retry_config={"max_retries": 1})
    staging = tmp_path / "staging"
    # A staging limit of one shard: uploads go one at a time, and the writer waits for room when the
    # failure comes, so the failure reaches it there (not only at the end of the run). One writer: shards
    # are sealed in plan order, so exactly those before the failing one are published (with several, a
    # later shard sealed first may go up first).
    failed = run(
        remote.cmd(embedded, staging, "--staging-limit", "1", "--writer-threads", "1", options=failing),
        env=ENV,
    )
    assert failed.returncode == 1, failed.stderr
    lines = _error_lines(failed.stderr)
    assert len(lines) == 1, failed.stderr
    assert remote.store.name(KEYS.shard_tar(2)) in lines[0], lines[0]
    assert proxy.faults["503"] >= 2
    committed = remote.shard_ids("idx")
    assert committed == {0, 1}, committed  # those before it were published, none after it
    assert LEASE not in remote.listing()  # a failed run gives its lease back
    proxy.clear()
    again = run(remote.cmd(embedded, staging), env=ENV)
    assert again.returncode == 0, again.stderr
    log = _after_last_resume(staging)
    assert log[0]["data"]["published"] == len(committed)
    total = len(CachePaths(reference).indexed_shard_ids())
    assert sorted(_published_ids(log)) == sorted(set(range(total)) - committed)
    _assert_verified(remote, tmp_path / "node", capsys)
    _assert_samples_equal(remote, tmp_path / "node2", reference)


# -- 10. refused credentials, a missing bucket --------------------------------------------------

def test_refused_credentials_and_a_missing_bucket_are_one_line_errors(embedded, s3_server, tmp_path, capsys):
    with S3Server(check_credentials=True) as strict:
        bucket = unique_bucket_name()
        strict.make_bucket(bucket)
        wrong = strict.options(secret_access_key="wrong-secret-value")
        denied = Remote(f"s3://{bucket}/c", wrong)
        capsys.readouterr()
        code = produce_main(denied.args(embedded, tmp_path / "a"))
        err = capsys.readouterr().err.strip().splitlines()
        assert code != 0 and len(err) == 1, err
        assert err[0].startswith("dspark-produce: error") and "access denied (403)" in err[0], err
        assert "wrong-secret-value" not in err[0]
        assert strict.boto3_client().list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0
    missing = Remote(f"s3://{unique_bucket_name('absent')}/c", client_options(s3_server.endpoint))
    code = produce_main(missing.args(embedded, tmp_path / "b"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1, err
    assert err[0].startswith("dspark-produce: error") and "does not exist" in err[0], err
    assert RemoteURL.parse(missing.url).bucket in err[0]


def test_the_disk_check_counts_a_shard_for_every_writer(remote, tmp_path):
    """Each writer lane's shard is on the staging disk (being written, or sealed and waiting for room) besides
    the limit's worth and the one upload let through: the pre-run check counts them all."""
    from dspark_cache.storage.backing import StorageOptions
    from dspark_cache.storage.remote.output import RemoteOutput

    output = RemoteOutput(remote.url, storage=StorageOptions(remote.options), staging_dir=str(tmp_path / "s"),
                          staging_limit=100)
    assert output.space_needed(10_000, 40, writers=1) == 100 + 2 * 40
    assert output.space_needed(10_000, 40, writers=4) == 100 + 5 * 40
    assert output.space_needed(150, 40, writers=4) == 150  # never more than what is left to write
