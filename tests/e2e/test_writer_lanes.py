"""Several shards in flight: the same bytes whatever the writer count, and crash-safe at any instant."""

from __future__ import annotations

import filecmp
import json
import os
import random
import signal
import time

import pytest

import dspark_cache
from dspark_cache.format.paths import CachePaths
from dspark_cache.verify import verify_cache
from tests.support.produce import produce_args, run_produce
from tests.support.proc import assert_same_samples, kill_group, producer_cmd, run, start, wait_for

ARGS = ("--seq-length", "256", "--shard-size", "5", "--batch-size", "2")


def _shard_files(out: str) -> list[str]:
    names = sorted(os.listdir(CachePaths(out).shards_dir))
    assert names and not [n for n in names if n.endswith(".partial")]
    return names


@pytest.mark.parametrize("native", ["1", "0"])
def test_caches_are_byte_identical_whatever_the_writer_count(embedded, tmp_path, monkeypatch, native):
    monkeypatch.setenv("DSPARK_NATIVE", native)  # the C writer and the Python one write the same bytes
    outs = {}
    for writers in (1, 2, 4):
        outs[writers] = str(tmp_path / f"w{writers}")
        assert (
            run_produce(embedded.stock, embedded.data, outs[writers], *ARGS, "--writer-threads", str(writers))
            == 0
        )
    names = _shard_files(outs[1])
    tars = [n for n in names if n.endswith(".tar")]
    assert len(tars) >= 8  # enough shards for 4 lanes to interleave
    for writers in (2, 4):
        assert _shard_files(outs[writers]) == names
        match, mismatch, errors = filecmp.cmpfiles(
            CachePaths(outs[1]).shards_dir, CachePaths(outs[writers]).shards_dir, tars, shallow=False
        )
        assert (mismatch, errors) == ([], []), writers
        for shard in CachePaths(outs[1]).indexed_shard_ids():  # equal but for the run's cache id
            assert _index(outs[writers], shard) == _index(outs[1], shard)
        assert filecmp.cmp(
            CachePaths(outs[1]).wids_index, CachePaths(outs[writers]).wids_index, shallow=False
        )
        assert verify_cache(outs[writers]).ok


def _index(out: str, shard: int) -> dict:
    with open(CachePaths(out).shard_index(shard), "rb") as f:
        index = json.load(f)
    assert index.pop("cache_id")
    return index


@pytest.mark.slow
def test_sigkill_with_several_shards_in_flight_then_resume(embedded, tmp_path, reference):
    """Four lanes: every kill lands with shards half-written side by side; published ones stay valid
    and the resumed cache equals a single-writer run's."""
    out = str(tmp_path / "cache")
    cmd = producer_cmd(*produce_args(embedded.stock, embedded.data, out, *ARGS, "--writer-threads", "4"))
    proc = run(cmd, env={"DSPARK_CRASH_AT": "mid_shard:9"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert len(CachePaths(out).partial_files()) >= 2  # several shards were open when it died
    rng = random.Random(11)
    for _ in range(3):
        before = len(CachePaths(out).indexed_shard_ids())
        proc = start(cmd)
        wait_for(
            lambda: len(CachePaths(out).indexed_shard_ids()) > before or proc.poll() is not None, poll=0.002
        )
        time.sleep(rng.uniform(0.0, 0.05))
        kill_group(proc)
        report = verify_cache(out)
        assert not report.corrupt, report.corrupt
    assert not dspark_cache.open_cache(out, allow_incomplete=True).manifest.complete
    final = run(cmd)
    assert final.returncode == 0, final.stderr
    assert not CachePaths(out).partial_files()
    assert assert_same_samples(out, reference) == dspark_cache.open_cache(reference).manifest.num_samples
    assert verify_cache(out).ok
    names = _shard_files(out)
    match, mismatch, errors = filecmp.cmpfiles(CachePaths(out).shards_dir, CachePaths(reference).shards_dir,
                                               [n for n in names if n.endswith(".tar")], shallow=False)
    assert (mismatch, errors) == ([], [])


def test_the_heartbeat_names_every_shard_in_flight(embedded, tmp_path, monkeypatch):
    """With three writer lanes the rank's status lists the shards its writers hold (each from its first
    batch queued until it is published), for the monitor's rank table; none once the run is done."""
    from dspark_cache.producer.report.status import StatusReporter

    seen: list[list[int]] = []  # the shards in flight as each status update left them
    update = StatusReporter.update

    def spy(self, force: bool = False, **fields) -> None:
        update(self, force, **fields)
        seen.append(list(self.status.writing))

    monkeypatch.setattr(StatusReporter, "update", spy)
    out = str(tmp_path / "cache")
    # A batch budget of one full-length sample: every shard takes several batches, so the second batch
    # (the second lane's first) is queued while the first shard is still open, whatever the timing.
    args = ("--seq-length", "64", "--max-batch-tokens", "64", "--shard-size", "5", "--writer-threads", "3")
    assert run_produce(embedded.stock, embedded.data, out, *args) == 0
    shards = set(CachePaths(out).indexed_shard_ids())
    assert max(len(w) for w in seen) >= 2  # several shards in flight at once (more than the lanes while
    assert all(w == sorted(w) and set(w) <= shards for w in seen)  # a closed shard waits for its writer)
    assert seen[-1] == [] and json.load(open(CachePaths(out).status(0)))["writing"] == []
