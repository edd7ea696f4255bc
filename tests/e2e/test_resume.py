"""Resume by default: SIGKILL at any instant, SIGTERM, mismatches, --overwrite, a complete cache."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

import dspark_cache
from dspark_cache.format.paths import CachePaths
from dspark_cache.verify import verify_cache
from tests.support.produce import produce_args, run_produce
from tests.support.proc import assert_same_samples, kill_group, producer_cmd, published, run, start, wait_for

ARGS = ("--seq-length", "256", "--shard-size", "3", "--batch-size", "2")


def _cmd(embedded, out):
    return producer_cmd(*produce_args(embedded.stock, embedded.data, out, *ARGS))


def _assert_nothing_published_is_corrupt(out):
    if os.path.exists(CachePaths(out).manifest):
        report = verify_cache(out)
        assert not report.corrupt, report.corrupt


@pytest.mark.slow
def test_sigkill_at_any_instant_then_resume(embedded, tmp_path, reference):
    out = str(tmp_path / "cache")
    killed = 0
    for point in ("planned", "mid_shard:2", "after_rename:2", "after_index:1", "mid_shard:1"):
        proc = run(_cmd(embedded, out), env={"DSPARK_CRASH_AT": point})
        assert proc.returncode == -signal.SIGKILL, (point, proc.stderr)
        killed += 1
        _assert_nothing_published_is_corrupt(out)
    assert any(n.endswith(".partial") for n in os.listdir(CachePaths(out).shards_dir))  # mid_shard left one
    rng = random.Random(7)
    for _ in range(2):  # and at moments nobody chose: after a random number of this run's shards, plus a bit
        left = dspark_cache.open_cache(out, allow_incomplete=True).manifest.num_shards - len(
            CachePaths(out).indexed_shard_ids())
        # Half the rest is left to do. Shards are counted on disk (events can reach the file later than
        # the shard) and polled often: an idle machine publishes a shard of this cache every ~20 ms.
        before, then = len(CachePaths(out).indexed_shard_ids()), rng.randrange(max(1, left // 2))
        proc = start(_cmd(embedded, out))
        wait_for(lambda: len(CachePaths(out).indexed_shard_ids()) - before >= then or proc.poll() is not None,
                 poll=0.002)
        time.sleep(rng.uniform(0.0, 0.01))
        kill_group(proc)
        _assert_nothing_published_is_corrupt(out)
    assert not dspark_cache.open_cache(out, allow_incomplete=True).manifest.complete  # the last run has work
    final = run(_cmd(embedded, out))
    assert final.returncode == 0, final.stderr
    assert not CachePaths(out).partial_files()
    assert assert_same_samples(out, reference) == dspark_cache.open_cache(reference).manifest.num_samples
    assert verify_cache(out).ok


@pytest.mark.slow
def test_sigterm_stops_gracefully_and_resumes(embedded, tmp_path):
    out = str(tmp_path / "cache")
    proc = start(producer_cmd(*produce_args(embedded.stock, embedded.data, out, "--seq-length", "256",
                                            "--shard-size", "1", "--batch-size", "1")))
    wait_for(lambda: published(out) >= 2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, err
    assert "rerun the same command to resume" in err
    paths = CachePaths(out)
    assert not paths.partial_files()  # the shard in flight was finished, not left half-written
    done = len(paths.indexed_shard_ids())
    assert 2 <= done < dspark_cache.open_cache(out, allow_incomplete=True).manifest.num_shards
    assert not verify_cache(out).corrupt
    again = run(producer_cmd(*produce_args(embedded.stock, embedded.data, out, "--seq-length", "256",
                                           "--shard-size", "1", "--batch-size", "1")))
    assert again.returncode == 0, again.stderr
    assert verify_cache(out).ok


def test_mismatch_names_every_field_and_keeps_everything(embedded, tmp_path, capsys):
    out = str(tmp_path / "cache")
    assert run_produce(embedded.stock, embedded.data, out, *ARGS) == 0
    paths = CachePaths(out)
    weights_mtime = os.path.getmtime(paths.target_weights)
    manifest_before = open(paths.manifest).read()
    capsys.readouterr()
    code = run_produce(embedded.stock, embedded.data, out, "--seq-length", "200", "--shard-size", "3",
                       "--batch-size", "2", "--mask-reasoning-content", "--mask-generation-prompt")
    err = capsys.readouterr().err
    assert code == 1
    for field in ("seq_length", "mask_reasoning_content", "mask_generation_prompt", "planned_tokens"):
        assert field in err
    assert "--overwrite" in err
    assert open(paths.manifest).read() == manifest_before
    assert os.path.getmtime(paths.target_weights) == weights_mtime
    assert verify_cache(out).ok
    # --overwrite starts over with the new settings.
    assert run_produce(embedded.stock, embedded.data, out, "--seq-length", "200", "--shard-size", "3",
                       "--overwrite") == 0
    assert dspark_cache.open_cache(out).manifest.seq_length == 200


def test_complete_cache_rerun_does_nothing(embedded, tmp_path, capsys):
    out = str(tmp_path / "cache")
    assert run_produce(embedded.stock, embedded.data, out, *ARGS, "--resume") == 0
    paths = CachePaths(out)
    stamps = {
        f: os.path.getmtime(f)
        for f in [paths.manifest] + [paths.shard_tar(i) for i in paths.indexed_shard_ids()]
    }
    assert run_produce(embedded.stock, embedded.data, out, *ARGS, "--resume") == 0
    assert {f: os.path.getmtime(f) for f in stamps} == stamps


def test_shards_without_manifest_are_refused(embedded, tmp_path, capsys):
    out = str(tmp_path / "cache")
    paths = CachePaths(out)
    os.makedirs(paths.shards_dir)
    with open(paths.shard_index(0), "w") as handle:
        handle.write("{}")
    assert run_produce(embedded.stock, embedded.data, out, *ARGS) == 1
    assert "no manifest.json" in capsys.readouterr().err


def test_overwrite_replaces_an_unreadable_manifest(embedded, tmp_path, capsys):
    out = str(tmp_path / "cache")
    os.makedirs(out)
    with open(CachePaths(out).manifest, "w") as handle:
        handle.write("{not json")
    assert run_produce(embedded.stock, embedded.data, out, *ARGS) == 1
    assert "--overwrite" in capsys.readouterr().err
    assert run_produce(embedded.stock, embedded.data, out, *ARGS, "--overwrite") == 0
    assert verify_cache(out).ok
