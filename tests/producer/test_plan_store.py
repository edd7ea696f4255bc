"""The saved plan (``plan/``): reused by reruns, rebuilt when anything about it is wrong."""

from __future__ import annotations

import json
import os

import msgspec
import numpy as np
import xxhash

import dspark_cache
from dspark_cache.format.paths import CachePaths
from dspark_cache.verify import verify_cache
from tests.support.produce import run_produce, small_run, write_jsonl
from tests.support.proc import assert_same_samples

ARGS = small_run(4, 4)


def _stamps(out: str) -> dict[str, tuple[int, int]]:
    """Identity of every plan file: a file written again (atomically, by rename) gets a new inode."""
    plan = CachePaths(out).plan_dir
    files = sorted(os.path.join(plan, n) for n in os.listdir(plan))
    return {p: (os.stat(p).st_ino, os.stat(p).st_mtime_ns) for p in files}


def _part_files(out: str) -> list[str]:
    """The files of the tokenised input of a one-process run (its one part)."""
    paths = CachePaths(out)
    return [paths.plan_part_header(0), *(paths.plan_part(0, kind) for kind in ("ids", "mask", "rows"))]


def _parts(out: str, stamps: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    return {p: stamps[p] for p in _part_files(out)}


def test_a_resumed_run_reuses_the_saved_plan(embedded, tmp_path):
    out = str(tmp_path / "cache")
    assert run_produce(embedded.stock, embedded.data, out, *ARGS) == 0
    before = _stamps(out)
    paths = CachePaths(out)
    arrays = [paths.plan_array(name) for name in ("samples", "batches", "shards", "shard_bytes")]
    assert {paths.plan_header, *arrays, *_part_files(out)} == set(before)
    reference = str(tmp_path / "reference")
    os.rename(out, reference)
    os.makedirs(out)
    os.rename(CachePaths(reference).plan_dir, paths.plan_dir)  # only the plan, no cache yet
    assert run_produce(embedded.stock, embedded.data, out, *ARGS) == 0
    assert _stamps(out) == before  # nothing tokenised, nothing merged: the same files
    assert verify_cache(out).ok
    assert_same_samples(out, reference, exact=True)
    assert (
        dspark_cache.open_cache(out).manifest.plan_sha256
        == dspark_cache.open_cache(reference).manifest.plan_sha256
    )
    assert paths.indexed_shard_ids()


def test_sizing_a_job_batches_again_without_tokenising(embedded, tmp_path):
    out = str(tmp_path / "cache")
    assert run_produce(embedded.stock, embedded.data, out, *ARGS, "--dry-run") == 0
    before = _stamps(out)
    args = [*ARGS[:2], "--shard-size", "6", *ARGS[4:]]  # another shard size: another layout, same tokens
    assert run_produce(embedded.stock, embedded.data, out, *args, "--dry-run") == 0
    assert run_produce(embedded.stock, embedded.data, out, *args) == 0
    after = _stamps(out)
    assert _parts(out, after) == _parts(out, before)  # the tokenised input is reused ...
    header = CachePaths(out).plan_header
    assert after[header] != before[header]  # ... and batched again
    assert max(_samples_per_shard(out)) == 6
    assert verify_cache(out).ok


def _samples_per_shard(out: str) -> list[int]:
    """From the saved plan's arrays: shard s is batches shards[s]:shards[s + 1] of samples batches[b]:..."""
    batches, shards = (
        np.load(CachePaths(out).plan_array(n), allow_pickle=False) for n in ("batches", "shards")
    )
    return np.diff(batches[shards]).tolist()


def test_overwrite_tokenises_again(embedded, tmp_path):
    out = str(tmp_path / "cache")
    assert run_produce(embedded.stock, embedded.data, out, *ARGS) == 0
    before = _stamps(out)
    assert run_produce(embedded.stock, embedded.data, out, *ARGS, "--overwrite") == 0
    after = _stamps(out)
    assert set(after) == set(before) and all(after[n] != before[n] for n in before)


def test_a_damaged_plan_is_rebuilt_not_trusted(embedded, tmp_path, reference):
    for damage in (_flip_a_token, _point_outside_with_a_valid_checksum, _a_fifo_for_a_part):
        out = str(tmp_path / damage.__name__)
        os.makedirs(out)
        plan, source = CachePaths(out).plan_dir, CachePaths(reference).plan_dir
        os.makedirs(plan)
        for name in os.listdir(source):
            with open(os.path.join(source, name), "rb") as src, open(os.path.join(plan, name), "wb") as dst:
                dst.write(src.read())
        damaged = damage(CachePaths(out))
        before = _stamps(out)
        assert run_produce(embedded.stock, embedded.data, out, *ARGS) == 0
        assert _stamps(out)[damaged] != before[damaged]  # rebuilt
        assert verify_cache(out).ok
        assert_same_samples(out, reference, exact=True)


def _flip_a_token(paths: CachePaths) -> str:
    path = paths.plan_part(0, "ids")
    with open(path, "r+b") as handle:
        handle.seek(os.path.getsize(path) - 4)
        value = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([value[0] ^ 1]))
    return path


def _a_fifo_for_a_part(paths: CachePaths) -> str:
    """A plan file that is not a regular file: opening it to read would block forever."""
    path = paths.plan_part(0, "mask")
    os.unlink(path)
    os.mkfifo(path)
    return path


def _point_outside_with_a_valid_checksum(paths: CachePaths) -> str:
    """A hostile plan: an offset past the part's tokens, its checksum made to match."""
    path = paths.plan_array("samples")
    samples = np.load(path).copy()
    samples["offset"][0] = 1 << 40
    np.save(path, samples)
    header = json.load(open(paths.plan_header))
    header["arrays"]["samples"]["xxh3_64"] = xxhash.xxh3_64_hexdigest(samples.tobytes())
    open(paths.plan_header, "w").write(json.dumps(header))
    return path


def test_every_invalid_row_is_reported_in_one_run(embedded, tmp_path, capsys):
    good = [json.loads(line) for line in open(embedded.data)][:6]
    rows = []
    for i in range(30):
        rows.append(good[i % len(good)])
        rows.append({"messages": "not a list"} if i % 2 else {"no": "messages"})
    data = write_jsonl(tmp_path / "bad.jsonl", rows)
    out = str(tmp_path / "cache")
    assert run_produce(embedded.stock, data, out, *ARGS) == 1
    err = capsys.readouterr().err
    assert "30 invalid input rows" in err
    listed = [line for line in err.splitlines() if line.strip().startswith(f"{data}:")]
    assert len(listed) == 20 and listed[0].strip().startswith(f"{data}:2:") and "... and 10 more" in err
    assert "--on-invalid skip" in err and not os.path.exists(CachePaths(out).manifest)
    before = _parts(out, _stamps(out))
    assert run_produce(embedded.stock, data, out, *ARGS, "--on-invalid", "skip") == 0
    assert _parts(out, _stamps(out)) == before  # skipping them needed no second tokenisation
    manifest = dspark_cache.open_cache(out).manifest
    assert sum(manifest.skipped_rows.values()) == 30 and manifest.num_rows == 60


def test_part_header_lists_its_rows(reference):
    paths = CachePaths(reference)
    part = msgspec.json.decode(open(paths.plan_part_header(0), "rb").read())
    manifest = dspark_cache.open_cache(reference).manifest
    assert part["rows"] == manifest.num_rows and part["num_parts"] == 1
    rows = np.load(paths.plan_part(0, "rows"), mmap_mode="r", allow_pickle=False)
    assert rows.shape[0] == manifest.planned_samples and int(rows["length"].sum()) == manifest.planned_tokens
