"""Every kind of bad input, under both policies: a clear planning-time error, or counted skips."""

from __future__ import annotations

import json
import os

import pytest

import dspark_cache
from dspark_cache.format.paths import CachePaths
from tests.support.produce import run_produce
from tests.support.proc import events

GOOD = {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"}]}
NO_ANSWER = {"messages": [{"role": "user", "content": "anyone?"}]}

# (raw line, reason counted under --on-invalid skip, words the error message must contain)
BAD_ROWS = [
    ('{"messages": [{"role": "user"', "malformed JSON", "malformed JSON"),
    ('[1, 2, 3]', "row not an object", "expected a JSON object"),
    ('{"text": "no messages here"}', "missing messages", "neither 'messages' nor 'conversations'"),
    ('{"messages": "hello"}', "messages not a list", "'messages' is str, expected a list"),
    ('{"conversations": {"from": "human"}}', "messages not a list",
     "'conversations' is dict, expected a list"),
    ('{"messages": ["hello"]}', "message not an object", "messages[0] is str, expected an object"),
    ('{"messages": [{"content": "x"}]}', "message without role", "messages[0] has no 'role'"),
    ('{"messages": [{"role": "narrator", "content": "x"}]}', "unknown role",
     "messages[0].role: unknown role 'narrator'"),
    # The row's own key is named, where the wrong value is, not a message number of ours.
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}, '
     '{"role": "user", "content": 42}]}', "non-string content", "messages[2].content is of type int"),
    ('{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": 42}]}',
     "non-string content", "conversations[1].value is of type int"),
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "tool_calls": '
     '[{"function": {"arguments": "{}"}}]}]}', "bad tool_calls",
     "messages[1].tool_calls[0].function has no name"),
    (b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', "invalid UTF-8", "invalid UTF-8"),
    (b"\x89PNG\x1a\x00\x00\x00\rIHDR\xff\xfe\x00", "invalid UTF-8", "invalid UTF-8"),  # binary garbage
    ('{"conversations": [{"from": "alien", "value": "x"}]}', "unknown role",
     "conversations[0].from: unknown 'from'"),
    # Hostile rows: nesting deep enough to overflow a recursive decoder (in a field nobody reads),
    # and a JSON escape that decodes to a lone UTF-16 surrogate no tokenizer accepts.
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], "meta": '
     + "[" * 5000 + "]" * 5000 + "}", "nested too deeply", "more than 100 levels deep"),
    ('{"messages": [{"role": "user", "content": "bad \\ud800"}, {"role": "assistant", "content": "yo"}]}',
     "lone surrogate", "messages[0].content holds a lone UTF-16 surrogate"),
]


def _write(path, lines) -> str:
    with open(path, "wb") as handle:
        for line in lines:
            handle.write((line if isinstance(line, bytes) else line.encode()) + b"\n")
    return str(path)


@pytest.mark.parametrize("raw,reason,words", BAD_ROWS, ids=[r[1] + str(i) for i, r in enumerate(BAD_ROWS)])
def test_error_policy_names_file_line_and_reason(embedded, tmp_path, capsys, raw, reason, words):
    data = _write(tmp_path / "rows.jsonl", [json.dumps(GOOD), json.dumps(GOOD), raw, json.dumps(GOOD)])
    out = str(tmp_path / "out")
    assert run_produce(embedded.stock, data, out, "--seq-length", "64") == 1
    err = capsys.readouterr().err
    assert "rows.jsonl:3" in err and words in err and "--on-invalid skip" in err
    assert not os.path.exists(CachePaths(out).manifest)  # refused during planning


def test_skip_policy_counts_and_lists_every_bad_row(embedded, tmp_path):
    lines = [json.dumps(GOOD)]
    for raw, _, _ in BAD_ROWS:
        lines += [raw, json.dumps(GOOD)]
    lines.append(json.dumps(NO_ANSWER))
    data = _write(tmp_path / "rows.jsonl", lines)
    out = str(tmp_path / "out")
    assert run_produce(embedded.stock, data, out, "--seq-length", "64", "--on-invalid", "skip") == 0
    m = dspark_cache.open_cache(out).manifest
    expected: dict[str, int] = {"no supervised token": 1}
    for _, reason, _ in BAD_ROWS:
        expected[reason] = expected.get(reason, 0) + 1
    assert m.skipped_rows == dict(sorted(expected.items()))
    assert [s.row for s in m.skipped] == [2 * i + 1 for i in range(len(BAD_ROWS))] + [len(lines) - 1]
    assert all(s.where.startswith(data + ":") for s in m.skipped)
    assert m.num_samples == len(BAD_ROWS) + 1 and m.num_rows == len(lines)
    ids = [s["sample_id"] for s in dspark_cache.open_cache(out).samples()]
    assert ids == [2 * i for i in range(len(BAD_ROWS) + 1)]
    logged = [e for e in events(out) if e["kind"] == "skipped_row"]
    assert sorted(e["data"]["row"] for e in logged) == sorted(s.row for s in m.skipped)


@pytest.mark.parametrize("policy", ["error", "skip"])
def test_unusable_inputs_fail_under_both_policies(embedded, tmp_path, capsys, policy):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    nodata = tmp_path / "nodata"
    nodata.mkdir()
    (nodata / "readme.txt").write_text("x")
    only_bad = _write(tmp_path / "bad.jsonl", ["not json", "{]"])
    cases = [(str(empty), "holds no rows"), (str(tmp_path / "missing.jsonl"), "does not exist"),
             (str(nodata), "holds no data files")]
    if policy == "skip":
        cases.append((only_bad, "none of the 2 rows"))
    for path, words in cases:
        assert run_produce(embedded.stock, path, str(tmp_path / "out"), "--on-invalid", policy) == 1
        err = capsys.readouterr().err
        assert words in err, err


# A tokenizer.json normalizer whose regex backtracks past Oniguruma's retry limit on a long run of
# "a"s: tokenizers then panics in Rust (pyo3_runtime.PanicException, not an Exception).
PANIC_NORMALIZER = {"type": "Replace", "pattern": {"Regex": "(a|aa)+#"}, "content": "#"}
PANIC_ROW = {
    "messages": [{"role": "user", "content": "x " + "a" * 60 + "b"}, {"role": "assistant", "content": "ok"}]
}


@pytest.fixture(scope="module")
def panicking_target(embedded, tmp_path_factory) -> str:
    import shutil

    target = str(tmp_path_factory.mktemp("panic") / "target")
    shutil.copytree(embedded.stock, target)
    spec_path = os.path.join(target, "tokenizer.json")
    with open(spec_path, encoding="utf-8") as handle:
        spec = json.load(handle)
    spec["normalizer"] = PANIC_NORMALIZER
    with open(spec_path, "w", encoding="utf-8") as handle:
        json.dump(spec, handle)
    return target


@pytest.mark.parametrize("workers", ["0", "2"])
def test_a_tokenizer_panic_is_an_invalid_row_in_process_and_in_workers(
    panicking_target, tmp_path, capsys, workers
):
    data = _write(tmp_path / "rows.jsonl", [json.dumps(GOOD), json.dumps(PANIC_ROW), json.dumps(GOOD)])
    out = str(tmp_path / "out")
    args = ("--seq-length", "64", "--num-workers", workers)
    assert run_produce(panicking_target, data, out, *args) == 1
    err = capsys.readouterr().err
    assert "rows.jsonl:2: the tokenizer crashed (a Rust panic)" in err and "--on-invalid skip" in err, err
    assert run_produce(panicking_target, data, out, *args, "--on-invalid", "skip") == 0
    m = dspark_cache.open_cache(out).manifest
    assert m.skipped_rows == {"tokenizer panic": 1} and m.num_samples == 2


@pytest.mark.parametrize("policy", ["error", "skip"])
def test_an_input_of_only_bad_rows_lists_them_like_a_partly_bad_one(embedded, tmp_path, capsys, policy):
    bad = ['{"messages": [', json.dumps(NO_ANSWER)] + [
        '{"messages": [{"role": "narrator", "content": "x"}]}'
    ] * 23
    data = _write(tmp_path / "bad.jsonl", bad)
    assert (
        run_produce(embedded.stock, data, str(tmp_path / "out"), "--seq-length", "64", "--on-invalid", policy)
        == 1
    )
    err = capsys.readouterr().err
    assert (
        "none of the 25 rows" in err and "(1 malformed JSON, 1 no supervised token, 23 unknown role)" in err
    ), err
    assert f"{data}:1: malformed JSON (" in err and f"{data}:2: no supervised token" in err
    assert f"{data}:20: messages[0].role: unknown role 'narrator'" in err and f"{data}:21:" not in err
    assert "... and 5 more" in err and "Fix these rows" in err


def test_a_file_of_a_kind_we_do_not_read_says_so(embedded, tmp_path, capsys):
    text = tmp_path / "corpus.txt"
    text.write_text("one line of plain text\nanother line\n")
    assert run_produce(embedded.stock, str(text), str(tmp_path / "out")) == 1
    err = capsys.readouterr().err
    assert (
        f"input file {text} is not a kind of file dspark-produce reads" in err and "JSONL (.jsonl" in err
    ), err
