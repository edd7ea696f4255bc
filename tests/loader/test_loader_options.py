"""``num_workers`` in both builders: what 0 means, and negatives refused with a clear ValueError."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch

import dspark_cache
from dspark_cache.nemo import build_cached_dspark_dataloader

READER_THREAD = "dspark-read"  # loader/reader.py's thread name prefix
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _reader_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith(READER_THREAD)}


def _all_batches(loader) -> list[dict[str, torch.Tensor]]:
    return [{k: v.clone() for k, v in batch.items()} for batch in loader]


@pytest.mark.parametrize("bad", [-1, -4])
def test_negative_reader_threads_are_refused(small_cache, bad):
    with pytest.raises(ValueError, match=rf"num_workers={bad}: it is the number of reader threads"):
        dspark_cache.build_dataloader(small_cache, 2, num_workers=bad)


def test_zero_reader_threads_means_one_and_reads_the_same_batches(small_cache):
    before = _reader_threads()
    zero = dspark_cache.build_dataloader(
        small_cache, 3, shuffle=True, seed=5, num_workers=0, pin_memory=False
    )
    batches = iter(zero)
    first = {k: v.clone() for k, v in next(batches).items()}
    assert len(_reader_threads() - before) == 1  # one new reader thread, off the training thread
    rest = [{k: v.clone() for k, v in b.items()} for b in batches]
    zero.close()
    three = dspark_cache.build_dataloader(
        small_cache, 3, shuffle=True, seed=5, num_workers=3, pin_memory=False
    )
    expected = _all_batches(three)
    three.close()
    assert len(expected) == 1 + len(rest) > 1
    for got, want in zip([first, *rest], expected):
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_nemo_builder_refuses_negative_workers_before_opening_the_cache(tmp_path):
    missing = str(tmp_path / "no-cache-here")  # opening it would raise FileNotFoundError
    with pytest.raises(ValueError, match=r"num_workers=-1: it is the number of DataLoader worker processes"):
        build_cached_dspark_dataloader(cache_dir=missing, batch_size=2, shuffle=False, num_workers=-1)
    with pytest.raises(FileNotFoundError):
        build_cached_dspark_dataloader(cache_dir=missing, batch_size=2, shuffle=False, num_workers=0)


def test_nemo_builder_zero_workers_reads_in_this_process(small_cache):
    loader = build_cached_dspark_dataloader(cache_dir=small_cache, batch_size=4, shuffle=False, num_workers=0)
    assert loader.num_workers == 0
    batches = list(loader)
    assert sum(len(b["input_ids"]) for b in batches) == len(loader.dataset)


@pytest.mark.slow
def test_loader_bench_makes_its_directories_and_deletes_only_its_own(tmp_path):
    # --workdir outside the repository used to crash after the whole run, writing to a missing .bench/.
    workdir, results = tmp_path / "work", tmp_path / "results" / "loader"
    workdir.mkdir()
    (workdir / "notes.txt").write_text("the user's, not the bench's")
    done = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "bench", "loader.py"),
            "--samples",
            "6",
            "--hidden",
            "32",
            "--seq-length",
            "128",
            "--shard-size",
            "3",
            "--repeat",
            "1",
            "--workdir",
            str(workdir),
            "--results-dir",
            str(results),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (saved,) = results.glob("loader-*.json")
    printed, last = done.stdout.rsplit("\n", 2)[0], done.stdout.strip().splitlines()[-1]
    assert last == f"results: {saved}"  # the table is printed before it is saved
    assert json.loads(printed[printed.index("{"):]) == json.loads(saved.read_text())
    assert sorted(p.name for p in workdir.iterdir()) == ["notes.txt"]
