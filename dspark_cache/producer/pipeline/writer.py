"""The writer thread: staged batches -> shard tars, in plan order, each shard published whole."""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from dspark_cache.format.geometry import SampleShape
from dspark_cache.format.output import CacheOutput
from dspark_cache.format.sample import INPUT_IDS, LOSS_MASK
from dspark_cache.format.schema import ShardIndex
from dspark_cache.format.tar.writer import ShardWriter
from dspark_cache.producer.plan.batches import PlannedSample, ShardPlan
from dspark_cache.producer.pipeline.staging import Region, StagingRing
from dspark_cache.producer.pipeline.tensors import byte_view
from dspark_cache.producer.pipeline.timing import BatchClock, StageTimes

log = logging.getLogger(__name__)


class NonFiniteError(Exception):
    """The target produced NaN/inf for a sample and the policy is ``error``."""


@dataclass
class PipelineStats:
    current_shard: int | None = None  # the shard the device is computing
    samples: int = 0
    tokens: int = 0
    bytes: int = 0
    shards: int = 0
    times: StageTimes = field(default_factory=StageTimes)


@dataclass
class WriteJob:
    """One staged batch: its samples' tensors are views of ``region`` in the staging ring."""

    shard: ShardPlan
    samples: list[PlannedSample]
    tensors: list[dict[str, torch.Tensor]]  # per sample: its stored float tensors (states, FP8 scales) by name
    finite: torch.Tensor  # bool [B], host (in the region too)
    ready: torch.cuda.Event | None  # recorded after the last copy into the region
    region: Region
    clock: BatchClock
    closes_shard: bool


class ShardWriterThread(threading.Thread):
    """Appends staged batches to shards in plan order and publishes each finished shard.

    A batch's region goes back to the ring once its bytes are in the shard file (or the batch
    is dropped after an error), which is what lets the main thread stage the next one.
    """

    def __init__(self, output: CacheOutput, shape: SampleShape, ring: StagingRing, stats: PipelineStats,
                 on_published: Callable[[ShardPlan, ShardIndex], None], on_nonfinite: str = "error",
                 durable: bool = True) -> None:
        super().__init__(name="dspark-writer", daemon=True)
        self.output, self.paths = output, output.paths
        self.shape, self.ring, self.stats = shape, ring, stats
        self.on_published = on_published
        self.on_nonfinite = on_nonfinite
        self.durable = durable
        self.cache_id = output.cache_id  # every index this run publishes carries it
        self._nonfinite: list[int] = []
        self.jobs: queue.Queue[WriteJob | None] = queue.Queue()
        self.error: BaseException | None = None
        self._writer: ShardWriter | None = None

    def run(self) -> None:
        while (job := self.jobs.get()) is not None:
            try:
                self._wait_for_copy(job)
                if self.error is None:
                    self._write(job)
            except BaseException as exc:  # surfaced to the main thread, which stops cleanly
                self.error = exc
                self.abandon()
            finally:
                self.ring.release(job.region)

    def _wait_for_copy(self, job: WriteJob) -> None:
        """Block until the batch is in host memory; then its CUDA stage times can be read."""
        if job.ready is None:
            return
        started = time.perf_counter()
        job.ready.synchronize()
        times = self.stats.times
        times.wait += time.perf_counter() - started
        times.device += job.clock.seconds("forward", "forward_done")
        times.copy += job.clock.seconds("copy", "copy_done")

    def _write(self, job: WriteJob) -> None:
        started = time.perf_counter()
        if self._writer is None:
            self._writer = ShardWriter(self.paths, job.shard.shard_id, durable=self.durable,
                                       cache_id=self.cache_id)
        for sample, staged, finite in zip(job.samples, job.tensors, job.finite.tolist()):
            if not finite:
                self._drop_nonfinite(sample, job.shard)
                continue
            # The writer takes buffers: the staged tensors as byte views, ids and mask as they are.
            buffers = {name: byte_view(t) for name, t in staged.items()}
            buffers.update({INPUT_IDS: sample.input_ids, LOSS_MASK: sample.loss_mask})
            self._writer.append(sample.sample_id, sample.loss_tokens, self.shape.specs(sample.length),
                                self.shape.metadata(sample.sample_id), buffers)
            self.stats.samples += 1
            self.stats.tokens += sample.length
        if job.closes_shard:
            self._publish(job.shard)
        self.stats.times.write += time.perf_counter() - started

    def _drop_nonfinite(self, sample: PlannedSample, shard: ShardPlan) -> None:
        if self.on_nonfinite == "error":
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
        # Announced once readers see it: at once in a directory, when its index is on the store for a remote cache.
        index = self.output.publish(self._writer, self._nonfinite, lambda index: self.on_published(shard, index))
        self._nonfinite = []
        self.stats.bytes += index.tar_bytes
        self.stats.shards += 1
        self._writer = None

    def abandon(self) -> None:
        """Drop an unfinished shard (its .partial is removed; a rerun recomputes it)."""
        if self._writer is not None:
            self._writer.abort()
            self._writer = None
        self._nonfinite = []
