"""Several producer ranks: a real torchrun job (gloo, CPU), and ranks started with torchrun's environment:
kills, a different world size, a dying rank, SIGTERM."""

from __future__ import annotations

import os
import signal

import msgspec
import numpy as np
import pytest

import dspark_cache
from dspark_cache.format.paths import CachePaths
from dspark_cache.format.tar.reader import load_shard_index
from dspark_cache.storage.cache import CacheDir
from dspark_cache.verify import verify_cache
from tests.support.produce import produce_args, small_run
from tests.support.proc import (
    assert_same_samples,
    kill_group,
    producer_cmd,
    published,
    run,
    start_ranks,
    torchrun,
    wait_for,
)

ARGS = small_run(2, 2)


@pytest.mark.slow
def test_two_ranks_equal_one(embedded, tmp_path, reference):
    out = str(tmp_path / "cache")
    proc = run(torchrun(2, *produce_args(embedded.stock, embedded.data, out, *ARGS)))
    assert proc.returncode == 0, proc.stderr
    # torchrun runs each rank with one thread: equal content up to float summation order.
    assert_same_samples(out, reference, exact=False)
    assert verify_cache(out).ok
    for rank in (0, 1):
        status = open(CachePaths(out).status(rank)).read()
        assert '"state":"finished"' in status and '"shards_owned":0' not in status  # both ranks worked
    claims = [n for n in os.listdir(CachePaths(out).control_dir) if CachePaths.is_completion_claim(n)]
    assert len(claims) == 1  # completion claimed exactly once (next to the directory's lock file)
    # Each rank builds its own manifest; every shard, whichever rank wrote it, carries rank 0's cache id, the
    # one the completed manifest names (a loader's replaced-cache check relies on it).
    paths, cache_id = CachePaths(out), CacheDir(out).cache_id
    assert len(cache_id) == 32
    assert {load_shard_index(paths, s).cache_id for s in paths.indexed_shard_ids()} == {cache_id}
    # Each rank encoded its own rows (row % 2 == rank), so every row was tokenised exactly once.
    parts = [msgspec.json.decode(open(CachePaths(out).plan_part_header(r), "rb").read()) for r in (0, 1)]
    manifest = dspark_cache.open_cache(out).manifest
    assert sum(p["rows"] for p in parts) == manifest.num_rows and all(p["rows"] > 0 for p in parts)
    for rank in (0, 1):
        ids = np.load(CachePaths(out).plan_part(rank, "rows"))["sample_id"]
        skipped = [row["row"] for row in parts[rank]["skipped"]]
        assert sorted(ids.tolist() + skipped) == list(range(rank, manifest.num_rows, 2))


@pytest.mark.slow
def test_two_ranks_killed_then_one_rank_finishes(embedded, tmp_path, reference):
    out = str(tmp_path / "cache")
    ranks = start_ranks(producer_cmd(*produce_args(embedded.stock, embedded.data, out, *ARGS)), 2)
    wait_for(lambda: published(out) >= 3)
    for rank in ranks:
        kill_group(rank)
    report = verify_cache(out)
    assert not report.complete and report.missing and not report.corrupt
    done = run(producer_cmd(*produce_args(embedded.stock, embedded.data, out, *ARGS)))
    assert done.returncode == 0, done.stderr
    assert_same_samples(out, reference, exact=False)


@pytest.mark.slow
def test_a_dying_rank_does_not_hang_the_others(embedded, tmp_path, reference):
    out = str(tmp_path / "cache")
    cmd = producer_cmd(*produce_args(embedded.stock, embedded.data, out, *ARGS, "--rank-timeout", "4"))
    ranks = start_ranks(cmd, 2, rank_env={1: {"DSPARK_CRASH_AT": "mid_shard:3"}})
    out0, err0 = ranks[0].communicate(timeout=240)
    ranks[1].wait(timeout=60)
    assert ranks[1].returncode == -signal.SIGKILL
    assert ranks[0].returncode == 4, err0
    assert "were not published" in err0 and "rerun" in err0
    report = verify_cache(out)
    assert report.missing and not report.corrupt
    assert f"shards {report.missing}" in err0  # the survivor names exactly what is missing
    done = run(producer_cmd(*produce_args(embedded.stock, embedded.data, out, *ARGS)))
    assert done.returncode == 0, done.stderr
    assert_same_samples(out, reference, exact=False)
    assert dspark_cache.open_cache(out).manifest.complete


@pytest.mark.slow
def test_sigterm_stops_both_ranks_and_each_says_stopped(embedded, tmp_path):
    """SIGTERM to every rank of a 2-rank job (as torchrun forwards it): each finishes its shard in flight,
    reports stopped (rank 1's line too, not "done") and exits 3; a rerun completes the cache."""
    out = str(tmp_path / "cache")
    cmd = producer_cmd(*produce_args(embedded.stock, embedded.data, out, *small_run(1, 1)))
    ranks = start_ranks(cmd, 2)
    try:
        wait_for(lambda: published(out) >= 2 or any(r.poll() is not None for r in ranks), timeout=240)
    finally:
        for r in ranks:
            r.send_signal(signal.SIGTERM)
    said = [r.communicate(timeout=240) for r in ranks]
    assert [r.returncode for r in ranks] == [3, 3], said
    assert said[1][0].strip() == "rank 1: stopped", said[1]
    assert said[0][0].startswith("cache incomplete: "), said[0]
    for rank in (0, 1):
        status = open(CachePaths(out).status(rank)).read()
        assert '"state":"stopped"' in status, status
    report = verify_cache(out)
    assert not report.complete and not report.corrupt
    done = run(cmd)  # the same command resumes
    assert done.returncode == 0, done.stderr
    assert verify_cache(out).ok
