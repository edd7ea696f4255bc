"""Our C XXH3-64 (dspark_cache/format/csrc/xxh3.h) against the `xxhash` package, bit for bit.

The header is compiled here, through tests/loader/xxh3_probe.c, into a throwaway shared library,
and every check runs for each stripe-loop path: the one detected at run time ("auto"), and
scalar, SSE2, AVX2 and AVX-512 pinned by probe_set_path, so each is checked whatever the CPU would
pick (a vector path the CPU lacks is skipped).
Every length up to 2100 (all the short and medium forms, the first blocks), lengths either side
of each stripe and block boundary up to 70,000, MB-sized buffers, streaming in many chunkings
(with a digest after every piece, which must not disturb the state), that dispatch reaches the
pinned loop, and the no-__int128 and no-prefetch builds.
"""

from __future__ import annotations

import ctypes
import os
import platform
import shutil
import subprocess

import numpy as np
import pytest
import xxhash

PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "xxh3_probe.c")
CC = shutil.which("gcc") or shutil.which("cc")
X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
PATHS = {"auto": -1, "scalar": 0, "sse2": 1, "avx2": 2, "avx512": 3}  # probe_set_path() values
CPU_FLAG = {"avx2": "avx2", "avx512": "avx512f"}  # /proc/cpuinfo flag each vector path needs

pytestmark = pytest.mark.skipif(CC is None, reason="no C compiler (gcc/cc) on PATH")


def build(out_dir: str, *flags: str) -> tuple[ctypes.CDLL, str]:
    """Compile the probe into out_dir and load it: (library, the compiler's stderr)."""
    so = os.path.join(out_dir, "xxh3_probe.so")
    cmd = [CC, "-O2", "-std=gnu11", "-Wall", "-Wextra", "-shared", "-fPIC", *flags, PROBE, "-o", so]
    proc = subprocess.run(cmd, stderr=subprocess.PIPE, text=True)
    assert proc.returncode == 0, proc.stderr
    lib = ctypes.CDLL(so)
    lib.probe_path.restype = ctypes.c_int
    lib.probe_set_path.argtypes = [ctypes.c_int]
    lib.probe_set_path.restype = None
    lib.probe_ran.restype = ctypes.c_int
    lib.probe_xxh3_64.restype = ctypes.c_uint64
    lib.probe_xxh3_64.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
    lib.probe_xxh3_chunked.restype = ctypes.c_uint64
    lib.probe_xxh3_chunked.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_uint64]
    return lib, proc.stderr


def cpu_flags() -> set[str] | None:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), None)
    except OSError:
        return None  # unknown: trust the probe's own detection


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    lib, err = build(str(tmp_path_factory.mktemp("xxh3")))
    detected = lib.probe_path()  # before any test pins a path
    return lib, err, detected


@pytest.fixture(scope="module")
def data() -> np.ndarray:
    return np.random.default_rng(20240611).integers(0, 256, 8 << 20, dtype=np.uint8)


@pytest.fixture(params=list(PATHS))
def lib(request, built):
    lib, _, detected = built
    name = request.param
    if name in ("sse2", "avx2", "avx512") and not X86:
        pytest.skip(f"{name}: x86 only")
    if name in CPU_FLAG and detected < PATHS[name]:  # detection prefers the widest the CPU has
        pytest.skip(f"CPU without {CPU_FLAG[name]}")
    lib.probe_set_path(PATHS[name])
    assert lib.probe_path() == (detected if name == "auto" else PATHS[name])
    yield lib
    lib.probe_set_path(-1)


def oneshot(lib, data: np.ndarray, n: int) -> int:
    return lib.probe_xxh3_64(data.ctypes.data, n)


def chunked(lib, data: np.ndarray, n: int, cuts) -> int:
    c = np.asarray(cuts, dtype=np.uint64)
    return lib.probe_xxh3_chunked(data.ctypes.data, n, c.ctypes.data, len(c))


def want(data: np.ndarray, n: int) -> int:
    return xxhash.xxh3_64_intdigest(memoryview(data)[:n])


def mismatches(got, data, lengths):
    return [n for n, h in zip(lengths, got) if h != want(data, n)]


def test_compiles_cleanly_and_detects_the_cpu_path(built):
    _, err, detected = built
    assert err.strip() == ""  # -Wall -Wextra
    flags = cpu_flags()
    if not X86:
        assert detected == 0
    elif flags is None:
        assert detected in (1, 2, 3)
    else:
        assert detected == (3 if "avx512f" in flags else 2 if "avx2" in flags else 1)


def test_the_pinned_path_runs_its_own_loop(lib, data):
    # Every loop gives the same hashes, so only this shows that dispatch reached the right one.
    path = lib.probe_path()
    lib.probe_ran()  # clears the mark
    assert oneshot(lib, data, 240) == want(data, 240) and lib.probe_ran() == -1  # closed form, no loop
    for n in (241, 1025, 5000):  # the first length with stripes, one with a scramble, several
        assert oneshot(lib, data, n) == want(data, n)
        assert lib.probe_ran() == path, n
        assert chunked(lib, data, n, [100]) == want(data, n)
        assert lib.probe_ran() == path, n


def test_every_length_to_2100(lib, data):
    lengths = range(2101)
    assert mismatches([oneshot(lib, data, n) for n in lengths], data, lengths) == []


def test_lengths_at_stripe_and_block_boundaries(lib, data):
    # 64*k +-1 covers every stripe and block (1024*k) edge: the last stripe fully inside the last
    # block, exactly filling it, and one byte into the next block (which flips the last block's
    # scramble).
    lengths = sorted({n for k in range(4, 70_000 // 64 + 1) for n in (64 * k - 1, 64 * k, 64 * k + 1)})
    assert mismatches([oneshot(lib, data, n) for n in lengths], data, lengths) == []


def test_megabyte_buffers(lib, data):
    lengths = [1 << 20, 3_000_017, (4 << 20) + 1024, len(data) - 1, len(data)]
    assert mismatches([oneshot(lib, data, n) for n in lengths], data, lengths) == []
    assert mismatches([chunked(lib, data, n, [256 << 10]) for n in lengths], data, lengths) == []
    assert (
        mismatches([chunked(lib, data, n, [1, 255 << 10, 4096]) for n in lengths[:2]], data, lengths[:2])
        == []
    )


def test_streaming_fixed_chunkings(lib, data):
    # Every length to 700 byte by byte (buffered-only, the 240/241 switch, the 256-byte buffer
    # filling and spilling) and in stripe-sized steps; totals that are whole stripes and blocks.
    for cut in (1, 63, 64, 65):
        lengths = range(701)
        assert mismatches([chunked(lib, data, n, [cut]) for n in lengths], data, lengths) == [], cut
    lengths = [64 * k for k in range(1, 80)] + [1024 * k for k in range(1, 40)]
    for cuts in ([1], [7], [64], [1024], [1025], [4096], [1023, 1], [0, 64, 0, 192]):
        assert mismatches([chunked(lib, data, n, cuts) for n in lengths], data, lengths) == [], cuts


def test_streaming_random_chunkings(lib, data):
    rng = np.random.default_rng(7)
    pool = [1, 7, 63, 64, 65, 240, 241, 256, 1023, 1024, 1025, 4096]
    cases = []
    for i in range(300):
        n = int(rng.integers(0, 300_000 if i % 10 == 0 else 20_000))
        cuts = [int(pool[j]) if rng.random() < 0.6 else int(rng.integers(1, 5000))
                for j in rng.integers(0, len(pool), int(rng.integers(1, 5)))]
        cases.append((n, cuts))
    bad = [(n, cuts) for n, cuts in cases if chunked(lib, data, n, cuts) != want(data, n)]
    assert bad == []


def test_oneshot_and_stream_agree_on_unaligned_input(lib, data):
    # Straight-from-the-caller stripes use unaligned loads: start at every offset in a stripe.
    for off in range(0, 64, 3):
        view = data[off:]
        for n in (241, 1024, 5000):
            assert oneshot(lib, view, n) == chunked(lib, view, n, [333]) == want(view, n), (off, n)


def test_without_int128(tmp_path, data):
    # 32-bit targets have no 128-bit integer: the 64x64 -> 128 multiply falls back to 32-bit parts.
    lib, err = build(str(tmp_path), "-U__SIZEOF_INT128__")
    assert err.strip() == ""
    lengths = [*range(300), 1000, 5000, 70_001]
    assert mismatches([oneshot(lib, data, n) for n in lengths], data, lengths) == []
    assert mismatches([chunked(lib, data, n, [7, 1025]) for n in lengths], data, lengths) == []


def test_without_prefetch(tmp_path, built, data):
    # -DDSPARK_XXH3_PREFETCH=0 (how bench/xxh3.py --also measures what the prefetch is worth)
    # compiles it out of every loop: still clean, still the same hashes.
    lib, err = build(str(tmp_path), "-DDSPARK_XXH3_PREFETCH=0")
    assert err.strip() == ""
    lengths = [241, 1024, 1025, 5000, 70_001]
    for path in range(built[2] + 1):  # every path the CPU has
        lib.probe_set_path(path)
        assert mismatches([oneshot(lib, data, n) for n in lengths], data, lengths) == [], path
        assert mismatches([chunked(lib, data, n, [7, 1025]) for n in lengths], data, lengths) == [], path
