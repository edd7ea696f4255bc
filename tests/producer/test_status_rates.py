"""The producer's own rate fields: work resumed from an earlier run never counts as speed."""

from __future__ import annotations

import time

from dspark_cache.format.paths import CachePaths
from dspark_cache.format.schema import RankPhase
from dspark_cache.producer.report.status import StatusReporter


def test_resumed_work_is_not_a_rate(tmp_path, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    status = StatusReporter(CachePaths(str(tmp_path)), 0, 1, "run")
    status.update(force=True, phase=RankPhase.LOADING)
    clock[0] += 30  # a model load longer than the rate window
    status.update(force=True, phase=RankPhase.RUNNING, tokens_done=50_000)  # resumed shards counted as done
    clock[0] += 1
    status.update(tokens_done=50_100)
    assert status.status.tokens_per_s == 0.0  # not (50,100 - 0) / 31 s: no window has passed yet
    clock[0] += 2
    status.update(tokens_done=50_300)
    assert status.status.tokens_per_s == 100.0  # 300 tokens of this run over its 3 s
