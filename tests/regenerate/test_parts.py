"""The parts of dspark-regenerate that need no server: the seed rule, the turn rule, reading a
reply, the rows it refuses, the resume index, the identity, the manifest's record, the command line,
and a run with no server at all (the server tests cover the rest)."""

from __future__ import annotations

import os
import subprocess
import sys

import msgspec
import pytest

from dspark_cache.cli.conventions import EXIT_INCOMPLETE
from dspark_cache.format.schema import Manifest, RegeneratedInput
from dspark_cache.format.validate import manifest_problems
from dspark_cache.producer import InvalidRow
from dspark_cache.regenerate.client import Rejected, Transient, base_url
from dspark_cache.regenerate.conversation import regenerate, targets
from dspark_cache.regenerate.endpoints import Reply, parse_reply, same_model
from dspark_cache.regenerate.output import OutputError, OutputFiles, check_resume, done_rows, take_lock
from dspark_cache.regenerate.run import check_row, encode_row
from dspark_cache.regenerate.settings import RegenerateConfig, identity, identity_diff, row_seed
from tests.support.diskfull import grow, small_filesystem
from tests.support.produce import write_jsonl
from tests.support.regenerate import (
    CHAT, canned_endpoint, completion, count_lines, read_jsonl, regen_cmd,
)
from tests.support.regenerate import regenerate as run_regenerate
from tests.support.ports import free_port

BIN = os.path.dirname(sys.executable)


def test_row_seed_is_stable_distinct_and_fits_31_bits():
    seeds = [row_seed(0, i) for i in range(10_000)]
    assert len(set(seeds)) > 9_980 and all(0 <= s < 2**31 for s in seeds)
    assert {row_seed(1, i) for i in range(100)}.isdisjoint({row_seed(0, i) for i in range(100)})
    assert row_seed(0, 0) == 1801254344  # outputs record it: the rule must not drift between releases


def test_turn_targets():
    u, a, s = ({"role": r, "content": r} for r in ("user", "assistant", "system"))
    assert targets([s, u, a, u, a, u], "all") == [2, 4] and targets([s, u, a, u, a, u], "last") == [4]
    assert targets([s, u], "all") == targets([s, u], "last") == [2]


def test_regenerated_history_and_reasoning_kept():
    asked: list[list[dict]] = []

    def generate(history):
        asked.append(history)
        reply, _ = parse_reply({"model": "m", "choices": [{"finish_reason": "stop", "message": {
            "content": f"answer {len(asked)}", "reasoning_content": f"thought {len(asked)}"}}],
            "usage": {"completion_tokens": 3}}, "http://x")
        return reply

    rows = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "old"},
            {"role": "user", "content": "q2"}, {"role": "assistant", "content": "old"}]
    out, replies = regenerate(rows, "all", generate)
    assert [m.get("reasoning_content") for m in out if m["role"] == "assistant"] == ["thought 1", "thought 2"]
    # no past reasoning sent
    assert asked[1] == [rows[0], {"role": "assistant", "content": "answer 1"}, rows[2]]
    assert [r.completion_tokens for r in replies] == [3, 3]
    reply, model = parse_reply({"model": "m", "choices": [{"message": {"content": None, "reasoning": "r"},
                                                           "finish_reason": "length"}]}, "http://x")
    assert (
        reply == Reply({"role": "assistant", "content": "", "reasoning_content": "r"}, "length", 0)
        and model == "m"
    )


@pytest.mark.parametrize(
    "message, why",
    [
        ({"content": 12345}, "its content is int, not text"),
        ({"content": "ok", "reasoning_content": ["x"]}, "its reasoning_content is list, not text"),
        ({"content": "bad \ud800 text"}, "its content holds a lone UTF-16 surrogate"),
        ({"content": None, "tool_calls": "call it"}, "its tool_calls are not a list of function calls"),
        ({"content": None, "tool_calls": [{"id": "1"}]}, "its tool_calls are not a list of function calls"),
        (
            {
                "content": None,
                "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": '{"x": "\ud83d"}'}}],
            },
            "it holds what JSON text cannot",
        ),
        ("just text", "its message is not an object"),
    ],
)
def test_a_reply_that_cannot_be_written_is_not_taken(message, why):
    """What a server answers is written as it is: anything dspark-produce could not read is a rejected answer
    (the row is listed as skipped with the reason: the same request would get it again), never a line."""
    with pytest.raises(Rejected, match=why):
        parse_reply({"model": "m", "choices": [{"message": message, "finish_reason": "stop"}]}, "http://x")
    call = [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    reply, _ = parse_reply(
        {"model": "m", "choices": [{"message": {"content": None, "tool_calls": call}}]}, "http://x"
    )
    assert reply.message == {"role": "assistant", "content": "", "tool_calls": call}
    with pytest.raises(Transient, match="not a chat completion"):  # a gateway's page, a cut answer: retried
        parse_reply({"model": "m", "choices": []}, "http://x")


def test_a_reply_may_name_the_served_model_with_its_revision():
    """transformers serve lists a hub id as given and answers with the revision it resolved."""
    assert same_model("org/tiny", "org/tiny") and same_model("org/tiny@main", "org/tiny")
    assert not same_model("org/tiny-2", "org/tiny") and not same_model("org/other@main", "org/tiny")


def test_rows_no_server_can_answer_or_no_line_can_hold_are_invalid():
    import datetime
    import decimal

    import numpy

    u, a = {"role": "user", "content": "q"}, {"role": "assistant", "content": "old"}
    s = {"role": "system", "content": "be brief"}
    cases = [
        ([], {}, "empty conversation"),
        ([a, u], {}, "nothing to answer"),
        ([s, a, u], {}, "nothing to answer"),
        ([s], {}, "nothing to answer"),
        ([u, {"role": "user", "content": "bad \ud800"}], {}, "lone surrogate"),
        ([u], {"title": "x \udfff"}, "lone surrogate"),
        ([u], {"handle": object()}, "value not JSON"),
    ]
    for messages, columns, reason in cases:
        with pytest.raises(InvalidRow) as err:
            check_row({"messages": messages, **columns}, messages, None, "all")
        assert err.value.reason == reason
    unwritable = str(check_row_error([u], handle=object()))
    assert "column 'handle' holds a value of type object, which JSON cannot hold" in unwritable
    check_row({"messages": [a, u, a]}, [a, u, a], None, "last")  # the turn regenerated has a turn before it
    # Columns of Parquet and datasets that JSON has no type for are written as text, and kept.
    when = datetime.datetime(2024, 5, 1, 12, 30)
    row = {
        "messages": [u],
        "timestamp": when,
        "blob": b"\x00\xff",
        "price": decimal.Decimal("1.50"),
        "source": "sharegpt",
        "seen": numpy.datetime64("2024-05-01T12:30:00"),
        "count": decimal.Decimal("1E+2"),
        "score": float("nan"),
        "scores": numpy.array([0.5, numpy.inf]),
    }
    check_row(row, [u], None, "all")
    assert (
        encode_row(row)
        == (
            '{"messages":[{"role":"user","content":"q"}],"timestamp":"2024-05-01T12:30:00",'
            '"blob":"AP8=","price":"1.50","source":"sharegpt","seen":"2024-05-01T12:30:00",'
            '"count":"100","score":null,"scores":[0.5,null]}\n'
        ).encode()
    )


def check_row_error(messages, **columns) -> InvalidRow:
    with pytest.raises(InvalidRow) as err:
        check_row({"messages": messages, **columns}, messages, None, "all")
    return err.value


def test_endpoint_urls():
    assert base_url("http://h:8000/v1/") == base_url("http://h:8000") == "http://h:8000"
    with pytest.raises(ValueError, match="is not an http"):
        base_url("h:8000")


def test_resume_index_cuts_a_torn_line_and_refuses_an_edited_file(tmp_path):
    files = OutputFiles(str(tmp_path / "o.jsonl"))
    with open(files.path, "wb") as handle:
        handle.write(
            b'{"regenerated":{"source":{"index":3,"where":"a:4"}}}\n{"regenerated":{"source":{"index":1}}}\n'
            b'{"regenerated":{"sour'
        )
    torn = open(files.path, "rb").read()
    assert done_rows(files, cut=False) == {1, 3}
    assert open(files.path, "rb").read() == torn  # a dry run looks while a run may append: it never cuts
    assert done_rows(files) == {1, 3}
    assert open(files.path, "rb").read().endswith(b'{"regenerated":{"source":{"index":1}}}\n')
    with open(files.path, "ab") as handle:
        handle.write(b'{"messages":[]}\n')
    with pytest.raises(OutputError, match="line 3 is not a row dspark-regenerate wrote"):
        done_rows(files)


def test_rows_without_a_run_record_are_not_resumed_nor_counted(tmp_path):
    """An output (or its skipped list) whose run record is gone says nothing of how its rows were made: a run
    refuses it instead of skipping the rows it lists."""
    files = OutputFiles(str(tmp_path / "o.jsonl"))
    new = identity(RegenerateConfig(input_data="in.jsonl", output=files.path), "abc", "m")
    with open(files.skipped, "wb") as handle:
        handle.write(b'{"index":0,"where":"in.jsonl:1","reason":"truncated"}\n')
    with pytest.raises(
        OutputError, match=r"o\.jsonl\.skipped exists but .*o\.jsonl\.run does not.*--overwrite"
    ):
        check_resume(files, new, overwrite=False)
    assert check_resume(files, new, overwrite=True) is False and not os.path.exists(files.skipped)
    assert check_resume(files, new, overwrite=False) is True


def test_an_earlier_builds_output_resumes_and_its_record_takes_the_new_name(tmp_path):
    """Earlier builds kept the run record as ``OUTPUT.state``: a rerun reads it there, checks it as ever,
    and renames it to ``OUTPUT.run``; ``--overwrite`` removes it under either name."""
    files = OutputFiles(str(tmp_path / "o.jsonl"))
    new = identity(RegenerateConfig(input_data="in.jsonl", output=files.path), "abc", "m")
    assert check_resume(files, new, overwrite=False) is False
    os.replace(files.run, files.legacy_run)  # the output as an earlier build left it
    other = identity(RegenerateConfig(input_data="in.jsonl", output=files.path, temperature=0.5), "abc", "m")
    with pytest.raises(OutputError, match="temperature"):
        check_resume(files, other, overwrite=False)
    assert os.path.exists(files.legacy_run) and not os.path.exists(files.run)  # a refusal renames nothing
    assert check_resume(files, new, overwrite=False) is True
    assert os.path.exists(files.run) and not os.path.exists(files.legacy_run)
    os.replace(files.run, files.legacy_run)
    assert check_resume(files, new, overwrite=True) is False
    assert os.path.exists(files.run) and not os.path.exists(files.legacy_run)


def test_a_record_that_cannot_be_renamed_is_one_line_naming_it(tmp_path, monkeypatch):
    """A directory where the record may be read but not renamed (as root, no mode bit refuses it: the
    refusal is injected) stops the run with the record's name and what to do, not a traceback."""
    import errno

    from dspark_cache.regenerate import output

    files = OutputFiles(str(tmp_path / "o.jsonl"))
    new = identity(RegenerateConfig(input_data="in.jsonl", output=files.path), "abc", "m")
    check_resume(files, new, overwrite=False)
    os.replace(files.run, files.legacy_run)

    def refused(src, dst):
        raise PermissionError(errno.EACCES, "Permission denied", src)

    monkeypatch.setattr(output.os, "replace", refused)
    with pytest.raises(OutputError, match=r"o\.jsonl\.state: cannot be written \(Permission denied\) while "
                                          r"renaming the run record: fix the file or its directory"):
        check_resume(files, new, overwrite=False)
    assert os.path.exists(files.legacy_run)


def test_a_local_input_is_identified_by_its_absolute_path(tmp_path, monkeypatch):
    (tmp_path / "in.jsonl").write_text("{}\n")
    monkeypatch.chdir(tmp_path)
    here = identity(RegenerateConfig(input_data="in.jsonl", output="o.jsonl"), "abc", "m")
    there = identity(RegenerateConfig(input_data=str(tmp_path / "in.jsonl"), output="o.jsonl"), "abc", "m")
    assert identity_diff(here, there) == [] and here.input_data == str(tmp_path / "in.jsonl")
    hub = identity(RegenerateConfig(input_data="org/chats", output="o.jsonl"), "abc", "m")
    assert hub.input_data == "org/chats"


def test_identity_names_what_changed():
    cfg = RegenerateConfig(input_data="in.jsonl", output="o.jsonl")
    old = identity(cfg, "abc", "model-a")
    cfg.top_p, cfg.concurrency = 0.9, 64
    diff = identity_diff(old, identity(cfg, "abc", "model-b"))
    assert diff == [("regeneration.model", "model-a", "model-b"), ("regeneration.top_p", 1.0, 0.9)]


def _manifest(**fields) -> Manifest:
    base = dict(
        target_model="t",
        target_model_type="qwen3",
        target_vocab_size=10,
        hidden_size=4,
        num_hidden_layers=2,
        seq_length=8,
        dtype="bf16",
        num_samples=1,
        planned_samples=1,
        num_shards=1,
        shard_size=1,
        target_hidden_dim=4,
        target_last_hidden_dim=4,
        target_layer_ids=[1],
        train_data_path="x",
        num_rows=3,
    )
    return Manifest(**{**base, **fields})


def test_manifest_regenerated_field():
    entry = RegeneratedInput(model="m", turns="all", temperature=0.0, top_p=1.0, max_tokens=8, seed=0, rows=3)
    assert list(manifest_problems(_manifest(regenerated=[entry]))) == []
    bad = msgspec.structs.replace(entry, turns="some", rows=4)
    problems = list(manifest_problems(_manifest(regenerated=[bad])))
    assert any("turns 'some'" in p for p in problems) and any(
        "rows 4 is not in [1, num_rows 3]" in p for p in problems
    )
    # A manifest from before the field reads, with no entry, and the field is not identity.
    old = msgspec.json.decode(
        msgspec.json.encode(_manifest()).replace(b',"regenerated":[]', b""), type=Manifest
    )
    assert old.regenerated == [] and "regenerated" not in _manifest(regenerated=[entry]).identity()


def _script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [os.path.join(BIN, "dspark-regenerate"), *args], capture_output=True, text=True, timeout=120
    )


def test_the_console_script_shares_the_conventions(tmp_path):
    """As every script: a usage error is one line and exit 2, --help exits 0 with the exit codes, and
    settings that cannot work are usage errors before anything is asked or read."""
    bad = _script("--no-such-option")
    assert (
        bad.returncode == 2 and bad.stderr.count("\n") == 1 and "see dspark-regenerate --help" in bad.stderr
    )
    helped = _script("--help")
    assert helped.returncode == 0 and "--on-truncated" in helped.stdout and "exit status: 0 " in helped.stdout
    base = ["--input-data", "x.jsonl", "--output", str(tmp_path / "o.jsonl"), "--endpoint"]
    for extra, words in ((["ftp://h"], "is not an http:// or https:// URL"),
                         (["http://h", "--top-p", "0"], "--top-p must be in (0, 1]"),
                         (["http://h", "--concurrency", "0"], "--concurrency must be >= 1"),
                         (["http://h", "--chat-template-kwargs", "[1]"], "must be a JSON object")):
        done = _script(*base, *extra)
        assert done.returncode == 2 and done.stderr.count("\n") == 1 and words in done.stderr, done.stderr
    module = subprocess.run(
        [sys.executable, "-m", "dspark_cache.regenerate", "--version"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert module.returncode == 0 and module.stdout.startswith("dspark-regenerate ")
    assert not os.listdir(tmp_path)


def test_help_imports_no_torch():
    code = ("import sys\nfrom dspark_cache.cli import regenerate\ntry:\n    regenerate(['--help'])\n"
            "except SystemExit:\n    pass\nprint('TORCH' if 'torch' in sys.modules else 'NO-TORCH')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip().splitlines()[-1] == "NO-TORCH", done.stdout + done.stderr


def test_no_endpoint_answers_is_one_line(embedded, tmp_path):
    out = tmp_path / "regen.jsonl"
    dead = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]
    done = run_regenerate(dead, embedded.data, str(out))
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dspark-regenerate: error: no endpoint answers: "), (
        done.stderr
    )
    assert all(url in lines[0] for url in dead) and "refused" in lines[0] and "rerun" in lines[0]
    assert not os.listdir(tmp_path), "nothing is written when no endpoint answers"


# -- around the requests: a canned endpoint (the fault proxy answering by itself), no model served ---------

def _prompts(path, n: int, width: int = 0) -> str:
    return write_jsonl(path, [{"messages": [{"role": "user", "content": f"question {i} " + "x" * width}]}
                              for i in range(n)])


def test_an_output_that_is_the_input_is_a_usage_error(tmp_path):
    """The input itself, a symlink to it, or a file inside an input directory: refused as a usage error before
    anything is deleted (--overwrite) or written, whatever the endpoint."""
    folder = tmp_path / "in"
    folder.mkdir()
    data = _prompts(folder / "rows.jsonl", 3)
    before = open(data, "rb").read()
    (tmp_path / "link.jsonl").symlink_to(data)
    with canned_endpoint() as endpoint:
        cases = ((data, data, "the input"), (tmp_path / "link.jsonl", data, "the input"),
                 (folder / "out.jsonl", folder, "inside the input directory"))
        for output, data_arg, what in cases:
            done = run_regenerate([endpoint.endpoint], str(data_arg), str(output), "--overwrite")
            lines = done.stderr.strip().splitlines()
            assert done.returncode == 2 and len(lines) == 1, done.stderr
            assert f"which is {what}" in lines[0] and "Choose an --output outside the input" in lines[0]
            assert open(data, "rb").read() == before and sorted(os.listdir(folder)) == ["rows.jsonl"]
        assert endpoint.requests == 0, "refused before any endpoint is asked"


def test_a_symlink_and_its_target_are_one_output(tmp_path):
    """The lock and the state are named after the output's real path: a run given a symlink resumes what a run
    given its target wrote, and waits on the same lock."""
    data = _prompts(tmp_path / "rows.jsonl", 4)
    target, link = tmp_path / "regen.jsonl", tmp_path / "link.jsonl"
    link.symlink_to(target)
    with canned_endpoint() as endpoint:
        assert run_regenerate([endpoint.endpoint], data, str(target)).returncode == 0
        written = target.read_bytes()
        again = run_regenerate([endpoint.endpoint], data, str(link))
        assert again.returncode == 0 and "(4 done before)" in again.stdout, again.stderr
        lock = take_lock(OutputFiles.of(str(target)))
        try:
            held = run_regenerate([endpoint.endpoint], data, str(link), "--overwrite")
        finally:
            lock.release()
    assert held.returncode == 1 and f"pid {os.getpid()}" in held.stderr, held.stderr
    assert target.read_bytes() == written and link.is_symlink()
    assert not (tmp_path / "link.jsonl.lock").exists() and not (tmp_path / "link.jsonl.run").exists()


def test_a_trickling_answer_is_a_timeout(tmp_path):
    """--request-timeout bounds the whole request: a server sending its answer a byte at a time (each byte
    well within the timeout) times out like a silent one, and the request is retried."""
    data = _prompts(tmp_path / "rows.jsonl", 3)
    out = tmp_path / "regen.jsonl"
    with canned_endpoint() as endpoint:
        endpoint.fail_next(1, "trickle", match=CHAT, trickle_s=0.05, first=True)
        done = run_regenerate([endpoint.endpoint], data, str(out), "--request-timeout", "2",
                              "--concurrency", "1", "--log-level", "INFO", timeout=90)
        trickled = endpoint.faults["trickle"]
    assert done.returncode == 0 and trickled == 1, done.stderr
    assert f"{endpoint.endpoint} did not answer within 2 s; retry 1/6" in done.stderr
    assert count_lines(str(out)) == 3


def test_an_answer_nested_too_deep_is_a_row_failure(tmp_path):
    """JSON nested a hundred thousand deep (what makes a recursive parser raise RecursionError): not a chat
    completion, retried, and a failed row in one line, never a traceback; as an error's body, the text."""
    data = _prompts(tmp_path / "rows.jsonl", 4)
    out = tmp_path / "regen.jsonl"
    deep = b'{"choices":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with canned_endpoint() as endpoint:
        endpoint.fail_next(1, "answer", match=CHAT, status="400 Bad Request", raw=deep, first=True)
        endpoint.fail_next(2, "answer", match=CHAT, raw=deep, first=True)  # row 0's request and its retry
        done = run_regenerate([endpoint.endpoint], data, str(out), "--retries", "1", "--concurrency", "1")
    assert done.returncode == EXIT_INCOMPLETE and "Traceback" not in done.stderr, done.stderr
    assert "1 rows failed" in done.stderr
    failed, skipped = read_jsonl(str(out) + ".failed"), read_jsonl(str(out) + ".skipped")
    assert [f["index"] for f in failed] == [0] and "JSON nested too deep" in failed[0]["detail"]
    assert [s["index"] for s in skipped] == [1] and "HTTP 400" in skipped[0]["detail"]
    assert [r["regenerated"]["source"]["index"] for r in read_jsonl(str(out))] == [2, 3]
    with pytest.raises(Rejected, match="nested deeper than JSON text can be written"):
        message: dict = {"content": "x"}
        for _ in range(100_000):
            message = {"tool_calls": [{"function": message}]}
        parse_reply({"model": "m", "choices": [{"message": {"content": None, **message}}]}, "http://x")


def _peak_rss_mb(cmd: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    """``cmd``'s result and its peak RSS, in a fresh parent of its own (the only child its rusage counts)."""
    code = ("import resource, subprocess, sys\ndone = subprocess.run(sys.argv[1:])\n"
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)\n"
            "sys.exit(done.returncode)")
    done = subprocess.run([sys.executable, "-c", code, *cmd], capture_output=True, text=True, timeout=300)
    *said, peak = done.stderr.strip().splitlines()
    return subprocess.CompletedProcess(cmd, done.returncode, done.stdout, "\n".join(said)), int(peak) / 1024


def test_a_huge_line_is_counted_and_skipped_in_bounded_memory(tmp_path):
    """A 200 MB line with no newline (over --max-row-bytes): counted for the progress total and skipped as an
    invalid row, named, without being read whole."""
    data = _prompts(tmp_path / "rows.jsonl", 3)
    with open(data, "ab") as handle:
        for _ in range(200):
            handle.write(b"x" * (1 << 20))
    out = tmp_path / "regen.jsonl"
    with canned_endpoint() as endpoint:
        done, peak = _peak_rss_mb(regen_cmd([endpoint.endpoint], data, str(out), "--max-row-bytes",
                                            str(1 << 20), "--on-invalid", "skip"))
    assert done.returncode == 0, done.stderr
    assert count_lines(str(out)) == 3
    too_long = f"the row is {200 << 20} bytes, over --max-row-bytes {1 << 20}"
    assert read_jsonl(str(out) + ".skipped") == [{"index": 3, "where": f"{data}:4", "reason": "row too long",
                                                  "detail": too_long}]
    assert peak < 160, f"peak RSS {peak:.0f} MB: the 200 MB line was held"


@pytest.mark.parametrize("how", ["tmpfs", "injected"])
def test_a_full_disk_is_one_line_and_a_rerun_resumes(tmp_path, how):
    """The disk fills while rows are appended: one line naming the file, exit 1, and once space is freed a
    rerun writes exactly what an uninterrupted run writes. A state that cannot be written is one line too."""
    data = _prompts(tmp_path / "rows.jsonl", 40, width=2000)  # rows of ~2 KB: about 80 KB in all
    reference = tmp_path / "reference.jsonl"
    with canned_endpoint() as endpoint:
        assert run_regenerate([endpoint.endpoint], data, str(reference)).returncode == 0
        size = reference.stat().st_size
        with small_filesystem(tmp_path, f"{16 + size // 2 // 1024}k") as mount:
            if how == "tmpfs" and mount is None:
                pytest.skip("no permission to mount a tmpfs here: the injected failure covers it")
            out = os.path.join(mount, "regen.jsonl") if how == "tmpfs" else str(tmp_path / "regen.jsonl")
            env = {} if how == "tmpfs" else {"DSPARK_FAIL_WRITES_AFTER": str(size // 2)}
            full = run_regenerate([endpoint.endpoint], data, out, "--fsync-rows", "1", env=env)
            lines = full.stderr.strip().splitlines()
            assert full.returncode == 1 and len(lines) == 1, full.stderr
            assert lines[0].startswith(f"dspark-regenerate: error: {out}: the disk is full"), lines
            assert "rerun" in lines[0]
            kept = open(out, "rb").read()
            whole = kept[:kept.rfind(b"\n") + 1]  # and maybe a torn line, which the rerun cuts off
            assert 0 < kept.count(b"\n") < 40 and reference.read_bytes().startswith(whole)
            if how == "tmpfs":
                grow(mount, "4m")
            done = run_regenerate([endpoint.endpoint], data, out)
            assert done.returncode == 0, done.stderr
            assert open(out, "rb").read() == reference.read_bytes()
        if how == "injected":
            state = run_regenerate([endpoint.endpoint], data, str(tmp_path / "other.jsonl"),
                                   env={"DSPARK_FAIL_WRITES_AFTER": "0"})
            assert state.returncode == 1 and state.stderr.count("\n") == 1, state.stderr
            assert f"{tmp_path / 'other.jsonl.run'}: the disk is full" in state.stderr


def test_rows_answered_then_dropped_as_truncated_prove_the_endpoint(tmp_path):
    """The endpoint-wide rule counts answers, not lines written: a run whose answers are all dropped as
    truncated (--on-truncated drop) beside a row the server rejects is the row's rejection, recorded."""
    data = _prompts(tmp_path / "rows.jsonl", 4)
    out = tmp_path / "regen.jsonl"
    cut = completion("canned/model", "a cut answer")
    cut["choices"][0]["finish_reason"] = "length"
    with canned_endpoint() as endpoint:
        endpoint.fail_next(None, "answer", match=CHAT, body=cut, first=True)
        endpoint.fail_next(1, "answer", match=CHAT, status="400 Bad Request", first=True,
                           body={"error": {"message": "the prompt is longer than the context"}})
        done = run_regenerate([endpoint.endpoint], data, str(out), "--on-truncated", "drop",
                              "--concurrency", "1")
    assert done.returncode == 0, done.stderr
    assert count_lines(str(out)) == 0
    assert [(s["index"], s["reason"]) for s in read_jsonl(str(out) + ".skipped")] == \
        [(0, "rejected"), (1, "truncated"), (2, "truncated"), (3, "truncated")]


def test_an_endpoint_rejecting_every_row_is_asked_at_most_a_window_of_rows(tmp_path):
    """Rows go out ahead of the oldest unwritten one by at most the hand-out window (64 rows for 2 workers):
    when every one is refused alike, the run stops within that window, however slow its main thread is,
    and lists the rows it sent for the rerun."""
    from dspark_cache.regenerate.run import ENDPOINT_WIDE_AFTER

    rows = 300
    data = _prompts(tmp_path / "rows.jsonl", rows)
    out = tmp_path / "regen.jsonl"
    gone = {
        "error": {"message": "The model `canned/model` does not exist.", "type": "NotFoundError", "code": 404}
    }
    with canned_endpoint() as endpoint:
        endpoint.fail_next(None, "answer", match=CHAT, status="404 Not Found", body=gone, first=True)
        done = run_regenerate([endpoint.endpoint], data, str(out), "--concurrency", "2")
        asked = endpoint.faults["answer"]
    assert done.returncode == 1 and "HTTP 404" in done.stderr, done.stderr
    assert ENDPOINT_WIDE_AFTER <= asked <= 64, asked
    assert count_lines(str(out)) == 0 and count_lines(str(out) + ".failed") >= ENDPOINT_WIDE_AFTER
