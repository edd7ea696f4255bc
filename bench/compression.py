"""Compression benchmark (issue 42): bytes, codec speed per core and loader throughput, on our own states.

    python bench/compression.py     # the embedded target and a random Qwen3 8 x 512, long-tail rows
    python bench/compression.py --rows 160 --repeat 5

What it does, all on CPU, through the real producer (``dspark-produce``):
  bytes    the same rows stored as bf16, fp32 and fp8, uncompressed and with ``--compression zstd``
           (level 1; bf16 also at level 3), by two targets: ``make demo``'s embedded one (H=64, 8 layers)
           and a random-init Qwen3 of 8 layers x H=512 on long-tail rows (the issue's case); shard bytes
           and the ratio compressed / uncompressed
  codec    per core (one thread), on the 8 x 512 caches' samples as the writer hands them over: encode and
           decode GB/s of the decoded bytes for this project's codec (numpy byte planes + ``zstandard``,
           ``format.codec``) and the candidates: plain zstd (no planes), ``numcodecs`` (Shuffle + Zstd)
           and ``blosc2`` (its SIMD shuffle + ZSTD), each where importable, with the ratio each gives
  loader   ``build_dataloader`` over the bf16 8 x 512 caches, uncompressed and compressed, 1 and 2 reader
           threads: GB/s of states handed out (real tokens x hidden bytes), steady state (checksums once)
  remote   (``--remote``) both caches uploaded to moto's S3 server on this machine (tests/support/s3server):
           a fresh loader's first epoch from ``s3://`` (every tar downloaded to an empty node copy, every
           checksum checked), 2 reader threads: seconds, GB/s of states, and the tar bytes downloaded
Medians of ``--repeat``. Results: WORKDIR/results.json and markdown tables on stdout (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402

import dspark_cache  # noqa: E402
from dspark_cache.format import codec  # noqa: E402
from dspark_cache.format.geometry import SampleShape  # noqa: E402
from dspark_cache.format.manifest import read_manifest  # noqa: E402
from dspark_cache.format.paths import CachePaths  # noqa: E402
from dspark_cache.format.tar.reader import ShardReader, load_shard_index  # noqa: E402

DTYPES = ("bf16", "fp32", "fp8")


def shard_bytes(cache: str) -> int:
    paths = CachePaths(cache)
    return sum(os.path.getsize(paths.shard_tar(i)) for i in paths.indexed_shard_ids())


def produce(target: str, data: str, out: str, *extra: str) -> None:
    from dspark_cache.producer.__main__ import main

    if os.path.exists(os.path.join(out, "manifest.json")) and read_manifest(out).complete:
        return
    code = main(["--target-model", target, "--input-data", data, "--output-dir", out, "--device", "cpu",
                 "--seq-length", "2048", "--batch-size", "2", "--shard-size", "16", "--overwrite",
                 "--log-level", "WARNING", "--no-progress", *extra])
    if code != 0:
        raise SystemExit(f"dspark-produce {extra} failed with exit {code}")


def targets(work: str, rows: int) -> dict[str, tuple[str, str]]:
    from dspark_cache.embedded.data import write_sample_data
    from dspark_cache.embedded.target import build_target

    out = {}
    embedded = os.path.join(work, "embedded")
    if not os.path.isdir(embedded):
        build_target(embedded)
    rows_file = write_sample_data(os.path.join(work, "rows.jsonl"), 48, seed=3)
    out["embedded (H=64, 8 layers)"] = (embedded, rows_file)
    q = os.path.join(work, "qwen3-8x512")
    if not os.path.isdir(q):
        build_target(q, hidden_size=512, num_layers=8, intermediate_size=1024, num_heads=8, num_kv_heads=4)
    long_tail = write_sample_data(os.path.join(work, "long-tail.jsonl"), rows, seed=5, profile="long-tail")
    out["Qwen3 8 x 512, long-tail"] = (q, long_tail)
    return out


def caches(work: str, rows: int) -> dict[tuple[str, str, str], str]:
    made = {}
    for name, (target, data) in targets(work, rows).items():
        for dtype in DTYPES:
            for label, extra in (("none", ()), ("zstd-1", ("--compression", "zstd")),
                                 *((("zstd-3", ("--compression", "zstd", "--compression-level", "3")),)
                                   if dtype == "bf16" else ())):
                out = os.path.join(work, f"{target.rsplit('/', 1)[-1]}-{dtype}-{label}")
                produce(target, data, out, "--dtype", dtype, *extra)
                made[(name, dtype, label)] = out
    return made


def blobs(cache: str) -> tuple[SampleShape, list[tuple[int, np.ndarray]]]:
    """(shape, [(length, decoded data section as uint8)]) of every sample of an uncompressed cache."""
    manifest = read_manifest(cache)
    shape = SampleShape.from_manifest(manifest)
    paths = CachePaths(cache)
    out = []
    for shard in paths.indexed_shard_ids():
        index = load_shard_index(paths, shard, manifest)
        with ShardReader(paths, shard, index) as reader:
            for entry in index.samples:
                blob = np.frombuffer(bytes(reader.read_blob(entry)), dtype=np.uint8)
                out.append((entry.length, blob[entry.size - shape.data_size(entry.length):]))
    return shape, out


def _median_rate(fn, nbytes: int, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return nbytes / statistics.median(times) / 1e9


def codec_rows(shape: SampleShape, samples: list[tuple[int, np.ndarray]], repeat: int) -> list[dict]:
    """Encode/decode GB/s (of decoded bytes, one thread) and ratio for each candidate."""
    import zstandard

    total = sum(d.nbytes for _, d in samples)
    itemsize = shape.itemsize
    rows = []

    def ours(level: int) -> dict:
        tensors = []
        for length, data in samples:
            placed = shape.placed(length)
            named = {n: data[a:b] for n, a, b in placed if not n.startswith("__pad")}
            tensors.append((length, placed, named))
        frames = [codec.encode_data(p, shape.itemsizes(n), t, shape.data_size(n), level)
                  for n, p, t in tensors]
        outs = [np.empty(shape.data_size(n), np.uint8) for n, _, _ in tensors]

        def enc():
            for n, p, t in tensors:
                codec.encode_data(p, shape.itemsizes(n), t, shape.data_size(n), level)

        def dec():
            for (n, p, _), f, o in zip(tensors, frames, outs):
                codec.decode_data(f, p, shape.itemsizes(n), o)
        dec()
        assert all(np.array_equal(o, d) for o, (_, d) in zip(outs, samples))
        return {"codec": f"ours: byte planes + zstandard, level {level}",
                "ratio": sum(map(len, frames)) / total,
                "encode": _median_rate(enc, total, repeat), "decode": _median_rate(dec, total, repeat)}

    rows += [ours(1), ours(3)]
    c, d = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()
    frames = [c.compress(data) for _, data in samples]
    rows.append({"codec": "plain zstandard, level 1 (no planes)", "ratio": sum(map(len, frames)) / total,
                 "encode": _median_rate(lambda: [c.compress(x) for _, x in samples], total, repeat),
                 "decode": _median_rate(lambda: [d.decompress(f) for f in frames], total, repeat)})
    try:
        from numcodecs import Shuffle, Zstd

        shuffle, zstd = Shuffle(elementsize=itemsize), Zstd(level=1)
        frames = [zstd.encode(shuffle.encode(x)) for _, x in samples]

        def nc_enc():
            return [zstd.encode(shuffle.encode(x)) for _, x in samples]

        def nc_dec():
            return [shuffle.decode(zstd.decode(f)) for f in frames]
        rows.append({"codec": f"numcodecs Shuffle({itemsize}) + Zstd(1)",
                     "ratio": sum(map(len, frames)) / total, "encode": _median_rate(nc_enc, total, repeat),
                     "decode": _median_rate(nc_dec, total, repeat)})
    except ImportError as exc:
        rows.append({"codec": f"numcodecs: not importable ({exc})"})
    try:
        import blosc2

        blosc2.set_nthreads(1)
        kw = dict(typesize=itemsize, clevel=1, codec=blosc2.Codec.ZSTD, filters=[blosc2.Filter.SHUFFLE])
        frames = [blosc2.compress2(x, **kw) for _, x in samples]
        outs = [np.empty(x.nbytes, np.uint8) for _, x in samples]
        def b2_enc():
            return [blosc2.compress2(x, **kw) for _, x in samples]

        def b2_dec():
            return [blosc2.decompress2(f, dst=o) for f, o in zip(frames, outs)]
        rows.append({"codec": "blosc2 SHUFFLE + ZSTD, clevel 1", "ratio": sum(map(len, frames)) / total,
                     "encode": _median_rate(b2_enc, total, repeat),
                     "decode": _median_rate(b2_dec, total, repeat)})
    except ImportError as exc:
        rows.append({"codec": f"blosc2: not importable ({exc})"})
    return rows


def loader_rate(cache: str, threads: int, repeat: int) -> float:
    """GB/s of states handed out (real tokens' hidden bytes), steady state, median of ``repeat`` epochs."""
    manifest = read_manifest(cache)
    loader = dspark_cache.build_dataloader(cache, 4, shuffle=True, seed=0, num_workers=threads,
                                           pin_memory=False, pad_to="longest", prefetch=2 * threads)
    per_token = (manifest.target_hidden_dim + manifest.hidden_size) * 2  # a bf16 batch row's states
    rates = []
    for epoch in range(repeat + 1):
        loader.set_epoch(epoch)
        tokens, started = 0, time.perf_counter()
        for batch in loader:
            tokens += int(batch["attention_mask"].sum())
        if epoch:  # the first epoch checks every checksum: left out
            rates.append(tokens * per_token / (time.perf_counter() - started) / 1e9)
    loader.close()
    return statistics.median(rates)


def remote_first_epochs(caches: dict[str, str], repeat: int, work: str) -> list[dict]:
    """A fresh loader's first epoch over s3:// for each cache (interleaved), median of ``repeat``."""
    import shutil

    from tests.support.remote import upload_cache
    from tests.support.s3server import S3Server

    rows: dict[str, list[float]] = {label: [] for label in caches}
    with S3Server() as server:
        os.environ.update(server.env())
        server.make_bucket("bench")
        options = {"endpoint": server.endpoint}
        for label, cache in caches.items():
            upload_cache(cache, f"s3://bench/{label}", storage_options=options)
        for rep in range(repeat):
            for label, cache in caches.items():
                node = os.path.join(work, f"node-{label}-{rep}")
                loader = dspark_cache.build_dataloader(f"s3://bench/{label}", 4, shuffle=True, seed=rep,
                                                       num_workers=2, pin_memory=False, pad_to="longest",
                                                       storage_options=options, local_cache_dir=node)
                started = time.perf_counter()
                for _ in loader:
                    pass
                rows[label].append(time.perf_counter() - started)
                loader.close()
                shutil.rmtree(node, ignore_errors=True)
    out = []
    for label, cache in caches.items():
        manifest = read_manifest(cache)
        states = manifest.planned_tokens * (manifest.target_hidden_dim + manifest.hidden_size) * 2
        seconds = statistics.median(rows[label])
        out.append({"cache": label, "seconds": seconds, "states_gbps": states / seconds / 1e9,
                    "downloaded": shard_bytes(cache), "runs": rows[label]})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "dspark-bench-compression"))
    p.add_argument("--rows", type=int, default=96, help="long-tail rows through the 8 x 512 target")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--codec-mb", type=float, default=64, help="decoded MB of samples each codec is timed on")
    p.add_argument("--remote", action="store_true", help="only the first epoch from a local S3 server (moto)")
    args = p.parse_args()
    os.makedirs(args.work, exist_ok=True)
    made = caches(args.work, args.rows)
    qwen = "Qwen3 8 x 512, long-tail"
    if args.remote:
        rows = remote_first_epochs({label: made[(qwen, "bf16", label)] for label in ("none", "zstd-1")},
                                   args.repeat, args.work)
        print("| cache | first epoch s | GB/s of states | tar bytes downloaded |\n|---|---|---|---|")
        for row in rows:
            print(f"| {row['cache']} | {row['seconds']:.2f} | {row['states_gbps']:.2f} | "
                  f"{row['downloaded']:,} |")
        with open(os.path.join(args.work, "remote.json"), "w") as handle:
            json.dump(rows, handle, indent=1)
        return
    results: dict = {"bytes": [], "codec": {}, "loader": []}
    print("| target | dtype | uncompressed bytes | zstd-1 | ratio | zstd-3 | ratio |\n"
          "|---|---|---|---|---|---|---|")
    for (name, dtype, label), cache in sorted(made.items()):
        if label != "none":
            continue
        base, one = shard_bytes(cache), shard_bytes(made[(name, dtype, "zstd-1")])
        three = shard_bytes(made[(name, dtype, "zstd-3")]) if (name, dtype, "zstd-3") in made else None
        results["bytes"].append({"target": name, "dtype": dtype, "none": base, "zstd-1": one,
                                 "zstd-3": three})
        extra = f"{three:,} | {three / base:.3f}x" if three else " | "
        print(f"| {name} | {dtype} | {base:,} | {one:,} | **{one / base:.3f}x** | {extra} |")
    for dtype in DTYPES:
        shape, samples = blobs(made[(qwen, dtype, "none")])
        kept, held = [], 0
        for length, data in samples:  # the first in shard order (the longest), up to --codec-mb
            if held < args.codec_mb * 1e6:
                kept.append((length, data))
                held += data.nbytes
        samples = kept
        rows = codec_rows(shape, samples, args.repeat)
        results["codec"][dtype] = rows
        mb = sum(d.nbytes for _, d in samples) / 1e6
        print(f"\n{dtype}: {len(samples)} samples, {mb:.1f} MB decoded; GB/s of decoded bytes, one thread\n"
              "| codec | ratio | encode GB/s | decode GB/s |\n|---|---|---|---|")
        for row in rows:
            if "ratio" in row:
                print(f"| {row['codec']} | {row['ratio']:.3f} | {row['encode']:.2f} | {row['decode']:.2f} |")
            else:
                print(f"| {row['codec']} | | | |")
    print("\nloader, bf16 8 x 512: GB/s of states handed out (steady state)\n"
          "| cache | 1 thread | 2 threads |\n|---|---|---|")
    for label in ("none", "zstd-1"):
        cache = made[(qwen, "bf16", label)]
        one, two = loader_rate(cache, 1, args.repeat), loader_rate(cache, 2, args.repeat)
        results["loader"].append({"cache": label, "1": one, "2": two})
        print(f"| {label} | {one:.2f} | {two:.2f} |")
    with open(os.path.join(args.work, "results.json"), "w") as handle:
        json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
