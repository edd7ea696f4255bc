"""XXH3-64 throughput: our C implementation (dspark_cache/format/csrc/xxh3.h) against `xxhash`.

    python bench/xxh3.py               # ~10 s
    python bench/xxh3.py --big-mib 64  # smaller DRAM case
    python bench/xxh3.py --also=-DDSPARK_XXH3_PREFETCH=0  # + every path built without prefetch

Compiles tests/loader/xxh3_probe.c (the header, -O3 as setup.py builds the filler) into a temp
dir and times, for each stripe-loop path the CPU has (scalar, SSE2, AVX2, AVX-512; pinned through
the probe; again for each --also build, with those compiler flags added) and for
`xxhash.xxh3_64_intdigest` / `xxhash.xxh3_64().update()`, hashing
  hot   a 256 KiB buffer over and over (L2 resident, as the filler sees a chunk after its pread)
  big   one --big-mib MiB buffer (DRAM bound)
one shot and in 256 KiB updates. GB/s (1e9 bytes/s), median of --repeat, configurations
interleaved. Our calls hash a whole run per ctypes call; xxhash's go through Python per buffer
(hot) or per chunk (~0.1 us each, against ~10 us of hashing). With --also, a second table puts
each path's default build against that build: the median of per-repeat time ratios (> 1: the
default is faster), which cancels most of a noisy machine's drift.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = os.path.join(ROOT, "tests", "loader", "xxh3_probe.c")
CHUNK = 256 << 10
PATHS = {"scalar": 0, "sse2": 1, "avx2": 2, "avx512": 3}

import numpy as np  # noqa: E402
import xxhash  # noqa: E402


def build(so: str, flags: list[str]) -> ctypes.CDLL:
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise SystemExit("needs gcc or cc on PATH")
    subprocess.run([cc, "-O3", "-std=gnu11", "-Wall", "-Wextra", "-shared", "-fPIC", *flags, PROBE, "-o", so],
                   check=True)
    lib = ctypes.CDLL(so)
    lib.probe_path.restype = ctypes.c_int
    lib.probe_set_path.argtypes = [ctypes.c_int]
    lib.probe_set_path.restype = None
    lib.probe_xxh3_64.restype = ctypes.c_uint64
    lib.probe_xxh3_64.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
    lib.probe_xxh3_repeat.restype = ctypes.c_uint64
    lib.probe_xxh3_repeat.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64]
    return lib


def ours(lib, path: int, buf: np.ndarray, chunk: int, reps: int):
    def run() -> None:
        lib.probe_set_path(path)
        lib.probe_xxh3_repeat(buf.ctypes.data, len(buf), chunk, reps)
    return run


def theirs(buf: np.ndarray, chunk: int, reps: int):
    view = memoryview(buf)

    def run() -> None:
        for _ in range(reps):
            if not chunk:
                xxhash.xxh3_64_intdigest(view)
                continue
            h = xxhash.xxh3_64()
            for off in range(0, len(view), chunk):
                h.update(view[off:off + chunk])
            h.intdigest()
    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--big-mib", type=int, default=256)
    p.add_argument("--hot-reps", type=int, default=512, help="256 KiB hashes per hot measurement")
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--also", action="append", default=[], metavar="CFLAGS",
                   help="also time every path built with these extra compiler flags (repeatable)")
    args = p.parse_args()

    rng = np.random.default_rng(0)
    hot = np.frombuffer(rng.bytes(CHUNK), dtype=np.uint8)
    big = np.frombuffer(rng.bytes(args.big_mib << 20), dtype=np.uint8)
    with tempfile.TemporaryDirectory() as tmp:
        libs = {extra: build(os.path.join(tmp, f"xxh3_probe_{i}.so"), extra.split())  # dlopen caches by path
                for i, extra in enumerate(["", *args.also])}
        detected = libs[""].probe_path()
        paths = {name: v for name, v in PATHS.items() if v <= detected}  # only those the CPU has
        for lib in libs.values():
            for name, v in paths.items():  # a wrong hash makes its speed moot
                lib.probe_set_path(v)
                for buf in (hot, big):
                    assert lib.probe_xxh3_64(buf.ctypes.data, len(buf)) == xxhash.xxh3_64_intdigest(buf), name
        variants = {f"ours {name} {extra}".rstrip(): (lib, v)
                    for extra, lib in libs.items() for name, v in paths.items()}
        rows = [*variants, "xxhash"]
        cases = [(buf, reps, chunk) for buf, reps in ((hot, args.hot_reps), (big, 1)) for chunk in (0, CHUNK)]
        runs = {}
        for row in rows:
            for i, (buf, reps, chunk) in enumerate(cases):
                runs[row, i] = (ours(*variants[row], buf, chunk, reps) if row != "xxhash"
                                else theirs(buf, chunk, reps), len(buf) * reps)
        seconds = {key: [] for key in runs}
        for _ in range(args.repeat):
            for key, (run, _) in runs.items():
                t = time.perf_counter()
                run()
                seconds[key].append(time.perf_counter() - t)
        for lib in libs.values():
            lib.probe_set_path(-1)

    detected_name = {v: n for n, v in PATHS.items()}[detected]
    print(f"XXH3-64 GB/s, median of {args.repeat} (ours: -O3, detected path {detected_name}; "
          f"xxhash {xxhash.VERSION}, libxxhash {xxhash.XXHASH_VERSION})")
    width = max(map(len, rows))
    print(f"| {'':{width}} | hot 256 KiB one-shot | hot 256 KiB chunks | {args.big_mib} MiB one-shot "
          f"| {args.big_mib} MiB 256 KiB chunks |")
    print("|---|---|---|---|---|")
    for row in rows:
        cells = [runs[row, i][1] / statistics.median(seconds[row, i]) / 1e9 for i in range(len(cases))]
        print(f"| {row:{width}} | " + " | ".join(f"{c:6.1f}" for c in cells) + " |")
    if args.also:  # paired: each repeat's default-build time over its --also time, so drift cancels
        print("\nspeed of the default build relative to each --also build, median of per-repeat ratios")
        for row in variants:
            name, _, extra = row[5:].partition(" ")
            if extra:
                cells = [statistics.median(a / b for a, b in zip(seconds[row, i], seconds[f"ours {name}", i]))
                         for i in range(len(cases))]
                print(f"| {row:{width}} | " + " | ".join(f"{c:6.3f}" for c in cells) + " |")


if __name__ == "__main__":
    sys.exit(main())
