"""Issue 23, the producer's command line, directory and run: usage errors exit 2 before anything is
read, leftovers are deleted only when the producer wrote them, a stop that lands after the last
shard completes the job, the lock record is never a FIFO we block on, a resume says what it kept."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys

import pytest

import dspark_cache
from dspark_cache.cli.conventions import EXIT_USAGE
from dspark_cache.format.paths import CachePaths
from dspark_cache.format.tar.reader import load_shard_index
from dspark_cache.verify import verify_cache
from tests.support.produce import produce_args, run_produce, small_run, write_jsonl
from tests.support.proc import BIN, producer_cmd, run, start, wait_for

ARGS = ("--seq-length", "128", "--shard-size", "4", "--batch-size", "2", "--num-workers", "0")


@pytest.fixture(scope="module")
def tiny_data(embedded, tmp_path_factory) -> str:
    with open(embedded.data, encoding="utf-8") as handle:
        rows = handle.read().splitlines()[:10]
    return write_jsonl(tmp_path_factory.mktemp("tiny") / "d.jsonl", rows)


@pytest.fixture(scope="module")
def tiny_cache(embedded, tiny_data, tmp_path_factory) -> str:
    """A complete cache of ``tiny_data`` with ``ARGS``: tests that damage one damage a copy."""
    out = str(tmp_path_factory.mktemp("tiny-cache") / "out")
    assert run_produce(embedded.stock, tiny_data, out, *ARGS) == 0
    return out


# --- settings that cannot work: one usage line, exit 2, nothing read or written -----------------

@pytest.mark.parametrize(
    "args,needle",
    [
        (["--batch-size", "0"], "--batch-size must be >= 1"),
        (["--seq-length", "0"], "--seq-length must be >= 1"),
        (["--shard-size", "0"], "--shard-size must be >= 1"),
        (["--writer-threads", "0"], "--writer-threads must be >= 1"),
        (["--writer-threads", "65"], "--writer-threads 65 is over 64"),
        (["--seq-length", str((1 << 24) + 1)], "the longest sample a cache's index and readers accept"),
        (["--shard-size", str(1 << 63)], "the most samples a shard index can list"),
        (["--num-workers", "-1"], "--num-workers must be >= 0"),
        (["--rank-timeout", "-5"], "--rank-timeout must be a positive number of seconds"),
        (["--rank-timeout", "nan"], "--rank-timeout must be a positive number of seconds"),
        (
            ["--seq-length", "512", "--max-batch-tokens", "100"],
            "--max-batch-tokens 100 is below --seq-length 512",
        ),
        (["--shuffle-seed", "-1"], "--shuffle-seed must be >= 0"),
        (["--target-layer-ids", "3", "1"], "must be strictly increasing"),
        (["--target-layer-ids", "1", "1"], "must be strictly increasing"),
        (["--target-layer-ids", "-2", "3"], "ids start at -1"),
    ],
)
def test_settings_that_cannot_work_are_usage_errors(tmp_path, capsys, args, needle):
    from dspark_cache.producer.__main__ import main

    out = tmp_path / "out"
    # The target and the input do not exist: the settings are refused before either is looked at.
    code = main(["--target-model", str(tmp_path / "no-model"), "--input-data", str(tmp_path / "no.jsonl"),
                 "--output-dir", str(out), "--device", "cpu", *args])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE, err
    assert err.count("\n") == 1 and needle in err and "see dspark-produce --help" in err, err
    assert not out.exists()


def test_a_file_as_target_model_is_a_usage_error(embedded, tmp_path, capsys):
    from dspark_cache.producer.__main__ import main

    config = os.path.join(embedded.stock, "config.json")
    code = main(produce_args(config, str(tmp_path / "no.jsonl"), str(tmp_path / "out")))
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and f"--target-model {config} is a file" in err and "directory" in err, err


@pytest.mark.parametrize("out", ["/proc/dspark-cache-test", "/proc/self/dspark-cache-test"])
def test_an_output_dir_that_cannot_be_created_says_so(embedded, tiny_data, capsys, out):
    assert run_produce(embedded.stock, tiny_data, out, *ARGS) == 1
    err = capsys.readouterr().err
    assert f"--output-dir {out} cannot hold a cache: creating {out}" in err, err
    assert "choose a directory on a writable filesystem" in err and "Errno" not in err, err


def test_the_format_limits_are_the_readers_own():
    """The producer's bounds come from the constants the readers enforce: an index of MAX_SHARD_SIZE of
    the widest entries fits what the reader accepts, one more entry would not."""
    import msgspec

    from dspark_cache.format.schema import SampleEntry, ShardIndex
    from dspark_cache.format.validate import MAX_INDEX_BYTES, MAX_SEQ_LENGTH
    from dspark_cache.producer.config import MAX_SHARD_SIZE

    top = (1 << 64) - 1
    entry = SampleEntry(top, MAX_SEQ_LENGTH, MAX_SEQ_LENGTH, top, top, top)
    one = len(msgspec.json.encode(ShardIndex(shard_id=0, tar_bytes=0, tar_xxh3=0, samples=[entry])))
    per_entry = (
        len(msgspec.json.encode(ShardIndex(shard_id=0, tar_bytes=0, tar_xxh3=0, samples=[entry] * 2))) - one
    )
    assert (MAX_SHARD_SIZE + 1) * per_entry > MAX_INDEX_BYTES >= MAX_SHARD_SIZE * per_entry


def test_convert_and_verify_agree_on_a_directory_that_is_not_a_cache(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    done = {}
    for script, args in (("dspark-verify", [str(empty)]),
                         ("dspark-convert", [str(empty), str(tmp_path / "dst"), "--to", "nemo"])):
        done[script] = subprocess.run(
            [os.path.join(BIN, script), *args], capture_output=True, text=True, timeout=120
        )
    for script, proc in done.items():
        assert proc.returncode == EXIT_USAGE, (script, proc.stderr)
        assert (
            f"{empty} is not a dspark cache" in proc.stderr and "dspark-produce --output-dir" in proc.stderr
        )


# --- the lock record: its stop hint, and never anything but a regular file ---------------------

def test_a_refused_second_producer_is_told_the_monitors_stop_key(tmp_path):
    from dspark_cache.storage.lock import CacheLockedError, lock_exclusive

    paths = CachePaths(str(tmp_path / "cache"))
    os.makedirs(paths.control_dir)
    held = lock_exclusive(paths, "run-a", 1)
    try:
        with pytest.raises(CacheLockedError) as refused:
            # another open file description: flock refuses it, as for a process
            lock_exclusive(paths, "run-b", 1)
    finally:
        held.release()
    # The monitor's stop key is s (q only leaves it; under --tui q asks, then stops the child it started).
    assert f"press s in dspark-monitor {paths.root}" in str(refused.value) and "q in" not in str(
        refused.value
    )


@pytest.mark.parametrize("kind", ["fifo", "directory", "link to a device"])
def test_a_lock_record_that_is_not_a_regular_file_is_refused_without_blocking(tmp_path, kind):
    """Every way in (rank 0, a joining rank, dspark-convert's destination) refuses it with what to do."""
    paths = CachePaths(str(tmp_path / "cache"))
    os.makedirs(paths.control_dir)
    {
        "fifo": lambda p: os.mkfifo(p),
        "directory": os.mkdir,
        "link to a device": lambda p: os.symlink("/dev/zero", p),
    }[kind](paths.lock)
    probe = ("import sys\nfrom dspark_cache.format.paths import CachePaths\n"
             "from dspark_cache.storage.lock import LockFileError, lock_exclusive, lock_shared\n"
             "paths = CachePaths(sys.argv[1])\n"
             "for take in (lambda: lock_exclusive(paths, 'r', 1), lambda: lock_shared(paths)):\n"
             "    try:\n        take()\n    except LockFileError as exc:\n        print(exc)\n")
    done = subprocess.run(
        [sys.executable, "-c", probe, paths.root], capture_output=True, text=True, timeout=60
    )
    lines = done.stdout.splitlines()
    assert done.returncode == 0 and len(lines) == 2, done.stdout + done.stderr
    assert all(f"{paths.lock} is not a regular file" in line and "Remove it" in line for line in lines), lines
    assert os.path.lexists(paths.lock)  # refused, never deleted


# --- leftovers: only what the writer names, only regular files ----------------------------------

def test_resume_deletes_only_the_writers_leftovers_and_refuses_odd_ones(
    embedded, tmp_path, tiny_data, capsys
):
    out = tmp_path / "cache"
    assert run_produce(embedded.stock, tiny_data, str(out), *ARGS) == 0
    paths = CachePaths(str(out))
    shards = pathlib.Path(paths.shards_dir)
    mine = {
        shards / "notes.tmp": "mine",
        shards / "draft.partial": "mine too",
        shards / "shard-1.tar.partial": "x",
        shards / "shard-000000.idx.tmp": "not the writer's spelling",
    }
    for path, text in mine.items():
        path.write_text(text)
    ours = [pathlib.Path(paths.shard_partial(7)), shards / "shard-000001.idx.123.456.tmp"]
    for path in ours:
        path.write_bytes(b"half written")
    assert run_produce(embedded.stock, tiny_data, str(out), *ARGS) == 0
    assert {p: p.read_text() for p in mine} == mine  # a user's files are not leftovers, whatever their suffix
    assert not any(p.exists() for p in ours)
    odd = pathlib.Path(paths.shard_partial(3))
    odd.mkdir()  # a directory named as a leftover: never deleted, and it would block every write of shard 3
    published = sorted(os.listdir(shards))
    capsys.readouterr()
    for extra in ((), ("--overwrite",)):
        assert run_produce(embedded.stock, tiny_data, str(out), *ARGS, *extra) == 1
        err = capsys.readouterr().err
        assert f"{odd} is a directory, not a regular file" in err and "move or rename it" in err, err
        assert odd.is_dir() and sorted(os.listdir(shards)) == published
    assert verify_cache(str(out)).ok


# --- a stop with the last shard in flight -------------------------------------------------------

@pytest.mark.slow
def test_a_stop_that_lands_on_the_last_shard_completes_the_job(embedded, tmp_path):
    """One shard, so the shard in flight is the last: the stop finishes it, and then the work is all done."""
    out = str(tmp_path / "cache")
    proc = start(
        producer_cmd(*produce_args(embedded.stock, embedded.data, out, *small_run(1000, 1, dtype=None)))
    )
    try:
        partial = CachePaths(out).shard_partial(0)
        wait_for(lambda: os.path.exists(partial) or proc.poll() is not None, timeout=240, poll=0.005)
        os.killpg(proc.pid, signal.SIGSTOP)  # hold it mid-shard while the monitor's stop request lands
        with open(CachePaths(out).stop_request, "w"):
            pass
    finally:
        os.killpg(proc.pid, signal.SIGCONT)
    stdout, err = proc.communicate(timeout=300)
    assert "stop requested by the monitor" in err, err  # the stop was seen, mid-job
    assert proc.returncode == 0, err
    assert "cache complete" in stdout and "stopped before completion" not in err
    report = verify_cache(out)
    assert report.ok and report.complete, report


# --- a resume says what it kept, and its progress is the whole job's ------------------------------

@pytest.mark.slow
def test_a_resume_says_what_it_kept_and_counts_the_whole_job(embedded, tiny_data, tmp_path):
    out = str(tmp_path / "cache")
    args = produce_args(embedded.stock, tiny_data, out, "--seq-length", "128", "--shard-size", "2",
                        "--batch-size", "1", "--num-workers", "0")
    killed = run(producer_cmd(*args), env={"DSPARK_CRASH_AT": "after_index:2"})  # two shards published
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    paths = CachePaths(out)
    kept = paths.indexed_shard_ids()
    assert kept == [0, 1]
    samples = sum(load_shard_index(paths, s).num_samples for s in kept)
    loud = [("INFO" if a == "WARNING" else a) for a in args]  # the console at dspark-produce's default level
    again = run(producer_cmd(*loud, "--no-progress"))
    assert again.returncode == 0, again.stderr
    total = verify_cache(out)
    assert total.ok
    manifest = dspark_cache.open_cache(out).manifest
    shards = manifest.num_shards
    line = f"resuming: 2 of {shards} shards ({samples} samples) already published; computing {shards - 2}"
    assert f"INFO dspark_cache.producer.report.status: {line}\n" in again.stderr, again.stderr
    final = re.search(
        r"progress: computed (\d+)/(\d+) samples, 100\.0% of tokens, (\d+)/(\d+) shards", again.stderr
    )
    assert final, again.stderr
    assert [int(g) for g in final.groups()] == [manifest.num_samples] * 2 + [shards] * 2


# --- two Ctrl-C ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_second_ctrl_c_while_exiting_exits_3_without_a_traceback(embedded, tmp_path):
    """The second SIGINT lands in the interpreter's shutdown (after the stop's last line): one line, exit 3,
    not a KeyboardInterrupt traceback from an atexit callback nor death by SIGINT (-2)."""
    out = str(tmp_path / "cache")
    proc = start(producer_cmd(*produce_args(embedded.stock, embedded.data, out, "--seq-length", "256",
                                            "--shard-size", "1", "--batch-size", "1", "--num-workers", "0")))
    paths = CachePaths(out)
    wait_for(lambda: paths.indexed_shard_ids() or proc.poll() is not None, timeout=240, poll=0.01)
    assert proc.poll() is None, proc.communicate()
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C sends: the whole foreground group
    said = []
    for line in proc.stderr:  # until the run's last line: the process is on its way out
        said.append(line)
        if "rerun the same command" in line:
            break
    os.killpg(proc.pid, signal.SIGINT)
    _, rest = proc.communicate(timeout=300)
    err = "".join(said) + rest
    assert proc.returncode == 3, err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert err.count("rerun the same command to resume") <= 2, err  # the stop's line, and at most one more
    assert not verify_cache(out).corrupt


def test_a_plan_with_more_shards_than_readers_accept_is_refused_before_loading(
    embedded, tmp_path, monkeypatch, capsys
):
    """The shard count is known only once planned: refused then, before the target loads, never after hours."""
    from dspark_cache.format import validate

    monkeypatch.setattr(validate, "MAX_SHARDS", 3)  # 10 million for real: a test cannot plan that many
    out = str(tmp_path / "out")
    assert run_produce(embedded.stock, embedded.data, out, "--shard-size", "1") == 1
    err = capsys.readouterr().err
    assert "could not be read back" in err and "num_shards" in err and "--shard-size" in err
    assert not os.path.exists(CachePaths(out).manifest)


@pytest.mark.slow
@pytest.mark.parametrize(
    "where,kind",
    [
        (lambda paths: paths.events(0), "fifo"),  # appended to: a FIFO hung the run, deaf to SIGTERM
        (
            lambda paths: paths.stop_request,
            "directory",
        ),  # read as a stop request: every rerun stopped at once
        (
            lambda paths: paths.shard_tar(5),
            "directory",
        ),  # published over: a bare errno after computing the shard
        (lambda paths: paths.shard_index(5), "directory"),
        (lambda paths: paths.status(0), "directory"),  # the heartbeat's rename failed
    ],
    ids=["events-fifo", "stop-directory", "shard-directory", "index-directory", "status-directory"],
)
def test_a_non_file_under_a_name_the_producer_writes_is_refused_up_front(
    embedded, tiny_data, tiny_cache, tmp_path, where, kind
):
    out = shutil.copytree(tiny_cache, str(tmp_path / "out"), symlinks=True)
    args = produce_args(embedded.stock, tiny_data, out, *ARGS)
    path = where(CachePaths(out))
    if os.path.lexists(path):
        os.unlink(path)
    os.mkfifo(path) if kind == "fifo" else os.mkdir(path)
    done = run(producer_cmd(*args), timeout=60)
    assert done.returncode == 1, done.stderr
    assert path in done.stderr and "not a regular file" in done.stderr and "move or rename it" in done.stderr
    assert os.path.lexists(path) and (os.path.isdir(path) or kind == "fifo")  # nothing of the user's deleted


@pytest.mark.parametrize("given", [["1", "3"], ["1,3"], ["1,", "3"], ["--target-layer-ids=1,3"]])
def test_target_layer_ids_take_commas_as_for_draft_layers_does(given):
    """Issue 41, item 17: ``1,3`` was an argparse error while ``--for-draft-layers 1,3`` was the way."""
    import argparse

    from dspark_cache.producer.config import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flag = [] if given[0].startswith("--") else ["--target-layer-ids"]
    args = parser.parse_args(["--target-model", "t", "--input-data", "d", "--output-dir", "o", *flag, *given])
    assert args.target_layer_ids == [1, 3]
