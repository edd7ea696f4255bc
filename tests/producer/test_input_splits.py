"""--split means one thing for every input kind; save_to_disk directories; the ``keep`` hook.

The oracle for shuffle-then-slice is ``datasets`` itself: ``Dataset.shuffle(seed)`` for the order
and ``ReadInstruction.from_spec(split).to_absolute`` for where a slice starts and stops.
"""

from __future__ import annotations

import json
import os

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import dspark_cache
from dspark_cache.producer.inputs import jsonl as input_lines, source as inputs
from dspark_cache.producer.inputs.jsonl import scan_lines
from dspark_cache.producer.inputs.rows import InputError
from dspark_cache.producer.inputs.source import InputSource
from dspark_cache.producer.inputs.split import parse_split
from tests.support.produce import run_produce

N = 40
ROWS = [{"messages": [{"role": "user", "content": f"question number {i}"},
                      {"role": "assistant", "content": f"answer number {i}"}]} for i in range(N)]
SPLITS = ["train", "train[5:12]", "train[-4:]", "train[:-35]", "train[:10%]", "train[10%:25%]",
          "train[-15%:]", "train[38:100]", "train[30:10]"]
KINDS = ["jsonl", "json", "parquet", "saved_dataset", "saved_dict"]


def _number(row) -> int:
    return int(row.value["messages"][0]["content"].split()[-1])


def _write_jsonl(path, rows, blank_every: int = 0) -> str:
    """Rows one per line, with blank lines sprinkled in (they hold no row but count as lines)."""
    with open(path, "w", encoding="utf-8") as handle:
        handle.write("\n")
        for i, row in enumerate(rows):
            handle.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
            if blank_every and i % blank_every == 0:
                handle.write(" \t\n")
    return str(path)


def _make(kind: str, tmp_path) -> str:
    if kind == "jsonl":
        return _write_jsonl(tmp_path / "d.jsonl", ROWS, blank_every=3)
    if kind == "json":
        (tmp_path / "d.json").write_text(json.dumps(ROWS))
        return str(tmp_path / "d.json")
    if kind == "parquet":  # two files: positions run across both
        pq.write_table(pa.Table.from_pylist(ROWS[:15]), tmp_path / "a.parquet")
        pq.write_table(pa.Table.from_pylist(ROWS[15:]), tmp_path / "b.parquet")
        return str(tmp_path)
    if kind == "saved_dataset":
        datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    else:
        datasets.DatasetDict(
            {"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:3])}
        ).save_to_disk(str(tmp_path / "saved"))
    return str(tmp_path / "saved")


def _expected(split: str, seed: int | None) -> list[int]:
    order = list(range(N)) if seed is None else datasets.Dataset.from_list(
        [{"i": i} for i in range(N)]).shuffle(seed=seed)["i"]
    (cut,) = datasets.ReadInstruction.from_spec(split).to_absolute({"train": N})
    return order[cut.from_:cut.to]


def _line_of(path: str) -> dict[int, int]:
    """Row number -> 1-based line of the file that holds it."""
    found = {}
    with open(path, encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, 1):
            if line.strip():
                found[int(json.loads(line)["messages"][0]["content"].split()[-1])] = line_no
    return found


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("split", SPLITS)
def test_every_input_kind_shuffles_then_slices_as_datasets_does(tmp_path, kind, split):
    path = _make(kind, tmp_path)
    source = InputSource(path, split=split, shuffle_seed=7)
    got = list(source.rows())
    assert [_number(r) for r in got] == _expected(split, 7)
    assert [r.index for r in got] == list(range(len(got)))
    assert source.count_hint() in (None, len(got))


@pytest.mark.parametrize("kind", KINDS)
def test_no_seed_slices_the_rows_in_their_stored_order(tmp_path, kind):
    path = _make(kind, tmp_path)
    got = [_number(r) for r in InputSource(path, split="train[-6:-2]", shuffle_seed=None).rows()]
    assert got == list(range(N - 6, N - 2))


def test_jsonl_locations_name_the_original_lines_in_any_order(tmp_path):
    path = _make("jsonl", tmp_path)
    lines = _line_of(path)
    for split, seed in (("train[3:30]", 11), (None, 11), ("train", None)):
        rows = list(InputSource(path, split=split, shuffle_seed=seed).rows())
        assert rows and all(r.where == f"{path}:{lines[_number(r)]}" for r in rows)


def test_plain_jsonl_keeps_file_order_as_nemo_reads_it(tmp_path):
    # NeMo reads local JSON/JSONL in file order whatever the seed; sample ids must match its.
    path = _make("jsonl", tmp_path)
    source = InputSource(path, shuffle_seed=42)
    assert not source.shuffled and [_number(r) for r in source.rows()] == list(range(N))
    assert InputSource(path, split="train", shuffle_seed=42).shuffled


def test_saved_rows_name_their_split_and_position(tmp_path):
    path = _make("saved_dict", tmp_path)
    rows = list(InputSource(path, split="test", shuffle_seed=None).rows())
    assert [r.where for r in rows] == [f"{path}[test] row {i}" for i in range(3)]
    assert [_number(r) for r in rows] == [0, 1, 2]
    parquet = _make("parquet", tmp_path)
    row = next(InputSource(parquet, split="train[20:21]", shuffle_seed=None).rows())
    assert row.where == f"{parquet}/b.parquet row 5" and _number(row) == 20


def test_shuffle_is_deterministic_and_follows_the_seed(tmp_path):
    path = _make("jsonl", tmp_path)
    runs = [
        [_number(r) for r in InputSource(path, split="train", shuffle_seed=seed).rows()] for seed in (3, 3, 4)
    ]
    assert runs[0] == runs[1] and runs[0] != runs[2] and sorted(runs[0]) == list(range(N))


@pytest.mark.parametrize("split,words", [
    ("train[5]", "for that one row pass 'train[5:6]'"),
    ("train[:10%", "is not a split; pass NAME, NAME[a:b]"),
    ("train[1%:5]", "mixes a percentage and a row count"),
    ("train[:150%]", "between -100% and 100%"),
    ("train+test", "is not a split"),
    ("", "is not a split"),
])
def test_an_unparseable_split_is_an_input_error_that_shows_the_forms(tmp_path, split, words):
    path = _make("jsonl", tmp_path)
    with pytest.raises(InputError) as info:
        InputSource(path, split=split)
    assert str(info.value).startswith(f"--split {split!r}") and words in str(info.value)


@pytest.mark.parametrize(
    "kind,split,words",
    [
        (
            "jsonl",
            "validation[:5]",
            "has no split 'validation' (it has 'train'); pass one of those, e.g. --split 'train[:5]'",
        ),
        ("json", "test", "has no split 'test'"),
        ("parquet", "validation[:5]", "has no split 'validation'"),
        ("saved_dataset", "test", "the Dataset"),
        ("saved_dict", "validation[2:]", "(it has 'train', 'test')"),
    ],
)
def test_a_split_name_the_input_does_not_have_is_an_input_error(tmp_path, kind, split, words):
    with pytest.raises(InputError) as info:
        InputSource(_make(kind, tmp_path), split=split)
    assert words in str(info.value)


def test_a_dataset_dict_without_train_needs_a_split(tmp_path):
    datasets.DatasetDict({"dev": datasets.Dataset.from_list(ROWS[:2])}).save_to_disk(str(tmp_path / "s"))
    with pytest.raises(InputError, match="no 'train' split .* --split dev"):
        InputSource(str(tmp_path / "s"))
    assert [_number(r) for r in InputSource(str(tmp_path / "s"), split="dev", shuffle_seed=None).rows()] == [
        0,
        1,
    ]


def test_saved_directory_hash_follows_its_data_not_datasets_cache_files(tmp_path):
    path = _make("saved_dict", tmp_path)
    before = InputSource(path).content_sha256()
    list(InputSource(path, split="train[:5]").rows())
    (tmp_path / "saved" / "train" / "cache-0123.arrow").write_bytes(b"written by a map() call")
    assert InputSource(path).content_sha256() == before
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[1:]),
                          "test": datasets.Dataset.from_list(ROWS[:3])}).save_to_disk(str(tmp_path / "other"))
    assert InputSource(str(tmp_path / "other")).content_sha256() != before


@pytest.mark.parametrize("split,seed", [(None, 42), ("train[2:37]", 5), ("train", None)])
def test_keep_takes_a_share_with_unchanged_indices_and_parses_only_its_lines(
    tmp_path, monkeypatch, split, seed
):
    lines = [json.dumps(r) for r in ROWS[:20]]
    lines[4] = '{"messages": [broken'
    path = _write_jsonl(tmp_path / "d.jsonl", lines, blank_every=4)
    whole = [(r.index, r.where, r.error is not None) for r in InputSource(path, split, seed).rows()]
    assert sum(bad for *_, bad in whole) == 1
    parsed = []
    real_loads = json.loads
    monkeypatch.setattr(inputs.json, "loads", lambda text: parsed.append(text) or real_loads(text))
    shares = []
    for rank in range(3):
        parsed.clear()
        share = list(InputSource(path, split, seed).rows(keep=lambda i, rank=rank: i % 3 == rank))
        assert [r.index for r in share] == [i for i, *_ in whole if i % 3 == rank]
        assert len(parsed) == len(share)  # the kept lines (the broken one too, if kept) and no other
        shares += [(r.index, r.where, r.error is not None) for r in share]
    assert sorted(shares) == sorted(whole)


def test_keep_rejecting_a_malformed_line_yields_no_row_for_it(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [json.dumps(ROWS[0]), "{not json", json.dumps(ROWS[1])])
    rows = list(InputSource(path).rows(keep=lambda i: i != 1))
    assert [(r.index, r.error) for r in rows] == [(0, None), (2, None)]


def test_over_long_and_blank_long_lines_agree_in_order_and_shuffled(tmp_path):
    lines = [json.dumps(ROWS[0]), json.dumps({"pad": "x" * 200}), " " * 300, json.dumps(ROWS[1])]
    path = _write_jsonl(tmp_path / "d.jsonl", lines)
    plain = list(InputSource(path, max_row_bytes=100).rows())
    shuffled = list(InputSource(path, split="train", shuffle_seed=1, max_row_bytes=100).rows())
    assert len(plain) == 3 and plain[1].error.reason == "row too long" and plain[1].where == f"{path}:3"
    assert sorted((r.where, r.error and r.error.reason) for r in shuffled) == \
        sorted((r.where, r.error and r.error.reason) for r in plain)


def test_line_scan_across_chunk_boundaries(tmp_path, monkeypatch):
    monkeypatch.setattr(input_lines, "_SCAN_CHUNK", 7)  # lines and blank runs straddle every read
    text = "\n".join(['{"a": 1}', "", "   ", '{"b": 22222}', '{"c": 3}', "", "", '{"d": 4}', "  "])
    (tmp_path / "d.jsonl").write_text(text)
    index = scan_lines(str(tmp_path / "d.jsonl"))
    starts = [i for i, line in enumerate(text.split("\n")) if line.strip()]
    offsets = [sum(len(line) + 1 for line in text.split("\n")[:i]) for i in starts]
    assert index.offsets.tolist() == offsets
    assert [index.line_no(r) for r in range(4)] == [s + 1 for s in starts]


def test_count_hint_is_known_when_cheap(tmp_path):
    assert InputSource(_make("parquet", tmp_path), split="train[:25%]").count_hint() == 10
    assert InputSource(_make("saved_dict", tmp_path), split="test").count_hint() == 3
    jsonl = _make("jsonl", tmp_path)
    assert InputSource(jsonl, split="train[-7:]").count_hint() == 7
    assert InputSource(jsonl).count_hint() is None
    assert InputSource(_make("json", tmp_path), split="train").count_hint() is None


def test_parse_split_bounds_match_datasets_read_instruction():
    for n in (0, 1, 7, 99, 100, 1001):
        for split in SPLITS + ["train[33%:67%]", "train[-100%:]", "train[:0]", "train[-1:]"]:
            (cut,) = datasets.ReadInstruction.from_spec(split).to_absolute({"train": n})
            assert parse_split(split).bounds(n) == (cut.from_, cut.to), (split, n)


def test_produce_reads_a_save_to_disk_dict_split_slice(embedded, tmp_path):
    path = _make("saved_dict", tmp_path)
    out = str(tmp_path / "cache")
    assert run_produce(embedded.stock, path, out, "--split", "train[-6:]", "--shuffle-seed", "3",
                       "--seq-length", "64") == 0
    cache = dspark_cache.open_cache(out)
    assert cache.manifest.num_samples == 6 and cache.manifest.train_split == "train[-6:]"
    assert cache.manifest.input_sha256 == InputSource(path).content_sha256()
    assert not any(n.startswith("cache-") for n in os.listdir(os.path.join(path, "train")))


def test_produce_refuses_a_split_a_jsonl_file_does_not_have(embedded, tmp_path, capsys):
    path = _make("jsonl", tmp_path)
    assert (
        run_produce(
            embedded.stock, path, str(tmp_path / "cache"), "--split", "test[:5]", "--seq-length", "64"
        )
        == 1
    )
    assert "has no split 'test'" in capsys.readouterr().err


@pytest.mark.parametrize("split", ["train[100:]", "train[5:5]", "train[:0%]"])
def test_a_split_that_selects_no_row_says_so_and_how_many_there_are(embedded, tmp_path, split, capsys):
    assert (
        run_produce(embedded.stock, embedded.data, str(tmp_path / "out"), "--split", split, "--dry-run") == 1
    )
    err = capsys.readouterr().err
    assert (
        f"--split {split!r} selects none of the 48 rows of {embedded.data}" in err and "choose a slice" in err
    )
