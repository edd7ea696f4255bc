"""The writer lanes: the host ring's batches -> shard tars, one shard per thread, each published whole."""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from dspark_cache.format.codec import DEFAULT_LEVEL
from dspark_cache.format.geometry import SampleShape
from dspark_cache.format.sample import INPUT_IDS, LOSS_MASK
from dspark_cache.format.schema import ShardIndex
from dspark_cache.format.tar.writer import SampleToWrite, ShardWriter
from dspark_cache.producer.pipeline.host_ring import Region, HostRing
from dspark_cache.producer.pipeline.tensors import byte_view
from dspark_cache.producer.pipeline.timing import BatchClock, StageTimes
from dspark_cache.producer.plan.batches import PlannedSample, ShardPlan
from dspark_cache.storage.output import CacheOutput

log = logging.getLogger(__name__)


class NonFiniteError(Exception):
    """The target produced NaN/inf for a sample and the policy is ``error``."""


@dataclass
class PipelineStats:
    current_shard: int | None = None  # the shard the device is computing
    failed_shard: int | None = None  # the shard a writer failed on (a failed run names it, not current_shard)
    samples: int = 0
    tokens: int = 0
    bytes: int = 0
    shards: int = 0
    times: StageTimes = field(default_factory=StageTimes)


@dataclass
class WriteJob:
    """One batch in the host ring: its samples' tensors are views of ``region`` in the host ring."""

    shard: ShardPlan
    samples: list[PlannedSample]
    # per sample: its stored float tensors (states, FP8 scales) by name
    tensors: list[dict[str, torch.Tensor]]
    finite: torch.Tensor  # bool [B], host (in the region too)
    ready: torch.cuda.Event | None  # recorded after the last copy into the region
    region: Region
    clock: BatchClock
    closes_shard: bool


class WriterLanes:
    """``count`` writer threads, one shard open on each (see ``schedule``): each appends its
    batches to its shard in order and publishes the shard when its last batch is in.

    A batch's region goes back to the ring once its bytes are in the shard file (or the batch is
    dropped after an error), which is what lets the main thread copy the next one in. The first
    error of any lane stops every lane: their unfinished shards are abandoned (a rerun recomputes
    them); published shards stay published.
    """

    def __init__(self, count: int, output: CacheOutput, shape: SampleShape, ring: HostRing,
                 stats: PipelineStats, on_published: Callable[[ShardPlan, ShardIndex], None],
                 on_nonfinite: str = "error", durable: bool = True,
                 compression_level: int = DEFAULT_LEVEL) -> None:
        self.output, self.shape, self.ring, self.stats = output, shape, ring, stats
        self.compression_level = compression_level  # of a compressed shape's samples, made on the lanes
        self.on_nonfinite, self.durable = on_nonfinite, durable
        self.cache_id = output.cache_id  # every index this run publishes carries it
        self._announce = threading.Lock()  # progress callbacks one at a time, whichever lane calls
        self._count = threading.Lock()  # the shared counts
        self._on_published = on_published
        self.error: BaseException | None = None
        self.failed_shard: int | None = None
        self.lanes = [_Lane(self, i) for i in range(count)]

    def start(self) -> None:
        for lane in self.lanes:
            lane.start()

    def put(self, lane: int, job: WriteJob) -> None:
        self.lanes[lane].jobs.put(job)

    def close(self) -> None:
        """No more jobs: each lane finishes what it was given, then ends; unfinished shards are abandoned."""
        for lane in self.lanes:
            lane.jobs.put(None)
        for lane in self.lanes:
            if lane.ident is not None:  # started (a failed start leaves the rest unstarted)
                lane.join()
        for lane in self.lanes:
            lane.abandon()
        # Each lane refers back to this object: let go of them, or the ring (host memory the size of
        # --max-inflight-bytes) would wait for the cyclic garbage collector.
        self.lanes = []

    def fail(self, exc: BaseException, shard: int) -> None:
        """A lane's first error stops every lane; ``failed_shard`` is the shard it was writing."""
        with self._count:
            if self.error is None:
                self.error, self.failed_shard = exc, shard

    def published(self, shard: ShardPlan, index: ShardIndex) -> None:
        with self._announce:
            self._on_published(shard, index)

    def counted(self, samples: int, tokens: int, seconds: float, *,
                published: ShardIndex | None = None) -> None:
        with self._count:
            self.stats.samples += samples
            self.stats.tokens += tokens
            self.stats.times.write += seconds
            if published is not None:
                self.stats.bytes += published.tar_bytes
                self.stats.shards += 1

    def waited(self, job: WriteJob, seconds: float) -> None:
        with self._count:
            times = self.stats.times
            times.wait += seconds
            times.device += job.clock.seconds("forward", "forward_done")
            times.copy += job.clock.seconds("copy", "copy_done")


class _Lane(threading.Thread):
    """One writer thread and the shard open on it."""

    def __init__(self, lanes: WriterLanes, number: int) -> None:
        super().__init__(name=f"dspark-writer-{number}", daemon=True)
        self.lanes = lanes
        self.jobs: queue.Queue[WriteJob | None] = queue.Queue()
        self._writer: ShardWriter | None = None
        self._nonfinite: list[int] = []

    def run(self) -> None:
        lanes = self.lanes
        while (job := self.jobs.get()) is not None:
            try:
                try:
                    self._wait_for_copy(job)
                    appended = lanes.error is None and self._append(job)
                finally:
                    # The bytes are in the file (or the batch is dropped): the device may copy into
                    # this space while the shard is published (fsync, rename, index; an upload's wait).
                    lanes.ring.release(job.region)
                if appended and job.closes_shard:
                    self._publish(job.shard)
            except BaseException as exc:  # surfaced to the main thread, which stops cleanly
                lanes.fail(exc, job.shard.shard_id)
                self.abandon()

    def _wait_for_copy(self, job: WriteJob) -> None:
        """Block until the batch is in host memory; then its CUDA stage times can be read."""
        if job.ready is None:
            return
        started = time.perf_counter()
        job.ready.synchronize()
        self.lanes.waited(job, time.perf_counter() - started)

    def _append(self, job: WriteJob) -> bool:
        started = time.perf_counter()
        lanes = self.lanes
        shape = lanes.shape
        if self._writer is None:
            self._writer = ShardWriter(lanes.output.paths, job.shard.shard_id, durable=lanes.durable,
                                       cache_id=lanes.cache_id, compression_level=lanes.compression_level)
        samples = []
        for sample, in_ring, finite in zip(job.samples, job.tensors, job.finite.tolist()):
            if not finite:
                self._drop_nonfinite(sample, job.shard)
                continue
            # The writer takes buffers: the ring's tensors as byte views, ids and mask as they are.
            buffers = {name: byte_view(t) for name, t in in_ring.items()}
            buffers.update({INPUT_IDS: sample.input_ids, LOSS_MASK: sample.loss_mask})
            samples.append(SampleToWrite(sample.sample_id, sample.loss_tokens, shape.specs(sample.length),
                                         shape.metadata(sample.sample_id), buffers))
        self._writer.append_samples(samples)
        lanes.counted(len(samples), sum(s.specs[-1].shape[0] for s in samples), time.perf_counter() - started)
        return True

    def _drop_nonfinite(self, sample: PlannedSample, shard: ShardPlan) -> None:
        if self.lanes.on_nonfinite == "error":
            raise NonFiniteError(
                f"the target produced non-finite hidden states for sample {sample.sample_id} (input "
                f"row {sample.sample_id}); nothing was written for shard {shard.shard_id}. Check the "
                "target and --compute-dtype, or pass --on-nonfinite skip to drop such samples (listed "
                "in the manifest)"
            )
        log.warning("sample %d has non-finite hidden states: dropped", sample.sample_id)
        self._nonfinite.append(sample.sample_id)

    def _publish(self, shard: ShardPlan) -> None:
        assert self._writer is not None
        started = time.perf_counter()
        # Announced once readers see it: at once in a directory, when its index is on the store for a remote cache.
        index = self.lanes.output.publish(self._writer, self._nonfinite,
                                          lambda index: self.lanes.published(shard, index))
        self._nonfinite = []
        self._writer = None
        self.lanes.counted(0, 0, time.perf_counter() - started, published=index)

    def abandon(self) -> None:
        """Drop an unfinished shard (its .partial is removed; a rerun recomputes it)."""
        if self._writer is not None:
            self._writer.abort()
            self._writer = None
        self._nonfinite = []
