"""Periodic progress lines with rate and ETA, driven by the plan's exact totals."""

from __future__ import annotations

import logging
import time

log = logging.getLogger("dspark_cache.progress")


def format_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class ProgressLog:
    """Logs at most every ``interval`` seconds: done/total samples and tokens, rate, ETA."""

    def __init__(self, total_tokens: int, total_samples: int, interval: float = 10.0) -> None:
        self.total_tokens = max(total_tokens, 1)
        self.total_samples = total_samples
        self.interval = interval
        self.started = self._last = time.monotonic()

    def update(self, tokens: int, samples: int, shards_done: int, shards_total: int) -> None:
        now = time.monotonic()
        if now - self._last < self.interval:
            return
        self._last = now
        rate = tokens / max(now - self.started, 1e-9)
        eta = (self.total_tokens - tokens) / rate if rate else float("inf")
        log.info("%d/%d samples, %.1f%% of tokens, %d/%d shards, %.0f tokens/s, ETA %s",
                 samples, self.total_samples, 100 * tokens / self.total_tokens, shards_done, shards_total,
                 rate, format_duration(eta) if rate else "?")
