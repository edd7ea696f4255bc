"""A fuzzer of hostile caches: every mutated cache reads exactly as the original or is refused.

Each case copies a small pristine cache, applies one seeded mutation (index fields, entries,
manifest fields, tar bytes, sample headers, FIFOs / devices / directories in place of files) and
reads it through ``open_cache``, the loader with both batch fillers, and ``verify_cache``
(``tests/fuzz_worker.py``). A case passes when every reader returns exactly the original samples
or raises a ``CacheError`` naming a file of the cache, and ``verify_cache`` flags every case a
reader refused. A hang, a signal, another exception type or more memory than the worker's
address-space limit fails it. ``DSPARK_FUZZ_CASES`` and ``DSPARK_FUZZ_SEED`` run more or other cases.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import run_produce

CASES = int(os.environ.get("DSPARK_FUZZ_CASES", "300"))
SEED = int(os.environ.get("DSPARK_FUZZ_SEED", "1"))
PER_WORKER = 100


@pytest.fixture(scope="module")
def pristine(embedded, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("fuzz") / "cache")
    assert run_produce(embedded.stock, embedded.data, out, "--seq-length", "48", "--shard-size", "12",
                       "--dtype", "fp32", "--target-layer-ids", "1", "3") == 0
    return out


def _run_worker(pristine: str, workdir: str, first: int, count: int, family: str = "cache") -> list[dict]:
    args = [sys.executable, "-m", "tests.fuzz_worker", pristine, workdir, str(SEED), str(first), str(count), family]
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=60 + 3 * count, cwd=os.getcwd())
        stdout, returncode, why = done.stdout, done.returncode, done.stderr[-2000:]
    except subprocess.TimeoutExpired as exc:
        stdout, returncode, why = (exc.stdout or b"").decode(), None, "timed out (a hang)"
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    results = [line for line in lines if "case" in line]
    started = [line for line in lines if "start" in line]
    if len(results) < count:
        unfinished = started[len(results)] if len(started) > len(results) else {"start": first + len(results)}
        results.append({"case": unfinished["start"], "mutation": unfinished.get("mutation"),
                        "outcome": f"FAIL: worker exit {returncode}: {why}"})
    return results


def test_hostile_caches_are_refused_or_read_exactly(pristine, tmp_path):
    results = []
    for first in range(0, CASES, PER_WORKER):
        results += _run_worker(pristine, str(tmp_path), first, min(PER_WORKER, CASES - first))
    failures = [r for r in results if r["outcome"].startswith("FAIL")]
    counts = collections.Counter(r["outcome"] for r in results)
    kinds = collections.Counter((r["mutation"] or "?").split(" ")[0].rstrip(":") for r in results)
    print(f"\nfuzz: {len(results)} cases, seed {SEED}: {dict(counts)}; mutated files: {dict(kinds)}")
    assert not failures, "\n".join(f"case {r['case']} ({r['mutation']}): {r['outcome']}" for r in failures[:10])
    assert counts["rejected"] > CASES // 2  # the mutations do reach the checks


# -- FP8 scales and codes (issue 23) ------------------------------------------------------------

FP8_CASES = int(os.environ.get("DSPARK_FUZZ_FP8_CASES", "100"))


@pytest.fixture(scope="module")
def pristine_fp8(embedded, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("fuzz-fp8") / "cache")
    assert run_produce(embedded.stock, embedded.data, out, "--seq-length", "48", "--shard-size", "12",
                       "--dtype", "fp8", "--target-layer-ids", "1", "3") == 0
    return out


def test_hostile_fp8_scales_and_codes_are_refused(pristine_fp8, tmp_path):
    """Crafted FP8 damage with matching checksums (NaN, inf, zero, negative, overflowing scales; NaN/inf
    codes) through open_cache (bf16 and raw), both fillers and verify: every reader refuses it by the FP8
    rule, never hands out NaN or inf. A quarter of the cases are the generic mutations on FP8 geometry."""
    results = []
    for first in range(0, FP8_CASES, PER_WORKER):
        results += _run_worker(pristine_fp8, str(tmp_path), first, min(PER_WORKER, FP8_CASES - first), "fp8")
    failures = [r for r in results if r["outcome"].startswith("FAIL")]
    counts = collections.Counter(r["outcome"] for r in results)
    crafted = [r for r in results if (r["mutation"] or "").startswith("fp8:")]
    print(f"\nfuzz fp8: {len(results)} cases, seed {SEED}: {dict(counts)}; crafted FP8 damage: {len(crafted)}")
    assert not failures, "\n".join(f"case {r['case']} ({r['mutation']}): {r['outcome']}" for r in failures[:10])
    assert len(crafted) > FP8_CASES // 2 and all(r["outcome"] == "rejected" for r in crafted)
