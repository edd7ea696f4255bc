"""The producer's overlapped pipeline: device forward | device->host copy | shard writing.

The main thread runs the target on batch i+1 while batch i is trimmed to its real tokens on
the device and copied into the host ring (pinned host memory,
:mod:`~dspark_cache.producer.pipeline.host_ring`) on a side stream, and writer threads
(:mod:`~dspark_cache.producer.pipeline.writer`, one shard open on each, batches taken in the
order of :mod:`~dspark_cache.producer.pipeline.schedule`) append earlier batches to their shards. Host
memory is the ring: the main thread claims a batch's region before it queues the copies and
waits while the ring is full, so the ring's bytes never exceed ``--max-inflight-bytes`` (or one
batch, when a single batch is larger). Nothing in the loop waits for the device: the model's
masks are built without the host waiting on the device
(:mod:`~dspark_cache.producer.device.masks`) and the non-finite
check stays on the device until the writer reads it. FP8 caches are quantised on the device,
after that check and before the copy (:func:`stored_states`): half the bytes cross PCIe and
land in host memory.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from dspark_cache.format.codec import DEFAULT_LEVEL
from dspark_cache.format.geometry import SampleShape
from dspark_cache.format.sample import (
    HIDDEN,
    HIDDEN_SCALE,
    INPUT_IDS,
    LAST_HIDDEN,
    LAST_HIDDEN_SCALE,
    LOSS_MASK,
)
from dspark_cache.format.schema import ShardIndex
from dspark_cache.producer.pipeline.host_ring import HostCopier, HostRing, region_bytes, ring_capacity
from dspark_cache.producer.pipeline.schedule import ShardSchedule, Step
from dspark_cache.producer.pipeline.tensors import quantize_fp8, torch_dtype
from dspark_cache.producer.pipeline.timing import BatchClock
from dspark_cache.producer.pipeline.writer import PipelineStats, WriteJob, WriterLanes
from dspark_cache.producer.plan.batches import PlannedSample, ShardPlan
from dspark_cache.storage.output import CacheOutput

log = logging.getLogger(__name__)


def _positions_finite(x: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: all values at that position finite. max|x| is NaN or inf exactly when some
    value is, and is ~3.5x faster than ``isfinite().all()`` on CPU; one sample at a time keeps
    the temporary small on the device."""
    return torch.stack([row.abs().amax(-1).isfinite() for row in x])


def finite_flags(hidden: torch.Tensor, last: torch.Tensor | None, real: torch.Tensor) -> torch.Tensor:
    """Per sample: are all its real positions finite? Computed on the device; the host does not wait for it.

    ``real`` is the batch's ``[B, T]`` mask of real tokens, already on the device (collate's
    attention mask): building it from a list of lengths would copy pageable host memory to
    the device, which waits for the forward to finish and stalls the host every batch.
    """
    ok = _positions_finite(hidden)
    if last is not None:
        ok &= _positions_finite(last)
    return (ok | ~real.bool()).all(-1)


def stored_states(
    shape: SampleShape, hidden: torch.Tensor, last: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """The batch's ``[B, T, ...]`` float tensors as a sample stores them, by tensor name, on the
    device: the forward's outputs, or for an FP8 cache their float8 bytes and scales."""
    if not shape.fp8:
        return {HIDDEN: hidden} if last is None else {HIDDEN: hidden, LAST_HIDDEN: last}
    states, scales = quantize_fp8(hidden, shape.hidden_size, shape.dtype)
    out = {HIDDEN: states, HIDDEN_SCALE: scales}
    if last is not None:
        out[LAST_HIDDEN], out[LAST_HIDDEN_SCALE] = quantize_fp8(last, shape.hidden_size, shape.dtype)
    return out


_NOT_COPIED = (INPUT_IDS, LOSS_MASK)  # the writer takes these from the plan, not from the device


def _ring_names(shape: SampleShape) -> list[str]:
    """The tensors a sample takes from the device, in storage order (``shape.specs``)."""
    return [spec.name for spec in shape.specs(1) if spec.name not in _NOT_COPIED]


def _ring_shapes(
    shape: SampleShape, batch: list[PlannedSample]
) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Views a batch takes in the ring: each sample's stored float tensors (scales, hidden and final
    states), then the flags."""
    shapes: list[tuple[tuple[int, ...], torch.dtype]] = []
    for sample in batch:
        shapes += [(spec.shape, torch_dtype(spec.dtype)) for spec in shape.specs(sample.length)
                   if spec.name not in _NOT_COPIED]
    return shapes + [((len(batch),), torch.bool)]


def collate(
    batch: list[PlannedSample], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad a length-grouped batch to its longest sample (not to seq_length)."""
    width = max(s.length for s in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, sample in enumerate(batch):
        ids[row, : sample.length] = torch.from_numpy(sample.input_ids)
        mask[row, : sample.length] = 1
    if device.type == "cuda":
        return ids.pin_memory().to(device, non_blocking=True), mask.pin_memory().to(device, non_blocking=True)
    return ids, mask


Forward = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]


def run_pipeline(
    shards: list[ShardPlan],
    forward: Forward,
    *,
    output: CacheOutput,
    shape: SampleShape,
    device: torch.device,
    pad_id: int,
    max_inflight_bytes: int,
    writer_threads: int = 1,
    on_published: Callable[[ShardPlan, ShardIndex], None] = lambda shard, index: None,
    should_stop: Callable[[], bool] = lambda: False,
    on_batch: Callable[[PipelineStats, HostRing], None] = lambda stats, ring: None,
    on_nonfinite: str = "error",
    durable: bool = True,
    check_finite: bool = True,
    copier: HostCopier | None = None,
    compression_level: int = DEFAULT_LEVEL,
) -> PipelineStats:
    """Compute and write ``shards``; returns when all are published or a stop was honoured.

    ``writer_threads`` shards are in flight at once, each written by its own thread, in the order
    of :class:`~dspark_cache.producer.pipeline.schedule.ShardSchedule` (the cache's bytes do not
    depend on it). Shards are published through ``output``, which keeps its published set current.
    ``should_stop`` is asked before each batch: once it says yes no shard is begun, and the shards
    in flight are finished. ``check_finite=False`` and ``copier`` are for benchmarks with a fake
    device (one with no NaN to find; one whose batches are already in host memory). ``on_batch``
    sees the ring (``inflight``, ``peak``, ``capacity`` bytes) after each batch.
    """
    sizes = [region_bytes(_ring_shapes(shape, batch)) for shard in shards for batch in shard.batches]
    capacity = ring_capacity(max_inflight_bytes, max(sizes, default=0), sum(sizes))
    _warn_if_lanes_starve(capacity, sizes, writer_threads, len(shards))
    ring = HostRing(capacity, device.type == "cuda")
    stats = PipelineStats()
    # A compressed shape's samples are compressed by the lanes, each on its own thread (and core).
    writers = WriterLanes(writer_threads, output, shape, ring, stats, on_published, on_nonfinite, durable,
                          compression_level)
    step: _Step | None = None
    raised = True  # until the loop ends by itself
    try:
        writers.start()
        step = _Step(forward, shape, device, pad_id, check_finite, ring, writers, stats, copier)
        schedule = ShardSchedule(shards, writer_threads)
        # A failed writer ends the loop before the stop question: a model-parallel group asks that
        # question of every rank, and the writer's partners then hear "no more batches" instead.
        while writers.error is None:
            if should_stop():
                schedule.drain()
            if (planned := schedule.next()) is None:
                break
            stats.current_shard = planned.shard.shard_id
            if not step.run(planned):
                break
            on_batch(stats, ring)
        raised = False
    finally:
        try:
            writers.close()
            if raised and writers.error is not None:  # two failures: the main thread's goes up, this is told
                log.error("a writer failed too, on shard %s: %s", writers.failed_shard, writers.error)
        finally:
            # A batch claimed but never queued (an exception between claim and put) may still
            # be copying into the ring: no copy may run into memory being unpinned.
            if step is not None:
                step.copier.synchronize()
            ring.close()
    if writers.error is not None:
        stats.failed_shard = writers.failed_shard
        raise writers.error
    return stats


def _warn_if_lanes_starve(capacity: int, sizes: list[int], writers: int, shards: int) -> None:
    """Every writer has work only while the ring holds a batch for each and one being copied in: say so
    when it cannot (at large hidden sizes a batch is hundreds of MB)."""
    if not sizes or writers < 2 or shards < 2:
        return
    typical = sorted(sizes)[len(sizes) // 2]
    wanted = (min(writers, shards) + 1) * typical
    if capacity < min(wanted, sum(sizes)):
        log.warning("the host ring (--max-inflight-bytes, %.2f GB) holds about %d of this run's "
                    "batches (%.0f MB typical): %d writer threads cannot all be busy; pass "
                    "--max-inflight-bytes %d or more, or fewer --writer-threads",
                    capacity / 1e9, capacity // typical, typical / 1e6, writers, wanted)


class _Step:
    """One batch through the main thread: collate, forward, claim ring space, queue the copies."""

    def __init__(self, forward: Forward, shape: SampleShape, device: torch.device, pad_id: int,
                 check_finite: bool, ring: HostRing, writers: WriterLanes, stats: PipelineStats,
                 copier: HostCopier | None) -> None:
        self.forward, self.shape, self.device, self.pad_id = forward, shape, device, pad_id
        self.check_finite, self.ring, self.writers, self.stats = check_finite, ring, writers, stats
        self.cuda = device.type == "cuda"
        self.copier = copier or HostCopier(device)
        self.names = _ring_names(shape)

    def run(self, step: Step) -> bool:
        """Queue the batch for its lane's writer; False when a writer failed while we waited."""
        batch = step.batch
        times = self.stats.times
        clock = BatchClock(self.cuda)
        t0 = time.perf_counter()
        ids, mask = collate(batch, self.pad_id, self.device)
        times.data += time.perf_counter() - t0
        clock.mark("forward")
        hidden, last = self.forward(ids, mask)
        # On the values the target computed: an FP8 cache's quantisation (next) saturates.
        finite = (finite_flags(hidden, last, mask) if self.check_finite
                  else torch.ones(len(batch), dtype=torch.bool, device=hidden.device))
        stored = stored_states(self.shape, hidden, last)
        del hidden, last  # an FP8 batch's unquantised states can go as soon as they are quantised
        clock.mark("forward_done")
        shapes = _ring_shapes(self.shape, batch)
        t1 = time.perf_counter()
        region = self.ring.claim(region_bytes(shapes), abort=lambda: self.writers.error is not None)
        times.backpressure += time.perf_counter() - t1
        if region is None:
            return False
        in_ring, finite_host, ready = self.copier.copy_in(region, shapes, self.names, stored, finite,
                                                       [s.length for s in batch], clock)
        if ready is None:  # the stages ran on this thread: host times are exact
            times.device += clock.seconds("forward", "forward_done")
            times.copy += clock.seconds("copy", "copy_done")
        self.writers.put(step.lane, WriteJob(step.shard, batch, in_ring, finite_host, ready, region, clock,
                                             step.closes))
        return True
