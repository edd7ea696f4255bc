"""--dry-run: the plan a real run would make (same shards, same exact bytes), and nothing written
but that plan, which the real run then reuses."""

from __future__ import annotations

import os
import re

import dspark_cache
from dspark_cache.format.paths import CachePaths
from tests.support.produce import run_produce


def test_dry_run_prints_the_plan_of_the_real_run_and_writes_only_the_plan(embedded, tmp_path, capsys, caplog):
    out = str(tmp_path / "cache")
    args = ("--seq-length", "512", "--shard-size", "8", "--batch-size", "4")
    assert run_produce(embedded.stock, embedded.data, out, *args, "--dry-run", "--device", "cuda") == 0
    report = capsys.readouterr().out  # planning a GPU job needs no GPU
    paths = CachePaths(out)
    dirs = {os.path.basename(paths.plan_dir), os.path.basename(paths.control_dir)}
    assert set(os.listdir(out)) <= dirs  # the saved plan (and the lock it was written under)
    assert not os.listdir(paths.control_dir) or os.listdir(paths.control_dir) == [
        os.path.basename(paths.lock)
    ]
    caplog.set_level("INFO", logger="dspark_cache")
    assert run_produce(embedded.stock, embedded.data, out, *args) == 0
    assert "reusing the saved plan" in caplog.text  # the real run tokenised nothing
    m = dspark_cache.open_cache(out).manifest
    assert f"-> {m.planned_samples} samples" in report
    assert f"shards: {m.num_shards} of at most 8 samples, {m.planned_bytes} bytes" in report
    assert f"{m.planned_padded_tokens} tokens computed" in report
    padding = float(re.search(r"padding ([0-9.]+)%", report).group(1))
    assert abs(padding - 100 * (m.planned_padded_tokens / m.planned_tokens - 1)) < 0.06
