"""Regenerate docs/monitor.svg: the monitor during a live run of the demo producer.

    .venv/bin/python docs/screenshot.py   (after `make demo` built .demo/)
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from dspark_cache.demo import ensure_embedded  # noqa: E402
from dspark_cache.tui.app import MonitorApp  # noqa: E402


def published(cache: str) -> int:
    path = os.path.join(cache, "events", "rank-00000.jsonl")
    if not os.path.exists(path):
        return 0
    with open(path) as handle:
        return sum(1 for line in handle if '"shard_published"' in line)


async def shoot(cache: str, out: str) -> None:
    app = MonitorApp(cache, refresh=0.5)
    async with app.run_test(size=(140, 52)) as pilot:
        for _ in range(40):  # until the monitor has measured a rate (~5 s of heartbeats), while the run is live
            await asyncio.sleep(0.5)
            snapshot = await app.refreshed()  # the newest snapshot, rendered
            if snapshot.tokens_per_s is not None:
                break
        await pilot.pause()
        app.save_screenshot(filename=os.path.basename(out), path=os.path.dirname(out))


def main() -> None:
    workdir = os.path.join(ROOT, ".demo")
    target, data = ensure_embedded(workdir)
    cache = os.path.join(workdir, "screenshot-cache")
    # A fresh directory: an earlier run's event log would count as published before --overwrite clears it.
    shutil.rmtree(cache, ignore_errors=True)
    # Small batches and shards: the demo data takes long enough to be photographed while running.
    cmd = [sys.executable, "-m", "dspark_cache.producer", "--target-model", target, "--input-data", data,
           "--output-dir", cache, "--seq-length", "2048", "--batch-size", "1", "--shard-size", "2",
           "--log-level", "WARNING", "--no-progress"]
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        while published(cache) < 1:
            time.sleep(0.2)
        asyncio.run(shoot(cache, os.path.join(ROOT, "docs", "monitor.svg")))
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()
    print(json.dumps({"screenshot": "docs/monitor.svg"}))


if __name__ == "__main__":
    main()
