"""The producer's host side at GPU rates, on a CPU machine: does the device ever wait for the writers?

A synthetic device hands ready batches of the Qwen3-8B DSpark layout (H=4096, 5 captured layers
plus the final state stored apart, bf16: 49,152 bytes a token; long-tail chat lengths) through the
real host ring, writer lanes and publication (``run_pipeline``) into ``--dir`` (default
``/dev/shm``, so the disk is not the limit). On a GPU the device-to-host copy is DMA and costs no
CPU, so the synthetic device charges none: the ring is filled once, and each batch's region is
handed over as it lies (``SyntheticDevice``). Every shard file is deleted once published (raw
files once written), by a thread of its own, so that runs long enough for the pipeline's fill and
drain not to matter fit a RAM file system.

Measured, each ``--repeat`` times, the kinds interleaved so that they share the machine's moods:

  raw_write_gbps[n]   the same bytes, in files of the same sizes, written by plain ``os.write`` (8 MiB
                      a call) by n threads from a buffer the size of our host ring (each file by one
                      thread, fsynced as ours are): the limit of this file system on this machine, its
                      scaling included
  writer_gbps[n]      our writers alone (n lanes), the device instant
  pipeline_efficiency the device producing at 0.9x the best writer rate, through the pipeline with
                      the best writer count: max(device time, writers-alone time) / pipeline time

    python bench/host_path.py --json .bench/host_path.json
    python bench/host_path.py --dir /mnt/nvme/bench --repeat 5
    python bench/host_path.py --compression zstd      # the lanes compress (issue 42)

With ``--compression zstd`` the lanes compress every sample (byte planes + zstd, ``format.codec``) and
the ring holds bf16 states shaped like a model's (normal values, per-channel scales) instead of a
constant byte, which zstd would compress for free; every GB/s is then of states (uncompressed bytes)
handed to the writers, and the bytes on disk are reported beside them. Raw writes still write the
uncompressed sizes: the file system's limit, against which compression only has to keep up.

Goals (issue "Capture at the device's speed"): best writers >= 0.8x best raw; writers scale from 1
to 2 threads at least 0.9x as well as raw writes do; pipeline >= 0.9.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from dataclasses import replace  # noqa: E402

from dspark_cache.format.geometry import SampleShape  # noqa: E402
from dspark_cache.format.paths import CachePaths  # noqa: E402
from dspark_cache.format.tar.append import native_available  # noqa: E402
from dspark_cache.producer.pipeline.host_ring import Region  # noqa: E402
from dspark_cache.producer.pipeline.loop import run_pipeline  # noqa: E402
from dspark_cache.producer.pipeline.timing import BatchClock  # noqa: E402
from dspark_cache.producer.plan.batches import PlannedSample, ShardPlan  # noqa: E402
from dspark_cache.storage.output import CacheOutput  # noqa: E402

# Qwen3-8B: 36 layers, H=4096. Five captured layers that leave out the last, so the final state is
# stored apart: 6 x 4096 bf16 values = 49,152 bytes a token.
QWEN3_8B = SampleShape((1, 9, 17, 25, 33), 36, 4096, "BF16")
_STATES = 64 << 20  # bytes of model-like states, tiled over the ring for --compression


def model_like_states(nbytes: int, seed: int = 0) -> torch.Tensor:
    """bf16 states shaped like a hidden state's: normal values with a scale per channel (a few channels
    far larger, as real models have), as raw bytes."""
    g = torch.Generator().manual_seed(seed)
    hidden = QWEN3_8B.hidden_size
    scale = torch.exp(torch.randn(hidden, generator=g) * 0.5)
    scale[torch.randperm(hidden, generator=g)[:8]] *= 50
    rows = nbytes // (2 * hidden)
    return (torch.randn(rows, hidden, generator=g) * scale).to(torch.bfloat16).view(torch.uint8).reshape(-1)
RAW_CHUNK = 8 << 20


def long_tail_lengths(samples: int, seed: int, longest: int) -> list[int]:
    """Chat lengths as users' data has them: lognormal (median ~490, mean ~740 tokens), a long tail
    cut at ``longest``."""
    rng = random.Random(seed)
    return [max(8, min(longest, int(rng.lognormvariate(6.2, 0.9)))) for _ in range(samples)]


def plan(lengths: list[int], batch_tokens: int, shard_samples: int) -> list[ShardPlan]:
    """Length-grouped batches under a padded-token budget, whole batches to a shard (as the planner)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    samples = {i: PlannedSample(i, np.zeros(lengths[i], dtype=np.int32), np.ones(lengths[i], dtype=np.uint8))
               for i in order}
    batches: list[list[PlannedSample]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * batches[-1][0].length <= batch_tokens:
            batches[-1].append(samples[i])
        else:
            batches.append([samples[i]])
    rng = random.Random(1)
    rng.shuffle(batches)  # shards mix long and short batches, as the planner's do
    shards, current = [], []
    for batch in batches:
        current.append(batch)
        if sum(len(b) for b in current) >= shard_samples:
            shards.append(ShardPlan(len(shards), current))
            current = []
    if current:
        shards.append(ShardPlan(len(shards), current))
    return shards


class SyntheticEvent:
    """A batch the synthetic device finishes at ``ready_at`` (``time.perf_counter``)."""

    def __init__(self, ready_at: float) -> None:
        self.ready_at = ready_at

    def synchronize(self) -> None:
        left = self.ready_at - time.perf_counter()
        if left > 0:
            time.sleep(left)


class SyntheticDevice:
    """A GPU that computes ``gbps`` of states (``None``: instantly) and copies them by DMA.

    Its ``forward`` is queued as the producer's is, before the batch's ring region is claimed: the
    batch is computed from the later of the device's last batch and the moment it was queued, and
    is ready for the writers once computed and its region claimed. The copy costs no CPU: the ring
    is filled once (not timed: a GPU's ring is faulted in when pinned) and each region is handed
    over as it lies.
    """

    def __init__(self, gbps: float | None, shape: SampleShape = QWEN3_8B) -> None:
        self.gbps = gbps
        self.shape = shape
        self.filled: set[int] = set()
        self.device_seconds = 0.0
        self.fill_seconds = 0.0
        self._busy_until = 0.0

    def forward(self, ids: torch.Tensor, mask: torch.Tensor):
        """Nothing to compute (the states are in the ring already): the device's clock runs on."""
        if self.gbps is not None:
            seconds = int(mask.sum()) * QWEN3_8B.data_size(1) / (self.gbps * 1e9)
            self.device_seconds += seconds
            self._busy_until = max(self._busy_until, time.perf_counter()) + seconds
        b = ids.shape[0]
        hidden = torch.empty((b, 0, len(QWEN3_8B.layer_ids) * QWEN3_8B.hidden_size), dtype=torch.bfloat16)
        return hidden, torch.empty((b, 0, QWEN3_8B.hidden_size), dtype=torch.bfloat16)

    def synchronize(self) -> None:
        pass

    def copy_in(self, region: Region, shapes, names, stored, finite, lengths, clock: BatchClock):
        ring = region.ring
        if id(ring) not in self.filled:
            started = time.perf_counter()
            if self.shape.compressed:  # states a codec sees as a model's, not a constant byte
                block = ring.block.view(-1)
                states = model_like_states(min(_STATES, block.numel()))
                for at in range(0, block.numel(), states.numel()):
                    block[at : at + states.numel()] = states[: block.numel() - at]
            else:
                ring.block.fill_(0x5A)
            self.fill_seconds += time.perf_counter() - started
            self.filled.add(id(ring))
        views = iter(region.views(shapes))
        in_ring = [{name: next(views) for name in names} for _ in lengths]
        finite_host = next(views)
        finite_host.fill_(True)
        clock.mark("copy")
        clock.mark("copy_done")
        if self.gbps is None:
            return in_ring, finite_host, None
        return in_ring, finite_host, SyntheticEvent(max(self._busy_until, time.perf_counter()))


class Reaper:
    """Deletes written files on a thread of its own, for ours and raw alike: long runs fit a RAM file
    system, and no writer pays for the deletes (ours would, under the lock that orders publications)."""

    def __init__(self) -> None:
        self._paths: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (path := self._paths.get()) is not None:
            os.unlink(path)

    def delete(self, path: str) -> None:
        self._paths.put(path)

    def close(self) -> None:
        self._paths.put(None)
        self._thread.join()


def run_ours(shards: list[ShardPlan], workdir: str, writers: int, gbps: float | None, budget: int,
             durable: bool, shape: SampleShape = QWEN3_8B, level: int = 1) -> tuple[float, int, float]:
    """(seconds, bytes written, the synthetic device's own seconds) for one pipeline run."""
    out = tempfile.mkdtemp(dir=workdir, prefix="ours-")
    try:
        paths = CachePaths(out)
        os.makedirs(paths.shards_dir, exist_ok=True)
        device = SyntheticDevice(gbps, shape)
        reaper = Reaper()
        started = time.perf_counter()
        stats = run_pipeline(
            shards,
            device.forward,
            output=CacheOutput(out),
            shape=shape,
            device=torch.device("cpu"),
            pad_id=0,
            max_inflight_bytes=budget,
            writer_threads=writers,
            check_finite=False,
            durable=durable,
            copier=device,
            compression_level=level,
            on_published=lambda shard, index: reaper.delete(paths.shard_tar(shard.shard_id)),
        )
        seconds = time.perf_counter() - started - device.fill_seconds
        reaper.close()
        assert stats.shards == len(shards), (stats.shards, len(shards))
        return seconds, stats.bytes, device.device_seconds
    finally:
        shutil.rmtree(out, ignore_errors=True)


def run_raw(sizes: list[int], workdir: str, threads: int, source: np.ndarray, durable: bool) -> float:
    """Seconds to write files of ``sizes`` with ``threads`` threads, each file whole by one thread, from
    ``source`` (as large as our host ring, so that both read memory, not a cached buffer)."""
    out = tempfile.mkdtemp(dir=workdir, prefix="raw-")
    view = memoryview(source)
    reaper = Reaper()
    try:
        def write(files: list[tuple[int, int]], start: int) -> None:
            at = start
            for number, size in files:
                fd = os.open(
                    os.path.join(out, f"file-{number}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644
                )
                try:
                    left = size
                    while left:
                        at = 0 if at + RAW_CHUNK > len(view) else at
                        done = os.write(fd, view[at : at + min(left, RAW_CHUNK)])
                        left -= done
                        at += done
                    if durable:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                reaper.delete(os.path.join(out, f"file-{number}"))

        files = list(enumerate(sizes))
        workers = [threading.Thread(target=write, args=(files[i::threads], i * len(view) // threads))
                   for i in range(threads)]
        started = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return time.perf_counter() - started
    finally:
        reaper.close()
        shutil.rmtree(out, ignore_errors=True)


def shard_sizes(shards: list[ShardPlan]) -> list[int]:
    from dspark_cache.format.tar.writer import predict_shard_bytes

    return [predict_shard_bytes(QWEN3_8B, s.sample_ids.tolist(), s.lengths.tolist()) for s in shards]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--json", default=os.path.join(ROOT, ".bench", "host_path.json"), help="where the results go"
    )
    p.add_argument("--dir", default="/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir(),
                   help="the file system written to (default /dev/shm: the disk is not the limit)")
    p.add_argument("--samples", type=int, default=256, help="samples a run writes (~36 MB each on average)")
    p.add_argument("--shard-samples", type=int, default=8, help="samples a shard holds (~290 MB shards)")
    p.add_argument("--batch-tokens", type=int, default=8192,
                   help="padded tokens a batch holds (default: dspark-produce's, 4 x 2048)")
    p.add_argument("--longest", type=int, default=4096, help="the longest sample, in tokens")
    p.add_argument("--threads", default=None, help="writer counts to measure, e.g. 1,2,4 (default 1..cores)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--max-inflight-bytes", type=int, default=1 << 30)
    p.add_argument("--no-durable", action="store_true", help="skip fsync (ours and raw alike)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compression", choices=["none", "zstd"], default="none",
                   help="zstd: the lanes compress every sample (GB/s are then of states, not of bytes on "
                   "disk)")
    p.add_argument("--compression-level", type=int, default=1)
    args = p.parse_args()
    shape = replace(QWEN3_8B, compression=args.compression)

    cores = os.cpu_count() or 1
    counts = [int(x) for x in args.threads.split(",")] if args.threads else list(range(1, cores + 1))
    durable = not args.no_durable
    shards = plan(
        long_tail_lengths(args.samples, args.seed, args.longest), args.batch_tokens, args.shard_samples
    )
    sizes = shard_sizes(shards)
    total = sum(sizes)
    source = np.full(args.max_inflight_bytes, 0x5A, dtype=np.uint8)
    os.makedirs(args.dir, exist_ok=True)
    print(f"{len(shards)} shards, {total / 1e9:.2f} GB, to {args.dir}; native writer: {native_available()}; "
          f"counts {counts}, {args.repeat} repetitions", flush=True)

    raw: dict[int, list[float]] = {n: [] for n in counts}
    ours: dict[int, list[float]] = {n: [] for n in counts}
    on_disk: list[int] = []
    codec = (shape, args.compression_level)
    # warm-up: imports, first pages
    run_ours(shards[:1], args.dir, 1, None, args.max_inflight_bytes, durable, *codec)
    for rep in range(args.repeat):
        for n in counts:
            raw[n].append(total / run_raw(sizes, args.dir, n, source, durable) / 1e9)
            seconds, written, _ = run_ours(shards, args.dir, n, None, args.max_inflight_bytes, durable,
                                           *codec)
            assert written == total or shape.compressed, (written, total)
            on_disk.append(written)
            ours[n].append(total / seconds / 1e9)
            print(
                f"  rep {rep}: {n} thread(s): raw {raw[n][-1]:.2f} GB/s, ours {ours[n][-1]:.2f} GB/s",
                flush=True,
            )

    raw_gbps = {str(n): statistics.median(v) for n, v in raw.items()}
    writer_gbps = {str(n): statistics.median(v) for n, v in ours.items()}
    best = max(counts, key=lambda n: writer_gbps[str(n)])
    rate = 0.9 * writer_gbps[str(best)]
    efficiencies, pipeline_runs = [], []
    for rep in range(args.repeat):
        alone, _, _ = run_ours(shards, args.dir, best, None, args.max_inflight_bytes, durable, *codec)
        seconds, _, device = run_ours(shards, args.dir, best, rate, args.max_inflight_bytes, durable, *codec)
        pipeline_runs.append({"pipeline_s": seconds, "device_s": device, "writers_alone_s": alone})
        efficiencies.append(max(device, alone) / seconds)
        print(f"  pipeline rep {rep}: device {device:.2f} s, writers alone {alone:.2f} s, "
              f"pipeline {seconds:.2f} s: {efficiencies[-1]:.3f}", flush=True)

    best_raw = max(raw_gbps.values())
    result = {
        "raw_write_gbps": raw_gbps,
        "writer_gbps": writer_gbps,
        "pipeline_efficiency": statistics.median(efficiencies),
        "best_writers": best,
        "writer_vs_raw": writer_gbps[str(best)] / best_raw,
        "scaling_1_to_2": (
            {"raw": raw_gbps["2"] / raw_gbps["1"], "ours": writer_gbps["2"] / writer_gbps["1"]}
            if "1" in raw_gbps and "2" in raw_gbps
            else None
        ),
        "runs": {
            "raw": {str(k): v for k, v in raw.items()},
            "ours": {str(k): v for k, v in ours.items()},
            "pipeline": pipeline_runs,
        },
        "setup": {
            "dir": args.dir,
            "shards": len(shards),
            "bytes": total,
            "samples": args.samples,
            "bytes_per_token": QWEN3_8B.data_size(1),
            "durable": durable,
            "native_writer": native_available(),
            "cores": cores,
            "repeat": args.repeat,
            "device_gbps": rate,
            "compression": args.compression,
            "compression_level": args.compression_level,
            "bytes_on_disk": statistics.median(on_disk),
            "disk_ratio": statistics.median(on_disk) / total,
        },
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps({k: result[k] for k in ("raw_write_gbps", "writer_gbps", "pipeline_efficiency",
                                             "writer_vs_raw", "scaling_1_to_2")}, indent=2))
    if shape.compressed:
        print(f"bytes on disk: {result['setup']['disk_ratio']:.3f}x the states")


if __name__ == "__main__":
    main()
