"""Remote-cache loader benchmark: the same cache read from local disk and from a local S3 server.

    python bench/remote_loader.py                      # ~560 MB cache, 24 shards of ~23 MB, H=1024
    python bench/remote_loader.py --samples 240 --repeat 5

It writes a synthetic cache with bench/loader.py's ``make_cache`` (random bf16 states through the
real shard writer; lengths lognormal(6.0, 0.5) clipped to [32, seq_length]: a long tail, mean ~460
tokens), uploads it to moto's S3 server (tests/support/s3server.py, a process of its own on this
machine) in publication order, warms the page cache, then measures, interleaved per repetition:
  local            build_dataloader(<dir>): a fresh loader's first epoch, page cache warm (the
                   baseline every ratio uses), and its second epoch
  s3 cold          build_dataloader(s3://...) with an empty local_cache_dir and cache_limit =
                   2x the cache: its first epoch (every tar downloaded, prefetched in epoch order)
  s3 steady        the same loader's second epoch (every tar already on the node)
  s3 len() first   as s3 cold, with len(loader) called (untimed) before the epoch, as a training
                   framework does: the loader then knows every shard's index, so it can prefetch
  s3 limit 1/3     a fresh loader, empty local_cache_dir, cache_limit = 1/3 of the tars' bytes
                   (eviction active): its first epoch, and the mirror's downloads vs shard count
  GET ceiling      every shard's tar GET once with obstore directly into memory, 4 at a time
                   (the mirror's downloads in flight) and one at a time: what the store gives;
                   and every tar to a file with ObjectStore.download (the mirror's own call), 4 at a time
Every loader: batch_size 4, num_workers 2, shuffle=True, seed 0, pin_memory off, verify="once"
(each sample hashed on its first read in that loader), ``for batch in loader: pass``.
GB/s are of sample bytes delivered = the shard tars' bytes (headers included) / seconds; batches/s
count the loader's batches. Medians of --repeat; ratios = local first-epoch time / this time.
For the cold epochs it also reports how long the mirror was downloading (the union of its
downloads' intervals), how many downloads were in flight on average, how many ran ahead on the
mirror's pool rather than on a reader thread that needed the shard, and the epoch against "GET
ceiling + local" (no overlap) and "max of them" (perfect overlap).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
RESULTS_DIR = os.path.join(ROOT, ".bench")

from loader import LAYERS, make_cache, warm  # noqa: E402  (bench/loader.py)

from dspark_cache.format.paths import CachePaths  # noqa: E402
from tests.support.remote import upload_cache  # noqa: E402
from tests.support.s3server import ACCESS_KEY, REGION, SECRET_KEY, S3Server  # noqa: E402

BUCKET = "bench"
PREFIX = "runs/cache"
IN_FLIGHT = 4  # dspark_cache.storage.remote.mirror._IN_FLIGHT


def machine() -> dict:
    cpu = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
        "?",
    )
    return {"cpu": cpu, "nproc": os.cpu_count(), "python": platform.python_version(),
            **{name: version(name) for name in ("obstore", "moto", "torch")}}


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by at least one of the intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def run_epochs(path: str, args: argparse.Namespace, epochs: int, call_len: bool = False, **storage) -> dict:
    """Seconds (and batches, time to the first batch) of ``epochs`` epochs of one fresh loader; for
    a remote cache also its downloads per epoch, when each ran and on which thread (the mirror's
    pool: ahead of the reader; a reader thread: the batch waited for it). ``call_len``: ``len(loader)``
    first (untimed), as a training framework does before its first epoch."""
    import dspark_cache

    loader = dspark_cache.build_dataloader(
        path,
        args.batch_size,
        shuffle=True,
        seed=0,
        num_workers=args.threads,
        pad_to=args.pad_to,
        pin_memory=False,
        **storage,
    )
    mirror = loader.cache.backing if loader.cache.remote else None
    intervals: list[tuple[float, float]] = []
    threads: list[str] = []
    if mirror is not None:  # observe the mirror's downloads (an instance attribute: nothing else changes)
        real = mirror._download
        lock = threading.Lock()

        def timed_download(index):
            t = time.perf_counter()
            try:
                return real(index)
            finally:
                with lock:
                    intervals.append((t, time.perf_counter()))
                    threads.append(threading.current_thread().name)

        mirror._download = timed_download
    out = {"seconds": [], "batches": [], "first_batch_s": [], "downloads": [], "download_busy_s": [],
           "download_sum_s": [], "prefetched": []}
    try:
        if call_len:
            len(loader)
        for _ in range(epochs):
            before, seen = (mirror.downloads if mirror else 0), len(intervals)
            t = time.perf_counter()
            first, n = None, 0
            for _batch in loader:
                n += 1
                if first is None:
                    first = time.perf_counter() - t
            end = time.perf_counter()
            out["seconds"].append(end - t)
            out["batches"].append(n)
            out["first_batch_s"].append(first)
            if mirror is not None:
                out["downloads"].append(mirror.downloads - before)
                with lock:
                    mine = [(max(a, t), min(b, end)) for a, b in intervals[seen:]]
                out["download_busy_s"].append(union_seconds(mine))
                out["download_sum_s"].append(sum(b - a for a, b in mine))
                out["prefetched"].append(sum(name.startswith("dspark-mirror") for name in threads[seen:]))
    finally:
        loader.close()
    return out


def get_all(store, keys: list[str], threads: int) -> float:
    """Seconds to GET every key once into memory, ``threads`` at a time (obstore's own client)."""
    import obstore

    def one(key: str) -> int:
        return len(obstore.get(store, key).bytes())

    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        got = sum(pool.map(one, keys))
    seconds = time.perf_counter() - t
    assert got > 0
    return seconds


def download_all(url: str, options: dict, names: list[str], directory: str, threads: int) -> float:
    """Seconds to download every tar to a file with the mirror's own client call
    (``ObjectStore.download``: streamed in 8 MiB chunks), ``threads`` at a time; files removed after."""
    from dspark_cache.storage.remote.store import ObjectStore

    store = ObjectStore(url, options)
    os.makedirs(directory, exist_ok=True)
    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda n: store.download(f"shards/{n}", os.path.join(directory, n)), names))
    seconds = time.perf_counter() - t
    shutil.rmtree(directory, ignore_errors=True)
    return seconds


def measure(args: argparse.Namespace, work: str) -> dict:
    began = time.monotonic()
    root, lengths = make_cache(os.path.join(work, "cache"), args.samples, args.hidden, args.seq_length,
                               args.shard_size, seed=args.seed)
    shards = -(-args.samples // args.shard_size)
    tars = [CachePaths(root).shard_tar(i) for i in range(shards)]
    tar_sizes = [os.path.getsize(f) for f in tars]
    tar_bytes = sum(tar_sizes)
    payload = sum(n * (args.hidden * len(LAYERS) * 2 + 5) for n in lengths)
    made = time.monotonic() - began
    print(
        f"cache: {args.samples} samples, {shards} shards of {statistics.median(tar_sizes) / 1e6:.1f} MB "
        f"(median), {tar_bytes / 1e6:.0f} MB of tars; tokens per sample median {statistics.median(lengths):.0f}, "
        f"mean {statistics.mean(lengths):.0f}, p99 {sorted(lengths)[int(0.99 * (len(lengths) - 1))]}, "
        f"max {max(lengths)} (seq_length {args.seq_length}) [{made:.0f} s]",
        flush=True,
    )

    import obstore.store

    with S3Server() as server:
        os.environ.update(server.env())  # credentials for obstore, as the tests' s3_env sets them
        server.make_bucket(BUCKET)
        url = f"s3://{BUCKET}/{PREFIX}"
        options = {"endpoint": server.endpoint}
        t = time.monotonic()
        upload_cache(root, url, storage_options=options)
        print(f"uploaded to moto at {server.endpoint} in {time.monotonic() - t:.1f} s", flush=True)
        store = obstore.store.S3Store(BUCKET, endpoint=server.endpoint, access_key_id=ACCESS_KEY,
                                      secret_access_key=SECRET_KEY, region=REGION,
                                      client_options={"allow_http": True, "timeout": "300s"})
        keys = [f"{PREFIX}/shards/{os.path.basename(f)}" for f in tars]
        get_all(store, keys[:2], IN_FLIGHT)  # warm-up: connections, moto's first responses
        warm(tars)
        runs: dict[str, list] = {
            k: []
            for k in (
                "local",
                "local_epoch2",
                "s3_cold",
                "s3_steady",
                "s3_cold_len_first",
                "s3_limit_third",
                "get_ceiling",
                "get_one_stream",
                "download_to_file",
            )
        }
        detail: dict[str, list] = {"s3_cold": [], "s3_cold_len_first": [], "s3_limit_third": [], "local": []}
        for rep in range(args.repeat):  # interleaved so that drift hits every reader alike
            local = run_epochs(root, args, 2)
            runs["local"].append(local["seconds"][0])
            runs["local_epoch2"].append(local["seconds"][1])
            detail["local"].append(local)

            node = os.path.join(work, f"node-cold-{rep}")
            cold = run_epochs(
                url, args, 2, storage_options=options, local_cache_dir=node, cache_limit=2 * tar_bytes
            )
            shutil.rmtree(node, ignore_errors=True)
            runs["s3_cold"].append(cold["seconds"][0])
            runs["s3_steady"].append(cold["seconds"][1])
            detail["s3_cold"].append(cold)

            node = os.path.join(work, f"node-len-{rep}")
            with_len = run_epochs(url, args, 1, call_len=True, storage_options=options, local_cache_dir=node,
                                  cache_limit=2 * tar_bytes)
            shutil.rmtree(node, ignore_errors=True)
            runs["s3_cold_len_first"].append(with_len["seconds"][0])
            detail["s3_cold_len_first"].append(with_len)

            node = os.path.join(work, f"node-third-{rep}")
            third = run_epochs(url, args, 1, storage_options=options, local_cache_dir=node,
                               cache_limit=tar_bytes // 3)
            shutil.rmtree(node, ignore_errors=True)
            runs["s3_limit_third"].append(third["seconds"][0])
            detail["s3_limit_third"].append(third)

            runs["get_ceiling"].append(get_all(store, keys, IN_FLIGHT))
            runs["get_one_stream"].append(get_all(store, keys, 1))
            runs["download_to_file"].append(download_all(url, options, [os.path.basename(f) for f in tars],
                                                         os.path.join(work, "files"), IN_FLIGHT))
            warm(tars)  # the local cache's pages again, after ~1 GB written to the node dirs
            print(
                f"  rep {rep}: "
                + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in runs.items())
                + f"; cold downloads {cold['downloads']} ({cold['prefetched'][0]} ahead), len-first "
                f"{with_len['prefetched'][0]} ahead, limit-1/3 downloads {third['downloads'][0]}",
                flush=True,
            )
    med = {k: statistics.median(v) for k, v in runs.items()}
    batches = detail["local"][0]["batches"][0]
    return {
        "machine": machine(),
        "args": vars(args),
        "shards": shards,
        "tar_bytes": tar_bytes,
        "tar_sizes": tar_sizes,
        "payload_bytes": payload,
        "lengths": {
            "median": statistics.median(lengths),
            "mean": statistics.mean(lengths),
            "max": max(lengths),
            "min": min(lengths),
        },
        "batches_per_epoch": batches,
        "seconds": med,
        "runs": runs,
        "detail": detail,
        "gb_per_s": {k: tar_bytes / v / 1e9 for k, v in med.items()},
        "batches_per_s": {k: batches / v for k, v in med.items() if not k.startswith(("get", "download"))},
        "vs_local": {k: med["local"] / v for k, v in med.items()},
        "vs_local_paired": {
            k: statistics.median(a / b for a, b in zip(runs["local"], v)) for k, v in runs.items()
        },
        "cold_first_batch_s": statistics.median(d["first_batch_s"][0] for d in detail["s3_cold"]),
        "local_first_batch_s": statistics.median(d["first_batch_s"][0] for d in detail["local"]),
        "cold_download_busy_s": statistics.median(d["download_busy_s"][0] for d in detail["s3_cold"]),
        "cold_download_sum_s": statistics.median(d["download_sum_s"][0] for d in detail["s3_cold"]),
        "len_first_download_busy_s": statistics.median(
            d["download_busy_s"][0] for d in detail["s3_cold_len_first"]
        ),
        "len_first_download_sum_s": statistics.median(
            d["download_sum_s"][0] for d in detail["s3_cold_len_first"]
        ),
        "prefetched": {
            k: [d["prefetched"][0] for d in detail[k]]
            for k in ("s3_cold", "s3_cold_len_first", "s3_limit_third")
        },
        "cold_downloads": [d["downloads"] for d in detail["s3_cold"]],
        "limit_third_downloads": [d["downloads"][0] for d in detail["s3_limit_third"]],
        "seconds_total": time.monotonic() - began,
    }


def table(r: dict) -> str:
    s, shards = r["seconds"], r["shards"]
    ahead = {k: statistics.median(v) for k, v in r["prefetched"].items()}
    notes = {
        "local": "page cache warm; fresh loader (hashes every sample)",
        "local_epoch2": "same loader, 2nd epoch (no hashing)",
        "s3_cold": f"empty node dir, limit 2x cache; downloads {statistics.median(d[0] for d in r['cold_downloads']):.0f}"
        f"/{shards}, {ahead['s3_cold']:.0f} of them ahead by the mirror's pool; first batch after "
        f"{r['cold_first_batch_s']:.2f} s (local {r['local_first_batch_s']:.2f} s)",
        "s3_steady": f"same loader, 2nd epoch; downloads {statistics.median(d[1] for d in r['cold_downloads']):.0f}",
        "s3_cold_len_first": f"as 2, but len(loader) called first (untimed); {ahead['s3_cold_len_first']:.0f}/{shards} "
        "downloaded ahead by the mirror's pool",
        "s3_limit_third": f"limit = 1/3 of the tars; downloads {statistics.median(r['limit_third_downloads']):.0f}"
        f"/{shards} shards, {ahead['s3_limit_third']:.0f} ahead",
        "get_ceiling": f"obstore GET of every tar into memory, {IN_FLIGHT} at a time",
        "get_one_stream": "the same, one at a time",
        "download_to_file": f"ObjectStore.download (the mirror's call) of every tar to a file, {IN_FLIGHT} at a time",
    }
    labels = {
        "local": "1. local disk",
        "local_epoch2": "1b. local disk, epoch 2",
        "s3_cold": "2. s3 cold, 1st epoch",
        "s3_cold_len_first": "2b. s3 cold, len() first",
        "s3_steady": "3. s3 steady, 2nd epoch",
        "s3_limit_third": "4. s3, cache_limit 1/3, 1st epoch",
        "get_ceiling": "5. GET ceiling",
        "get_one_stream": "5b. GET, one stream",
        "download_to_file": "5c. download to files",
    }
    rows = ["| reader | seconds | GB/s (tar bytes) | batches/s | vs local (paired) | notes |",
            "|---|---|---|---|---|---|"]
    for k, label in labels.items():
        bps = f"{r['batches_per_s'][k]:.1f}" if k in r["batches_per_s"] else "-"
        rows.append(f"| {label} | {s[k]:.2f} | {r['gb_per_s'][k]:.2f} | {bps} | "
                    f"**{r['vs_local'][k]:.2f}x** ({r['vs_local_paired'][k]:.2f}x) | {notes[k]} |")
    return "\n".join(rows)


def overlap_lines(r: dict) -> list[str]:
    s = r["seconds"]
    serial, parallel = s["get_ceiling"] + s["local"], max(s["get_ceiling"], s["local"])
    lines = []
    for k, label in (("s3_cold", "cold epoch"), ("s3_cold_len_first", "cold epoch, len() first")):
        where = (s[k] - parallel) / (serial - parallel) if serial > parallel else float("nan")
        lines.append(
            f"{label} {s[k]:.2f} s vs GET ceiling + local = {serial:.2f} s (no overlap) and "
            f"max(GET ceiling, local) = {parallel:.2f} s (full overlap): {where:.0%} of the way from full "
            "overlap to none (>100%: slower than downloading then reading)"
        )
    for k, label in (("cold", "cold epoch"), ("len_first", "cold epoch, len() first")):
        busy, total = r[f"{k}_download_busy_s"], r[f"{k}_download_sum_s"]
        lines.append(
            f"{label}: the mirror was downloading during {busy:.2f} s of it; its downloads took {total:.2f} s "
            f"summed ({total / busy:.1f} in flight on average)"
        )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=120)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--shard-size", type=int, default=5, help="samples per shard (5: ~23 MB shards at H=1024)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--threads", type=int, default=2, help="the loader's num_workers")
    p.add_argument("--pad-to", default="longest", choices=("longest", "seq_length"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--workdir", default=None,
                   help="where the cache and the node-local copies are written: a fresh directory inside it, "
                        "removed at the end (default: inside --results-dir)")
    p.add_argument(
        "--results-dir", default=RESULTS_DIR, help="where the JSON results are saved (default: .bench/)"
    )
    args = p.parse_args()
    os.makedirs(args.results_dir, exist_ok=True)
    if args.workdir:
        os.makedirs(args.workdir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="remote-loader-", dir=args.workdir or args.results_dir)
    try:
        result = measure(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = os.path.join(args.results_dir, f"remote-loader-{time.strftime('%Y%m%d-%H%M%S')}.json")
    print()
    print(table(result))
    print()
    for line in overlap_lines(result):
        print(line)
    m = result["machine"]
    print(
        f"\nmachine: {m['cpu']}, nproc {m['nproc']}, Python {m['python']}; obstore {m['obstore']}, moto {m['moto']}, "
        f"torch {m['torch']}; {result['shards']} shards, {result['tar_bytes'] / 1e6:.0f} MB, H={args.hidden}, "
        f"seq {args.seq_length}, pad_to={args.pad_to}, batch {args.batch_size}, {args.threads} workers; "
        f"medians of {args.repeat}; {result['seconds_total']:.0f} s in all"
    )
    with open(out, "w") as handle:
        json.dump(result, handle, indent=2)
    print(f"results: {out}")


if __name__ == "__main__":
    main()
