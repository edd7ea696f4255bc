"""What the producer tells the world: a per-rank heartbeat file, an append-only event log, the plan's announcement.

Phase and event-kind strings come from ``format.schema`` (``RankPhase``, ``EventKind``): the monitor
reads what is written here.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import threading
import time
from typing import Any

from dspark_cache.format.atomic import atomic_write_bytes
from dspark_cache.format.errors import CacheError
from dspark_cache.format.paths import CachePaths
from dspark_cache.format.schema import Event, EventKind, Manifest, RankPhase, RankStatus, encode_json
from dspark_cache.producer.plan.batches import Plan

log = logging.getLogger(__name__)


class StatusReporter:
    """Writes ``status/rank-N.json`` (atomically, at most every ``interval`` s) and events."""

    def __init__(self, paths: CachePaths, rank: int, world_size: int, run_id: str, interval: float = 1.0,
                 group: int | None = None, group_size: int = 1) -> None:
        """``group``/``group_size``: the model-parallel group the rank computes with (``--tp-size``)."""
        self.paths = paths
        self.rank = rank
        self.interval = interval
        now = time.time()
        self.status = RankStatus(
            rank=rank, world_size=world_size, run_id=run_id, pid=os.getpid(), host=socket.gethostname(),
            phase=RankPhase.PLANNING, updated_at=now, started_at=now, group=group, group_size=group_size,
        )
        self._last_write = 0.0
        self._lock = threading.Lock()
        self._rate_anchor: tuple[float, int, int] | None = None
        self._anchor_running = False  # the anchor was taken while RUNNING
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def start_heartbeat(self) -> None:
        """Rewrite the status every ``interval`` s even while a long step (model load) runs."""

        def beat() -> None:
            while not self._stop.wait(self.interval):
                self.update(force=True)

        self._beat = threading.Thread(target=beat, name="dspark-heartbeat", daemon=True)
        self._beat.start()

    def stop_heartbeat(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join()

    def event(self, kind: str, message: str, **data: Any) -> None:
        """Append one event line (O_APPEND keeps lines whole across restarts; a symlinked log is not followed)."""
        line = (
            encode_json(Event(time=time.time(), rank=self.rank, kind=kind, message=message, data=data))
            + b"\n"
        )
        os.makedirs(self.paths.events_dir, exist_ok=True)
        path = self.paths.events(self.rank)
        with self._lock:
            try:  # non-blocking: a FIFO there must not hang the run (CacheOutput.check refuses one up front)
                fd = os.open(
                    path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644
                )
            except OSError as exc:
                raise CacheError(
                    f"{path} cannot be appended to ({exc.strerror}): the event log must be a regular "
                    "file; move it away and rerun"
                ) from exc
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise CacheError(
                        f"{path} is not a regular file: the event log must be one; move it away and rerun"
                    )
                os.write(fd, line)
            finally:
                os.close(fd)
        if kind == EventKind.WARNING:  # errors reach the user once, through the exception the run raises
            log.warning(message)

    def update(self, force: bool = False, **fields: Any) -> None:
        """Change status fields; the file is rewritten when ``interval`` has passed (or forced)."""
        with self._lock:
            for key, value in fields.items():
                setattr(self.status, key, value)
            now = time.time()
            self._update_rates(now)
            if not force and now - self._last_write < self.interval:
                return
            self.status.updated_at = now
            self._last_write = now
            # Written under the lock: the heartbeat thread and the main loop both write, and the
            # file must end up with the newest status, not whichever rename came last.
            os.makedirs(self.paths.status_dir, exist_ok=True)
            atomic_write_bytes(self.paths.status(self.rank), encode_json(self.status), durable=False)

    def _update_rates(self, now: float) -> None:
        s = self.status
        if self._rate_anchor is None or s.phase != RankPhase.RUNNING or not self._anchor_running:
            # Anchored afresh on entering RUNNING: the counts jump there to the resumed work.
            self._rate_anchor = (now, s.tokens_done, s.bytes_written)
            self._anchor_running = s.phase == RankPhase.RUNNING
            return
        t0, tokens0, bytes0 = self._rate_anchor
        if now - t0 >= 2.0:  # rates over a few seconds are steadier than per batch
            s.tokens_per_s = (s.tokens_done - tokens0) / (now - t0)
            s.bytes_per_s = (s.bytes_written - bytes0) / (now - t0)
            self._rate_anchor = (now, s.tokens_done, s.bytes_written)


def announce(status: StatusReporter, plan: Plan, existing: Manifest | None, done: set[int]) -> None:
    """Rank 0's account of the run ahead: what is resumed, the plan's totals, every skipped row."""
    if existing is not None:
        kept = [s for s in plan.shards if s.shard_id in done]
        samples, todo = sum(s.num_samples for s in kept), len(plan.shards) - len(kept)
        line = (f"resuming: {len(kept)} of {len(plan.shards)} shards ({samples} samples) already published; "
                f"computing {todo}")
        status.event(EventKind.RESUMED, line, published=len(kept), total=len(plan.shards), samples=samples)
        if todo:  # a complete cache says so itself ("nothing to do")
            log.info("%s", line)
    status.event(
        EventKind.PLAN,
        "planned",
        rows=plan.num_rows,
        samples=plan.num_samples,
        shards=len(plan.shards),
        tokens=plan.num_tokens,
        bytes=plan.num_bytes,
        skipped=plan.skipped_counts(),
    )
    for row in plan.skipped:
        status.event(
            EventKind.SKIPPED_ROW, f"{row.where}: skipped ({row.reason})", row=row.row, reason=row.reason
        )
