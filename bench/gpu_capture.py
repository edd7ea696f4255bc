"""Capture efficiency at the Qwen3-8B shape: does the whole producer keep up with the forward alone?

    python bench/gpu_capture.py --out .bench/gpu_capture.json   # on one H100: ~4 minutes (estimated)
    python bench/gpu_capture.py --quick                         # a quarter of the rows: ~1.5 minutes
    python bench/gpu_capture.py --device cpu                    # the CPU mode: a tiny shape, the same code

Target: a Qwen3-8B-shaped model with random weights (36 layers, hidden 4,096, intermediate 12,288,
32 heads of 128, 8 KV heads, vocab 151,936, bf16; 16.4 GB), built on the GPU from its config (no
checkpoint, no network) and captured by the producer's own ``TargetRunner`` (its hooks, masks and
forward), handed the model in memory (:func:`in_memory_runner`). Layout: DSpark's, layers
(1, 9, 17, 25, 33) of 36 and the final state stored apart, bf16: 49,152 bytes a token. The CPU mode
builds a tiny model of the same structure (hidden 64, 6 layers, 5 captured + the final state).

Data: ``gpu_check.long_tail_lengths`` rows of up to ``--seq-length`` tokens, random ids, batched as
the planner does (length-grouped, ``--batch-tokens`` padded tokens a batch: dspark-produce's default,
4 x seq length), cut into ``--shards`` shards of about equal bytes. (The planner cuts shards by sample
count, so on a plan this small its first shard, of the longest rows, would hold a quarter of the bytes
at 32 samples a shard and keep one writer busy long after the others: equal shards stand for a window
of a long run, where neighbouring shards are alike.)

Steps, after a warm-up (every batch shape once, and a short pipeline run):
  forward alone  the same batches through collate, the forward and the finite check, nothing copied
                 to the host or written (``gpu_check.time_forward``, synchronised), first and last;
                 the faster of the two is the reference
  fp8            a short run each in BF16 and F8_E4M3 through a HostCopier that counts what it is asked to
                 copy: with FP8 only the codes and scales cross to the host (24,600 bytes a token, not
                 49,152), float8 already on the device; on CUDA the profiler's device-to-host memcpy
                 bytes must agree
  pipeline       ``run_pipeline`` with the real HostCopier, durable, with each of ``--writers`` (1, 2, 4, 8)
                 writer threads into ``--workdir`` (local disk) and ``--shm-dir`` (tmpfs), side by side,
                 then once more with the most writers and a ``--big-ring-bytes`` host ring: is the
                 ring (``--max-inflight-bytes``, dspark-produce's 1 GiB by default) what holds them back?
                 Then compressed (``--compression zstd``, level 1) with each of ``--zstd-writers`` (4, 8, 16)
                 writer threads into tmpfs: the lanes compress each sample (issue 42); do N cores keep up
                 with the device? (``gb_per_s`` is then of bytes on disk, ``states_gb_per_s`` of states)
                 A run that would end past ``--time-limit`` (420 s on CUDA) is skipped, and says so.

Per run: tokens/s, GB/s (published tar bytes), ``ratio`` = forward-alone seconds / pipeline seconds
(the goal: >= 0.95), ``steady_ratio`` = forward-alone seconds / the device's span from the first
forward's start to the last one's end (it leaves out ``head_s``, the ring's pinning before the first
forward, and ``tail_s``, the writers' drain after the last: costs a long run pays once), stage seconds
(``stats.times``) and the ring's peak. JSON to ``--out``, saved after every step (``"finished"`` says
whether it got to the end). Exit status 1 when a run failed or did not write every shard, or the FP8
check failed; the ratios are measurements, not failures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator
from unittest import mock

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here needs the hub: never wait for it
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.gpu_check import fresh_dir, long_tail_lengths, random_samples, sync, time_forward  # noqa: E402
from dspark_cache.format.geometry import SampleShape  # noqa: E402
from dspark_cache.format.sample import HIDDEN, INPUT_IDS, LAST_HIDDEN, LOSS_MASK  # noqa: E402
from dspark_cache.format.tar.append import native_available  # noqa: E402
from dspark_cache.format.tar.writer import predict_shard_bytes  # noqa: E402
from dspark_cache.producer.device.target import TargetRunner  # noqa: E402
from dspark_cache.producer.pipeline.host_ring import Region, HostCopier, HostRing  # noqa: E402
from dspark_cache.producer.pipeline.loop import Forward, run_pipeline  # noqa: E402
from dspark_cache.producer.pipeline.timing import BatchClock  # noqa: E402
from dspark_cache.producer.pipeline.writer import PipelineStats  # noqa: E402
from dspark_cache.producer.plan.batches import PlannedSample, ShardPlan  # noqa: E402
from dspark_cache.storage.output import CacheOutput  # noqa: E402
from tests.support.batching import length_grouped_batches, padding_waste  # noqa: E402

# In Qwen3Config's names. Captured: DSpark's five layers, never the last, so the final state is stored apart.
QWEN3_8B = dict(hidden_size=4096, num_hidden_layers=36, intermediate_size=12288, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936)
QWEN3_8B_LAYERS = (1, 9, 17, 25, 33)
TINY = dict(hidden_size=64, num_hidden_layers=6, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=2048)
TINY_LAYERS = (0, 1, 2, 3, 4)
BATCH_SAMPLES = 256  # dspark-produce's shard size, which caps its batches of short rows
GOAL = 0.95


# ----------------------------------------------------------------------------- the target

def build_model(dims: dict[str, int], device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A random-weight Qwen3 of these dimensions, allocated and initialised on ``device`` itself: an 8B
    model never passes through host memory or a file (writing and reloading 16 GB would take minutes)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(**dims, max_position_embeddings=32768, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.to(device)  # a no-op, unless a transformers release allocated elsewhere first


@contextlib.contextmanager
def loading_from_memory(model: torch.nn.Module) -> Iterator[None]:
    """While active, ``AutoModelForCausalLM.from_pretrained`` hands back ``model``, as loaded whole.

    ``TargetRunner`` loads from a path only; this lets it take a model built on the device, so that
    everything after the load (capture hooks, the sync-free masks and their check, the forward) is
    the producer's own code, not a copy of it."""
    from transformers import AutoModelForCausalLM

    def load(path: str, **kwargs: Any) -> tuple[torch.nn.Module, dict[str, list]]:
        if kwargs.get("dtype") not in (None, model.dtype):
            raise ValueError(f"the runner asks for {kwargs['dtype']}; the model in memory is {model.dtype}")
        return model, {"missing_keys": [], "mismatched_keys": []}

    with mock.patch.object(AutoModelForCausalLM, "from_pretrained", load):
        yield


def in_memory_runner(model: torch.nn.Module, layer_ids: tuple[int, ...], device: torch.device,
                     dtype: torch.dtype) -> TargetRunner:
    """The producer's runner over ``model``, handing out states in ``dtype``: what a BF16 cache's runner
    does, and an FP8 cache's too (the pipeline quantises)."""
    with loading_from_memory(model):
        return TargetRunner("<model built in memory>", list(layer_ids), model.config.num_hidden_layers,
                            device, dtype, dtype)


# ----------------------------------------------------------------------------- the plan

def equal_shards(batches: list[list[PlannedSample]], count: int) -> list[ShardPlan]:
    """Whole batches, in order, cut into at most ``count`` shards of about equal tokens (see above)."""
    total = sum(s.length for b in batches for s in b)
    shards: list[ShardPlan] = []
    current: list[list[PlannedSample]] = []
    done = 0
    for batch in batches:
        current.append(batch)
        done += sum(s.length for s in batch)
        if done * count >= total * (len(shards) + 1):
            shards.append(ShardPlan(len(shards), current))
            current = []
    if current:
        shards.append(ShardPlan(len(shards), current))
    return shards


def first_fraction(shards: list[ShardPlan], fraction: float) -> list[ShardPlan]:
    """The first shards that hold ``fraction`` of the tokens (one at least)."""
    total = sum(s.num_tokens for s in shards)
    out, tokens = [], 0
    for shard in shards:
        if out and tokens >= fraction * total:
            break
        out.append(shard)
        tokens += shard.num_tokens
    return out


def bytes_of(shards: list[ShardPlan], shape: SampleShape) -> int:
    return sum(predict_shard_bytes(shape, s.sample_ids.tolist(), s.lengths.tolist()) for s in shards)


def ring_bytes_per_token(shape: SampleShape) -> int:
    """What one token of this layout takes from the device: every stored tensor but ids and mask."""
    return sum(spec.nbytes for spec in shape.specs(1) if spec.name not in (INPUT_IDS, LOSS_MASK))


def file_system(path: str) -> str:
    """``"<type> on <mount point>"`` of the file system that holds ``path`` (Linux), else ``"unknown"``."""
    real, best = os.path.realpath(path), ("", "")
    with contextlib.suppress(OSError), open("/proc/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            if len(fields) < 3 or not (real == fields[1] or real.startswith(fields[1].rstrip("/") + "/")):
                continue
            if len(fields[1]) >= len(best[1]):
                best = (fields[2], fields[1])
    return f"{best[0]} on {best[1]}" if best[1] else "unknown"


def room_problem(directory: str, nbytes: int) -> str | None:
    """Why a run of ``nbytes`` cannot go to ``directory`` (too little free space), or None."""
    free = shutil.disk_usage(directory).free
    if free < nbytes * 1.05 + (1 << 30):
        return f"skipped: {free / 1e9:.1f} GB free in {directory}, a run writes {nbytes / 1e9:.1f} GB"
    return None


# ----------------------------------------------------------------------------- runs

class SpannedForward:
    """The target's forward, marking (on the device, no sync) when the first batch starts and the last
    one ends."""

    def __init__(self, forward: Forward, cuda: bool) -> None:
        self.forward = forward
        self.clock = BatchClock(cuda)
        self.calls = 0

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.calls:
            self.clock.mark("first")
        self.calls += 1
        out = self.forward(ids, mask)
        self.clock.mark("last")
        return out


def pipeline_run(shards: list[ShardPlan], forward: Forward, shape: SampleShape, device: torch.device,
                 base: str, writers: int, budget: int, copier: HostCopier | None = None) -> dict[str, Any]:
    """``shape`` compressed: the lanes compress (zstd level 1), ``bytes`` are then those on disk."""
    # One ``run_pipeline`` (durable) into a fresh directory under ``base``, removed afterwards.
    paths = fresh_dir(base, f"w{writers}")
    spanned = SpannedForward(forward, device.type == "cuda")
    ring = {"capacity": 0, "peak": 0}

    def seen(stats: PipelineStats, ring_now: HostRing) -> None:
        # the peak grows only at claims, made here
        ring.update(capacity=ring_now.capacity, peak=ring_now.peak)

    try:
        sync(device)
        spanned.clock.mark("start")
        started = time.perf_counter()
        stats = run_pipeline(shards, spanned, output=CacheOutput(paths.root), shape=shape, device=device,
                             pad_id=0, max_inflight_bytes=budget, writer_threads=writers, on_batch=seen,
                             on_nonfinite="skip", durable=True, copier=copier)
        sync(device)
        seconds = time.perf_counter() - started
    finally:
        shutil.rmtree(paths.root, ignore_errors=True)  # a run writes GBs: free them before the next
    head = spanned.clock.seconds("start", "first")
    span = spanned.clock.seconds("first", "last")
    return {
        "writers": writers, "max_inflight_bytes": budget, "pipeline_s": round(seconds, 3),
        "tokens_per_s": round(stats.tokens / seconds), "gb_per_s": round(stats.bytes / seconds / 1e9, 3),
        "forward_span_s": round(span, 3), "head_s": round(head, 3),
        "tail_s": round(seconds - head - span, 3),
        "batches": sum(len(s.batches) for s in shards), "shards": stats.shards, "samples": stats.samples,
        "dropped_nonfinite": sum(s.num_samples for s in shards) - stats.samples, "tokens": stats.tokens,
        "bytes": stats.bytes, "stage_seconds": stats.times.as_dict(), "ring_capacity": ring["capacity"],
        "ring_peak": ring["peak"], "complete": stats.shards == len(shards), "compression": shape.compression,
        "states_gb_per_s": round(stats.tokens * ring_bytes_per_token(shape) / seconds / 1e9, 3),
    }


class CountingCopier(HostCopier):
    """The real HostCopier, noting what each batch asks it to copy to the host: the stored tensors' dtype
    and device, and the bytes of their real tokens (plus the finite flags)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.copied = self.flags = self.tokens = self.region_bytes = 0
        self.tensors: dict[str, str] = {}

    def copy_in(self, region: Region, shapes: list[tuple[tuple[int, ...], torch.dtype]], names: list[str],
              stored: dict[str, torch.Tensor], finite: torch.Tensor, lengths: list[int], clock: BatchClock
              ) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor, torch.cuda.Event | None]:
        for name in names:
            tensor = stored[name]
            self.tensors[name] = f"{str(tensor.dtype).removeprefix('torch.')} on {tensor.device.type}"
            self.copied += sum(lengths) * tensor[0, 0].nbytes  # a token's row, copied per real token
        self.flags += finite.nbytes
        self.tokens += sum(lengths)
        self.region_bytes += region.size
        return super().copy_in(region, shapes, names, stored, finite, lengths, clock)


def profiled_dtoh(run: Callable[[], dict[str, Any]], device: torch.device, work: str
                  ) -> tuple[dict[str, Any], dict[str, Any]]:
    """``run()`` under the torch profiler: its result and the device-to-host memcpys the profiler saw. A
    profiler that cannot start or stop (no CUPTI) is reported, and the run goes on without it."""
    if device.type != "cuda":
        return run(), {"skipped": "CUDA only"}
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CUDA])
    try:
        prof.start()
    except Exception as exc:  # a failing profiler loses only this corroboration, never the run
        return run(), {"error": f"the profiler did not start: {exc}"}
    stop_error: Exception | None = None
    try:
        result = run()
    finally:
        try:
            prof.stop()
        except Exception as exc:
            stop_error = exc
    if stop_error is not None:
        return result, {"error": f"the profiler did not stop: {stop_error}"}
    trace = os.path.join(work, "dtoh-trace.json")
    try:
        prof.export_chrome_trace(trace)
        with open(trace) as handle:
            events = json.load(handle).get("traceEvents", [])
    except (OSError, ValueError) as exc:
        return result, {"error": f"no trace: {exc}"}
    finally:
        with contextlib.suppress(OSError):
            os.remove(trace)
    # Kineto names them "Memcpy DtoH (Device -> Pinned)", category "gpu_memcpy" ("Memcpy" in older releases).
    copies = [e for e in events
              if "memcpy" in str(e.get("cat", "")).lower() and "DtoH" in str(e.get("name", ""))]
    return result, {"events": len(copies), "names": sorted({str(e.get("name")) for e in copies}),
                    "bytes": sum(int((e.get("args") or {}).get("bytes", 0)) for e in copies)}


def check_fp8(shards: list[ShardPlan], runner: TargetRunner, bf16: SampleShape, device: torch.device,
              base: str, writers: int, budget: int) -> dict[str, Any]:
    """The same short run in BF16 and in F8_E4M3: the bytes asked of the copies (and, on CUDA, seen by
    the profiler) per token must be each layout's, and the FP8 states must be float8 on the device."""
    fp8 = SampleShape(bf16.layer_ids, bf16.num_layers, bf16.hidden_size, "F8_E4M3")
    result: dict[str, Any] = {"shards": len(shards), "tokens": sum(s.num_tokens for s in shards)}
    for label, shape in (("bf16", bf16), ("fp8", fp8)):
        copier = CountingCopier(device)
        run, dtoh = profiled_dtoh(lambda: pipeline_run(shards, runner.forward, shape, device, base, writers,
                                                       budget, copier=copier), device, base)
        part = result[label] = {
            "expected_bytes_per_token": ring_bytes_per_token(shape),
            "copied_bytes_per_token": copier.copied / copier.tokens if copier.tokens else 0.0,
            "copied_bytes": copier.copied + copier.flags, "ring_bytes_claimed": copier.region_bytes,
            "tensors": copier.tensors, "profiler_dtoh": dtoh, "pipeline_s": run["pipeline_s"],
            "complete": run["complete"], "ring_peak": run["ring_peak"],
        }
        if dtoh.get("events"):  # not one memcpy event: the profiler saw nothing, so it says nothing
            # Exact but for stray scalar reads (a host sync somewhere in the target's forward would add a
            # few bytes a batch); a bf16 state slipping through would double the bytes.
            part["profiler_extra_bytes"] = extra = dtoh["bytes"] - part["copied_bytes"]
            part["profiler_agrees"] = 0 <= extra <= 64 * run["batches"]
    result["fp8_over_bf16"] = round(result["fp8"]["copied_bytes_per_token"]
                                    / max(1.0, result["bf16"]["copied_bytes_per_token"]), 4)
    float8 = f"float8_e4m3fn on {device.type}"
    result["ok"] = (all(result[k]["complete"] and result[k].get("profiler_agrees", True)
                        and result[k]["copied_bytes_per_token"] == result[k]["expected_bytes_per_token"]
                        for k in ("bf16", "fp8"))
                    and all(result["fp8"]["tensors"].get(name) == float8 for name in (HIDDEN, LAST_HIDDEN)))
    return result


# ----------------------------------------------------------------------------- the whole check

@dataclass
class Settings:
    device: torch.device
    dims: dict[str, int]
    layer_ids: tuple[int, ...]
    rows: int
    seq_length: int
    batch_tokens: int
    shards: int
    writers: list[int]
    budget: int
    big_ring: int
    zstd_writers: list[int]
    fp8_fraction: float
    time_limit: float  # seconds from the start; 0: none
    work: str  # local disk
    shm: str | None  # tmpfs; None: no such runs
    out: str | None

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


class Capture:
    """The steps in order; the report is saved to ``--out`` after each, so that a run cut short by its
    machine's time limit still says what it measured."""

    def __init__(self, s: Settings) -> None:
        self.s = s
        self.started = time.perf_counter()
        self.report: dict[str, Any] = {"finished": False, "machine": {
            "python": platform.python_version(), "torch": torch.__version__, "cores": os.cpu_count(),
            "device": torch.cuda.get_device_name(s.device) if s.cuda else "cpu (CPU mode: tiny shape)",
            "native_writer": native_available()}, "settings": {
            "rows": s.rows, "writers": s.writers, "max_inflight_bytes": s.budget,
            "big_ring_bytes": s.big_ring, "time_limit_s": s.time_limit}, "runs": [], "failed": []}
        self.dirs = {"disk": s.work, "shm": s.shm}

    def save(self) -> None:
        self.report["seconds"] = round(time.perf_counter() - self.started, 1)
        if self.s.out:
            os.makedirs(os.path.dirname(os.path.abspath(self.s.out)), exist_ok=True)
            with open(self.s.out, "w") as handle:
                json.dump(self.report, handle, indent=2, default=str)

    def run(self) -> dict[str, Any]:
        self.build()
        self.plan()
        self.warm_up()
        self.check_fp8()  # before the long runs: cheap, and it must not be what a time limit cuts
        self.matrix()
        self.finish()
        return self.report

    def build(self) -> None:
        s = self.s
        built = time.perf_counter()
        # bf16 on a CPU too: one runner serves both layouts, as on a GPU (the tiny model's speed is moot)
        model = build_model(s.dims, s.device, torch.bfloat16)
        self.runner = in_memory_runner(model, s.layer_ids, s.device, torch.bfloat16)
        sync(s.device)
        self.shape = SampleShape(s.layer_ids, s.dims["num_hidden_layers"], s.dims["hidden_size"], "BF16")
        target = self.report["target"] = {
            "config": s.dims, "layer_ids": list(s.layer_ids), "compute_dtype": "bf16",
            "weights_gb": round(self.runner.weight_bytes / 1e9, 2),
            "build_s": round(time.perf_counter() - built, 1), "mask_path_sync_free": self.runner.masks_without_waiting,
            "bytes_per_token": ring_bytes_per_token(self.shape),
            "gpu_memory_gb": round(torch.cuda.memory_allocated(s.device) / 1e9, 2) if s.cuda else None}
        print(f"target built in {target['build_s']} s: {target['weights_gb']} GB of weights, "
              f"{target['bytes_per_token']} bytes a token", flush=True)
        self.save()

    def plan(self) -> None:
        s = self.s
        lengths = long_tail_lengths(s.rows, s.seq_length, seed=2)
        self.batches = length_grouped_batches(random_samples(lengths, s.dims["vocab_size"], seed=0),
                                              s.batch_tokens, BATCH_SAMPLES)
        self.shards = equal_shards(self.batches, s.shards)
        self.real, padded = padding_waste(self.batches)
        self.run_bytes = bytes_of(self.shards, self.shape)
        self.report["plan"] = {
            "rows": s.rows, "seq_length": s.seq_length, "batch_tokens": s.batch_tokens,
            "batches": len(self.batches), "shards": len(self.shards), "real_tokens": self.real,
            "padded_tokens": padded, "padding_waste": round(padded / self.real - 1, 4),
            "run_gb": round(self.run_bytes / 1e9, 2)}
        systems = self.report["file_systems"] = {name: file_system(path) if path else "none"
                                                 for name, path in self.dirs.items()}
        print(f"{len(self.batches)} batches, {len(self.shards)} shards, {self.real} tokens, "
              f"{self.run_bytes / 1e9:.2f} GB a run; disk: {systems['disk']}, shm: {systems['shm']}",
              flush=True)

    def forward_alone(self) -> float:
        return time_forward(self.batches, self.runner.forward, self.s.device)

    def warm_up(self) -> None:
        # Every batch shape once (kernel choice; on a CPU oneDNN builds its bf16 kernels per shape), the
        # allocator, the ring's pinning and the writer's first files.
        warmup_s = self.forward_alone()
        s = self.s
        pipeline_run(self.shards[:2], self.runner.forward, self.shape, s.device, s.work, 1, s.budget)
        self.alone = [self.forward_alone()]
        self.report["forward_alone"] = {"warmup_s": round(warmup_s, 3)}
        print(f"forward alone: {self.alone[0]:.2f} s, {self.real / self.alone[0]:.0f} tokens/s", flush=True)
        self.save()

    def check_fp8(self) -> None:
        s = self.s
        shards = first_fraction(self.shards, s.fp8_fraction)
        base = s.shm if s.shm and not room_problem(s.shm, bytes_of(shards, self.shape)) else s.work
        fp8 = self.report["fp8"] = check_fp8(shards, self.runner, self.shape, s.device, base,
                                             max(s.writers, default=1), s.budget)
        if not fp8["ok"]:
            self.report["failed"].append("fp8")
        print(f"fp8: {fp8['fp8']['copied_bytes_per_token']:.0f} bytes a token to the host (bf16: "
              f"{fp8['bf16']['copied_bytes_per_token']:.0f}): {'ok' if fp8['ok'] else 'FAILED'}", flush=True)
        self.save()

    def matrix(self) -> None:
        """Disk and tmpfs side by side for each writer count (they share the machine's moods), then the
        big ring."""
        s = self.s
        order = [(name, n, s.budget, "none") for n in s.writers for name in self.dirs]
        if s.big_ring and s.writers:
            order.append(("disk", max(s.writers), s.big_ring, "none"))
        order += [("shm" if s.shm else "disk", n, s.budget, "zstd") for n in s.zstd_writers]
        runs = self.report["runs"]
        for name, writers, budget, compression in order:
            run = {"target": name, "writers": writers, "max_inflight_bytes": budget,
                   "compression": compression}
            base = self.dirs[name]
            problem = room_problem(base, self.run_bytes) if base else "skipped: no such directory"
            # The forward alone is still to run once more; a run takes as long as the slowest one so far.
            longest = max([self.alone[0]] + [r["pipeline_s"] for r in runs if "pipeline_s" in r])
            late = time.perf_counter() - self.started + longest + self.alone[0] > s.time_limit
            if not problem and s.time_limit and late:
                problem = f"skipped: it would end past --time-limit {s.time_limit:g} s"
            if problem:
                runs.append({**run, "skipped": problem})
                continue
            try:
                run.update(pipeline_run(self.shards, self.runner.forward,
                                        replace(self.shape, compression=compression), s.device, base, writers,
                                        budget))
            except Exception as exc:  # one failed run (a full disk, say) must not lose the others' numbers
                run["error"] = f"{type(exc).__name__}: {exc}"
                self.report["failed"].append(f"{name} x{writers}: {run['error']}")
                runs.append(run)
                continue
            runs.append(run)
            if not run["complete"]:
                missing = f"{run['shards']} of {len(self.shards)} shards"
                self.report["failed"].append(f"{name} x{writers}: {missing}")
            print(f"{name} x{writers} {compression}, ring {run['ring_capacity'] / 1e9:.2f} GB: "
                  f"{run['pipeline_s']:.2f} s, "
                  f"{run['gb_per_s']:.2f} GB/s, ratio {self.alone[0] / run['pipeline_s']:.3f}", flush=True)
            self.save()

    def finish(self) -> None:
        self.alone.append(self.forward_alone())  # again: did the device itself drift meanwhile?
        reference = min(self.alone)  # the faster forward: the stricter reference
        measured = [r for r in self.report["runs"] if "pipeline_s" in r]
        for run in measured:
            run["ratio"] = round(reference / run["pipeline_s"], 3)
            span = run["forward_span_s"]
            run["steady_ratio"] = round(reference / span, 3) if span > 0 else None
        self.report["forward_alone"].update(
            seconds=[round(x, 3) for x in self.alone], reference_s=round(reference, 3),
            tokens_per_s=round(self.real / reference), gb_per_s=round(self.run_bytes / reference / 1e9, 3))
        best = {name: max((r for r in measured if r["target"] == name and r["compression"] == "none"),
                          key=lambda r: r["ratio"], default=None) for name in self.dirs}
        zstd = max((r for r in measured if r["compression"] == "zstd"), key=lambda r: r["ratio"],
                   default=None)
        self.report["summary"] = {
            "forward_tokens_per_s": round(self.real / reference),
            "best": {name: r and {"writers": r["writers"], "ring_gb": round(r["ring_capacity"] / 1e9, 2),
                                  "ratio": r["ratio"], "steady_ratio": r["steady_ratio"],
                                  "gb_per_s": r["gb_per_s"]} for name, r in best.items()},
            "goal": GOAL, "goal_met": {name: r and r["ratio"] >= GOAL for name, r in best.items()},
            "fp8_over_bf16_bytes": self.report["fp8"]["fp8_over_bf16"],
            "zstd_best": zstd and {"writers": zstd["writers"], "ratio": zstd["ratio"],
                                   "states_gb_per_s": zstd["states_gb_per_s"],
                                   "disk_gb_per_s": zstd["gb_per_s"],
                                   "bytes_vs_uncompressed": round(zstd["bytes"] / self.run_bytes, 3)},
        }
        self.report["finished"] = True
        self.save()


def table(runs: list[dict[str, Any]]) -> str:
    lines = [f"{'target':<6} {'writers':>7} {'ring GB':>7} {'pipeline s':>10} {'tok/s':>8} {'GB/s':>6} "
             f"{'ratio':>6} {'steady':>6} {'head s':>6} {'tail s':>6} {'backpr s':>8} {'wait s':>6} "
             f"{'write s':>7} {'peak GB':>7}"]
    for r in runs:
        if "pipeline_s" not in r:
            lines.append(f"{r['target']:<6} {r['writers']:>7} {r.get('skipped') or r.get('error')}")
            continue
        t = r["stage_seconds"]
        lines.append(f"{r['target']:<6} {r['writers']:>7} {r['ring_capacity'] / 1e9:>7.2f} "
                     f"{r['pipeline_s']:>10.2f} {r['tokens_per_s']:>8} {r['gb_per_s']:>6.2f} "
                     f"{r['ratio']:>6.3f} {r['steady_ratio'] or 0:>6.3f} {r['head_s']:>6.2f} "
                     f"{r['tail_s']:>6.2f} {t['backpressure']:>8.2f} {t['wait']:>6.2f} {t['write']:>7.2f} "
                     f"{r['ring_peak'] / 1e9:>7.2f}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cuda, or cpu (the tiny mode)")
    p.add_argument("--quick", action="store_true", help="a quarter of the rows and half the shards")
    p.add_argument("--rows", type=int, default=None,
                   help="rows measured (default 640: 285k tokens, 14 GB a run; --quick 160; 24 on a CPU)")
    p.add_argument("--seq-length", type=int, default=None,
                   help="the longest row (default 2048; 128 on a CPU)")
    p.add_argument("--batch-tokens", type=int, default=None,
                   help="padded tokens a batch (default 4 x seq length)")
    p.add_argument("--shards", type=int, default=None,
                   help="shards of about equal bytes (default 16: 2 a writer at 8; --quick 8; 4 on a CPU)")
    p.add_argument("--writers", default="1,2,4,8", help="writer thread counts measured")
    p.add_argument("--max-inflight-bytes", type=int, default=1 << 30,
                   help="the host ring (dspark-produce's default)")
    p.add_argument("--zstd-writers", default=None,
                   help="writer thread counts measured with --compression zstd (default 4,8,16 on CUDA, "
                   "2 on a CPU)")
    p.add_argument("--big-ring-bytes", type=int, default=4 << 30,
                   help="the ring of one more disk run with the most writers (0: no such run)")
    p.add_argument("--workdir", default=None,
                   help="local-disk directory of the disk runs (default: a new one under .bench/, removed)")
    p.add_argument("--shm-dir", default="/dev/shm",
                   help="tmpfs directory of the second set of runs ('' skips them)")
    p.add_argument("--fp8-fraction", type=float, default=0.125,
                   help="share of the tokens the FP8 check runs")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds after which no pipeline run starts (default 420 on CUDA, none on a CPU)")
    p.add_argument("--out", default=None, help="the JSON report, saved after every step")
    return p.parse_args(argv)


def settings_of(args: argparse.Namespace, work: str, shm: str | None) -> Settings:
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    seq = args.seq_length or (2048 if cuda else 128)
    return Settings(
        device=device, dims=QWEN3_8B if cuda else TINY, layer_ids=QWEN3_8B_LAYERS if cuda else TINY_LAYERS,
        rows=args.rows or ((160 if args.quick else 640) if cuda else 24), seq_length=seq,
        batch_tokens=args.batch_tokens or 4 * seq,
        shards=args.shards or ((8 if args.quick else 16) if cuda else 4),
        writers=[int(x) for x in args.writers.split(",") if x.strip()], budget=args.max_inflight_bytes,
        zstd_writers=[int(x) for x in (args.zstd_writers or ("4,8,16" if cuda else "2")).split(",")
                      if x.strip()],
        big_ring=args.big_ring_bytes, fp8_fraction=args.fp8_fraction,
        time_limit=args.time_limit if args.time_limit is not None else (420.0 if cuda else 0.0),
        work=work, shm=shm, out=args.out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    work = args.workdir or os.path.join(ROOT, ".bench", f"gpu-capture-{os.getpid()}")
    os.makedirs(work, exist_ok=True)
    shm = None
    if args.shm_dir and os.path.isdir(args.shm_dir) and os.access(args.shm_dir, os.W_OK):
        shm = tempfile.mkdtemp(prefix="dspark-gpu-capture-", dir=args.shm_dir)
    settings = settings_of(args, work, shm)
    if settings.cuda:
        torch.cuda.set_device(settings.device)
    else:  # the tiny forward gains nothing from more, and OpenMP threads spinning by the writers blur times
        torch.set_num_threads(1)
    try:
        report = Capture(settings).run()
    finally:
        if shm:
            shutil.rmtree(shm, ignore_errors=True)
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    print(table(report["runs"]))
    print(json.dumps({k: report[k] for k in ("summary", "failed", "seconds")}, indent=2))
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
