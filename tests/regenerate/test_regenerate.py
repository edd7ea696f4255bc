"""``dspark-regenerate`` end to end against a real ``transformers serve`` (one for the module): the rows it
writes, what ``dspark-produce`` makes of them, resume after SIGKILL, endpoints down, injected faults,
the turn, truncation and bad-row policies, and last the server itself killed and started again.

Greedy decoding (``--temperature 0``) on a server without batching gives each prompt one answer,
whatever else is in flight: the expected turns are asked of the server directly, and runs at any
``--concurrency`` (or interrupted and resumed) must write the same bytes.
"""

from __future__ import annotations

import base64
import datetime
import json
import os
import shutil
import signal
import time
from pathlib import Path

import msgspec
import pytest

from dspark_cache.cli.conventions import EXIT_INCOMPLETE
from dspark_cache.format.paths import CachePaths
from dspark_cache.producer import normalise_row
from dspark_cache.regenerate.endpoints import DOWN_AFTER
from dspark_cache.regenerate.output import OutputFiles, take_lock
from dspark_cache.regenerate.run import ENDPOINT_WIDE_AFTER
from dspark_cache.regenerate.settings import row_seed
from tests.support.faultproxy import FaultProxy, matching
from tests.support.produce import run_produce, write_jsonl
from tests.support.proc import kill_group, wait_for
from tests.support.regenerate import MAX_TOKENS, count_lines, read_jsonl, regenerate, start_regenerate
from tests.support.ports import free_port

CHAT = matching(method="POST", suffix="/v1/chat/completions")
ROWS = 24
# Every test here asks a real server (10 s to start, then a second or more of generation per run): make
# test-fast leaves them to make test; the parts that need no server are in test_parts.py.
pytestmark = pytest.mark.slow


def _multi_turn_rows() -> list[dict]:
    """Rows with several assistant turns, a trailing user turn, a system turn and a prompt-only row."""
    return [
        {
            "messages": [
                {"role": "user", "content": "what is a cache"},
                {"role": "assistant", "content": "old one"},
                {"role": "user", "content": "and a shard"},
                {"role": "assistant", "content": "old two"},
            ]
        },
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "read the disk"},
                {"role": "assistant", "content": "old"},
                {"role": "user", "content": "write the model"},
                {"role": "assistant", "content": "old"},
                {"role": "user", "content": "train it"},
            ]
        },
        {
            "conversations": [
                {"from": "human", "value": "token speed"},
                {"from": "gpt", "value": "old"},
                {"from": "human", "value": "layer state"},
                {"from": "gpt", "value": "old"},
            ],
            "id": "sharegpt-3",
        },
        {"messages": [{"role": "user", "content": "only a prompt here"}]},
    ]


@pytest.fixture(scope="module")
def rows_file(embedded, tmp_path_factory) -> str:
    """The sample data's first ROWS rows: OpenAI and ShareGPT forms, one to four assistant turns, a prompt
    alone (44 turns to answer, about a second of the server's time)."""
    with open(embedded.data, encoding="utf-8") as handle:
        lines = handle.readlines()[:ROWS]
    return write_jsonl(tmp_path_factory.mktemp("rows") / "rows.jsonl", [line.rstrip("\n") for line in lines])


@pytest.fixture(scope="module")
def reference_files(server, rows_file, tmp_path_factory) -> OutputFiles:
    """An uninterrupted run over the sample data (read-only to the tests): what every other run of it must write."""
    out = str(tmp_path_factory.mktemp("reference") / "regen.jsonl")
    done = regenerate([server.url], rows_file, out, "--concurrency", "4")
    assert done.returncode == 0, done.stderr
    return OutputFiles(out)


@pytest.fixture(scope="module")
def reference(reference_files) -> bytes:
    with open(reference_files.path, "rb") as handle:
        return handle.read()


def _expected(server, messages: list[dict], turns: str, seed: int) -> list[dict]:
    """The row as the server itself answers it, asked turn by turn here (the rule of ``--turns``)."""
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    wanted = (assistant if turns == "all" else assistant[-1:]) or [len(messages)]
    out: list[dict] = []
    for i in range(len(messages) + 1):
        if i in wanted:
            reply = server.chat(out, max_tokens=MAX_TOKENS, temperature=0, top_p=1.0, seed=seed)
            out.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"] or ""})
        elif i < len(messages):
            out.append(messages[i])
    return out


def _lines(data: bytes) -> list[bytes]:
    return data.splitlines(keepends=True)


def test_regenerate_then_produce(server, rows_file, reference, embedded, tmp_path):
    inputs = read_jsonl(rows_file)
    out = tmp_path / "regen.jsonl"
    out.write_bytes(reference)
    rows = read_jsonl(str(out))
    assert [r["regenerated"]["source"] for r in rows] == [{"index": i, "where": f"{rows_file}:{i + 1}"}
                                                          for i in range(len(inputs))]
    for i, (row, raw) in enumerate(zip(rows, inputs)):
        messages, _ = normalise_row(raw)
        record = row["regenerated"]
        assert record["model"] == server.model and record["row_seed"] == row_seed(0, i)
        assert (record["turns"], record["temperature"], record["top_p"], record["max_tokens"]) == (
            "all",
            0.0,
            1.0,
            MAX_TOKENS,
        )
        assert len(record["finish_reasons"]) == max(1, sum(m["role"] == "assistant" for m in messages))
        assert [m["role"] for m in row["messages"]] == [m["role"] for m in messages] + \
            ([] if any(m["role"] == "assistant" for m in messages) else ["assistant"])
        # Every non-assistant turn is the input's; the assistant turns are what the server says.
        assert [m for m in row["messages"] if m["role"] != "assistant"] == \
            [m for m in messages if m["role"] != "assistant"]
        if i < 6:  # asking the server for every row again would double the test's time
            assert row["messages"] == _expected(server, messages, "all", record["row_seed"])
    assert any(r["messages"] != normalise_row(raw)[0] for r, raw in zip(rows, inputs))
    # The premise of serving a hub id: the server answers with the revision it resolved, which the run accepts.
    assert server.chat([{"role": "user", "content": "hi"}], max_tokens=1)["model"] == f"{server.model}@main"
    tokens = sum(r["regenerated"]["completion_tokens"] for r in rows)
    assert tokens > len(rows)

    cache = tmp_path / "cache"
    assert run_produce(embedded.stock, str(out), str(cache), "--seq-length", "512") == 0
    manifest = msgspec.json.decode(Path(CachePaths(str(cache)).manifest).read_bytes())
    assert manifest["num_rows"] == len(inputs)
    assert manifest["regenerated"] == [
        {
            "model": server.model,
            "turns": "all",
            "temperature": 0.0,
            "top_p": 1.0,
            "max_tokens": MAX_TOKENS,
            "seed": 0,
            "chat_template_kwargs": {},
            "rows": len(inputs),
        }
    ]
    # The input the sample data itself is says nothing of regeneration: no entry.
    plain = tmp_path / "plain"
    assert run_produce(embedded.stock, rows_file, str(plain), "--seq-length", "512") == 0
    assert msgspec.json.decode(Path(CachePaths(str(plain)).manifest).read_bytes())["regenerated"] == []


def test_same_bytes_at_any_concurrency(server, rows_file, reference, tmp_path):
    out = tmp_path / "regen.jsonl"
    done = regenerate([server.url], rows_file, str(out), "--concurrency", "16")
    assert done.returncode == 0, done.stderr
    assert out.read_bytes() == reference


def test_sigkill_then_resume_equals_an_uninterrupted_run(server, rows_file, reference, tmp_path):
    out = tmp_path / "regen.jsonl"
    total = len(_lines(reference))
    for at, concurrency in ((3, "4"), (9, "1"), (16, "1")):  # killed three times, each further in
        # One request at a time writes rows one by one (a row of four turns holds back the rows after it
        # at 4 in flight, then they land together): the kill finds rows left to do.
        proc = start_regenerate(
            [server.url], rows_file, str(out), "--concurrency", concurrency, "--fsync-rows", "1"
        )
        wait_for(lambda: count_lines(str(out)) >= at or proc.poll() is not None, timeout=120, poll=0.01)
        kill_group(proc)
        written = count_lines(str(out))
        assert written < total, f"the run finished before the kill at {at} rows: the test proves nothing"
        assert out.read_bytes().startswith(b"".join(_lines(reference)[:written]))
    done = regenerate([server.url], rows_file, str(out), "--concurrency", "4")
    assert done.returncode == 0, done.stderr
    assert out.read_bytes() == reference
    assert "done before" in done.stdout


def test_sigterm_keeps_what_is_done_and_exits_3(server, rows_file, reference, tmp_path):
    out = tmp_path / "regen.jsonl"
    proc = start_regenerate([server.url], rows_file, str(out), "--concurrency", "2")
    wait_for(lambda: count_lines(str(out)) >= 4 or proc.poll() is not None, timeout=120, poll=0.01)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 3 and "rerun the same command to resume" in stderr, stderr
    written = count_lines(str(out))
    assert 4 <= written < len(_lines(reference))
    assert out.read_bytes() == b"".join(_lines(reference)[:written])  # whole rows, in order, synced
    done = regenerate([server.url], rows_file, str(out))
    assert done.returncode == 0, done.stderr
    assert out.read_bytes() == reference


def test_torn_last_line_is_cut_off_on_resume(server, rows_file, reference_files, reference, tmp_path):
    out = tmp_path / "regen.jsonl"
    lines = _lines(reference)
    # The reference run's output as a kill in the middle of an append leaves it: whole rows, then part of one.
    shutil.copyfile(reference_files.run, OutputFiles(str(out)).run)
    out.write_bytes(b"".join(lines[:-6]) + lines[-6][:40])
    done = regenerate([server.url], rows_file, str(out), "--concurrency", "2")
    assert done.returncode == 0, done.stderr
    assert out.read_bytes() == reference


def test_two_endpoints_one_dead_then_back(server, rows_file, reference, tmp_path):
    """The dead endpoint leaves the rotation, the run goes on with the other; once it answers it is used again."""
    port = free_port()
    proxy = FaultProxy("127.0.0.1", server.port, port=port, dialect="openai")
    out = tmp_path / "regen.jsonl"
    proc = start_regenerate(
        [f"http://127.0.0.1:{port}", server.url],
        rows_file,
        str(out),
        "--concurrency",
        "4",
        "--log-level",
        "INFO",
    )
    try:
        wait_for(lambda: count_lines(str(out)) >= 3 or proc.poll() is not None, timeout=120)
        proxy.start()  # the endpoint comes up in the middle of the run
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proxy.stop()
    assert proc.returncode == 0, stderr
    assert f"endpoint http://127.0.0.1:{port} does not answer" in stderr
    assert proxy.requests > 0, "the endpoint that came back was never tried again"
    assert out.read_bytes() == reference


def test_429_503_and_resets_are_retried(server, rows_file, reference, tmp_path):
    out = tmp_path / "regen.jsonl"
    with FaultProxy("127.0.0.1", server.port, dialect="openai") as proxy:
        proxy.fail_next(3, "429", match=CHAT)
        proxy.fail_next(2, "503", match=CHAT)
        proxy.fail_next(2, "reset", match=CHAT)
        proxy.fail_next(1, "cut", match=CHAT, cut_after=10)
        done = regenerate([proxy.endpoint], rows_file, str(out), "--concurrency", "4")
        faults = proxy.faults
    assert done.returncode == 0, done.stderr
    assert (faults["429"], faults["503"], faults["reset"], faults["cut"]) == (3, 2, 2, 1)
    assert out.read_bytes() == reference
    assert not (tmp_path / "regen.jsonl.failed").exists()


def _small(rows_file: str, tmp_path, n: int = 6) -> str:
    with open(rows_file) as handle:
        return write_jsonl(tmp_path / "small.jsonl", [line.rstrip("\n") for line in handle][:n])


def test_rows_failing_after_retries_are_listed_then_retried(server, rows_file, tmp_path):
    data = _small(rows_file, tmp_path)
    out = tmp_path / "regen.jsonl"
    with FaultProxy("127.0.0.1", server.port, dialect="openai") as proxy:
        proxy.fail_next(None, "503", match=CHAT)
        none = regenerate([proxy.endpoint], data, str(out), "--retries", "1", "--concurrency", "2")
        # No row answered: the endpoint's doing, not the rows'. Not 0 (`regenerate && produce` must not go
        # on), and not 4 either: one line naming the endpoint and the cause.
        last = none.stderr.strip().splitlines()[-1]
        assert none.returncode == 1, none.stderr
        assert last.startswith("dspark-regenerate: error: every row sent failed"), last
        assert f"HTTP 503 from {proxy.endpoint}" in last and "rerun the same command" in last
        failed = read_jsonl(str(out) + ".failed")
        assert [f["index"] for f in failed] == list(range(6))
        assert all("HTTP 503" in f["detail"] and f["where"] == f"{data}:{f['index'] + 1}" for f in failed)
        assert count_lines(str(out)) == 0

        stop = regenerate([proxy.endpoint], data, str(out), "--retries", "1", "--on-failed", "error")
        assert stop.returncode == 1
        assert f"{data}:1: the request failed: HTTP 503" in stop.stderr

        proxy.clear()
        proxy.fail_next(4, "503", match=CHAT)  # one request at a time: rows 0 and 1, each tried twice
        some = regenerate([proxy.endpoint], data, str(out), "--retries", "1", "--concurrency", "1")
        assert some.returncode == EXIT_INCOMPLETE, some.stderr  # rows answered beside them: the rows' failure
        assert "2 rows failed" in some.stderr and "rerun" in some.stderr
        assert [f["index"] for f in read_jsonl(str(out) + ".failed")] == [0, 1]
        again = regenerate([proxy.endpoint], data, str(out), "--concurrency", "2")
    assert again.returncode == 0, again.stderr
    assert [r["regenerated"]["source"]["index"] for r in read_jsonl(str(out))] == [2, 3, 4, 5, 0, 1]
    assert not os.path.exists(str(out) + ".failed")
    direct = tmp_path / "direct.jsonl"
    assert regenerate([server.url], data, str(direct)).returncode == 0
    assert sorted(_lines(out.read_bytes())) == sorted(_lines(direct.read_bytes()))


@pytest.mark.parametrize("turns", ["all", "last"])
def test_turns_on_multi_turn_rows(server, tmp_path, turns):
    data = write_jsonl(tmp_path / "multi.jsonl", _multi_turn_rows())
    out = tmp_path / "regen.jsonl"
    done = regenerate([server.url], data, str(out), "--turns", turns, "--seed", "7")
    assert done.returncode == 0, done.stderr
    rows = read_jsonl(str(out))
    for i, (row, raw) in enumerate(zip(rows, _multi_turn_rows())):
        messages, _ = normalise_row(raw)
        assert row["messages"] == _expected(server, messages, turns, row_seed(7, i))
        assert row["regenerated"]["turns"] == turns and row["regenerated"]["row_seed"] == row_seed(7, i)
    if turns == "last":  # earlier assistant turns are kept as they were
        assert (
            rows[0]["messages"][1]["content"] == "old one" and rows[0]["messages"][3]["content"] != "old two"
        )
    else:
        assert "old one" not in json.dumps(rows[0]["messages"])
    assert rows[1]["messages"][-1] == {"role": "user", "content": "train it"}  # a trailing turn stays
    assert rows[2]["id"] == "sharegpt-3" and "conversations" not in rows[2]  # ShareGPT written as messages
    assert [m["role"] for m in rows[3]["messages"]] == ["user", "assistant"]  # a prompt gets its answer


def test_truncation_policies(server, rows_file, reference, tmp_path):
    kept = read_jsonl_bytes(reference)
    truncated = {
        r["regenerated"]["source"]["index"] for r in kept if "length" in r["regenerated"]["finish_reasons"]
    }
    assert truncated and len(truncated) < len(kept), "the stopping target must end some turns both ways"
    out = tmp_path / "regen.jsonl"
    done = regenerate([server.url], rows_file, str(out), "--concurrency", "4", "--on-truncated", "drop")
    assert done.returncode == 0, done.stderr
    assert out.read_bytes() == b"".join(line for line, row in zip(_lines(reference), kept)
                                        if row["regenerated"]["source"]["index"] not in truncated)
    skipped = read_jsonl(str(out) + ".skipped")
    assert {s["index"] for s in skipped} == truncated and {s["reason"] for s in skipped} == {"truncated"}
    assert all(r["regenerated"]["finish_reasons"] and set(r["regenerated"]["finish_reasons"]) == {"stop"}
               for r in read_jsonl(str(out)))
    # The policy is part of the output's identity: a rerun that keeps them is refused.
    again = regenerate([server.url], rows_file, str(out), "--on-truncated", "keep")
    assert (
        again.returncode == 1 and "on_truncated: the output has 'drop', this run has 'keep'" in again.stderr
    )


def read_jsonl_bytes(data: bytes) -> list[dict]:
    return [json.loads(line) for line in data.splitlines()]


def test_bad_rows(server, tmp_path):
    good = [{"messages": [{"role": "user", "content": f"question {i}"}]} for i in range(4)]
    data = write_jsonl(
        tmp_path / "bad.jsonl",
        [
            good[0],
            good[1],
            "{not json",
            {"text": "no messages"},
            {"messages": [{"role": "wizard", "content": "x"}]},
            good[2],
            good[3],
        ],
    )
    out = tmp_path / "regen.jsonl"
    stop = regenerate([server.url], data, str(out), "--concurrency", "4")
    assert stop.returncode == 1
    assert f"{data}:3: invalid row" in stop.stderr and "--on-invalid skip" in stop.stderr
    # the rows before it are kept
    assert [r["regenerated"]["source"]["index"] for r in read_jsonl(str(out))] == [0, 1]
    done = regenerate([server.url], data, str(out), "--on-invalid", "skip")
    assert done.returncode == 0, done.stderr
    assert [r["regenerated"]["source"]["index"] for r in read_jsonl(str(out))] == [0, 1, 5, 6]
    skipped = read_jsonl(str(out) + ".skipped")
    assert [(s["index"], s["where"]) for s in skipped] == [
        (2, f"{data}:3"),
        (3, f"{data}:4"),
        (4, f"{data}:5"),
    ]
    assert [s["reason"] for s in skipped][1:] == ["missing messages", "unknown role"]


def test_parquet_and_split_read_as_the_producer_reads_them(server, tmp_path):
    """The producer's input code: a Parquet file, shuffled and sliced by --split as dspark-produce does."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dspark_cache.producer import InputSource

    # With the columns real datasets carry beside the turns, kept as they are: a "source" of their own, and
    # types JSON has none for (a timestamp, bytes), written as text.
    when = datetime.datetime(2024, 5, 1, 12, 30)
    rows = [{"messages": [{"role": "user", "content": f"question number {i}"}], "source": f"set-{i}",
             "timestamp": when, "blob": bytes([i, 255])} for i in range(10)]
    data = str(tmp_path / "rows.parquet")
    pq.write_table(pa.Table.from_pylist(rows), data)
    out = tmp_path / "regen.jsonl"
    done = regenerate([server.url], data, str(out), "--split", "train[2:6]", "--shuffle-seed", "5")
    assert done.returncode == 0, done.stderr
    expected = list(InputSource(data, "train[2:6]", 5).rows())
    got = read_jsonl(str(out))
    assert [r["regenerated"]["source"] for r in got] == [
        {"index": r.index, "where": r.where} for r in expected
    ]
    assert [r["messages"][0] for r in got] == [r.value["messages"][0] for r in expected]
    assert {r["regenerated"]["source"]["where"] for r in got} <= {f"{data} row {i}" for i in range(10)}
    number = [int(r["messages"][0]["content"].split()[-1]) for r in got]
    assert [r["source"] for r in got] == [f"set-{i}" for i in number]
    assert {r["timestamp"] for r in got} == {"2024-05-01T12:30:00"}
    assert [base64.b64decode(r["blob"]) for r in got] == [bytes([i, 255]) for i in number]


def test_changed_configuration_and_a_second_run_are_refused(server, tmp_path):
    data = write_jsonl(tmp_path / "rows.jsonl", [{"messages": [{"role": "user", "content": "hello"}]}])
    out = tmp_path / "regen.jsonl"
    assert regenerate([server.url], data, str(out)).returncode == 0
    changed = regenerate([server.url], data, str(out), "--temperature", "0.5", "--seed", "3")
    assert changed.returncode == 1
    assert "regeneration.temperature: the output has 0.0, this run has 0.5" in changed.stderr
    assert (
        "regeneration.seed: the output has 0, this run has 3" in changed.stderr
        and "--overwrite" in changed.stderr
    )
    write_jsonl(data, [{"messages": [{"role": "user", "content": "another input"}]}])
    assert "input_sha256" in regenerate([server.url], data, str(out)).stderr

    lock = take_lock(OutputFiles(str(out)))
    try:
        held = regenerate([server.url], data, str(out), "--overwrite")
    finally:
        lock.release()
    assert (
        held.returncode == 1
        and f"pid {os.getpid()}" in held.stderr
        and "another dspark-regenerate" in held.stderr
    )
    assert regenerate([server.url], data, str(out), "--overwrite").returncode == 0
    assert read_jsonl(str(out))[0]["messages"][0]["content"] == "another input"


def test_dry_run_checks_endpoints_and_counts_rows(server, rows_file, reference_files, reference, tmp_path):
    out = tmp_path / "regen.jsonl"
    done = regenerate([server.url, f"http://127.0.0.1:{free_port()}"], rows_file, str(out), "--dry-run")
    assert done.returncode == 0, done.stderr
    assert f"serving {server.model}" in done.stdout
    assert f"input: {ROWS} rows in {rows_file}; 0 already done" in done.stdout
    assert "does not answer" in done.stderr
    assert not os.listdir(tmp_path)
    # An output a run is appending to, seen mid-line: counted, left exactly as it is (the line is the run's).
    shutil.copyfile(reference_files.run, OutputFiles(str(out)).run)
    lines = _lines(reference)
    out.write_bytes(b"".join(lines[:10]) + lines[10][:30])
    done = regenerate([server.url], rows_file, str(out), "--dry-run")
    assert done.returncode == 0 and "10 already done" in done.stdout, done.stdout + done.stderr
    assert out.read_bytes() == b"".join(lines[:10]) + lines[10][:30]
    # Settings the run would refuse, the dry run refuses the same way.
    changed = regenerate([server.url], rows_file, str(out), "--dry-run", "--temperature", "0.5")
    assert changed.returncode == 1
    assert "regeneration.temperature: the output has 0.0, this run has 0.5" in changed.stderr


def test_replies_no_output_line_can_hold_are_rejected_never_written(server, rows_file, tmp_path):
    """A server answering what is not a chat message (content that is not text, a lone surrogate, tool calls
    that are not calls): the same request would get the same answer, so the row is listed as skipped with the
    reason, at once, and never written; the other rows are the server's answers."""
    data = _small(rows_file, tmp_path)
    bad = [
        {"content": 12345},
        {"content": "half \ud800 a character"},
        {"content": None, "tool_calls": "call"},
    ]
    out = tmp_path / "regen.jsonl"
    with FaultProxy("127.0.0.1", server.port, dialect="openai") as proxy:
        for message in bad:
            proxy.fail_next(1, "answer", match=CHAT, body={"model": server.model, "choices": [
                {"message": message, "finish_reason": "stop"}], "usage": {"completion_tokens": 1}})
        done = regenerate([proxy.endpoint], data, str(out), "--concurrency", "2")
        answered = proxy.faults["answer"]
    assert done.returncode == 0 and answered == 3, done.stderr
    skipped = read_jsonl(str(out) + ".skipped")
    assert len(skipped) == 3 and {s["reason"] for s in skipped} == {"rejected"}
    for why in ("its content is int, not text", "its content holds a lone UTF-16 surrogate",
                "its tool_calls are not a list of function calls"):
        assert sum(why in s["detail"] for s in skipped) == 1, skipped
    direct = tmp_path / "direct.jsonl"
    assert regenerate([server.url], data, str(direct)).returncode == 0
    written = _lines(out.read_bytes())
    assert len(written) == 3 and set(written) <= set(_lines(direct.read_bytes()))
    assert {r["regenerated"]["source"]["index"] for r in read_jsonl(str(out))}.isdisjoint(
        s["index"] for s in skipped
    )


def test_a_redirect_is_an_endpoint_failure_never_a_rejection(server, rows_file, tmp_path):
    """An endpoint answering its chat completions with a redirect (an http URL behind an https gateway, a
    login page): no row is rejected or recorded as done, the endpoint leaves the rotation. Alone, the run
    stops in one line naming it and the redirect; beside a working endpoint, the other writes every row."""
    data = _small(rows_file, tmp_path)
    out = tmp_path / "regen.jsonl"
    moved = {"Location": "https://gateway.example/v1/chat/completions"}
    with FaultProxy("127.0.0.1", server.port, dialect="openai") as proxy:
        proxy.fail_next(None, "answer", match=CHAT, status="307 Temporary Redirect", headers=moved, body={})
        alone = regenerate([proxy.endpoint], data, str(out), "--give-up-after", "3")
        assert count_lines(str(out)) == 0 and count_lines(str(out) + ".skipped") == 0
        both = regenerate([proxy.endpoint, server.url], data, str(out), "--concurrency", "2")
        redirected = proxy.faults["answer"]
    last = alone.stderr.strip().splitlines()[-1]
    assert alone.returncode == 1, alone.stderr
    assert last.startswith("dspark-regenerate: error: no endpoint answered for 3 s: "), last
    assert f"HTTP 307 from {proxy.endpoint}, a redirect to {moved['Location']}" in last
    assert "--endpoint" in last
    assert both.returncode == 0 and f"endpoint {proxy.endpoint} redirects" in both.stderr, both.stderr
    assert redirected >= 2
    direct = tmp_path / "direct.jsonl"
    assert regenerate([server.url], data, str(direct)).returncode == 0
    assert out.read_bytes() == direct.read_bytes()


def test_every_row_rejected_alike_is_the_endpoints_fault(server, rows_file, reference, tmp_path):
    """A server that rejects every request the same way (a 404: it serves no such model under that name): the
    run stops after ENDPOINT_WIDE_AFTER rows with one line naming the endpoint and the cause, exit 1, and
    records none as done, so the rerun against a working endpoint regenerates them all."""
    out = tmp_path / "regen.jsonl"
    gone = {"error": {"message": f"The model `{server.model}` does not exist.", "type": "NotFoundError",
                      "code": 404}}
    with FaultProxy("127.0.0.1", server.port, dialect="openai") as proxy:
        proxy.fail_next(None, "answer", match=CHAT, status="404 Not Found", body=gone)
        stop = regenerate([proxy.endpoint], rows_file, str(out), "--concurrency", "2")
        asked = proxy.faults["answer"]
    lines = stop.stderr.strip().splitlines()
    assert stop.returncode == 1 and len(lines) == 1, stop.stderr
    assert lines[0].startswith(f"dspark-regenerate: error: the first {ENDPOINT_WIDE_AFTER} rows sent"), lines
    assert f"HTTP 404 from {proxy.endpoint}: The model" in lines[0] and "rerun the same command" in lines[0]
    # how many of the rows go out before the stop depends on timing (the bound is the hand-out window,
    # test_parts.py: test_an_endpoint_rejecting_every_row_is_asked_at_most_a_window_of_rows)
    assert ENDPOINT_WIDE_AFTER <= asked <= ROWS, asked
    assert count_lines(str(out)) == 0 and count_lines(str(out) + ".skipped") == 0
    assert len(read_jsonl(str(out) + ".failed")) >= ENDPOINT_WIDE_AFTER
    done = regenerate([server.url], rows_file, str(out), "--concurrency", "4")
    assert done.returncode == 0, done.stderr
    assert out.read_bytes() == reference


def test_an_endpoint_that_keeps_failing_leaves_the_rotation(server, rows_file, tmp_path):
    """Beside a good server, one that answers every chat request 503: after DOWN_AFTER failures in a row it
    is left out (tried again after a pause), instead of taking half the requests and their retries."""
    data = _small(rows_file, tmp_path, 16)
    out = tmp_path / "regen.jsonl"
    with FaultProxy("127.0.0.1", server.port, dialect="openai") as failing:
        failing.fail_next(None, "503", match=CHAT)
        done = regenerate([failing.endpoint, server.url], data, str(out), "--concurrency", "2")
        faults = failing.faults["503"]
    assert done.returncode == 0, done.stderr
    assert f"endpoint {failing.endpoint} failed {DOWN_AFTER} requests in a row" in done.stderr
    # 16 rows: without the rule, about 8 rows and their retries; with it, DOWN_AFTER and a few tries again
    # (after 1 s, 2 s, 4 s ... down, by each of the 2 requests in flight).
    assert DOWN_AFTER <= faults <= DOWN_AFTER + 6, faults
    direct = tmp_path / "direct.jsonl"
    assert regenerate([server.url], data, str(direct)).returncode == 0
    assert out.read_bytes() == direct.read_bytes()


def test_refused_credentials_stop_the_run_in_one_line(server, rows_file, tmp_path):
    """401/403 would fail every row alike: the run stops at once (at the probe, or at the first request when
    only chat completions are guarded), one line saying which key to pass."""
    data = _small(rows_file, tmp_path)
    out = tmp_path / "regen.jsonl"
    refused = {"error": {"message": "Invalid API key", "type": "invalid_request_error", "code": 401}}
    with FaultProxy("127.0.0.1", server.port, dialect="openai") as proxy:
        for match in (None, CHAT):
            proxy.clear()
            proxy.fail_next(None, "answer", match=match, status="401 Unauthorized", body=refused)
            done = regenerate([proxy.endpoint], data, str(out))
            lines = done.stderr.strip().splitlines()
            assert done.returncode == 1 and len(lines) == 1, done.stderr
            assert "HTTP 401" in lines[0] and "Invalid API key" in lines[0] and "--api-key" in lines[0], (
                lines[0]
            )
    assert count_lines(str(out)) == 0 and not os.path.exists(str(out) + ".failed")


def test_concurrency_opens_a_connection_per_request_in_flight(server, rows_file, tmp_path):
    """--concurrency N keeps N keep-alive connections (one per worker), reused from request to request."""
    with FaultProxy("127.0.0.1", server.port, dialect="openai") as proxy:
        done = regenerate([proxy.endpoint], _small(rows_file, tmp_path, 24), str(tmp_path / "o.jsonl"),
                          "--concurrency", "6")
        connections, requests = proxy.connections, proxy.requests
    assert done.returncode == 0, done.stderr
    assert requests > 24 and 3 <= connections <= 7, (connections, requests)  # 6 workers and the probe


# -- the server dies: last in this file, since one of them kills the module's server (and starts it again) --

def test_server_gone_for_good_stops_the_run_with_one_line(server, rows_file, tmp_path):
    """The run's only endpoint dies for good: a proxy in front of the server, stopped (its port refuses, its
    connections are cut, as when a server is killed)."""
    out = tmp_path / "regen.jsonl"
    proxy = FaultProxy("127.0.0.1", server.port, dialect="openai").start()
    try:
        proc = start_regenerate(
            [proxy.endpoint], rows_file, str(out), "--concurrency", "2", "--give-up-after", "3"
        )
        wait_for(lambda: count_lines(str(out)) >= 2 or proc.poll() is not None, timeout=120)
        proxy.stop()
        _, stderr = proc.communicate(timeout=120)
    finally:
        proxy.stop()
    assert proc.returncode == 1
    last = stderr.strip().splitlines()[-1]
    assert (
        last.startswith("dspark-regenerate: error: no endpoint answered for 3 s: ") and proxy.endpoint in last
    )
    assert not (tmp_path / "regen.jsonl.failed").exists(), (
        "rows in flight are not failed rows: a rerun resumes them"
    )
    done = regenerate([server.url], rows_file, str(out), "--concurrency", "2")  # the endpoint is not identity
    assert done.returncode == 0, done.stderr
    assert count_lines(str(out)) == ROWS


def test_server_killed_mid_run_then_restarted(server, rows_file, reference, tmp_path):
    """The server dies in the middle of a run (SIGKILL) and comes back on the same port: the requests in flight
    fail, the endpoint leaves the rotation, is tried again, and the run ends with every row, the same bytes as
    an uninterrupted run."""
    out = tmp_path / "regen.jsonl"
    proc = start_regenerate([server.url], rows_file, str(out), "--concurrency", "4", "--log-level", "INFO")
    wait_for(lambda: count_lines(str(out)) >= 5 or proc.poll() is not None, timeout=120)
    server.kill()
    killed_at = count_lines(str(out))
    time.sleep(2)  # the run is left with no endpoint for a while: it must wait, not fail the rows
    assert proc.poll() is None, proc.communicate()
    server.start()
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    assert killed_at < len(_lines(reference)), "the run finished before the server was killed"
    assert "is down" in stderr and "answers again" in stderr
    assert "0 failed" in stdout
    assert out.read_bytes() == reference
