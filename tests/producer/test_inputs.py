"""Input formats: Parquet with NeMo's shuffle-then-slice, ShareGPT rows, directories."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq

import dspark_cache
from dspark_cache.producer.inputs.source import InputSource
from tests.support.produce import run_produce


def _rows(n):
    return [{"messages": [{"role": "user", "content": f"question number {i}"},
                          {"role": "assistant", "content": f"answer number {i}"}]} for i in range(n)]


def test_parquet_shuffle_then_slice(embedded, tmp_path):
    rows = _rows(20)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    source = InputSource(str(tmp_path / "d.parquet"), split="train[5:12]", shuffle_seed=7)
    got = [r.value["messages"][0]["content"] for r in source.rows()]
    import datasets

    expected = datasets.Dataset.from_list(rows).shuffle(seed=7)[5:12]["messages"]
    assert got == [m[0]["content"] for m in expected]
    out = str(tmp_path / "cache")
    assert run_produce(embedded.stock, str(tmp_path / "d.parquet"), out, "--split", "train[5:12]",
                       "--shuffle-seed", "7", "--seq-length", "64") == 0
    cache = dspark_cache.open_cache(out)
    assert cache.manifest.num_samples == 7 and cache.manifest.train_split == "train[5:12]"


def test_directory_of_files_in_name_order(tmp_path):
    rows = _rows(5)
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[3:]))
    (tmp_path / "a.json").write_text(json.dumps(rows[:3]))
    (tmp_path / "notes.txt").write_text("ignored")
    source = InputSource(str(tmp_path))
    got = [(r.index, r.where.split("/")[-1], r.value["messages"][1]["content"]) for r in source.rows()]
    assert got == [(0, "a.json row 0", "answer number 0"), (1, "a.json row 1", "answer number 1"),
                   (2, "a.json row 2", "answer number 2"), (3, "b.jsonl:1", "answer number 3"),
                   (4, "b.jsonl:2", "answer number 4")]


def test_fifos_and_devices_in_the_input_are_refused_before_anything_opens_them(embedded, tmp_path, capsys):
    import os

    import pytest

    from dspark_cache.producer.inputs.rows import InputError

    good = tmp_path / "a.jsonl"
    good.write_text("".join(json.dumps(r) + "\n" for r in _rows(2)))
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(
        InputError, match=r"fifo\.jsonl is a FIFO, not a regular file; --input-data reads regular"
    ):
        InputSource(str(fifo))
    with pytest.raises(InputError, match=r"fifo\.jsonl is a FIFO, not a regular file"):
        InputSource(str(tmp_path))  # inside a directory
    with pytest.raises(InputError, match=r"/dev/zero is a character device, not a regular file"):
        InputSource("/dev/zero")
    devdir = tmp_path / "dev"
    devdir.mkdir()
    (devdir / "b.jsonl").write_text(good.read_text())
    os.symlink("/dev/zero", devdir / "z.jsonl")
    with pytest.raises(InputError, match=r"z\.jsonl is a character device, not a regular file"):
        InputSource(str(devdir))
    saved = tmp_path / "saved"
    import datasets

    datasets.Dataset.from_list(_rows(2)).save_to_disk(str(saved))
    os.mkfifo(saved / "extra.arrow")
    with pytest.raises(InputError, match=r"extra\.arrow is a FIFO, not a regular file"):
        InputSource(str(saved))
    # The whole producer: a usage-level refusal naming the file, nothing left waiting on the FIFO.
    assert run_produce(embedded.stock, str(tmp_path), str(tmp_path / "out")) == 1
    assert "fifo.jsonl is a FIFO, not a regular file" in capsys.readouterr().err
