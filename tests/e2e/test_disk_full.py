"""A full disk stops cleanly, says how much space is needed, and the cache resumes afterwards."""

from __future__ import annotations

import os
import shutil

import pytest

from dspark_cache.format.paths import CachePaths
from dspark_cache.verify import verify_cache
from tests.support.diskfull import grow, small_filesystem
from tests.support.produce import produce_args
from tests.support.proc import assert_same_samples, producer_cmd, run

ARGS = ("--seq-length", "256", "--shard-size", "4", "--batch-size", "4")


@pytest.fixture
def small_fs(tmp_path):
    """A 3 MiB tmpfs when this process may mount one (root, as in CI); else None."""
    with small_filesystem(tmp_path, "3m") as mount:
        yield mount


@pytest.mark.slow
def test_disk_full_stops_cleanly_then_resumes(embedded, tmp_path, small_fs):
    reference = str(tmp_path / "ref")
    assert run(producer_cmd(*produce_args(embedded.stock, embedded.data, reference, *ARGS))).returncode == 0
    if small_fs:
        out, env = os.path.join(small_fs, "cache"), {}
    else:  # no mount permission: the writer fails with ENOSPC past 2 MB instead
        out, env = str(tmp_path / "cache"), {"DSPARK_FAIL_WRITES_AFTER": str(2 << 20)}
    cmd = producer_cmd(*produce_args(embedded.stock, embedded.data, out, *ARGS))
    refused = run(cmd, env=env)
    if small_fs:  # pre-flight: the plan does not fit, nothing is loaded or written
        assert refused.returncode == 1 and "GB free" in refused.stderr and "--force" in refused.stderr
        assert not os.path.exists(CachePaths(out).shards_dir) or not os.listdir(CachePaths(out).shards_dir)
    full = run(cmd + ["--force"], env=env)
    assert full.returncode == 1, full.stderr
    assert "disk full" in full.stderr and "GB is free" in full.stderr and "rerun" in full.stderr
    report = verify_cache(out)
    assert report.shards_ok >= 1 and not report.corrupt and report.missing
    assert not any(f.endswith(".partial") for f in os.listdir(CachePaths(out).shards_dir))
    if small_fs:
        grow(small_fs, "64m")
    done = run(cmd)  # space freed (or no injected failure): resume finishes
    assert done.returncode == 0, done.stderr
    assert verify_cache(out).ok
    assert_same_samples(out, reference)
    if small_fs:
        shutil.rmtree(out)
