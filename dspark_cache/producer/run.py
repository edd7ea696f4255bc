"""One producer run (one rank of it): prepare, reconcile the directory, compute, complete.

Each step is its own module: ``prepare`` (validate, encode, plan, manifest; nothing written),
``reconcile`` (rank 0, holding the lock: the directory made to agree with the plan), ``compute``
(the target and the pipeline over this rank's shards), ``completion`` (the rank that sees every
shard marks the cache complete) and ``status`` (heartbeats, events). This module only orders them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from dspark_cache.format.errors import CacheError
from dspark_cache.format.paths import CachePaths
from dspark_cache.format.schema import EventKind, Manifest, RankState
from dspark_cache.producer.completion import finish
from dspark_cache.producer.compute import compute_shards, ensure_target_weights
from dspark_cache.producer.config import ProduceConfig
from dspark_cache.producer.distributed import (
    RankInfo, assign_shards, barrier_before_setup, new_run_id, rank_info, share_setup,
)
from dspark_cache.producer.lock import DirectoryLock, lock_shared
from dspark_cache.producer.manifest import read_manifest_file
from dspark_cache.producer.pipeline import PipelineStats
from dspark_cache.producer.plan import Plan
from dspark_cache.producer.prepare import Prepared, prepare
from dspark_cache.producer.reconcile import reconcile_directory, take_directory
from dspark_cache.producer.signals import StopFlag
from dspark_cache.producer.status import StatusReporter, announce

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    """What one rank's run did; the command line turns it into a summary and an exit code."""

    manifest: Manifest
    plan: Plan
    stats: PipelineStats | None
    seconds: float
    stopped: bool = False
    missing: list[int] = field(default_factory=list)  # shards owned by a rank that died


def produce(cfg: ProduceConfig) -> RunResult:
    """Run this rank of the producer; bad input or configuration raises before device work."""
    started = time.time()
    me = rank_info()
    run_id = new_run_id()  # rank 0's is the job's: share_setup hands it to every rank
    lock: DirectoryLock | None = None

    def take(paths: CachePaths) -> None:
        nonlocal lock
        if me.is_leader:
            lock = take_directory(paths, run_id, me, cfg.overwrite)

    try:
        p = prepare(cfg, take)
        barrier_before_setup(me)
        error, existing = None, None
        if me.is_leader:
            try:
                existing = reconcile_directory(p)
                if lock is not None and me.world_size > 1:
                    lock.share()  # the job's other ranks join it from here on
            except Exception as exc:
                error = str(exc)
                if me.world_size == 1:
                    raise
        error, run_id = share_setup(me, error, run_id)
        if error:
            raise CacheError(error if me.is_leader else f"rank 0 could not prepare {p.paths.root}: {error}")
        if not me.is_leader:
            lock = lock_shared(p.paths)
            existing = read_manifest_file(p.paths)
        return _run_locked(p, me, run_id, existing, started)
    finally:
        if lock is not None:
            lock.release()


def _run_locked(p: Prepared, me: RankInfo, run_id: str, existing: Manifest | None, started: float) -> RunResult:
    """Heartbeat and stop handling around the rank's work; a failure is recorded before it propagates."""
    status = StatusReporter(p.paths, me.rank, me.world_size, run_id)
    status.start_heartbeat()
    stop = StopFlag(p.paths)
    stop.install()
    try:
        return _run_rank(p, me, run_id, existing, status, stop, started)
    except BaseException as exc:
        status.update(force=True, state=RankState.FAILED, last_error=str(exc) or type(exc).__name__)
        shard = status.status.shard  # the shard in flight failed; the monitor marks it
        status.event(EventKind.ERROR, f"producer failed: {exc}", **({"shard": shard} if shard is not None else {}))
        raise
    finally:
        stop.uninstall()
        status.stop_heartbeat()


def _run_rank(p: Prepared, me: RankInfo, run_id: str, existing: Manifest | None, status: StatusReporter,
              stop: StopFlag, started: float) -> RunResult:
    done = set(p.paths.indexed_shard_ids())
    todo = [s for s in p.plan.shards if s.shard_id not in done]
    owned = assign_shards(todo, me.world_size)[me.rank]
    status.update(force=True, shards_owned=len(owned), samples_total=p.plan.num_samples,
                  tokens_total=p.plan.num_tokens, shards_done=0)
    if me.is_leader:
        announce(status, p.plan, existing, done)
    if existing is not None and existing.complete and not todo:
        log.info("%s is already complete: nothing to do", p.paths.root)
        status.update(force=True, state=RankState.FINISHED)
        return RunResult(existing, p.plan, None, time.time() - started)
    stats = compute_shards(p, owned, status, stop, leader=me.is_leader) if owned else None
    if me.is_leader:
        ensure_target_weights(p, None)
    if stop():
        status.update(force=True, state=RankState.STOPPED)
        status.event(EventKind.STOPPED, f"stopped ({stop.reason}); rerun the same command to resume")
        return RunResult(p.manifest, p.plan, stats, time.time() - started, stopped=True)
    manifest, missing = finish(p, status, run_id, me)
    if missing:
        status.update(force=True, state=RankState.INCOMPLETE)
        status.event(EventKind.ERROR, f"shards {missing} were not published (their rank stopped); rerun to "
                     "complete them", missing=missing)
    else:
        status.update(force=True, state=RankState.FINISHED, samples_done=p.plan.num_samples,
                      tokens_done=p.plan.num_tokens)
    return RunResult(manifest, p.plan, stats, time.time() - started, missing=missing)
