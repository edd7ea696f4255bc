"""Adversarial inputs to dspark-produce: linked-out cache directories, concurrent producers,
rows that are too long or too big, and the memory a huge row costs."""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import subprocess
import sys
from operator import attrgetter, methodcaller
from pathlib import Path

import pytest

from dspark_cache.embedded.data import sample_rows
from dspark_cache.format.paths import CachePaths
from dspark_cache.producer.encode.chat import ChatEncoder
from dspark_cache.producer.encode.messages import normalise_row
from dspark_cache.verify import verify_cache
from tests.support.produce import produce_args, run_produce, write_jsonl
from tests.support.proc import kill_group, producer_cmd, run, start, wait_for

ARGS = ("--seq-length", "128", "--shard-size", "4", "--batch-size", "4", "--num-workers", "0")
GOOD = {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"}]}


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> str:
    rows = [r for r in sample_rows(12, seed=4)][:6]
    return write_jsonl(tmp_path_factory.mktemp("tiny") / "d.jsonl", [json.dumps(r) for r in rows])


# --- 1. A cache whose directories lead out of it --------------------------------------------

OURS = {  # one file of ours in each of our directories
    "control": attrgetter("stop_request"),
    "events": methodcaller("events", 0),
    "shards": methodcaller("shard_index", 0),
    "status": methodcaller("status", 0),
}


@pytest.mark.parametrize("sub", sorted(OURS))
def test_symlinked_cache_dir_is_refused_and_nothing_behind_it_is_touched(embedded, tmp_path, capsys, sub):
    out = tmp_path / "cache"
    ours = OURS[sub](CachePaths(str(out)))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    victims = {elsewhere / os.path.basename(ours): "{}", elsewhere / "precious.txt": "keep me"}
    for path, text in victims.items():
        path.write_text(text)
    out.mkdir()
    linked = Path(os.path.dirname(ours))
    linked.symlink_to(elsewhere, target_is_directory=True)
    for extra in ((), ("--overwrite",)):
        assert run_produce(embedded.stock, embedded.data, str(out), *ARGS, *extra) == 1
        err = capsys.readouterr().err
        assert f"{linked} is a symbolic link (to {elsewhere})" in err, err
        assert "real directory" in err and "--output-dir" in err
        # every file behind the link survives
        assert {p: p.read_text() for p in elsewhere.iterdir()} == victims
        assert not os.path.exists(CachePaths(str(out)).manifest)


def test_non_directory_in_place_of_a_cache_dir_is_refused(embedded, tmp_path, capsys):
    out = tmp_path / "cache"
    out.mkdir()
    shards = Path(CachePaths(str(out)).shards_dir)
    shards.write_text("not a directory")
    assert run_produce(embedded.stock, embedded.data, str(out), *ARGS, "--overwrite") == 1
    assert f"{shards} is not a directory" in capsys.readouterr().err
    assert shards.read_text() == "not a directory"


def test_a_symlinked_lock_file_is_refused(embedded, tmp_path, capsys):
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    paths = CachePaths(str(tmp_path / "cache"))
    os.makedirs(paths.control_dir)
    os.symlink(target, paths.lock)
    assert run_produce(embedded.stock, embedded.data, str(tmp_path / "cache"), *ARGS, "--overwrite") == 1
    assert "lock is not a regular file" in capsys.readouterr().err
    assert target.read_text() == "keep me"


def test_overwrite_removes_only_what_the_producer_wrote(embedded, tmp_path, tiny_data):
    out = tmp_path / "cache"
    shards = Path(CachePaths(str(out)).shards_dir)
    shards.mkdir(parents=True)
    mine = {out / "NOTES.md": "my notes", shards / "README": "about these shards"}
    for path, text in mine.items():
        path.write_text(text)
    assert run_produce(embedded.stock, tiny_data, str(out), *ARGS) == 0
    assert run_produce(embedded.stock, tiny_data, str(out), *ARGS, "--overwrite", "--seq-length", "96") == 0
    assert {p: p.read_text() for p in mine} == mine
    assert os.path.isfile(CachePaths(str(out)).lock)  # never deleted: someone may be waiting on it
    report = verify_cache(str(out))
    assert report.ok, report


# --- 2. One producer per output directory ------------------------------------------------------

def _holder_pid(out: str) -> int | None:
    try:
        with open(CachePaths(out).lock) as handle:
            return json.loads(handle.read() or "null")["pid"]
    except (OSError, ValueError, TypeError, KeyError):
        return None


@pytest.mark.slow
def test_second_producer_and_overwrite_are_refused_while_a_run_is_live(embedded, tmp_path, tiny_data, capsys):
    out = str(tmp_path / "cache")
    cmd = producer_cmd(*produce_args(embedded.stock, tiny_data, out, *ARGS))
    first = start(cmd)
    try:
        wait_for(lambda: _holder_pid(out) == first.pid or first.poll() is not None, timeout=120)
        assert first.poll() is None, first.communicate()
        os.killpg(first.pid, signal.SIGSTOP)  # hold it mid-run, lock held, for as long as the test needs
        holder = f"pid {first.pid} on host {socket.gethostname()}"
        second = run(cmd, timeout=120)  # the same command again, as its own process
        assert second.returncode == 1, second.stderr
        assert holder in second.stderr and "in use by another dspark-produce run" in second.stderr
        assert "Traceback" not in second.stderr
        assert run_produce(embedded.stock, tiny_data, out, *ARGS, "--overwrite") == 1
        err = capsys.readouterr().err
        assert "--overwrite refused" in err and holder in err
    finally:
        os.killpg(first.pid, signal.SIGCONT)
    stdout, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    assert "cache complete" in stdout
    report = verify_cache(out)
    assert report.ok, report
    with open(CachePaths(out).status(0)) as handle:
        assert json.load(handle)["pid"] == first.pid  # nobody else wrote this cache's status


@pytest.mark.slow
def test_a_killed_holder_never_blocks_the_rerun(embedded, tmp_path, tiny_data):
    out = str(tmp_path / "cache")
    proc = start(producer_cmd(*produce_args(embedded.stock, tiny_data, out, *ARGS)))
    wait_for(lambda: _holder_pid(out) == proc.pid or proc.poll() is not None, timeout=120)
    kill_group(proc)
    assert proc.returncode == -signal.SIGKILL
    assert _holder_pid(out) == proc.pid  # the lock file stays; the kernel dropped the lock with its holder
    assert run_produce(embedded.stock, tiny_data, out, *ARGS) == 0
    assert verify_cache(out).ok


HOLD = """
import sys, time
from dspark_cache.format.paths import CachePaths
from dspark_cache.storage.lock import lock_exclusive, lock_shared
paths = CachePaths(sys.argv[1])
if sys.argv[2] == "rank0":
    lock_exclusive(paths, "job-a", 2).share()
else:
    lock_shared(paths)
print("held", flush=True)
time.sleep(600)
"""


def test_every_rank_of_a_job_holds_the_lock(tmp_path):
    """A job's other ranks keep the directory locked after its rank 0 is gone."""
    from dspark_cache.storage.lock import CacheLockedError, lock_exclusive

    paths = CachePaths(str(tmp_path / "cache"))
    os.makedirs(os.path.dirname(paths.lock))
    ranks = []
    try:
        for role in ("rank0", "rank1"):
            ranks.append(
                subprocess.Popen(
                    [sys.executable, "-c", HOLD, paths.root, role], stdout=subprocess.PIPE, text=True
                )
            )
            assert ranks[-1].stdout.readline() == "held\n"
        ranks[0].kill()
        ranks[0].wait()
        with pytest.raises(CacheLockedError, match=f"2-rank job: pid {ranks[0].pid} on host .*, run job-a"):
            lock_exclusive(paths, "job-b", 1)
        ranks[1].kill()
        ranks[1].wait()
        lock_exclusive(paths, "job-b", 1).release()  # the last rank gone, the directory is free
    finally:
        for proc in ranks:
            proc.kill()
            proc.wait()


# --- 3. Hostile rows: invalid rows with file:line, under both policies ------------------------

def test_a_row_over_max_row_bytes_is_an_invalid_row(embedded, tmp_path, capsys):
    long = {"messages": [{"role": "user", "content": "word " * 2000}, {"role": "assistant", "content": "ok"}]}
    data = write_jsonl(tmp_path / "d.jsonl", [GOOD, long, GOOD])
    out = str(tmp_path / "out")
    assert run_produce(embedded.stock, data, out, *ARGS, "--max-row-bytes", "4096") == 1
    err = capsys.readouterr().err
    assert (
        "d.jsonl:2: the row is 10" in err
        and "over --max-row-bytes 4096" in err
        and "--on-invalid skip" in err
    )
    assert (
        run_produce(embedded.stock, data, out, *ARGS, "--max-row-bytes", "4096", "--on-invalid", "skip") == 0
    )
    m = json.load(open(CachePaths(out).manifest))
    assert m["skipped_rows"] == {"row too long": 1} and m["skipped"][0]["where"] == f"{data}:2"
    assert m["num_samples"] == 2


def test_a_row_the_chat_template_refuses_is_an_invalid_row(embedded, tmp_path, capsys):
    template = (
        "{% for m in messages %}{% if m.content == 'boom' %}{{ raise_exception('no boom here') }}{% endif %}"
        "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    )
    boom = {"messages": [{"role": "user", "content": "boom"}, {"role": "assistant", "content": "ok"}]}
    data = write_jsonl(tmp_path / "d.jsonl", [GOOD, boom, GOOD])
    out = str(tmp_path / "out")
    assert run_produce(embedded.stock, data, out, *ARGS, "--chat-template", template) == 1
    err = capsys.readouterr().err
    assert "d.jsonl:2: the chat template or tokenizer failed on this row" in err and "no boom here" in err
    assert (
        run_produce(embedded.stock, data, out, *ARGS, "--chat-template", template, "--on-invalid", "skip")
        == 0
    )
    m = json.load(open(CachePaths(out).manifest))
    assert m["skipped_rows"] == {"cannot encode": 1} and m["num_samples"] == 2


# --- 4. Memory per row follows --seq-length, not the row ---------------------------------------

MEASURE = """
import json, sys
from transformers import AutoTokenizer
from dspark_cache.producer.encode.chat import ChatEncoder
from dspark_cache.producer.inputs.source import InputSource
from dspark_cache.producer.encode.messages import normalise_row

def rss(field):
    with open("/proc/self/status") as handle:
        return next(int(l.split()[1]) * 1024 for l in handle if l.startswith(field))

encoder = ChatEncoder(AutoTokenizer.from_pretrained(sys.argv[1]), 2048, True, True)
with open("/proc/self/clear_refs", "w") as handle:
    handle.write("5")  # reset the peak (VmHWM) to what is resident now
base = rss("VmRSS:")
rows = [encoder.encode(*normalise_row(row.value)) for row in InputSource(sys.argv[2]).rows()]
print(json.dumps({"grew": rss("VmHWM:") - base, "lengths": [len(r.input_ids) for r in rows],
                  "exact": [getattr(r, "full_length_exact", None) for r in rows]}))
"""


def test_a_huge_row_costs_memory_for_seq_length_tokens_not_for_the_row(embedded, tmp_path):
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs Linux /proc/self/clear_refs to measure peak memory")
    words = " ".join(
        itertools.islice(itertools.cycle("the model reads a shard of cached states".split()), 2_000_000)
    )
    row = {"messages": [{"role": "user", "content": "summarise"},
                        {"role": "assistant", "content": words, "reasoning_content": "think " * 50}]}
    data = write_jsonl(tmp_path / "big.jsonl", [row])
    size = os.path.getsize(data)  # ~10 MB on one line
    proc = run([sys.executable, "-c", MEASURE, embedded.stock, data], timeout=300, code=True)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # Tokenising the whole row took ~127 bytes per input byte; the row itself is held a few times.
    assert result["grew"] < 10 * size, (
        f"peak grew by {result['grew'] / 1e6:.0f} MB for a {size / 1e6:.0f} MB row"
    )
    assert result["lengths"] == [2048] and result["exact"] == [False]


@pytest.mark.parametrize("variant", ["stock", "generation"])
def test_prefix_tokenisation_gives_the_whole_rows_ids_and_mask(tokenizers, variant):
    """Forced onto the bounded path (tiny prefixes, many growth steps), every row of the sample
    data, truncated anywhere, with each masking rule, encodes exactly as the whole render does."""
    rows = []
    for raw in sample_rows(40, seed=11):
        try:
            rows.append(normalise_row(raw))
        except Exception:
            continue
    tok = getattr(tokenizers, variant)
    bounded_rows = 0
    for seq, reasoning, prompt in itertools.product((12, 96, 700), (False, True), (False, True)):
        whole = ChatEncoder(tok, seq, reasoning, prompt)
        whole.exact_chars = 1 << 40
        cut = ChatEncoder(tok, seq, reasoning, prompt)
        cut.exact_chars, cut.chars_per_token_guess = 0, 1
        for messages, tools in rows:
            a, b = whole.encode(messages, tools), cut.encode(messages, tools)
            assert b.input_ids.tolist() == a.input_ids.tolist(), (seq, reasoning, prompt, messages)
            assert b.loss_mask.tolist() == a.loss_mask.tolist(), (seq, reasoning, prompt, messages)
            if b.full_length_exact:
                assert b.full_length == a.full_length
            else:
                assert a.full_length >= b.full_length > seq
                bounded_rows += 1
    assert bounded_rows > 100  # the bounded path was the one tested
