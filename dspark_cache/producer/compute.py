"""Computing: load the target on this rank's device and run the pipeline over the shards it owns.

Under ``--tp-size``/``--ep-size`` the shards are a model-parallel group's (see ``model_group``): every
rank of the group loads its slice of the target and runs the same forwards, batch for batch, but
only the group's writer stages and writes; the others run :func:`_follow_shards`.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import xxhash

from dspark_cache.format.atomic import atomic_write_bytes
from dspark_cache.format.errors import CacheError
from dspark_cache.format.sample import CACHE_DTYPES
from dspark_cache.format.schema import EventKind, Manifest, RankPhase
from dspark_cache.format.weights import weights_problem
from dspark_cache.producer.device.model_group import (
    DRAIN, END, GO, GroupAgreement, PartnerWatch, distributed_config, group_error, join_group, leave_group,
)
from dspark_cache.producer.device.ranks import job_store
from dspark_cache.producer.device.target import TargetRunner
from dspark_cache.producer.device.topology import Topology
from dspark_cache.producer.pipeline.loop import collate, run_pipeline
from dspark_cache.producer.pipeline.schedule import ShardSchedule
from dspark_cache.producer.pipeline.writer import PipelineStats
from dspark_cache.producer.plan.batches import ShardPlan
from dspark_cache.producer.prepare import Prepared
from dspark_cache.producer.report.progress import ProgressLog
from dspark_cache.producer.report.signals import StopFlag
from dspark_cache.producer.report.status import StatusReporter
from dspark_cache.producer.resume import disk_space

log = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, torch.Tensor], Any]


class DiskFullError(CacheError):
    """A write hit ENOSPC; published shards are intact and the run is resumable."""


class GroupStopped(Exception):
    """A partner of the writer's model-parallel group stopped: the writer's shards in flight are abandoned."""


@dataclasses.dataclass
class Computed:
    """What :func:`compute_shards` did: the pipeline's counts (a partner's: computed, not written),
    and whether the model-parallel group stopped before its shards were done."""

    stats: PipelineStats | None
    group_stopped: bool = False


def load_runner(p: Prepared, parallel: Any = None) -> TargetRunner:
    """The target on this rank's device (its slice of it with ``parallel``, transformers'
    ``DistributedConfig``), in the compute dtype, capturing the planned layers."""
    cfg = p.cfg
    return TargetRunner(
        cfg.target_model,
        p.layer_ids,
        p.info.num_layers,
        p.device,
        CACHE_DTYPES[p.compute_dtype],
        CACHE_DTYPES[cfg.dtype],
        cfg.target_attn_implementation,
        cfg.trust_remote_code,
        distributed_config=parallel,
        device_map=cfg.device_map,
        revision=p.info.revision,
        allow_pickle=cfg.allow_pickle_weights,
    )


def ensure_target_weights(p: Prepared, runner: TargetRunner | None, write: bool = True) -> bool:
    """Write ``embed_tokens`` and ``lm_head`` (training needs them) unless a good file is there; loads
    the target when not given. Returns whether this rank wrote them.

    "Good" is :func:`weights_problem`'s check against ``p.manifest`` (its recorded checksum once a
    run completed the cache): a missing, damaged or foreign file is rewritten, the shards untouched.
    In a model-parallel group every rank calls this (the sharded weights are gathered) and only the
    writer (``write``) writes. Ranks agree on whether the file is good: only the writer replaces it,
    and only after the gather, which needs every rank's call.
    """
    problem = weights_problem(p.paths, p.manifest)
    if problem is None:
        return False
    if os.path.exists(p.paths.target_weights):
        log.warning("%s; rewriting it from the target", problem)
    if os.path.isdir(p.paths.target_weights) and not os.path.islink(p.paths.target_weights):
        raise CacheError(
            f"{p.paths.target_weights} is a directory where the target weights belong: remove it "
            "(nothing of the cache is in it), then rerun dspark-produce with the same arguments"
        )
    from safetensors.torch import save

    runner = runner or load_runner(p)
    weights = runner.target_weights()
    if not write:
        return False
    data = save(weights)
    atomic_write_bytes(p.paths.target_weights, data)
    p.manifest.target_weights_xxh3 = xxhash.xxh3_64_intdigest(data)
    return True


def write_missing_target_weights(
    p: Prepared, topology: Topology, status: StatusReporter, run_id: str
) -> bool:
    """Group 0 writes the target weights when they are missing or damaged after its shards (it had
    none to compute, or a rerun found the cache's shards done). Returns whether this rank wrote them."""
    if topology.group != 0 or weights_problem(p.paths, p.manifest) is None:
        return False
    if not topology.model_parallel:
        return ensure_target_weights(p, None)
    with _model_group(p, topology, status, run_id):
        return ensure_target_weights(p, load_runner(p, distributed_config(topology)), write=topology.writer)


def repair_complete_weights(p: Prepared, existing: Manifest, topology: Topology, status: StatusReporter,
                            run_id: str) -> None:
    """A complete cache whose weights file is missing or damaged: rewrite it (the target is loaded
    for its two weight matrices only, no shard is recomputed) and record its new checksum."""
    if write_missing_target_weights(p, topology, status, run_id):
        existing.target_weights_xxh3 = p.manifest.target_weights_xxh3
        p.output.write_manifest(existing)
        status.event(EventKind.WARNING, f"{p.paths.target_weights} was rewritten (it was missing or damaged)")


def compute_shards(p: Prepared, owned: list[ShardPlan], status: StatusReporter, stop: StopFlag,
                   topology: Topology | None = None, run_id: str = "") -> Computed:
    """Load the target and compute this rank's shards (its group's, under ``--tp-size``/``--ep-size``),
    reporting as each batch and shard lands.

    Group 0 (rank 0 without model parallelism) extracts the target weights: one file per job.
    """
    topology = topology or Topology()
    status.update(force=True, phase=RankPhase.LOADING)
    if not topology.model_parallel:
        runner = _loaded(p, status, None)
        if p.cfg.device_map is not None:  # the pipeline works where the spread-out decoder leaves its output
            p = dataclasses.replace(p, device=runner.device)
        if topology.group == 0:
            ensure_target_weights(p, runner)
        stats, _ = _write_shards(p, owned, status, runner.forward, p.cfg.writers, stop)
        return Computed(stats)
    with _model_group(p, topology, status, run_id) as agreement:
        runner = _loaded(p, status, distributed_config(topology))
        if topology.group == 0:
            ensure_target_weights(p, runner, write=topology.writer)
        lanes = agreement.least(p.cfg.writers)  # every rank must run the writer's schedule
        if not topology.writer:
            return _follow_shards(p, owned, status, stop, runner, agreement, lanes)
        agreed = _AgreedStop(agreement, stop)
        try:
            role = f" as the writer of model-parallel group {topology.group}"
            forward = _tracked(runner, agreement)
            stats, group_stopped = _write_shards(p, owned, status, forward, lanes, agreed, role)
        finally:
            agreement.close()
        return Computed(stats, group_stopped or agreed.drained)


def _loaded(p: Prepared, status: StatusReporter, parallel: Any) -> TargetRunner:
    """The target, loaded; the weights this rank holds and its device memory go into its status."""
    runner = load_runner(p, parallel)
    held = runner.weight_bytes
    log.info("rank %d holds %.3f GB of the target's weights", status.rank, held / 1e9)
    status.update(force=True, weight_bytes=held, device_memory_bytes=_device_memory(p.cfg, runner.device))
    return runner


def _device_memory(cfg: Any, device: torch.device) -> int | None:
    """Bytes allocated on this rank's GPU (on every visible GPU when ``--device-map auto`` spreads it)."""
    if device.type != "cuda":
        return None
    if cfg.device_map is not None:
        return sum(torch.cuda.memory_allocated(i) for i in range(torch.cuda.device_count()))
    return torch.cuda.memory_allocated(device)


class _AgreedStop:
    """The writer's stop question before each batch, asked of the whole group (the partners ask it at the
    same steps, see ``_follow_shards``): True = begin no shard; a partner that ended raises ``GroupStopped``.
    ``drained``: the group agreed to stop (asked by this rank or by a partner)."""

    def __init__(self, agreement: GroupAgreement, stop: StopFlag) -> None:
        self.agreement, self.stop = agreement, stop
        self.drained = False

    def __call__(self) -> bool:
        agreed = self.agreement.agree(DRAIN if self.stop() else GO)
        if agreed == END:
            raise GroupStopped
        self.drained = self.drained or agreed == DRAIN
        return agreed == DRAIN


def _tracked(runner: TargetRunner, agreement: GroupAgreement) -> Forward:
    """The writer's forward, marked while it runs (see ``model_group.GroupAgreement.close``)."""

    def forward(ids: torch.Tensor, mask: torch.Tensor) -> Any:
        agreement.in_forward = True  # a failure from here on may leave the partners inside a collective
        result = runner.forward(ids, mask)
        agreement.in_forward = False
        return result

    return forward


def _write_shards(p: Prepared, owned: list[ShardPlan], status: StatusReporter, forward: Forward, writers: int,
                  should_stop: Callable[[], bool], role: str = "") -> tuple[PipelineStats, bool]:
    """The pipeline over ``owned``, ``writers`` shards at once, asking ``should_stop`` before each batch:
    ``(stats, whether a model-parallel partner stopped the group)``."""
    status.event(EventKind.STARTED, f"computing {len(owned)} shards on {p.device}{role}",
                 shards=[s.shard_id for s in owned], device=str(p.device))
    done_before = p.output.published()
    published: set[int] = set()
    base = {"samples": 0, "tokens": 0, "shards": 0}  # what earlier runs published counts as done
    for s in p.plan.shards:
        if s.shard_id in done_before:
            base["samples"] += s.num_samples
            base["tokens"] += s.num_tokens
            base["shards"] += 1
    progress = ProgressLog(base["tokens"] + sum(s.num_tokens for s in owned),
                           base["samples"] + sum(s.num_samples for s in owned), done_tokens=base["tokens"],
                           done_samples=base["samples"], done_shards=base["shards"])

    # The shards in flight (a batch queued to a writer, not yet published) for the monitor's rank
    # table: the main thread adds, the writer threads remove, each under this lock as it tells the status.
    writing: set[int] = set()
    writing_lock = threading.Lock()

    def on_published(shard: ShardPlan, index) -> None:
        published.add(shard.shard_id)
        status.event(EventKind.SHARD_PUBLISHED, f"shard {shard.shard_id} published", shard=shard.shard_id,
                     samples=index.num_samples, bytes=index.tar_bytes)
        for sid in index.nonfinite:
            status.event(EventKind.WARNING, f"sample {sid} dropped: non-finite hidden states", sample=sid)
        with writing_lock:
            writing.discard(shard.shard_id)
            status.update(force=True, shards_done=len(published), shard=None, writing=sorted(writing))
        progress.shards_published(len(published), len(owned))

    latest = PipelineStats()  # the counts so far, for a run a partner stops

    def on_batch(stats: PipelineStats, budget) -> None:
        nonlocal latest
        latest = stats
        with writing_lock:
            if stats.current_shard not in published:  # its last batch may be written and published already
                writing.add(stats.current_shard)
            status.update(phase=RankPhase.RUNNING, shard=stats.current_shard, writing=sorted(writing),
                          samples_done=base["samples"] + stats.samples,
                          tokens_done=base["tokens"] + stats.tokens, bytes_written=stats.bytes,
                          inflight_bytes=budget.inflight, stage_seconds=stats.times.as_dict(),
                          device_memory_bytes=_device_memory(p.cfg, p.device))
        progress.update(stats.tokens, stats.samples, len(published), len(owned))

    # Resumed work counts as done from the first heartbeat of the run, so the rate anchor taken
    # here does not see the jump to it (a resume read as 50x the real tokens/s).
    status.update(force=True, phase=RankPhase.RUNNING, shards_owned=len(owned), samples_done=base["samples"],
                  tokens_done=base["tokens"])
    try:
        stats = run_pipeline(owned, forward, output=p.output, shape=p.shape, device=p.device,
                             pad_id=p.manifest.pad_token_id, max_inflight_bytes=p.cfg.max_inflight_bytes,
                             writer_threads=writers, on_published=on_published, should_stop=should_stop,
                             on_batch=on_batch, on_nonfinite=p.cfg.on_nonfinite,
                             compression_level=p.manifest.compression_level)
        # the last batch's counts too
        progress.update(stats.tokens, stats.samples, len(published), len(owned))
        return stats, False
    except GroupStopped:  # a partner ended: the shards in flight were abandoned, a rerun computes them
        return latest, True
    except BaseException as exc:
        if latest.failed_shard is not None:  # a writer failed: the error names its shard, not the device's
            status.update(force=True, shard=latest.failed_shard)
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            raise _disk_full(p, exc) from exc
        raise
    finally:
        progress.close()  # the bar ends (and logging is given back) before any summary or error prints


def _follow_shards(p: Prepared, owned: list[ShardPlan], status: StatusReporter, stop: StopFlag,
                   runner: TargetRunner, agreement: GroupAgreement, lanes: int) -> Computed:
    """A writer's partner: the same forwards, batch for batch, and nothing written.

    It runs the writer's schedule (same shards, same lanes) and agrees with the writer before each
    batch, as the writer's pipeline asks (``_AgreedStop``): a stop begins no shard, the open ones
    are finished. Its status counts shards it computed; its samples and tokens stay 0 (the writer's
    count them: a monitor summing ranks would count a group's work once per rank).
    """
    stats = PipelineStats()
    status.event(EventKind.STARTED, f"computing {len(owned)} shards on {p.device} with the writer of its "
                 "model-parallel group", shards=[s.shard_id for s in owned], device=str(p.device))
    status.update(force=True, phase=RankPhase.RUNNING, shards_owned=len(owned))
    schedule = ShardSchedule(owned, lanes)
    drained = False
    while True:
        agreed = agreement.agree(DRAIN if stop() else GO)
        if agreed == END:
            return Computed(stats, group_stopped=True)
        if agreed == DRAIN:
            schedule.drain()
            drained = True
        step = schedule.next()
        if step is None:
            break
        stats.current_shard = step.shard.shard_id
        ids, _ = collate(step.batch, p.manifest.pad_token_id, p.device)
        runner.compute_only(ids)
        stats.samples += len(step.batch)
        stats.tokens += sum(s.length for s in step.batch)
        status.update(phase=RankPhase.RUNNING, shard=step.shard.shard_id,
                      device_memory_bytes=_device_memory(p.cfg, p.device))
        if step.closes:
            stats.shards += 1
            status.update(force=True, shards_done=stats.shards, shard=None)
    agreement.close()
    return Computed(stats, group_stopped=drained)


@contextmanager
def _model_group(p: Prepared, topology: Topology, status: StatusReporter,
                 run_id: str) -> Iterator[GroupAgreement]:
    """This rank inside its model-parallel group, watched: a partner that fails, dies or falls silent
    ends this rank too (never a hang), and a collective that fails because of one says so."""
    agreement = join_group(topology, p.device, job_store(topology))

    def abandon(reason: str) -> None:  # the watch thread: this rank is stuck in a collective
        error = group_error(reason, topology)
        log.error("%s", error)
        status.update(force=True, phase=RankPhase.FAILED, last_error=str(error))
        status.event(EventKind.ERROR, str(error))
        logging.shutdown()
        os._exit(1)  # the main thread cannot be woken from a collective; the group's shards wait for a rerun

    watch = PartnerWatch(p.paths, topology, run_id, p.cfg.rank_timeout, abandon)
    watch.start()
    try:
        yield agreement
    except RuntimeError as exc:  # how a collective fails (gloo at once, NCCL at its timeout)
        reason = watch.wait_gone()
        if reason is not None:
            raise group_error(reason, topology) from exc
        raise
    finally:
        watch.stop()
    leave_group()


def _disk_full(p: Prepared, exc: OSError) -> DiskFullError:
    done = p.output.scan()  # other ranks publish too
    space = disk_space(p.output, p.plan, done, p.cfg.writers)
    return DiskFullError(
        f"disk full while writing {p.paths.shards_dir} ({exc.strerror}): {len(done)} of {len(p.plan.shards)} shards "
        f"are published and intact; the rest needs {space.needed / 1e9:.3f} GB and {space.free / 1e9:.3f} GB is free. "
        "Free space, then rerun the same command to resume"
    )
