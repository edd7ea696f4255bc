"""One producer run (one rank of it): prepare, reconcile the directory, compute, complete.

Each step is its own module: ``prepare`` (validate, encode, plan, manifest; only the saved plan
is written), ``resume`` (rank 0, holding the lock: the directory made to agree with the plan),
``compute`` (the target and the pipeline over this rank's shards), ``finish`` (the rank
that sees every shard marks the cache complete) and ``report.status`` (heartbeats, events).
This module only orders them.

With ``--tp-size``/``--ep-size`` (``device.model_group``) shards belong to model-parallel groups of
ranks, not to single ranks; the topology and the target's fitness for it are checked before planning.
"""

from __future__ import annotations

import logging
import time

from dspark_cache.format.errors import CacheError
from dspark_cache.format.schema import EventKind, Manifest, RankPhase
from dspark_cache.producer.compute import (
    Computed, compute_shards, repair_complete_weights, write_missing_target_weights,
)
from dspark_cache.producer.config import ProduceConfig, cache_output
from dspark_cache.producer.device.model_group import check_target
from dspark_cache.producer.device.ranks import assign_shards, barrier_before_setup, new_run_id, share_setup
from dspark_cache.producer.device.topology import Topology, check_topology
from dspark_cache.producer.finish import finish
from dspark_cache.producer.plan.found import found_directory
from dspark_cache.producer.prepare import Prepared, prepare, resolve_settings
from dspark_cache.producer.report.signals import StopFlag
from dspark_cache.producer.report.summary import RunResult
from dspark_cache.producer.report.status import StatusReporter, announce
from dspark_cache.producer.resume import read_existing, reconcile_directory, take_directory

log = logging.getLogger(__name__)


def produce(cfg: ProduceConfig) -> RunResult:
    """Run this rank of the producer; bad input or configuration raises before device work."""
    started = time.time()
    topology = Topology.from_environment(cfg.tp_size, cfg.ep_size)
    check_topology(topology, cfg.device, cfg.device_map)
    run_id = new_run_id()  # rank 0's is the job's: share_setup hands it to every rank
    output = cache_output(cfg, topology.rank)
    had_lock = True  # whether the lock file was there before this run (rank 0 finds out)
    try:
        settings = resolve_settings(cfg)
        # before planning, on every rank alike
        check_target(cfg.target_model, topology, cfg.trust_remote_code)
        if topology.is_leader:  # before the input is read: a second producer is refused at once
            had_lock = found_directory(output).had_lock
            take_directory(output, run_id, topology.world_size, cfg.overwrite)
        try:
            p = prepare(settings, output)
        except BaseException:
            # Nothing of a cache yet: no lock file is left behind. The rows encoded so far stay, so that a
            # rerun (say with --on-invalid skip) does not tokenise them again.
            if topology.is_leader and not had_lock:
                output.drop_lock()
            raise
        barrier_before_setup(topology)
        error, existing = None, None
        if topology.is_leader:
            try:
                existing = reconcile_directory(p)
                if topology.world_size > 1:
                    output.share()  # the job's other ranks join it from here on
            except Exception as exc:
                error = str(exc)
                if topology.world_size == 1:
                    raise
        error, run_id = share_setup(topology, error, run_id)
        if error:
            raise CacheError(
                error if topology.is_leader else f"rank 0 could not prepare {p.paths.root}: {error}"
            )
        if not topology.is_leader:
            output.join(apart=p.exchange.apart)
            existing = read_existing(output)
        result = _run_locked(p, topology, run_id, existing, started)
        result.output = output
        return result
    finally:
        output.release()


def _run_locked(p: Prepared, topology: Topology, run_id: str, existing: Manifest | None,
                started: float) -> RunResult:
    """Heartbeat and stop handling around the rank's work; a failure is recorded before it propagates."""
    status = StatusReporter(p.paths, topology.rank, topology.world_size, run_id,
                            group=topology.group if topology.model_parallel else None,
                            group_size=topology.group_size)
    status.start_heartbeat()
    stop = StopFlag(p.paths)
    stop.install()
    try:
        return _run_rank(p, topology, run_id, existing, status, stop, started)
    except BaseException as exc:
        status.update(force=True, phase=RankPhase.FAILED, last_error=str(exc) or type(exc).__name__)
        shard = status.status.shard  # the failed shard (a writer's, else the device's): the monitor marks it
        status.event(
            EventKind.ERROR, f"producer failed: {exc}", **({"shard": shard} if shard is not None else {})
        )
        raise
    finally:
        stop.uninstall()
        status.stop_heartbeat()


def _run_rank(p: Prepared, topology: Topology, run_id: str, existing: Manifest | None, status: StatusReporter,
              stop: StopFlag, started: float) -> RunResult:
    done = p.output.published()
    todo = [s for s in p.plan.shards if s.shard_id not in done]
    owned = assign_shards(todo, topology.groups)[topology.group]  # a group's ranks own the same shards
    status.update(force=True, shards_owned=len(owned), samples_total=p.plan.num_samples,
                  tokens_total=p.plan.num_tokens, shards_done=0)
    if topology.is_leader:
        announce(status, p.plan, existing, done)
    if existing is not None:  # a completed run's checksum of the target weights: they are checked against it
        p.manifest.target_weights_xxh3 = existing.target_weights_xxh3
    if existing is not None and existing.complete and not todo:
        repair_complete_weights(p, existing, topology, status, run_id)
        log.info("%s is already complete: nothing to do", p.paths.root)
        status.update(force=True, phase=RankPhase.FINISHED)
        return RunResult(existing, p.plan, None, time.time() - started, output=p.output)
    computed = compute_shards(p, owned, status, stop, topology, run_id) if owned else Computed(None)
    p.output.flush()  # a cache on object storage: the last shards' uploads (a failed one raises here)
    stats = computed.stats
    write_missing_target_weights(p, topology, status, run_id)
    stopped = stop() or computed.group_stopped
    if stopped and {s.shard_id for s in p.plan.shards} <= p.output.scan():
        # The stop came with the last shard in flight, which a stop finishes: the job's work is all done.
        log.info("stop requested (%s) after every shard was published: completing the cache", stop.reason)
        stopped = False
    if stopped:
        reason = stop.reason if stop() else (f"model-parallel group {topology.group} stopped "
                                             f"(ranks {topology.group_ranks()})")
        status.update(force=True, phase=RankPhase.STOPPED)
        status.event(EventKind.STOPPED, f"stopped ({reason}); rerun the same command to resume")
        return RunResult(p.manifest, p.plan, stats, time.time() - started, stopped=True, output=p.output)
    manifest, missing = finish(p, status, run_id, topology)
    if missing:
        status.update(force=True, phase=RankPhase.INCOMPLETE)
        status.event(EventKind.ERROR, f"shards {missing} were not published (their rank stopped); rerun to "
                     "complete them", missing=missing)
    else:
        status.update(force=True, phase=RankPhase.FINISHED, samples_done=p.plan.num_samples,
                      tokens_done=p.plan.num_tokens)
    return RunResult(manifest, p.plan, stats, time.time() - started, missing=missing, output=p.output)
