"""The parts of dspark-regenerate that need no server: the seed rule, the turn rule, reading a
reply, the resume index, the identity and the manifest's record (the server tests cover the rest)."""

from __future__ import annotations

import os
import subprocess
import sys

import msgspec
import pytest

from dspark_cache.format.schema import Manifest, RegeneratedInput
from dspark_cache.format.validate import manifest_problems
from dspark_cache.regenerate.client import base_url
from dspark_cache.regenerate.conversation import regenerate, targets
from dspark_cache.regenerate.endpoints import Reply, parse_reply
from dspark_cache.regenerate.output import OutputError, OutputFiles, done_rows
from dspark_cache.regenerate.settings import RegenerateConfig, identity, identity_diff, row_seed

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
    assert asked[1] == [rows[0], {"role": "assistant", "content": "answer 1"}, rows[2]]  # no past reasoning sent
    assert [r.completion_tokens for r in replies] == [3, 3]
    reply, model = parse_reply({"model": "m", "choices": [{"message": {"content": None, "reasoning": "r"},
                                                           "finish_reason": "length"}]}, "http://x")
    assert reply == Reply({"role": "assistant", "content": "", "reasoning_content": "r"}, "length", 0) and model == "m"


def test_endpoint_urls():
    assert base_url("http://h:8000/v1/") == base_url("http://h:8000") == "http://h:8000"
    with pytest.raises(ValueError, match="is not an http"):
        base_url("h:8000")


def test_resume_index_cuts_a_torn_line_and_refuses_an_edited_file(tmp_path):
    files = OutputFiles(str(tmp_path / "o.jsonl"))
    with open(files.path, "wb") as handle:
        handle.write(b'{"source":{"index":3,"where":"a:4"}}\n{"source":{"index":1}}\n{"source":{"ind')
    assert done_rows(files) == {1, 3}
    assert open(files.path, "rb").read().endswith(b'{"source":{"index":1}}\n')
    with open(files.path, "ab") as handle:
        handle.write(b'{"messages":[]}\n')
    with pytest.raises(OutputError, match="line 3 is not a row dspark-regenerate wrote"):
        done_rows(files)


def test_identity_names_what_changed():
    cfg = RegenerateConfig(input_data="in.jsonl", output="o.jsonl")
    old = identity(cfg, "abc", "model-a")
    cfg.top_p, cfg.concurrency = 0.9, 64
    diff = identity_diff(old, identity(cfg, "abc", "model-b"))
    assert diff == [("regeneration.model", "model-a", "model-b"), ("regeneration.top_p", 1.0, 0.9)]


def _manifest(**fields) -> Manifest:
    base = dict(target_model="t", target_model_type="qwen3", target_vocab_size=10, hidden_size=4, num_hidden_layers=2,
                seq_length=8, dtype="bf16", num_samples=1, planned_samples=1, num_shards=1, shard_size=1,
                target_hidden_dim=4, target_last_hidden_dim=4, target_layer_ids=[1], train_data_path="x", num_rows=3)
    return Manifest(**{**base, **fields})


def test_manifest_regenerated_field():
    entry = RegeneratedInput(model="m", turns="all", temperature=0.0, top_p=1.0, max_tokens=8, seed=0, rows=3)
    assert list(manifest_problems(_manifest(regenerated=[entry]))) == []
    bad = msgspec.structs.replace(entry, turns="some", rows=4)
    problems = list(manifest_problems(_manifest(regenerated=[bad])))
    assert any("turns 'some'" in p for p in problems) and any("rows 4 is not in [1, num_rows 3]" in p for p in problems)
    # A manifest from before the field reads, with no entry, and the field is not identity.
    old = msgspec.json.decode(msgspec.json.encode(_manifest()).replace(b',"regenerated":[]', b""), type=Manifest)
    assert old.regenerated == [] and "regenerated" not in _manifest(regenerated=[entry]).identity()


def _script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([os.path.join(BIN, "dspark-regenerate"), *args], capture_output=True, text=True, timeout=120)


def test_the_console_script_shares_the_conventions(tmp_path):
    """As every script: a usage error is one line and exit 2, --help exits 0 with the exit codes, and
    settings that cannot work are usage errors before anything is asked or read."""
    bad = _script("--no-such-option")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "see dspark-regenerate --help" in bad.stderr
    helped = _script("--help")
    assert helped.returncode == 0 and "--on-truncated" in helped.stdout and "exit status: 0 " in helped.stdout
    base = ["--input-data", "x.jsonl", "--output", str(tmp_path / "o.jsonl"), "--endpoint"]
    for extra, words in ((["ftp://h"], "is not an http:// or https:// URL"),
                         (["http://h", "--top-p", "0"], "--top-p must be in (0, 1]"),
                         (["http://h", "--concurrency", "0"], "--concurrency must be >= 1"),
                         (["http://h", "--chat-template-kwargs", "[1]"], "must be a JSON object")):
        done = _script(*base, *extra)
        assert done.returncode == 2 and done.stderr.count("\n") == 1 and words in done.stderr, done.stderr
    module = subprocess.run([sys.executable, "-m", "dspark_cache.regenerate", "--version"], capture_output=True,
                            text=True, timeout=120)
    assert module.returncode == 0 and module.stdout.startswith("dspark-regenerate ")
    assert not os.listdir(tmp_path)


def test_help_imports_no_torch():
    code = ("import sys\nfrom dspark_cache.cli import regenerate\ntry:\n    regenerate(['--help'])\n"
            "except SystemExit:\n    pass\nprint('TORCH' if 'torch' in sys.modules else 'NO-TORCH')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip().splitlines()[-1] == "NO-TORCH", done.stdout + done.stderr
