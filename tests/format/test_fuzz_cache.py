"""A fuzzer of hostile caches: every mutated cache reads exactly as the original or is refused.

Each case copies a small pristine cache, applies one seeded mutation (index fields, entries,
manifest fields, tar bytes, sample headers, FIFOs / devices / directories in place of files) and
reads it through ``open_cache``, the loader with both batch fillers, and ``verify_cache``
(``tests/support/fuzz_worker.py``). A case passes when every reader returns exactly the original samples
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

from tests.support.produce import run_produce
from tests.support import warm

CASES = int(os.environ.get("DSPARK_FUZZ_CASES", "300"))
SEED = int(os.environ.get("DSPARK_FUZZ_SEED", "1"))
PER_WORKER = 100


# The small cache every case copies before mutating it (fp32 here, fp8 for the FP8 families).
PRISTINE_ARGS = ("--seq-length", "48", "--shard-size", "12", "--target-layer-ids", "1", "3")


@pytest.fixture
def pristine(produced) -> str:
    return produced(*PRISTINE_ARGS, "--dtype", "fp32")


def _run_worker(pristine: str, workdir: str, first: int, count: int, family: str = "cache") -> list[dict]:
    args = [
        sys.executable,
        "-m",
        "tests.support.fuzz_worker",
        pristine,
        workdir,
        str(SEED),
        str(first),
        str(count),
        family,
    ]
    try:
        done = warm.run(args, capture_output=True, text=True, timeout=60 + 3 * count, cwd=os.getcwd())
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


@pytest.mark.slow
def test_hostile_caches_are_refused_or_read_exactly(pristine, tmp_path):
    results = []
    for first in range(0, CASES, PER_WORKER):
        results += _run_worker(pristine, str(tmp_path), first, min(PER_WORKER, CASES - first))
    failures = [r for r in results if r["outcome"].startswith("FAIL")]
    counts = collections.Counter(r["outcome"] for r in results)
    kinds = collections.Counter((r["mutation"] or "?").split(" ")[0].rstrip(":") for r in results)
    print(f"\nfuzz: {len(results)} cases, seed {SEED}: {dict(counts)}; mutated files: {dict(kinds)}")
    assert not failures, "\n".join(
        f"case {r['case']} ({r['mutation']}): {r['outcome']}" for r in failures[:10]
    )
    assert counts["rejected"] > CASES // 2  # the mutations do reach the checks


# -- target weights ---------------------------------------------------------------------------------

_WEIGHTS_READER = """
import json, sys
from dspark_cache.format.errors import CacheError
from dspark_cache.format.paths import CachePaths
from dspark_cache.nemo import read_target_weight_modules
from dspark_cache.verify import verify_cache
for root in sys.argv[1:]:
    path = CachePaths(root).target_weights
    flagged = [p for p in verify_cache(root).problems if path in p]
    try:
        read_target_weight_modules(root)
        refused = "read"
    except (CacheError, FileNotFoundError) as exc:
        refused = type(exc).__name__ if path in str(exc) and "dspark-produce" in str(exc) else f"vague: {exc}"
    print(json.dumps({"root": root, "flagged": bool(flagged), "refused": refused}), flush=True)
"""


def _weights_mutations(path: str, rng) -> list[tuple[str, object]]:
    """Seeded damage to a weights file: truncations, bit flips in header and data, other shapes or
    names, and every kind of thing that is not a plain file of ours."""
    import shutil

    import numpy as np
    from safetensors.numpy import load_file, save_file

    size = os.path.getsize(path)
    header_end = 8 + int.from_bytes(open(path, "rb").read(8), "little")

    def truncate(n):
        return lambda p: os.truncate(p, n)

    def flip(at):
        def apply(p):
            with open(p, "r+b") as handle:
                handle.seek(at)
                byte = handle.read(1)[0]
                handle.seek(at)
                handle.write(bytes([byte ^ (1 << rng.randrange(8))]))
        return apply

    def rewrite(change):
        def apply(p):
            save_file(change(load_file(p)), p)
        return apply

    def replace(make):
        def apply(p):
            os.unlink(p)
            make(p)
        return apply

    outside = os.path.join(os.path.dirname(os.path.dirname(path)), "outside-weights.safetensors")
    cases = [
        (f"truncated to {n}", truncate(n))
        for n in (
            0,
            7,
            8,
            header_end - 1,
            header_end,
            *sorted(rng.sample(range(header_end + 1, size), 3)),
            size - 1,
        )
    ]
    cases += [(f"bit flip in header at {at}", flip(at)) for at in sorted(rng.sample(range(header_end), 4))]
    cases += [
        (f"bit flip in data at {at}", flip(at)) for at in sorted(rng.sample(range(header_end, size), 4))
    ]
    cases += [
        ("one row fewer", rewrite(lambda t: {k: v[:-1] for k, v in t.items()})),
        ("one column more", rewrite(lambda t: {k: np.pad(v, ((0, 0), (0, 1))) for k, v in t.items()})),
        (
            "names swapped",
            rewrite(
                lambda t: {
                    "embed_tokens.weight": t["lm_head.weight"],
                    "lm_head.weight": t["embed_tokens.weight"],
                }
            ),
        ),
        ("a third tensor", rewrite(lambda t: {**t, "norm.weight": t["lm_head.weight"][0]})),
        ("int32 weights", rewrite(lambda t: {k: v.view(np.int32) for k, v in t.items()})),
        ("grown by a byte", lambda p: open(p, "ab").write(b"\0")),
        ("missing", os.unlink),
        ("fifo", replace(os.mkfifo)),
        ("directory", replace(os.mkdir)),
        ("symlink to /dev/zero", replace(lambda p: os.symlink("/dev/zero", p))),
        ("dangling symlink", replace(lambda p: os.symlink(p + ".gone", p))),
        (
            "symlink out of the cache",
            lambda p: (shutil.copyfile(p, outside), os.unlink(p), os.symlink(outside, p)),
        ),
    ]
    return cases


@pytest.mark.slow
def test_fuzz_target_weights(pristine, embedded, tmp_path):
    """Every damaged weights file: dspark-verify reports it, the reader refuses it naming it (in a
    child, so a reader that blocks is a timeout), and a rerun of the producer rewrites it."""
    import random
    import shutil

    from dspark_cache.format.paths import CachePaths
    from dspark_cache.verify import verify_cache

    rng = random.Random(SEED)
    original = open(CachePaths(pristine).target_weights, "rb").read()
    cases = _weights_mutations(CachePaths(pristine).target_weights, rng)
    roots = {}
    for i, (name, apply) in enumerate(cases):
        root = shutil.copytree(pristine, str(tmp_path / f"case-{i}" / "cache"))
        apply(CachePaths(root).target_weights)
        roots[root] = name
    done = warm.run(
        [sys.executable, "-c", _WEIGHTS_READER, *roots],
        code=True,
        capture_output=True,
        text=True,
        timeout=60 + 5 * len(roots),
        cwd=os.getcwd(),
    )
    seen = {r["root"]: r for r in map(json.loads, done.stdout.splitlines())}
    bad = [f"{roots[root]}: {seen.get(root, 'no result (the reader hung or crashed)')}" for root in roots
           if not (seen.get(root, {}).get("flagged") and seen[root]["refused"] in ("TargetWeightsError",
                                                                                    "FileNotFoundError"))]
    assert not bad, "\n".join(bad) + done.stderr[-2000:]
    # A rerun rewrites the file without recomputing a shard, for one case of each kind; a directory
    # is not ours to delete: the rerun says to remove it.
    args = ("--seq-length", "48", "--shard-size", "12", "--dtype", "fp32", "--target-layer-ids", "1", "3")
    rerun = ("truncated to 7", "bit flip in data", "one row fewer", "missing", "fifo", "directory",
             "symlink to /dev/zero", "symlink out of the cache")
    for kind in rerun:
        name, root = next((n, r) for r, n in roots.items() if n.startswith(kind))
        shards = CachePaths(root).shards_dir
        before = {n: os.stat(os.path.join(shards, n)).st_mtime_ns for n in os.listdir(shards)}
        code = run_produce(embedded.stock, embedded.data, root, *args)
        if name == "directory":
            assert code == 1 and os.path.isdir(CachePaths(root).target_weights), name
            continue
        assert code == 0, name
        assert open(CachePaths(root).target_weights, "rb").read() == original, name
        assert {n: os.stat(os.path.join(shards, n)).st_mtime_ns for n in os.listdir(shards)} == before, name
        assert verify_cache(root).ok, name


# -- FP8 scales and codes (issue 23) ------------------------------------------------------------

FP8_CASES = int(os.environ.get("DSPARK_FUZZ_FP8_CASES", "100"))


@pytest.fixture
def pristine_fp8(produced) -> str:
    return produced(*PRISTINE_ARGS, "--dtype", "fp8")


@pytest.mark.slow
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
    print(
        f"\nfuzz fp8: {len(results)} cases, seed {SEED}: {dict(counts)}; crafted FP8 damage: {len(crafted)}"
    )
    assert not failures, "\n".join(
        f"case {r['case']} ({r['mutation']}): {r['outcome']}" for r in failures[:10]
    )
    assert len(crafted) > FP8_CASES // 2 and all(r["outcome"] == "rejected" for r in crafted)


# -- compressed samples (issue 42) -------------------------------------------------------------

ZSTD_CASES = int(os.environ.get("DSPARK_FUZZ_ZSTD_CASES", "100"))


@pytest.fixture
def pristine_zstd(produced) -> str:
    return produced(*PRISTINE_ARGS, "--dtype", "bf16", "--compression", "zstd")


@pytest.mark.slow
def test_hostile_compressed_frames_are_refused(pristine_zstd, tmp_path):
    """Crafted frames with matching checksums (decompression bombs of up to 1 GiB, frames that declare no
    size, another size or no checksum, random bytes, flipped bits, cut frames, another sample's) through
    open_cache, both fillers, webdataset and verify, under the worker's address-space limit: every reader
    refuses each as a corrupt sample naming its file, in bounded time and memory; never other states. A
    quarter as many cases more: the generic mutations on a compressed cache's geometry (without plain
    WebDataset, whose own tar reading is not ours: it waits on a FIFO)."""
    results = []
    end = ZSTD_CASES + ZSTD_CASES // 4
    for first in range(0, end, PER_WORKER):
        crafted = first < ZSTD_CASES
        count = min(PER_WORKER, (ZSTD_CASES if crafted else end) - first)
        results += _run_worker(pristine_zstd, str(tmp_path), first, count, "zstd" if crafted else "cache")
    failures = [r for r in results if r["outcome"].startswith("FAIL")]
    counts = collections.Counter(r["outcome"] for r in results)
    crafted = [r for r in results if (r["mutation"] or "").startswith("zstd:")]
    kinds = collections.Counter(r["mutation"].split(": ")[-1] for r in crafted)
    print(f"\nfuzz zstd: {len(results)} cases, seed {SEED}: {dict(counts)}; crafted frames: {dict(kinds)}")
    assert not failures, "\n".join(
        f"case {r['case']} ({r['mutation']}): {r['outcome']}" for r in failures[:10]
    )
    assert len(crafted) == ZSTD_CASES and all(r["outcome"] == "rejected" for r in crafted)


# -- convert sources ------------------------------------------------------------------------------

CONVERT_CASES = int(os.environ.get("DSPARK_FUZZ_CONVERT_CASES", "250"))


def test_fuzz_convert_sources(tmp_path):
    """``dspark-convert --to dspark`` on seeded mutations of a small NeMo cache and of what an
    earlier run left in DST (``tests/support/convert_fuzz.py``), all in one worker under its address-space
    limit: each converts exactly as the pristine cache does or exits 1/2 with one line naming a
    file of the case; never a hang, a traceback or a runaway allocation."""
    from dspark_cache.nemo.convert import convert_to_dspark
    from tests.support import convert_fuzz
    from tests.support.convert_fixture import write_tiny_nemo
    from tests.support.convert_worker import run_jobs

    pad = convert_fuzz.PAD
    ids = [[5, 6, 9, pad, pad, pad, pad, pad], [5, 6, pad, pad, pad, pad, pad, pad], [5, 6, 9, 9, 9, 9, 9, 9],
           [pad] * 8, [5, pad, 9, pad, pad, pad, pad, pad]]
    masks = [[0, 1, 1, 0, 0, 0, 0, 0], [0, 1, 1, 0, 0, 0, 0, 0], [0, 1, 1, 1, 1, 1, 1, 1], [0] * 8,
             [0, 1, 1, 0, 0, 0, 0, 0]]
    nemo, reference = str(tmp_path / "pristine"), str(tmp_path / "reference")
    write_tiny_nemo(nemo, ids, masks, shard_size=2)
    convert_to_dspark(nemo, reference, pad_token_id=pad, progress=None)
    import dspark_cache

    expected = convert_fuzz.samples(dspark_cache.open_cache(reference))
    cases = convert_fuzz.make_cases(nemo, reference, str(tmp_path), SEED, CONVERT_CASES)
    done = run_jobs([{"name": c["name"], "argv": c["argv"]} for c in cases], str(tmp_path),
                    timeout=60 + CONVERT_CASES)
    outcomes = {c["name"]: convert_fuzz.judge(done[c["name"]], c["root"], c["dst"], expected) for c in cases}
    failures = [(c, outcomes[c["name"]]) for c in cases if outcomes[c["name"]].startswith("FAIL")]
    counts = collections.Counter(outcomes.values())
    kinds = collections.Counter(c["mutation"].split(":")[0] for c in cases)
    print(f"\nconvert fuzz: {len(cases)} cases, seed {SEED}: {dict(counts)}; mutations: {dict(kinds)}")
    assert not failures, "\n".join(f"case {c['name']} ({c['mutation']}): {why}" for c, why in failures[:10])
    # the checks are reached, not just hit
    assert counts["rejected"] > CONVERT_CASES // 2 and counts["same"] > 0


PLAN_CASES = int(os.environ.get("DSPARK_FUZZ_PLAN_CASES", "20"))


def _inode(path: str) -> int | None:
    return os.lstat(path).st_ino if os.path.lexists(path) else None


@pytest.mark.slow
def test_hostile_saved_plans_are_reused_intact_or_rebuilt(embedded, produced, tmp_path):
    """Seeded mutations of a saved plan (``tests/support/plan_fuzz.py``: values forged with matching
    checksums or not, header fields, cut / extended / sparse files, directories, FIFOs, symlinks):
    a rerun reuses the plan only when it is intact, else rebuilds it, within a deadline, and
    writes byte for byte the shards of the pristine run."""
    import shutil

    from dspark_cache.format.paths import CachePaths
    from tests.support.plan_fuzz import mutate
    from tests.support.plan_files import deadline
    from tests.producer.test_plan_hardening import ARGS

    pristine = produced(*ARGS)  # read only: each case copies its plan
    vocab = json.load(open(os.path.join(embedded.stock, "config.json")))["vocab_size"]
    paths = CachePaths(pristine)
    shards = sorted(n for n in os.listdir(paths.shards_dir) if n.endswith(".tar"))
    expected = {n: open(os.path.join(paths.shards_dir, n), "rb").read() for n in shards}
    plan_files = sorted(os.listdir(paths.plan_dir))
    outcomes, failures = collections.Counter(), []
    for case in range(PLAN_CASES):
        out = str(tmp_path / f"case-{case}")
        os.makedirs(out)
        case_paths = CachePaths(out)
        shutil.copytree(paths.plan_dir, case_paths.plan_dir)
        mutation = mutate(SEED, case, case_paths.plan_dir, vocab)
        before = {n: _inode(os.path.join(case_paths.plan_dir, n)) for n in plan_files}
        try:
            with deadline(60):
                code = run_produce(embedded.stock, embedded.data, out, *ARGS)
        except BaseException as exc:  # a hang or an exception escaping the command: both are failures
            failures.append(f"case {case} ({mutation}): {type(exc).__name__}: {exc}")
            continue
        got = sorted(n for n in os.listdir(case_paths.shards_dir) if n.endswith(".tar")) if code == 0 else []
        same = code == 0 and got == shards and all(
            open(os.path.join(case_paths.shards_dir, n), "rb").read() == expected[n] for n in shards)
        reused = all(_inode(os.path.join(case_paths.plan_dir, n)) == before[n] for n in plan_files)
        outcome = "reused" if reused else "rebuilt"
        if not same or (mutation == "intact" and not reused):
            failures.append(f"case {case} ({mutation}): exit {code}, same shards {same}, {outcome}")
        outcomes[outcome] += 1
    print(f"\nplan fuzz: {PLAN_CASES} cases, seed {SEED}: {dict(outcomes)}")
    assert not failures, "\n".join(failures[:10])
    assert outcomes["rebuilt"] > PLAN_CASES // 2  # the mutations reach the checks


# -- token ids and loss masks (issue 23, item 5) ------------------------------------------------

TOKEN_CASES = int(os.environ.get("DSPARK_FUZZ_TOKEN_CASES", "100"))


def test_hostile_token_ids_and_loss_masks_are_refused(pristine, tmp_path):
    """Crafted token damage with matching checksums (ids at or past target_vocab_size, negative ids,
    loss mask values past 1) through open_cache, both fillers, plain WebDataset and verify: every reader
    refuses it by the token rule, never hands out an id the target's embedding has no row for."""
    results = []
    for first in range(0, TOKEN_CASES, PER_WORKER):
        results += _run_worker(pristine, str(tmp_path), first, min(PER_WORKER, TOKEN_CASES - first), "tokens")
    failures = [r for r in results if r["outcome"].startswith("FAIL")]
    counts = collections.Counter(r["outcome"] for r in results)
    print(f"\nfuzz tokens: {len(results)} cases, seed {SEED}: {dict(counts)}")
    assert not failures, "\n".join(
        f"case {r['case']} ({r['mutation']}): {r['outcome']}" for r in failures[:10]
    )
    assert len(results) == TOKEN_CASES and all(r["outcome"] == "rejected" for r in results)
