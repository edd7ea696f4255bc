"""Bad input and bad arguments: a clear message, a non-zero exit, and no shard written."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from dspark_cache.format.paths import CachePaths
from tests.support import warm
from tests.support.produce import produce_args, run_produce, write_jsonl

GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def _assert_failed(capsys, out, code, *needles):
    err = capsys.readouterr().err
    assert code == 1, err
    for needle in needles:
        assert needle in err, err
    shards = CachePaths(out).shards_dir
    assert not os.path.exists(shards) or not os.listdir(shards)
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


@pytest.mark.parametrize("dry_run", [False, True])
def test_layer_ids_past_the_targets_depth_are_a_usage_error(embedded, tmp_path, capsys, dry_run):
    """Found once the target's config is read, but a setting all the same: exit 2 and one line, as every
    other bad id (tests/producer/test_hardening_run.py), for a run and a dry run alike."""
    out = str(tmp_path / "out")
    code = run_produce(embedded.stock, embedded.data, out, "--target-layer-ids", "3", "8",
                       *(["--dry-run"] if dry_run else []))
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "out of range" in err and embedded.stock in err and "see dspark-produce --help" in err, err
    assert not os.path.exists(CachePaths(out).shards_dir) or not os.listdir(CachePaths(out).shards_dir)


@pytest.mark.slow
def test_console_script_exit_code(embedded, tmp_path):
    """The installed entry point, as a real process: usage errors and bad input exit non-zero."""
    exe = os.path.join(os.path.dirname(sys.executable), "dspark-produce")
    usage = subprocess.run([exe, "--input-data", "x"], capture_output=True, text=True)
    assert usage.returncode == 2 and "--target-model" in usage.stderr
    data = write_jsonl(tmp_path / "d.jsonl", [json.dumps(GOOD), "not json"])
    bad = subprocess.run(
        [exe, *produce_args(embedded.stock, data, str(tmp_path / "o"))], capture_output=True, text=True
    )
    assert bad.returncode == 1 and "d.jsonl:2" in bad.stderr


@pytest.mark.parametrize("script", ["dspark-produce", "dspark-monitor", "dspark-verify", "dspark-convert"])
def test_every_console_script_has_version(script):
    import dspark_cache

    done = subprocess.run([os.path.join(os.path.dirname(sys.executable), script), "--version"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == f"{script} {dspark_cache.__version__}", done.stderr


SCRIPTS = ["dspark-produce", "dspark-monitor", "dspark-verify", "dspark-convert"]


def _script(name: str, *args: str) -> subprocess.CompletedProcess:
    """The console script ``name`` on ``args``, forked warm (the installed scripts themselves start cold
    in the two tests above)."""
    exe = os.path.join(os.path.dirname(sys.executable), name)
    return warm.run([exe, *args], capture_output=True, text=True, timeout=120)


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

    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    rows = [int(code) for code in re.findall(r"^\| `(\d+)` \| .+ \|$", readme, re.M)]
    assert rows == sorted(EXIT_CODES)


def test_tui_flag_only_on_the_console_script(tmp_path):
    """The torchrun module refuses --tui (its child would start another monitor) with one usage line."""
    done = warm.run(
        [
            sys.executable,
            "-m",
            "dspark_cache.producer",
            "--tui",
            "--target-model",
            "x",
            "--input-data",
            "y",
            "--output-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "--tui" in done.stderr, done.stderr


@pytest.mark.parametrize("module,entry", [("dspark_cache.producer.cli", "dspark_cache.producer"),
                                          ("dspark_cache.tui.cli", "dspark_cache.tui"),
                                          ("dspark_cache.nemo.convert.cli", "dspark_cache.nemo.convert")])
def test_a_command_module_is_not_an_entry_that_does_nothing(tmp_path, module, entry):
    """A script still naming an entry's old path (``-m dspark_cache.producer.cli`` ...) fails naming the
    right one, instead of exiting 0 having done nothing."""
    done = warm.run(
        [sys.executable, "-m", module, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and f"python -m {entry} with the same arguments" in done.stderr, done.stderr
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("args,needles", [
    (["--log-level", "LOUD"], ["--log-level", "'LOUD'", "DEBUG"]),
    (["--device", "tpu"], ["--device", "'tpu'", "auto, cpu, cuda or cuda:N"]),
    (["--device", "cuda:x"], ["--device", "'cuda:x'", "auto, cpu, cuda or cuda:N"]),
    # a storage dtype, not a compute one
    (["--compute-dtype", "fp8"], ["--compute-dtype", "'fp8'", "'bf16'"]),
])
def test_bad_log_level_and_device_are_one_line_usage_errors(tmp_path, args, needles):
    """Checked while parsing: exit 2, one line naming the accepted values, no traceback, nothing written."""
    out = tmp_path / "out"
    done = _script(
        "dspark-produce", "--target-model", "x", "--input-data", "y", "--output-dir", str(out), *args
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, (
        done.stderr
    )
    assert all(needle in done.stderr for needle in needles), done.stderr
    assert done.stdout == "" and not out.exists()


def test_device_is_checked_for_api_callers_too(embedded, tmp_path):
    """A ProduceConfig built in code gets the same message, before anything is loaded."""
    from dspark_cache.producer.config import ProduceConfig
    from dspark_cache.producer.run import produce

    cfg = ProduceConfig(embedded.stock, embedded.data, str(tmp_path / "out"), device="tpu")
    with pytest.raises(ValueError, match=r"--device 'tpu' .* use auto, cpu, cuda or cuda:N"):
        produce(cfg)
    assert not (tmp_path / "out").exists()


def test_help_lists_defaults():
    """--help states every default a user would otherwise look up (NeMo's differ for some)."""
    blocks = _help_blocks(_script("dspark-produce", "--help").stdout)
    for option, default in [("--seq-length", "2048"), ("--batch-size", "4"), ("--shard-size", "256"),
                            ("--dtype", "bf16"), ("--device", "auto"), ("--shuffle-seed", "42"),
                            ("--draft-num-hidden-layers", "5"), ("--compute-dtype", "auto"),
                            ("--rank-timeout", "300.0"), ("--log-level", "INFO")]:
        assert f"(default: {default})" in blocks[option] or f"(default {default})" in blocks[option], blocks[
            option
        ]
    assert "default" in blocks["--num-workers"] and "cores" in blocks["--num-workers"]
    assert not [b for b in blocks.values() if "(default: None)" in b or "(default: False)" in b]
    assert "--no-progress" in blocks


def test_shuffle_seed_help_says_what_split_does():
    """Which inputs the seed shuffles depends on --split (JSON/JSONL only with it), and --split slices the
    shuffled rows: the help says both, where it once said "Parquet / hub only"."""
    blocks = _help_blocks(_script("dspark-produce", "--help").stdout)
    seed = blocks["--shuffle-seed"]
    assert "JSON/JSONL files only when --split is given" in seed and "file order" in seed, seed
    assert "--split then takes its slice" in seed and "of the shuffled rows" in seed, seed


def _help_blocks(text: str) -> dict[str, str]:
    """``--help``'s option entries, each joined onto one line, by the option's first name."""
    blocks: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        start = re.match(r"^  (-[-\w]+)", line)
        if start:
            current = start.group(1)
            blocks[current] = line.strip()
        elif current and line.startswith("    "):
            blocks[current] += " " + line.strip()
        else:
            current = None
    return blocks


@pytest.mark.parametrize("script", SCRIPTS)
def test_command_hints_name_a_command_that_runs(script, monkeypatch, tmp_path):
    """The hint is the bare name on PATH, else the script beside this Python, else ``python -m``: each runs."""
    from dspark_cache.cli.conventions import command_hint

    beside = os.path.join(os.path.dirname(sys.executable), script)
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable))
    assert command_hint(script) == script
    monkeypatch.setenv("PATH", str(tmp_path))  # installed, but its venv is not activated
    assert os.path.samefile(os.path.abspath(command_hint(script)), beside)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))  # no script anywhere (pip --target ...)
    hint = command_hint(script)
    assert hint.startswith(f"{tmp_path / 'python'} -m dspark_cache.")
    monkeypatch.undo()
    module = hint.split(" -m ", 1)[1]
    done = warm.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith(dspark_version()), done.stderr


def dspark_version() -> str:
    import dspark_cache

    return dspark_cache.__version__


@pytest.mark.parametrize("dry_run", [False, True])
def test_an_output_dir_under_a_file_cannot_hold_a_cache(embedded, tmp_path, capsys, dry_run):
    """Issue 41, item 14: one line naming the file in the way, not a raw [Errno 20]."""
    (tmp_path / "a-file").write_text("mine")
    out = str(tmp_path / "a-file" / "deeper" / "cache")
    code = run_produce(embedded.stock, embedded.data, out, *(["--dry-run"] if dry_run else []))
    err = _assert_failed(capsys, out, code, "cannot hold a cache", f"{tmp_path / 'a-file'} is a file")
    assert "Errno" not in err and err.count("\n") == 1, err
    assert (tmp_path / "a-file").read_text() == "mine"
