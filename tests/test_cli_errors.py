"""Bad input and bad arguments: a clear message, a non-zero exit, and no shard written."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from tests.conftest import produce_args, run_produce, write_jsonl

GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def _assert_failed(capsys, out, code, *needles):
    err = capsys.readouterr().err
    assert code == 1, err
    for needle in needles:
        assert needle in err, err
    assert not os.path.exists(os.path.join(out, "shards")) or not os.listdir(os.path.join(out, "shards"))
    return err


def test_missing_input_file(embedded, tmp_path, capsys):
    out = str(tmp_path / "out")
    code = run_produce(embedded.stock, str(tmp_path / "nope.jsonl"), out)
    _assert_failed(capsys, out, code, "nope.jsonl does not exist")


def test_malformed_json_line_names_file_and_line(embedded, tmp_path, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", [GOOD, GOOD, '{"messages": [', GOOD])
    out = str(tmp_path / "out")
    code = run_produce(embedded.stock, data, out)
    _assert_failed(capsys, out, code, "d.jsonl:3", "malformed JSON", "--on-invalid skip")


def test_unknown_role(embedded, tmp_path, capsys):
    bad = {"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]}
    data = write_jsonl(tmp_path / "d.jsonl", [GOOD, bad])
    out = str(tmp_path / "out")
    code = run_produce(embedded.stock, data, out)
    _assert_failed(capsys, out, code, "d.jsonl:2", "unknown role 'wizard'")


def test_missing_target_dir(embedded, tmp_path, capsys):
    out = str(tmp_path / "out")
    code = run_produce(str(tmp_path / "no-model"), embedded.data, out)
    _assert_failed(capsys, out, code, "no-model does not exist", "--target-model")


def test_nonexistent_chat_template_path(embedded, tmp_path, capsys):
    out = str(tmp_path / "out")
    code = run_produce(embedded.stock, embedded.data, out, "--chat-template", str(tmp_path / "tmpl.jinja"))
    _assert_failed(capsys, out, code, "tmpl.jinja", "neither an existing file")


@pytest.mark.parametrize("ids,needle", [(["3", "8"], "out of range"), (["4", "2"], "strictly increasing")])
def test_bad_layer_ids(embedded, tmp_path, capsys, ids, needle):
    out = str(tmp_path / "out")
    code = run_produce(embedded.stock, embedded.data, out, "--target-layer-ids", *ids)
    _assert_failed(capsys, out, code, needle)


def test_console_script_exit_code(embedded, tmp_path):
    """The installed entry point, as a real process: usage errors and bad input exit non-zero."""
    exe = os.path.join(os.path.dirname(sys.executable), "dspark-produce")
    usage = subprocess.run([exe, "--input-data", "x"], capture_output=True, text=True)
    assert usage.returncode == 2 and "--target-model" in usage.stderr
    data = write_jsonl(tmp_path / "d.jsonl", [json.dumps(GOOD), "not json"])
    bad = subprocess.run([exe, *produce_args(embedded.stock, data, str(tmp_path / "o"))], capture_output=True, text=True)
    assert bad.returncode == 1 and "d.jsonl:2" in bad.stderr


@pytest.mark.parametrize("script", ["dspark-produce", "dspark-monitor", "dspark-verify", "dspark-convert"])
def test_every_console_script_has_version(script):
    import dspark_cache

    done = subprocess.run([os.path.join(os.path.dirname(sys.executable), script), "--version"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == f"{script} {dspark_cache.__version__}", done.stderr


SCRIPTS = ["dspark-produce", "dspark-monitor", "dspark-verify", "dspark-convert"]


def _script(name: str, *args: str) -> subprocess.CompletedProcess:
    exe = os.path.join(os.path.dirname(sys.executable), name)
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_console_script_shares_the_conventions(script):
    """One module's conventions: a usage error is one line and exit 2; --log-level is checked; --help exits 0."""
    from dspark_cache.cli.conventions import EXIT_USAGE

    bad = _script(script, "--no-such-option")
    assert bad.returncode == EXIT_USAGE and bad.stderr.count("\n") == 1, bad.stderr
    assert bad.stderr.startswith(f"{script}: error: ") and f"see {script} --help" in bad.stderr
    level = _script(script, "--log-level", "chatty")
    assert level.returncode == EXIT_USAGE and "--log-level" in level.stderr, level.stderr
    helped = _script(script, "--help")
    assert helped.returncode == 0 and "--log-level" in helped.stdout and "exit status: 0 " in helped.stdout


def test_readme_exit_codes_are_the_code_table():
    """The README's exit-code table lists exactly the codes the scripts share, in order."""
    from dspark_cache.cli.conventions import EXIT_CODES

    readme = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text()
    rows = [int(code) for code in re.findall(r"^\| `(\d+)` \| .+ \|$", readme, re.M)]
    assert rows == sorted(EXIT_CODES)


def test_tui_flag_only_on_the_console_script(tmp_path):
    """The torchrun module refuses --tui (its child would start another monitor) with one usage line."""
    done = subprocess.run([sys.executable, "-m", "dspark_cache.producer.cli", "--tui", "--target-model", "x",
                           "--input-data", "y", "--output-dir", str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "--tui" in done.stderr, done.stderr
