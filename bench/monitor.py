"""Monitor start-up time and memory, on a real cache (the demo's by default).

    python bench/monitor.py [CACHE_DIR]

Each run is a fresh interpreter: wall time from process start to the first fully rendered
screen (headless, Textual's test driver), import time, and peak RSS. Median of 5.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = r"""
import time, resource, sys, asyncio
t0 = time.perf_counter()
from dspark_cache.tui.app import MonitorApp
t_import = time.perf_counter() - t0

async def main():
    app = MonitorApp(sys.argv[1], refresh=3600)
    async with app.run_test(size=(140, 50)) as pilot:
        await app.first_snapshot()  # files read off the UI thread: wait for them to be on screen
        await pilot.pause()
    return time.perf_counter() - t0

t_ready = asyncio.run(main())
print(t_import, t_ready, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 'torch' in sys.modules)
"""


def main() -> None:
    cache = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, ".demo", "cache")
    runs = []
    for _ in range(5):
        out = subprocess.run([sys.executable, "-c", PROBE, cache], capture_output=True, text=True, check=True)
        t_import, t_ready, rss, torch_loaded = out.stdout.split()
        runs.append((float(t_import), float(t_ready), float(rss), torch_loaded))
    print(json.dumps({
        "cache": cache,
        "import_s_median": statistics.median(r[0] for r in runs),
        "first_screen_s_median": statistics.median(r[1] for r in runs),
        "peak_rss_mb_median": statistics.median(r[2] for r in runs),
        "torch_imported": any(r[3] == "True" for r in runs),
    }, indent=2))


if __name__ == "__main__":
    main()
