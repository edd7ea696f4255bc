"""Follow mode: training reads while dspark-produce writes, through a producer kill and resume."""

from __future__ import annotations

import threading
import time

import pytest

import dspark_cache
from dspark_cache.verify import verify_cache
from tests.support.produce import produce_args
from tests.support.proc import kill_group, producer_cmd, published, run, start, wait_for

ARGS = ("--seq-length", "256", "--shard-size", "2", "--batch-size", "2")


@pytest.mark.slow
def test_follow_a_producer_that_is_killed_and_resumed(embedded, tmp_path):
    out = str(tmp_path / "cache")
    cmd = producer_cmd(*produce_args(embedded.stock, embedded.data, out, *ARGS))
    producer = start(cmd)
    seen: list[tuple[float, list[int], list[bool]]] = []
    errors: list[BaseException] = []

    def train() -> None:
        try:
            loader = dspark_cache.build_dataloader(out, 3, follow=True, seed=2, poll_interval=0.05,
                                                   follow_timeout=120)
            for batch in loader:
                seen.append((time.time(), batch["sample_ids"].tolist(), batch["is_repeat"].tolist()))
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    trainer = threading.Thread(target=train)
    trainer.start()
    wait_for(lambda: published(out) >= 3)
    kill_group(producer)  # the producer dies while training waits for more
    time.sleep(1.0)
    assert trainer.is_alive() and not errors
    resumed = run(cmd)
    assert resumed.returncode == 0, resumed.stderr
    trainer.join(timeout=120)
    assert not trainer.is_alive() and not errors, errors
    completed_at = dspark_cache.open_cache(out).manifest.completed_at
    assert seen[0][0] < completed_at  # training started before the cache was complete
    cache = dspark_cache.open_cache(out)
    got = [s for _, ids, rep in seen for s, r in zip(ids, rep) if not r]
    assert sorted(got) == cache.sample_ids  # every sample exactly once, repeats flagged
    assert verify_cache(out).ok
    # The order never depended on timing: a follow loader over the finished cache agrees.
    again = dspark_cache.build_dataloader(out, 3, follow=True, seed=2)
    assert [b["sample_ids"].tolist() for b in again] == [ids for _, ids, _ in seen]
