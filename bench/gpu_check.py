"""One-shot check of the GPU paths, for a machine with a GPU at hand (under 5 minutes on one).

    python bench/gpu_check.py                      # CUDA when present, else the CPU mode
    python bench/gpu_check.py --device cpu         # the CPU mode: CUDA-only parts are skipped, and say so
    python bench/gpu_check.py --out results.json

  (a) stream safety: a fake target fills every batch with its batch number, the pipeline stages
      and writes it, and every stored sample must hold its own batch's number. A control run with
      ``record_stream`` disabled must show corruption, or the check could not have failed.
  (b) host waits on the device per step of the producer's loop with the real-shape target below:
      ``torch.cuda.set_sync_debug_mode`` (every thread) and a dispatch-mode trap (main thread).
  (c) pinned host memory: the host ring and ``torch.cuda.host_memory_stats()`` against
      ``--max-inflight-bytes``.
  (d) the loader's pinned batches, copied ``non_blocking`` to the GPU behind a busy stream and
      dropped at once, for two epochs, equal the unpinned loader's; and at the level of one
      pinned slab, dropped while its copy waits and asked for again at once, the copy still sees
      the old bytes (a control with the copy fence disabled must not).
  (e) efficiency: a Qwen3-0.6B-shaped target (hidden 1024, 28 layers, 16 heads of 128, 8 KV
      heads, vocab 151,936; random weights, bf16) on long-tail lengths: forward-only of the same
      batches, write-only of the same bytes, and the whole pipeline; stage times from CUDA events.
  (f) capture efficiency at the Qwen3-8B shape (16 GB of random weights built on the GPU), with 1 to 8
      writer threads to local disk and to /dev/shm, and the check that FP8 caches copy only codes and
      scales to the host: ``bench/gpu_capture.py``, a script of its own (~4 minutes on an H100),
      which reuses this one's data and timing helpers.

Exit status 0 when every check that ran passed, 1 otherwise. Prints a JSON report.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load as load_safetensors  # noqa: E402

from dspark_cache.format.geometry import SampleShape  # noqa: E402
from dspark_cache.format.paths import CachePaths  # noqa: E402
from dspark_cache.producer.pipeline.loop import Forward, collate, finite_flags, run_pipeline  # noqa: E402
from dspark_cache.producer.plan.batches import PlannedSample, ShardPlan  # noqa: E402
from dspark_cache.storage.output import CacheOutput  # noqa: E402
from tests.support.batching import length_grouped_batches  # noqa: E402
from tests.support.syncs import HostSyncTrap  # noqa: E402

QWEN3_06B = dict(hidden_size=1024, num_layers=28, intermediate_size=3072, num_heads=16, num_kv_heads=8,
                 head_dim=128, model_vocab_size=151936)
TINY = dict(hidden_size=64, num_layers=8, intermediate_size=128, num_heads=4, num_kv_heads=2)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def long_tail_lengths(count: int, seq_length: int, seed: int) -> list[int]:
    """Chat-like lengths: a log-normal body (median ~250) and 8% of rows at ``seq_length``."""
    rng = np.random.default_rng(seed)
    body = np.clip(rng.lognormal(5.5, 0.9, count), 8, seq_length).astype(int)
    tail = rng.random(count) < 0.08
    body[tail] = seq_length
    return body.tolist()


def random_samples(lengths: list[int], vocab: int, seed: int = 0) -> list[PlannedSample]:
    """One sample per length, random token ids below ``vocab``, every token a loss token."""
    rng = np.random.default_rng(seed)
    return [PlannedSample(i, rng.integers(0, vocab, n).astype(np.int32), np.ones(n, dtype=np.uint8))
            for i, n in enumerate(lengths)]


def make_shards(lengths: list[int], vocab: int, batch_size: int, seq_length: int, batches_per_shard: int,
                seed: int = 0) -> list[ShardPlan]:
    """Length-grouped batches over all samples, whole batches per shard (random token ids)."""
    samples = random_samples(lengths, vocab, seed)
    batches = length_grouped_batches(samples, batch_size * seq_length, batch_size)
    return [ShardPlan(i // batches_per_shard, batches[i : i + batches_per_shard])
            for i in range(0, len(batches), batches_per_shard)]


def fresh_dir(base: str, name: str) -> CachePaths:
    paths = CachePaths(tempfile.mkdtemp(prefix=f"{name}-", dir=base))
    os.makedirs(paths.shards_dir, exist_ok=True)
    return paths


def stored_hidden(paths: CachePaths) -> dict[int, torch.Tensor]:
    """Every stored sample's hidden states, read with the standard library and safetensors."""
    out = {}
    for shard_id in paths.indexed_shard_ids():
        with tarfile.open(paths.shard_tar(shard_id)) as tar:
            for member in tar.getmembers():
                sample_id = int(member.name.split(".")[0].split("-")[-1])
                out[sample_id] = load_safetensors(tar.extractfile(member).read())["target_hidden_states"]
    return out


# ----------------------------------------------------------------------------- (a) stream safety

def check_stream_safety(device: torch.device, work: str, budget: int) -> dict:
    hidden_size = 1024 if device.type == "cuda" else 64
    hidden_dim = 5 * hidden_size
    shape = SampleShape((0, 1, 2, 3, 4), 5, hidden_size, "BF16")
    seq = 1024 if device.type == "cuda" else 128
    shards = make_shards(long_tail_lengths(384, seq, seed=1), 1000, 8, seq, 4)
    expected = {s.sample_id: (b % 120) + 1 for b, s in
                enumerate_batches(shards)}

    def run(label: str) -> dict:
        counter = itertools.count()

        def numbered(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, None]:
            value = float(next(counter) % 120 + 1)
            return torch.full((*ids.shape, hidden_dim), value, dtype=torch.bfloat16, device=ids.device), None

        paths = fresh_dir(work, label)
        run_pipeline(shards, numbered, output=CacheOutput(paths.root), shape=shape, device=device, pad_id=0,
                     max_inflight_bytes=budget, check_finite=False, durable=False)
        stored = stored_hidden(paths)
        shutil.rmtree(paths.root, ignore_errors=True)
        wrong = sum(1 for sid, h in stored.items() if not bool((h == expected[sid]).all()))
        return {"samples": len(stored), "corrupted": wrong}

    result = {"ours": run("stream")}
    result["ok"] = result["ours"]["corrupted"] == 0 and result["ours"]["samples"] == len(expected)
    if device.type != "cuda":
        result["control"] = "skipped: a CPU has no streams (CUDA only)"
        return result
    original = torch.Tensor.record_stream
    torch.Tensor.record_stream = lambda self, stream: None  # the control: device memory freed too early
    try:
        result["control"] = run("control")
    finally:
        torch.Tensor.record_stream = original
    result["control_can_fail"] = result["control"]["corrupted"] > 0
    return result


def enumerate_batches(shards: list[ShardPlan]):
    """``(batch number, sample)`` in the order the pipeline computes them."""
    number = 0
    for shard in shards:
        for batch in shard.batches:
            for sample in batch:
                yield number, sample
            number += 1


# ----------------------------------------------------------------------------- (e) efficiency, (b), (c)

def build_real_shape_target(work: str, tiny: bool) -> str:
    from dspark_cache.embedded.target import build_target

    out = os.path.join(work, "target-tiny" if tiny else "target-qwen3-0.6b-shape")
    if not os.path.exists(os.path.join(out, "config.json")):
        build_target(out, **(TINY if tiny else QWEN3_06B))
    return out


class SyncRecorder:
    """Every sync ``torch.cuda.set_sync_debug_mode('warn')`` reports, by thread and place."""

    def __init__(self) -> None:
        self.where: dict[str, int] = {}
        self.count = 0

    @contextlib.contextmanager
    def watching(self, device: torch.device):
        if device.type != "cuda":
            yield self
            return
        previous = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            text = str(message)
            # not set_sync_debug_mode's own notice
            if "synchroniz" in text.lower() and "prototype" not in text:
                self.count += 1
                key = f"{threading.current_thread().name} {os.path.basename(filename)}:{lineno}"
                self.where[key] = self.where.get(key, 0) + 1
            else:
                previous(message, category, filename, lineno, file, line)

        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield self
            finally:
                torch.cuda.set_sync_debug_mode(0)
                warnings.showwarning = previous


def time_forward(batches: list[list[PlannedSample]], forward: Forward, device: torch.device) -> float:
    """Seconds for the device alone on these batches: what the pipeline's main thread computes per
    batch (collate, the forward, the finite check), nothing copied to the host or written; synchronised."""
    sync(device)
    start = time.perf_counter()
    for batch in batches:
        ids, mask = collate(batch, 0, device)
        hidden, last = forward(ids, mask)
        finite_flags(hidden, last, mask)
    sync(device)
    return time.perf_counter() - start


def check_efficiency(
    device: torch.device, work: str, budget: int, rows: int, seq: int
) -> tuple[dict, dict, dict]:
    from dspark_cache.format.layers import build_target_layer_ids
    from dspark_cache.producer.device.target import TargetRunner, read_target_info

    tiny = device.type != "cuda"
    target = build_real_shape_target(work, tiny)
    info = read_target_info(target)
    layer_ids = build_target_layer_ids(info.num_layers, 5)
    compute = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = SampleShape(layer_ids, info.num_layers, info.hidden_size, "BF16")
    loaded = time.perf_counter()
    runner = TargetRunner(target, layer_ids, info.num_layers, device, compute, torch.bfloat16)
    load_s = time.perf_counter() - loaded
    shards = make_shards(long_tail_lengths(rows, seq, seed=2), 150000 if not tiny else 2000, 16, seq, 4)
    batches = [b for s in shards for b in s.batches]
    real_tokens = sum(s.length for b in batches for s in b)
    padded_tokens = sum(max(s.length for s in b) * len(b) for b in batches)

    time_forward(batches, runner.forward, device)  # warm-up: kernels chosen, allocator filled
    forward_s = sorted(time_forward(batches, runner.forward, device) for _ in range(3))[1]

    captured = {}

    def pipeline(label: str, fwd, check: bool = True) -> tuple[float, object]:
        paths = fresh_dir(work, label)
        rings = []
        start = time.perf_counter()
        stats = run_pipeline(
            shards,
            fwd,
            output=CacheOutput(paths.root),
            shape=shape,
            device=device,
            pad_id=0,
            max_inflight_bytes=budget,
            check_finite=check,
            on_batch=lambda st, ring: rings.append((ring.capacity, ring.peak)),
        )
        sync(device)
        seconds = time.perf_counter() - start
        captured[label] = (stats, rings[-1] if rings else (0, 0))
        shutil.rmtree(paths.root, ignore_errors=True)  # a run writes GBs: keep the disk free
        return seconds, stats

    # Write-only: the same bytes from a device that answers at once: slices of one output of the
    # largest batch shape, computed beforehand.
    widest = max(len(b) for b in batches), max(s.length for b in batches for s in b)
    big_hidden, big_last = runner.forward(torch.zeros(widest, dtype=torch.long, device=device), None)

    def instant(ids: torch.Tensor, mask: torch.Tensor):
        b, t = ids.shape
        return big_hidden[:b, :t], None if big_last is None else big_last[:b, :t]

    write_s, _ = pipeline("write", instant, check=False)
    if device.type == "cuda":
        torch.cuda.reset_peak_host_memory_stats() if hasattr(
            torch.cuda, "reset_peak_host_memory_stats"
        ) else None
    pipeline_s, stats = pipeline("pipeline", runner.forward)
    ring_capacity, ring_peak = captured["pipeline"][1]
    # Syncs are counted in a run of their own: the dispatch-mode trap slows every operation.
    syncs = SyncRecorder()
    watched = shards[: max(2, len(shards) // 8)]
    with syncs.watching(device), HostSyncTrap() as trap:
        run_pipeline(
            watched,
            runner.forward,
            output=CacheOutput(fresh_dir(work, "syncs").root),
            shape=shape,
            device=device,
            pad_id=0,
            max_inflight_bytes=budget,
        )
    stored_bytes = stats.bytes
    efficiency = {
        "target": "Qwen3-0.6B shape (random weights)" if not tiny else "embedded tiny Qwen3 (CPU mode)",
        "compute_dtype": str(compute),
        "mask_path_sync_free": runner.masks_without_waiting,
        "load_s": round(load_s, 2),
        "rows": rows,
        "seq_length": seq,
        "batches": len(batches),
        "real_tokens": real_tokens,
        "padded_tokens": padded_tokens,
        "padding_waste": round(padded_tokens / real_tokens - 1, 4),
        "forward_only_s": round(forward_s, 3),
        "write_only_s": round(write_s, 3),
        "pipeline_s": round(pipeline_s, 3),
        "efficiency_vs_forward_only": round(forward_s / pipeline_s, 3),
        "overlap": round(max(forward_s, write_s) / pipeline_s, 3),
        "pipeline_tokens_per_s": round(real_tokens / pipeline_s),
        "forward_tokens_per_s": round(real_tokens / forward_s),
        "stored_gb": round(stored_bytes / 1e9, 3),
        "write_gb_per_s": round(stored_bytes / 1e9 / write_s, 3),
        "stage_seconds": stats.times.as_dict(),
    }
    host_syncs = {
        "steps": sum(len(sh.batches) for sh in watched),
        "main_thread_trap": trap.count,
        "main_thread_first": trap.where[:2],
        "cuda_sync_debug": syncs.count if device.type == "cuda" else "skipped: CUDA only",
        "cuda_sync_debug_where": syncs.where,
    }
    host_syncs["ok"] = trap.count == 0 and (device.type != "cuda" or
                                            all(not k.startswith("MainThread") for k in syncs.where))
    pinned = {"budget": budget, "ring_capacity": ring_capacity, "ring_peak": ring_peak,
              "largest_batch_in_ring": max_batch_bytes(shards, shape)}
    largest = pinned["largest_batch_in_ring"]
    if device.type == "cuda":
        stats_now = torch.cuda.host_memory_stats()
        pinned["host_allocator"] = {k: v for k, v in stats_now.items() if "bytes" in k}
        reserved = max((v for k, v in stats_now.items() if "reserved" in k and "peak" in k), default=0)
        pinned["ok"] = ring_capacity <= budget + largest and reserved <= 256 << 20
    else:
        pinned["host_allocator"] = "skipped: CUDA only"
        pinned["ok"] = ring_capacity <= budget + largest and ring_peak <= ring_capacity
    return efficiency, host_syncs, pinned


def max_batch_bytes(shards: list[ShardPlan], shape: SampleShape) -> int:
    per_token = shape.hidden_dim * shape.itemsize + (
        shape.hidden_size * shape.itemsize if shape.stores_last else 0
    )
    return max(sum(s.length for s in b) * per_token for sh in shards for b in sh.batches)


# ----------------------------------------------------------------------------- (d) loader

def check_loader(device: torch.device, work: str) -> dict:
    if device.type != "cuda":
        return {"ok": True, "skipped": "pinned batches need CUDA"}
    import dspark_cache
    from dspark_cache.embedded.data import write_sample_data
    from dspark_cache.embedded.target import build_target

    target, data = os.path.join(work, "loader-target"), os.path.join(work, "loader-data.jsonl")
    build_target(target)
    write_sample_data(data, num_rows=160)
    cache = os.path.join(work, "loader-cache")
    cmd = [sys.executable, "-m", "dspark_cache.producer", "--target-model", target, "--input-data", data,
           "--output-dir", cache, "--seq-length", "512", "--shard-size", "16", "--batch-size", "8",
           "--device", "cuda", "--log-level", "WARNING"]
    produced = subprocess.run(cmd, capture_output=True, text=True)
    if produced.returncode != 0:
        return {"ok": False, "error": produced.stderr[-2000:]}

    def epochs(pinned: bool, busy: bool) -> list[dict[str, torch.Tensor]]:
        loader = dspark_cache.build_dataloader(cache, 6, seed=3, pin_memory=pinned)
        out = []
        for _ in range(2):
            for batch in loader:
                if busy:
                    torch.cuda._sleep(2_000_000)  # the copy below waits behind ~1 ms of device work
                out.append(
                    {k: v.to(device, non_blocking=True) for k, v in batch.items() if torch.is_tensor(v)}
                )
                del batch  # dropped at once: the loader may reuse its memory
        torch.cuda.synchronize()
        return out

    want = epochs(False, False)

    def mismatches(got: list[dict[str, torch.Tensor]]) -> int:
        return sum(1 for a, b in zip(want, got) for k in a if not torch.equal(a[k], b[k])) + abs(
            len(want) - len(got)
        )

    result = {"batches": len(want), "mismatched": mismatches(epochs(True, True))}
    result["slab_fence"] = check_slab_fence(device)
    result["ok"] = result["mismatched"] == 0 and result["slab_fence"]["ok"]
    return result


def check_slab_fence(device: torch.device, trials: int = 20) -> dict:
    """A pinned slab dropped while its copy waits behind device work, then asked for again at
    once and overwritten: the copy must still see the old bytes. The control (no fence) must not."""
    from dspark_cache.loader import memory

    fields = (memory.Field("x", 1 << 18, torch.float32, False),)  # 1 MiB per slot

    def trial_run() -> int:
        pool = memory.BatchMemory(fields, 16, pinned=True, keep=1)
        wrong = 0
        for i in range(trials):
            view = pool.take(16, 1).views(16, 1)["x"]
            view.fill_(float(i))
            torch.cuda._sleep(5_000_000)  # the copy starts a few ms from now
            copied = view.to(device, non_blocking=True)
            del view
            again = pool.take(16, 1).views(16, 1)["x"]
            again.fill_(-1.0)  # what a recycled slab would get from the next batch
            del again
            torch.cuda.synchronize()
            wrong += int(not bool((copied == float(i)).all()))
        return wrong

    result = {"trials": trials, "wrong": trial_run()}
    original = memory.Slab.reusable
    memory.Slab.reusable = lambda self, stream=None: self.idle()  # the control: recycle once unheld
    try:
        result["control_wrong"] = trial_run()
    finally:
        memory.Slab.reusable = original
    result["control_can_fail"] = result["control_wrong"] > 0
    result["ok"] = result["wrong"] == 0
    return result


# ----------------------------------------------------------------------------- main

def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cuda or cpu")
    p.add_argument("--max-inflight-bytes", type=int, default=1 << 30)
    p.add_argument("--rows", type=int, default=None, help="rows for (e) (default 1024 on CUDA, 48 on a CPU)")
    p.add_argument("--seq-length", type=int, default=None, help="(default 2048 on CUDA, 256 on a CPU)")
    p.add_argument(
        "--workdir", default=None, help="where caches are written (default: a temporary directory)"
    )
    p.add_argument("--out", default=None, help="also write the JSON report here")
    args = p.parse_args()
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    cuda = device.type == "cuda"
    if cuda:
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
    work = args.workdir or tempfile.mkdtemp(prefix="dspark-gpu-check-")
    os.makedirs(work, exist_ok=True)
    budget = args.max_inflight_bytes if cuda else min(args.max_inflight_bytes, 8 << 20)
    report: dict = {"machine": {"python": platform.python_version(), "torch": torch.__version__,
                                "device": torch.cuda.get_device_name(device) if cuda else "cpu (CPU mode)"}}
    started = time.perf_counter()
    report["a_stream_safety"] = check_stream_safety(device, work, budget)
    print(json.dumps({"a_stream_safety": report["a_stream_safety"]}), flush=True)
    efficiency, syncs, pinned = check_efficiency(device, work, budget, args.rows or (1024 if cuda else 48),
                                                    args.seq_length or (2048 if cuda else 256))
    report["b_host_syncs"], report["c_pinned_memory"], report["e_efficiency"] = syncs, pinned, efficiency
    print(json.dumps({"b_host_syncs": syncs, "c_pinned_memory": pinned}), flush=True)
    report["d_loader_pinned"] = check_loader(device, work)
    report["seconds"] = round(time.perf_counter() - started, 1)
    failed = [name for name, part in report.items() if isinstance(part, dict) and part.get("ok") is False]
    report["failed"] = failed
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
