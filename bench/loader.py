"""Loader benchmark: our reader against the raw disk, plain WebDataset and a NeMo-style reader.

    python bench/loader.py                # ~1 GB cache of ~4 MB samples (H=1024, 5 layers, bf16)
    python bench/loader.py --samples 400  # bigger

It writes a cache in our format (random tensors through the real shard writer, so the bytes
are exactly what dspark-produce writes) and the same samples in NeMo's padded safetensors
format, warms the page cache, then measures, all in this run:
  raw        sequential read of every shard file (one thread) into an 8 MiB buffer (cache
             resident: the kernel-copy ceiling) and into a page-aligned 256 MiB one (every byte
             to DRAM, as a loader's must; the baseline the ratios use)
  ours       build_dataloader(...) batches materialised (pad_to longest and seq_length), timed
             over its first epoch (a fresh process: batch memory faulted in, every sample's
             checksum checked), in steady state (median of epochs 5-7; verify="once": no
             re-hashing), and over a first read with warm batch memory (epoch 8 with the
             checked-samples bitmap cleared: every sample hashed, as in the first epoch of a
             cache far larger than the batch memory), with the native batch filler and with
             the Python one, and with verify="always"
  webdataset webdataset.WebDataset(urls).decode(our handler), sample by sample
  nemo       NeMo's reader: safe_open + get_slice(key)[row] per sample, then torch.stack
Numbers: GB/s of real-token payload, samples/s, and ratios against raw, medians of --repeat.

    python bench/loader.py --cold         # every read from the disk (pages dropped before each epoch)
    python bench/loader.py --samples 960 --ours-only   # a 4.4 GB cache: the first epoch at scale
    python bench/loader.py --fp8          # FP8 mode: the same states as a bf16 and an fp8 cache

--cold drops the shards' pages (posix_fadvise DONTNEED, after an fsync) before every raw read and
every loader epoch, so both read the disk, not the page cache (the CPU-bound readers, the Python
filler, WebDataset and NeMo's, are left out).

--fp8 writes the samples twice (the same bf16 states, and those states quantised as the producer
does) and measures, interleaved: the raw read of each cache's shards, the loader on the bf16
cache, the loader on the fp8 cache handing out bf16 (dequantised by the native and by the Python
filler) and handing out raw fp8 plus scales; pad_to="longest", steady state. GB/s are of the
bf16 payload delivered (real tokens x (layers x H x 2 + 5) bytes) for every reader alike.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
RESULTS_DIR = os.path.join(ROOT, ".bench")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from dspark_cache.format.paths import CachePaths  # noqa: E402
from dspark_cache.loader.memory import page_aligned_zeros  # noqa: E402
from dspark_cache.format.sample import HIDDEN, HIDDEN_SCALE, sample_metadata, sample_specs  # noqa: E402
from dspark_cache.format.schema import Manifest  # noqa: E402
from dspark_cache.format.tar.writer import ShardWriter  # noqa: E402
from dspark_cache.loader.tensors import sample_to_torch  # noqa: E402
from dspark_cache.producer.pipeline.tensors import byte_views, quantize_fp8  # noqa: E402
from dspark_cache.format.manifest import write_manifest  # noqa: E402

LAYERS, NUM_LAYERS = [1, 8, 14, 20, 27], 28


def make_cache(root: str, samples: int, hidden: int, seq: int, shard_size: int, seed: int = 0,
               dtype: str = "bf16") -> tuple[str, list[int]]:
    """A complete cache of random bf16 samples with a realistic, skewed length distribution
    (``dtype="fp8"``: the same states, quantised per token and layer as the producer does)."""
    torch.manual_seed(seed)  # the same states for every dtype
    code = {"bf16": "BF16", "fp8": "F8_E4M3"}[dtype]
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(6.0, 0.5, samples).astype(int), 32, seq).tolist()
    paths = CachePaths(root)
    paths.ensure_dirs()
    dim = hidden * len(LAYERS)
    for shard in range(-(-samples // shard_size)):
        writer = ShardWriter(paths, shard, durable=False)
        for sid in range(shard * shard_size, min(samples, (shard + 1) * shard_size)):
            n = lengths[sid]
            tensors = {"target_hidden_states": torch.randn(n, dim).to(torch.bfloat16),
                       "input_ids": torch.randint(0, 150000, (n,), dtype=torch.int32),
                       "loss_mask": torch.ones(n, dtype=torch.uint8)}
            if dtype == "fp8":
                tensors[HIDDEN], tensors[HIDDEN_SCALE] = quantize_fp8(tensors[HIDDEN], hidden, code)
            writer.append(sid, n, sample_specs(n, dim, hidden, code, False),
                          sample_metadata(sid, LAYERS, NUM_LAYERS, hidden, code), byte_views(tensors))
        writer.publish()
    write_manifest(paths, Manifest(
        complete=True, target_model="bench", target_model_type="qwen3", target_vocab_size=151936,
        hidden_size=hidden, num_hidden_layers=NUM_LAYERS, seq_length=seq, dtype=dtype, num_samples=samples,
        planned_samples=samples, shard_size=shard_size, target_hidden_dim=dim, target_last_hidden_dim=hidden,
        target_layer_ids=LAYERS, train_data_path="bench", num_shards=-(-samples // shard_size)))
    return root, lengths


def make_nemo_shards(cache_root: str, nemo_root: str, seq: int) -> list[str]:
    """The same samples in NeMo's format: [n, S, ...] padded tensors per safetensors shard."""
    import dspark_cache
    from safetensors.torch import save_file

    os.makedirs(nemo_root, exist_ok=True)
    cache = dspark_cache.open_cache(cache_root)
    files = []
    for shard in cache.shards:
        rows = [
            sample_to_torch(cache.reader(shard).read_sample(e))
            for e in sorted(shard.samples, key=lambda e: e.sample_id)
        ]
        batch = {}
        for key, dtype in (("input_ids", torch.int64), ("loss_mask", torch.int64),
                           ("target_hidden_states", None), ("target_last_hidden_states", None)):
            first = rows[0][key]
            out = torch.zeros((len(rows), seq, *first.shape[1:]), dtype=dtype or first.dtype)
            for i, r in enumerate(rows):
                out[i, : r[key].shape[0]] = r[key]
            batch[key] = out
        path = os.path.join(nemo_root, f"shard-{shard.shard_id:06d}.safetensors")
        save_file(batch, path)
        files.append(path)
    return files


def warm(files: list[str]) -> None:
    buf = bytearray(64 << 20)
    for f in files:
        with open(f, "rb", buffering=0) as h:
            while h.readinto(buf):
                pass


def aligned_buffer(size: int) -> memoryview:
    """A page-aligned, already-touched buffer (as the loader's batch memory is): a ``bytearray``
    would be 16-byte aligned, slower to copy into, and flatter every ratio. It is numpy memory,
    which may get transparent huge pages: the raw read into it was 3% faster than into the
    loader's 4 KiB-page slabs (8 interleaved runs), so the baseline gets the faster one."""
    block = page_aligned_zeros(size)
    block.fill(1)  # touch every page now, not inside the timed read
    return memoryview(block)


def bench_raw(files: list[str], dest_bytes: int = 8 << 20) -> float:
    """Sequential reads of every shard, 8 MiB at a time, cycling through ``dest_bytes``.

    With the default 8 MiB the destination stays in the CPU cache (the kernel-copy ceiling);
    with a destination as large as a few batches, every byte lands in DRAM, as a loader's must.
    """
    dest = aligned_buffer(dest_bytes)
    chunk, pos = 8 << 20, 0
    t = time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as h:
            while True:
                if pos + chunk > dest_bytes:
                    pos = 0
                got = h.readinto(dest[pos : pos + chunk])
                if not got:
                    break
                pos += got
    return time.perf_counter() - t


def evict(files: list[str]) -> None:
    """Drop these files' pages from the page cache (synced first: dirty pages would stay), so the
    next read comes from the disk; other processes' cached files are untouched."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def bench_ours(root: str, batch: int, pad_to: str, threads: int, native: bool, verify: str = "once",
               dtype: str | None = None, cold: list[str] | None = None) -> tuple[float, float, float]:
    """Seconds for the loader's first epoch (batch memory faulted in), its steady state, and a
    first read of every sample with warm batch memory.

    Steady state is the median of epochs 5-7: until then, rows that see a longer sample than
    before fault in fresh pages often (the first 250 batches here). A training run's epochs are
    thousands of batches long, so that is what it sees after its first few minutes. The last
    epoch runs with the checked-samples bitmap cleared: every sample is hashed again, as each is
    in the first epoch of a cache whose size dwarfs the batch memory's one-time faults.
    """
    import dspark_cache
    from dspark_cache.loader.verify import VerifiedSamples

    os.environ["DSPARK_NATIVE"] = "1" if native else "0"
    loader = dspark_cache.build_dataloader(
        root,
        batch,
        shuffle=True,
        seed=0,
        pad_to=pad_to,
        num_workers=threads,
        prefetch=4,
        pin_memory=False,
        verify=verify,
        dtype=dtype,
    )
    seconds = []
    for epoch in range(9):
        if epoch == 8:
            loader.reader.verified = VerifiedSamples(verify)
        if cold:  # every epoch from the disk
            evict(cold)
        t = time.perf_counter()
        for _ in loader:
            pass
        seconds.append(time.perf_counter() - t)
    loader.close()
    return seconds[0], statistics.median(seconds[5:8]), seconds[8]


def bench_webdataset(files: list[str]) -> float:
    import webdataset as wds

    from dspark_cache.loader.tensors import decode_dspark_sample

    t = time.perf_counter()
    for _ in wds.WebDataset(files, shardshuffle=False).decode(decode_dspark_sample):
        pass
    return time.perf_counter() - t


def bench_nemo(files: list[str], shard_size: int, samples: int, batch: int) -> float:
    from safetensors import safe_open

    handles = {}
    keys = ("input_ids", "loss_mask", "target_hidden_states", "target_last_hidden_states")
    order = np.random.default_rng(0).permutation(samples)  # NeMo's RandomSampler
    t = time.perf_counter()
    for start in range(0, samples, batch):
        items = []
        for i in order[start : start + batch]:
            f = files[i // shard_size]
            h = handles.get(f) or handles.setdefault(f, safe_open(f, "pt"))
            items.append({k: h.get_slice(k)[int(i % shard_size)] for k in keys})
        {k: torch.stack([it[k] for it in items]) for k in keys}
    return time.perf_counter() - t


def measure_fp8(args: argparse.Namespace, work: str) -> dict:
    """``--fp8``: the same states as a bf16 and an fp8 cache; delivered bf16 GB/s of each reader."""
    roots, tars = {}, {}
    for dtype in ("bf16", "fp8"):
        roots[dtype], lengths = make_cache(
            os.path.join(work, dtype),
            args.samples,
            args.hidden,
            args.seq_length,
            args.shard_size,
            dtype=dtype,
        )
        tars[dtype] = [
            CachePaths(roots[dtype]).shard_tar(i) for i in range(-(-args.samples // args.shard_size))
        ]
        warm(tars[dtype])
    payload = sum(n * (args.hidden * len(LAYERS) * 2 + 5) for n in lengths)  # bf16 delivered, for all
    from dspark_cache.loader.fill import native_available

    native = native_available()
    cold = {d: tars[d] if args.cold else None for d in tars}

    def raw(dtype: str) -> float:
        if args.cold:
            evict(tars[dtype])
        return bench_raw(tars[dtype], 256 << 20)

    def ours(dtype: str, native_filler: bool, out: str | None = None) -> float:
        return bench_ours(roots[dtype], args.batch_size, "longest", args.threads, native_filler, dtype=out,
                          cold=cold[dtype])[1]

    readers = {
        "ours_bf16_cache": lambda: ours("bf16", native),
        "ours_fp8_cache_to_bf16": lambda: ours("fp8", native),
        "ours_fp8_cache_raw": lambda: ours("fp8", native, "raw"),
        "raw_read_bf16_tars": lambda: raw("bf16"),
        "raw_read_fp8_tars": lambda: raw("fp8"),
    }
    if not args.cold:  # the Python filler is CPU-bound either way
        readers["ours_fp8_cache_to_bf16_python_filler"] = lambda: ours("fp8", False)
    runs: dict[str, list[float]] = {name: [] for name in readers}
    for _ in range(args.repeat):  # interleaved so that drift hits every reader alike
        for name, reader in readers.items():
            runs[name].append(reader())
    med = {k: statistics.median(v) for k, v in runs.items()}
    base = runs["ours_bf16_cache"]
    return {
        "mode": "fp8",
        "cold": args.cold,
        "samples": args.samples,
        "mean_tokens": statistics.mean(lengths),
        "payload_bytes": payload,
        "tar_bytes": {d: sum(os.path.getsize(f) for f in tars[d]) for d in tars},
        "seconds": med,
        "runs": runs,
        "bf16_gb_per_s": {k: payload / v / 1e9 for k, v in med.items()},
        "vs_bf16_cache_paired": {
            k: statistics.median(b / o for b, o in zip(base, v)) for k, v in runs.items()
        },
        "threads": args.threads,
        "batch_size": args.batch_size,
        "cores": os.cpu_count(),
        "native_filler": native,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=240)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--shard-size", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--workdir", default=None,
                   help="where the caches are written: a fresh directory inside it, removed at the end "
                        "(default: inside --results-dir)")
    p.add_argument(
        "--results-dir", default=RESULTS_DIR, help="where the JSON results are saved (default: .bench/)"
    )
    p.add_argument("--switch-interval", type=float, default=None,
                   help="sys.setswitchinterval for this run (threads hand the GIL over sooner)")
    p.add_argument(
        "--fp8", action="store_true", help="FP8 mode: bf16 vs fp8 caches of the same states (see above)"
    )
    p.add_argument(
        "--ours-only",
        action="store_true",
        help="leave out the WebDataset and NeMo readers (and NeMo's padded copy of the cache, ~5x its size)",
    )
    p.add_argument("--cold", action="store_true",
                   help="drop the caches' pages before every epoch and raw read (reads come from the disk)")
    args = p.parse_args()
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    # The results directory exists before a minute of measuring, so saving cannot fail on it.
    os.makedirs(args.results_dir, exist_ok=True)
    if args.workdir:
        os.makedirs(args.workdir, exist_ok=True)
    # Always a directory of our own (inside --workdir when given): the cleanup deletes nothing else.
    work = tempfile.mkdtemp(prefix="loader-", dir=args.workdir or args.results_dir)
    try:
        result = (measure_fp8 if args.fp8 else measure)(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result, indent=2))  # printed first: the numbers survive a failed save
    kind = "loader-fp8" if args.fp8 else "loader"
    out = os.path.join(args.results_dir, f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(out, "w") as handle:
        json.dump(result, handle, indent=2)
    print(f"results: {out}")


def measure(args: argparse.Namespace, work: str) -> dict:
    """Every measurement of one run, with its caches written under ``work``."""
    root, lengths = make_cache(os.path.join(work, "cache"), args.samples, args.hidden, args.seq_length,
                               args.shard_size)
    tars = [CachePaths(root).shard_tar(i) for i in range(-(-args.samples // args.shard_size))]
    nemo_files = [] if args.ours_only else make_nemo_shards(root, os.path.join(work, "nemo"), args.seq_length)
    payload = sum(n * (args.hidden * len(LAYERS) * 2 + 5) for n in lengths)
    tar_bytes = sum(os.path.getsize(f) for f in tars)
    nemo_bytes = sum(os.path.getsize(f) for f in nemo_files) or None
    warm(tars)
    warm(nemo_files)
    runs: dict[str, list[float]] = {}
    from dspark_cache.loader.fill import native_available

    native = native_available()
    cold = tars if args.cold else None

    def add(name: str, seconds: float) -> None:
        runs.setdefault(name, []).append(seconds)

    for _ in range(args.repeat):  # interleaved so that drift hits every reader alike
        if not args.cold:
            add("raw_cache_resident", bench_raw(tars))
        else:
            evict(tars)
        add("raw", bench_raw(tars, 256 << 20))
        for pad_to in ("longest", "seq_length"):
            first, steady, first_read = bench_ours(
                root, args.batch_size, pad_to, args.threads, native, cold=cold
            )
            add(f"ours_{pad_to}_first_epoch", first)
            add(f"ours_{pad_to}", steady)
            add(f"ours_{pad_to}_first_read_warm_memory", first_read)
            if not args.cold:
                add(f"ours_{pad_to}_python_filler",
                    bench_ours(root, args.batch_size, pad_to, args.threads, native=False)[1])
            add(
                f"ours_{pad_to}_verify_always",
                bench_ours(root, args.batch_size, pad_to, args.threads, native, verify="always", cold=cold)[
                    1
                ],
            )
        if not (args.cold or args.ours_only):
            add("webdataset", bench_webdataset(tars))
            add("nemo", bench_nemo(nemo_files, args.shard_size, args.samples, args.batch_size))
    med = {k: statistics.median(v) for k, v in runs.items()}
    result = {
        "cold": args.cold,
        "samples": args.samples,
        "mean_tokens": statistics.mean(lengths),
        "payload_bytes": payload,
        "tar_bytes": tar_bytes,
        "nemo_bytes": nemo_bytes,
        "mb_per_sample": payload / args.samples / 1e6,
        "seconds": med,
        "runs": runs,
        "gb_per_s": {k: payload / v / 1e9 for k, v in med.items()},
        "samples_per_s": {k: args.samples / v for k, v in med.items()},
        "vs_raw": {k: med["raw"] / v for k, v in med.items()},
        # The same ratio per repetition (raw and ours measured moments apart), then the median:
        # robust to this VM's memory bandwidth drifting between repetitions.
        "vs_raw_paired": {
            k: statistics.median(r / o for r, o in zip(runs["raw"], v)) for k, v in runs.items()
        },
        "threads": args.threads,
        "batch_size": args.batch_size,
        "cores": os.cpu_count(),
        "native_filler": native,
    }
    return result


if __name__ == "__main__":
    main()

