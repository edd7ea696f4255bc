"""Object-store client benchmark: obstore against s3fs on a local S3 server, to pick the library.

    python bench/object_store.py                  # 64 MiB object, 5 repetitions, 1000 keys to list
    python bench/object_store.py --repeat 9 --json .bench/object_store.json

It starts moto's S3 server in a process of its own (tests/support/s3server.py, the one the tests
use) and measures, interleaved (obstore then s3fs, --repeat times, after one untimed warm-up of
each), every client with its library's defaults:
  put          one --size-mib object from memory (obstore.put: multipart in 5 MiB parts, 12 at
               a time; s3fs pipe: one PUT below 100 MiB), and again as one PUT request for both
               (obstore use_multipart=False)
  get          it whole into memory (obstore get().bytes(); s3fs cat)
  get to file  it streamed to a local file (obstore get().stream() chunks written out; s3fs
               get_file: concurrent ranged parts above 50 MiB)
  range 1 MiB  a 1 MiB ranged GET at a random offset (mean of 10 per repetition)
  small get    a 2 KB object (mean of 50 per repetition): per-request latency
  list         a prefix of --keys small keys, all pages (s3fs: ls with refresh=True, no cache)
  create       a conditional put (If-None-Match: *) of a new 2 KB key, and the error each raises
               when the key exists
Numbers are medians over the repetitions; ratio = s3fs time / obstore time (> 1: obstore is
faster). Both clients talk to the same single-process Python server on this machine, so absolute
throughput is the server's; the ratios are what the clients add.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.support.s3server import ACCESS_KEY, REGION, SECRET_KEY, S3Server  # noqa: E402

MiB = 1 << 20
RANGES_PER_REP = 10
SMALL_PER_REP = 50
SMALL = 2048


class Obstore:
    name = "obstore"

    def __init__(self, endpoint: str, bucket: str) -> None:
        import obstore
        from obstore.store import S3Store

        self.ob = obstore
        self.store = S3Store(
            bucket,
            endpoint=endpoint,
            access_key_id=ACCESS_KEY,
            secret_access_key=SECRET_KEY,
            region=REGION,
            client_options={"allow_http": True},
        )

    def put(self, key: str, data: bytes) -> None:
        self.ob.put(self.store, key, data)

    def put_single(self, key: str, data: bytes) -> None:
        self.ob.put(self.store, key, data, use_multipart=False)

    def get(self, key: str) -> int:
        return len(self.ob.get(self.store, key).bytes())

    def get_file(self, key: str, path: str) -> int:
        with open(path, "wb") as handle:
            for chunk in self.ob.get(self.store, key).stream():
                handle.write(chunk)
            return handle.tell()

    def get_range(self, key: str, start: int, length: int) -> int:
        return len(self.ob.get_range(self.store, key, start=start, length=length))

    def list(self, prefix: str) -> int:
        return sum(len(batch) for batch in self.ob.list(self.store, prefix=prefix))

    def create(self, key: str, data: bytes) -> None:
        self.ob.put(self.store, key, data, mode="create")


class S3fs:
    name = "s3fs"

    def __init__(self, endpoint: str, bucket: str) -> None:
        import s3fs

        self.bucket = bucket
        self.fs = s3fs.S3FileSystem(key=ACCESS_KEY, secret=SECRET_KEY, skip_instance_cache=True,
                                    client_kwargs={"endpoint_url": endpoint, "region_name": REGION})

    def _path(self, key: str) -> str:
        return f"{self.bucket}/{key}"

    def put(self, key: str, data: bytes) -> None:
        self.fs.pipe_file(self._path(key), data)

    put_single = put  # one PutObject below 2 x 50 MiB already

    def get(self, key: str) -> int:
        return len(self.fs.cat_file(self._path(key)))

    def get_file(self, key: str, path: str) -> int:
        self.fs.get_file(self._path(key), path)
        return os.path.getsize(path)

    def get_range(self, key: str, start: int, length: int) -> int:
        return len(self.fs.cat_file(self._path(key), start=start, end=start + length))

    def list(self, prefix: str) -> int:
        return len(self.fs.ls(self._path(prefix.rstrip("/")), refresh=True, detail=False))

    def create(self, key: str, data: bytes) -> None:
        self.fs.pipe_file(self._path(key), data, mode="create")


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def error_of(fn: Callable[[], object]) -> str:
    try:
        fn()
    except Exception as exc:  # what a caller would have to catch is the point
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return f"{type(exc).__module__}.{type(exc).__qualname__}: {first[:160]}"
    return "no error (the existing object was overwritten)"


def one_rep(client, big_key: str, size: int, data: bytes, small_key: str, prefix: str, keys: int,
            workdir: str, rep: int, rng: random.Random) -> dict[str, float]:
    out: dict[str, float] = {}
    key = f"{client.name}/put-{rep}.bin"
    out["put"] = timed(lambda: client.put(key, data))
    out["put, one request"] = timed(lambda: client.put_single(key, data))
    got = {}
    out["get"] = timed(lambda: got.setdefault("get", client.get(big_key)))
    path = os.path.join(workdir, f"{client.name}-{rep}.bin")
    out["get to file"] = timed(lambda: got.setdefault("file", client.get_file(big_key, path)))
    os.unlink(path)
    assert got["get"] == got["file"] == size, got
    starts = [rng.randrange(0, size - MiB) for _ in range(RANGES_PER_REP)]
    out["range 1 MiB"] = timed(lambda: [client.get_range(big_key, s, MiB) for s in starts]) / RANGES_PER_REP
    out["small get"] = timed(lambda: [client.get(small_key) for _ in range(SMALL_PER_REP)]) / SMALL_PER_REP
    listed = {}
    out["list"] = timed(lambda: listed.setdefault("n", client.list(prefix)))
    assert listed["n"] == keys, (client.name, listed["n"], keys)
    out["create"] = timed(lambda: client.create(f"{client.name}/create-{rep}.bin", b"c" * SMALL))
    return out


def machine() -> dict:
    cpu = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
        "?",
    )
    libs = {name: version(name) for name in ("obstore", "s3fs", "aiobotocore", "botocore", "fsspec", "moto")}
    return {"cpu": cpu, "nproc": os.cpu_count(), "python": platform.python_version(), **libs}


def fill_prefix(server: S3Server, bucket: str, prefix: str, keys: int) -> None:
    """``keys`` small objects under ``prefix`` (boto3 from a few threads: setup, not measured)."""
    client = server.boto3_client()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: client.put_object(Bucket=bucket, Key=f"{prefix}k-{i:05d}", Body=b"l" * 64),
                      range(keys)))


def table(results: dict) -> str:
    rows = ["| operation | obstore | s3fs | ratio (s3fs / obstore) |", "|---|---|---|---|"]
    size = results["args"]["size_mib"]
    for op, label, throughput in (
        ("put", f"PUT {size} MiB", True),
        ("put, one request", f"PUT {size} MiB, one request", True),
        ("get", f"GET {size} MiB to memory", True),
        ("get to file", f"GET {size} MiB to a file", True),
        ("range 1 MiB", "ranged GET 1 MiB", False),
        ("small get", "GET 2 KB", False),
        ("list", f"LIST {results['args']['keys']} keys", False),
        ("create", "conditional create 2 KB", False),
    ):
        cells = []
        for lib in ("obstore", "s3fs"):
            seconds = results["median_s"][lib][op]
            cell = f"{seconds * 1e3:.1f} ms"
            if throughput:
                cell += f" ({size / seconds:.0f} MiB/s)"
            cells.append(cell)
        ratio = results["median_s"]["s3fs"][op] / results["median_s"]["obstore"][op]
        rows.append(f"| {label} | {cells[0]} | {cells[1]} | **{ratio:.2f}x** |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=64)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--keys", type=int, default=1000, help="keys under the listed prefix")
    p.add_argument("--json", metavar="PATH", help="also write the results (every run, medians, machine) here")
    args = p.parse_args()
    size = args.size_mib * MiB
    data = os.urandom(size)
    rng = random.Random(0)
    bucket, big_key, small_key, prefix = "bench", "big.bin", "small.bin", "many/"
    began = time.monotonic()
    with S3Server() as server, tempfile.TemporaryDirectory(prefix="object-store-bench-") as workdir:
        server.make_bucket(bucket)
        fill_prefix(server, bucket, prefix, args.keys)
        clients = [Obstore(server.endpoint, bucket), S3fs(server.endpoint, bucket)]
        clients[0].put(big_key, data)
        clients[0].put(small_key, b"s" * SMALL)
        print(f"moto S3 server at {server.endpoint}; {args.keys} keys under {prefix}, "
              f"{args.size_mib} MiB object ({time.monotonic() - began:.1f} s setup)", flush=True)
        runs: dict[str, list[dict[str, float]]] = {c.name: [] for c in clients}
        for rep in range(-1, args.repeat):  # rep -1: warm-up (connections, sessions, imports)
            for client in clients:
                result = one_rep(client, big_key, size, data, small_key, prefix, args.keys, workdir, rep, rng)
                if rep >= 0:
                    runs[client.name].append(result)
                    times = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in result.items())
                    print(f"  {client.name:8s} rep {rep}: {times}", flush=True)
        errors = {c.name: error_of(lambda c=c: c.create(small_key, b"again")) for c in clients}
    medians = {lib: {op: statistics.median(r[op] for r in rs) for op in rs[0]} for lib, rs in runs.items()}
    results = {"machine": machine(), "args": vars(args), "runs": runs, "median_s": medians,
               "create_on_existing": errors, "seconds_total": time.monotonic() - began}
    print()
    print(table(results))
    print()
    for lib, err in errors.items():
        print(f"conditional create on an existing key, {lib}: {err}")
    m = results["machine"]
    print(
        f"\nmachine: {m['cpu']}, nproc {m['nproc']}, Python {m['python']}; obstore {m['obstore']}, "
        f"s3fs {m['s3fs']} (aiobotocore {m['aiobotocore']}, botocore {m['botocore']}, fsspec {m['fsspec']}), "
        f"moto {m['moto']}; medians of {args.repeat}; {results['seconds_total']:.0f} s in all"
    )
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)
        print(f"saved {args.json}")


if __name__ == "__main__":
    main()
