"""A saved plan is checked by value, bounded by its own sizes, written or refused whole (issue 23).

Every hostile plan here keeps its checksums consistent with its content (they are recomputed after
each mutation), so only the value checks can catch it: a rerun must rebuild the plan and write the
same cache as a clean run, quickly. The dry-run tests check that a failed ``--dry-run`` leaves the
output directory as it found it.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import time
import uuid

import numpy as np
import pytest

import dspark_cache
from dspark_cache.format.paths import CachePaths
from dspark_cache.verify import verify_cache
from tests.support.plan_files import deadline, rechecksum
from tests.support.produce import produce_args, run_produce, small_run, write_jsonl
from tests.support.proc import assert_same_samples, producer_cmd, run

ARGS = small_run(4, 4)


def _edit(path: str):
    return np.load(path, mmap_mode="r+", allow_pickle=False)


def _vocab(target: str) -> int:
    return int(json.load(open(os.path.join(target, "config.json")))["vocab_size"])


# -- item 5: values -------------------------------------------------------------------------------

def mask_of_two(paths: CachePaths, target: str) -> str:
    _edit(paths.plan_part(0, "mask"))[3] = 2
    return paths.plan_part(0, "mask")


def id_past_the_vocabulary(paths: CachePaths, target: str) -> str:
    _edit(paths.plan_part(0, "ids"))[5] = _vocab(target)
    return paths.plan_part(0, "ids")


def negative_id(paths: CachePaths, target: str) -> str:
    _edit(paths.plan_part(0, "ids"))[7] = -3
    return paths.plan_part(0, "ids")


def sample_length_not_the_row_tables(paths: CachePaths, target: str) -> str:
    samples = _edit(paths.plan_array("samples"))
    samples["length"][0] -= 1  # still inside its part: only the row table says it is wrong
    return paths.plan_array("samples")


def rows_out_of_order(paths: CachePaths, target: str) -> str:
    """Two rows' token spans swapped in the row table (offsets no longer tile the tokens)."""
    rows = _edit(paths.plan_part(0, "rows"))
    a, b = rows[0].copy(), rows[1].copy()
    rows["offset"][0], rows["offset"][1] = b["offset"], a["offset"]
    rows["length"][0], rows["length"][1] = b["length"], a["length"]
    samples = _edit(paths.plan_array("samples"))
    for record, old in ((a, b), (b, a)):  # the merged plan agrees with the forged table
        at = np.flatnonzero(samples["sample_id"] == record["sample_id"])[0]
        samples["offset"][at], samples["length"][at] = old["offset"], old["length"]
    return paths.plan_part(0, "rows")


def loss_tokens_not_the_masks(paths: CachePaths, target: str) -> str:
    rows = _edit(paths.plan_part(0, "rows"))
    rows["loss_tokens"][2] += 1
    samples = _edit(paths.plan_array("samples"))
    samples["loss_tokens"][samples["sample_id"] == rows["sample_id"][2]] += 1
    return paths.plan_part(0, "rows")


def a_sample_twice(paths: CachePaths, target: str) -> str:
    rows = _edit(paths.plan_part(0, "rows"))
    rows["sample_id"][16] = rows["sample_id"][15]
    return paths.plan_part(0, "rows")


def shard_bytes_off_by_a_block(paths: CachePaths, target: str) -> str:
    _edit(paths.plan_array("shard_bytes"))[0] += 512
    return paths.plan_array("shard_bytes")


VALUE_MUTATIONS = (mask_of_two, id_past_the_vocabulary, negative_id, sample_length_not_the_row_tables,
                   rows_out_of_order, loss_tokens_not_the_masks, a_sample_twice, shard_bytes_off_by_a_block)


def _with_plan_of(reference: str, out: str) -> CachePaths:
    """``out``, holding only ``reference``'s saved plan."""
    paths = CachePaths(out)
    os.makedirs(out)
    shutil.copytree(CachePaths(reference).plan_dir, paths.plan_dir)
    return paths


def _stamp(path: str) -> tuple[int, int]:
    st = os.lstat(path)
    return st.st_ino, st.st_mtime_ns


@pytest.mark.parametrize("mutate", VALUE_MUTATIONS, ids=lambda m: m.__name__)
def test_hostile_plan_values_with_matching_checksums_are_rebuilt(embedded, reference, tmp_path, mutate):
    out = str(tmp_path / "cache")
    paths = _with_plan_of(reference, out)
    damaged = mutate(paths, embedded.stock)
    rechecksum(paths)
    before = _stamp(damaged)
    assert run_produce(embedded.stock, embedded.data, out, *ARGS) == 0
    assert _stamp(damaged) != before  # rebuilt, not trusted
    assert verify_cache(out).ok
    assert_same_samples(out, reference, exact=True)


def test_a_token_the_target_has_no_embedding_for_is_an_invalid_row(embedded, tmp_path, capsys):
    """A tokenizer larger than the target's embedding (as in some real checkpoints): a row with such
    a token is an invalid row (named, counted), never written into a shard."""
    out = str(tmp_path / "dry")
    assert run_produce(embedded.stock, embedded.data, out, *ARGS, "--dry-run") == 0
    paths = CachePaths(out)
    ids = np.load(paths.plan_part(0, "ids"), allow_pickle=False)
    rows = np.load(paths.plan_part(0, "rows"), allow_pickle=False)
    highest = np.maximum.reduceat(ids, rows["offset"])
    vocab = int(np.median(highest)) + 1  # about half of the rows fit
    too_big = int((highest >= vocab).sum())
    assert 0 < too_big < rows.shape[0]
    target = _narrow_target(embedded.stock, str(tmp_path / "narrow"), vocab)
    capsys.readouterr()
    code = run_produce(target, embedded.data, str(tmp_path / "refused"), *ARGS)
    err = capsys.readouterr().err
    assert code == 1 and f"{too_big} invalid input row" in err
    assert f"{embedded.data}:" in err and f"vocabulary size {vocab}" in err and "--on-invalid skip" in err
    cache = str(tmp_path / "skipped")
    assert run_produce(target, embedded.data, cache, *ARGS, "--on-invalid", "skip") == 0
    manifest = dspark_cache.open_cache(cache).manifest
    assert manifest.skipped_rows.get("token outside the target's vocabulary") == too_big
    assert manifest.num_samples == rows.shape[0] - too_big
    assert all(int(s["input_ids"].max()) < vocab for s in dspark_cache.open_cache(cache).samples())


def _narrow_target(source: str, dest: str, vocab: int) -> str:
    """``source`` with its embedding and LM head cut to ``vocab`` rows (the tokenizer unchanged)."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(source, dest)
    config = json.load(open(os.path.join(dest, "config.json")))
    config["vocab_size"] = vocab
    json.dump(config, open(os.path.join(dest, "config.json"), "w"))
    weights = os.path.join(dest, "model.safetensors")
    tensors = load_file(weights)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        tensors[name] = np.ascontiguousarray(tensors[name][:vocab])
    save_file(tensors, weights, metadata={"format": "pt"})
    return dest


# -- item 9: sizes, counts, kinds of file ------------------------------------------------------------

def a_billion_parts(paths: CachePaths) -> str:
    path = paths.plan_part_header(0)
    header = json.load(open(path))
    header["num_parts"] = 10 ** 9
    open(path, "w").write(json.dumps(header))
    return paths.plan_part_header(0)


def sparse_terabyte_of_ids(paths: CachePaths) -> str:
    os.truncate(paths.plan_part(0, "ids"), 1 << 40)
    return paths.plan_part(0, "ids")


def sparse_terabyte_of_samples(paths: CachePaths) -> str:
    os.truncate(paths.plan_array("samples"), 1 << 40)
    return paths.plan_array("samples")


def a_directory_for_the_ids(paths: CachePaths) -> str:
    os.unlink(paths.plan_part(0, "ids"))
    os.mkdir(paths.plan_part(0, "ids"))
    return paths.plan_part(0, "ids")


def a_directory_for_the_header(paths: CachePaths) -> str:
    os.unlink(paths.plan_header)
    os.mkdir(paths.plan_header)
    return paths.plan_header


def a_symlink_for_the_rows(paths: CachePaths) -> str:
    """A link to an identical copy outside the plan: content right, kind wrong."""
    path = paths.plan_part(0, "rows")
    outside = os.path.join(os.path.dirname(paths.root), "rows-elsewhere.npy")
    os.replace(path, outside)
    os.symlink(outside, path)
    return paths.plan_part(0, "rows")


FILE_MUTATIONS = (
    a_billion_parts,
    sparse_terabyte_of_ids,
    sparse_terabyte_of_samples,
    a_directory_for_the_ids,
    a_directory_for_the_header,
    a_symlink_for_the_rows,
)


@pytest.mark.parametrize("mutate", FILE_MUTATIONS, ids=lambda m: m.__name__)
def test_hostile_plan_files_are_rebuilt_in_bounded_time(embedded, reference, tmp_path, mutate):
    out = str(tmp_path / "cache")
    path = mutate(_with_plan_of(reference, out))
    kind = stat.S_IFMT(os.lstat(path).st_mode)
    with deadline(90):  # the whole run; rejecting the plan itself takes milliseconds (printed below)
        assert run_produce(embedded.stock, embedded.data, out, *ARGS) == 0
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and st.st_size < 1 << 20, (kind, st)  # a plan file of ours again
    assert verify_cache(out).ok
    assert_same_samples(out, reference, exact=True)


def test_rejecting_a_hostile_plan_takes_milliseconds(embedded, reference, tmp_path):
    from dspark_cache.producer.plan.store import load_plan

    header = json.load(open(CachePaths(reference).plan_header))
    spec = _spec(reference, header)
    assert load_plan(CachePaths(reference), spec) is not None
    timings = {}
    for mutate in FILE_MUTATIONS:
        out = str(tmp_path / mutate.__name__)
        paths = _with_plan_of(reference, out)
        mutate(paths)
        started = time.perf_counter()
        with deadline(5):
            assert load_plan(paths, spec) is None
        timings[mutate.__name__] = round(1e3 * (time.perf_counter() - started), 2)
    print(f"\nms to reject each hostile plan: {timings}")
    assert max(timings.values()) < 1000


def _spec(reference: str, header: dict):
    """The settings the reference run planned with (``ARGS``), as the producer passes them."""
    from dspark_cache.format.geometry import SampleShape
    from dspark_cache.format.sample import CACHE_DTYPES
    from dspark_cache.producer.plan.store import PlanSpec

    m = dspark_cache.open_cache(reference).manifest
    shape = SampleShape(list(m.target_layer_ids), m.num_hidden_layers, m.hidden_size, CACHE_DTYPES[m.dtype])
    return PlanSpec(
        keys=(header["encode_key"], header["layout_key"]),
        vocab_size=m.target_vocab_size,
        seq_length=m.seq_length,
        shape=shape,
        shard_size=m.shard_size,
        max_batch_tokens=4 * m.seq_length,
    )


# -- item 16: a full disk ------------------------------------------------------------------------------

@pytest.fixture
def tiny_fs(tmp_path):
    """A 1 MiB tmpfs (this process may mount one: root, as in CI)."""
    mount = tmp_path / f"fs-{uuid.uuid4().hex[:6]}"
    mount.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a small filesystem here (needs root)")
    yield str(mount)
    subprocess.run(["umount", "-l", str(mount)], capture_output=True)


@pytest.mark.slow
def test_a_full_disk_while_the_plan_is_written_says_where_how_much_and_what_to_do(
    embedded, reference, tiny_fs
):
    out = os.path.join(tiny_fs, "cache")
    filler = os.path.join(tiny_fs, "filler")
    with open(filler, "wb") as handle:  # room for the lock and directories, not for the tokens (~38 kB)
        handle.write(b"\0" * (shutil.disk_usage(tiny_fs).free - (16 << 10)))
    cmd = producer_cmd(*produce_args(embedded.stock, embedded.data, out, *ARGS))
    full = run(cmd)
    assert full.returncode == 1, full.stderr
    err = full.stderr
    plan = CachePaths(out).plan_dir
    assert f"disk full while writing the saved plan in {plan}" in err, err
    assert "needs about" in err and "MB is free" in err and "--output-dir" in err and "rerun" in err
    assert "Traceback" not in err
    assert not [n for n in os.listdir(plan) if n.endswith((".json", ".tmp"))]  # no header: nothing to trust
    assert not os.path.exists(CachePaths(out).lock)  # nothing of a cache yet: no lock file left behind
    os.unlink(filler)
    subprocess.run(["mount", "-o", "remount,size=64m", tiny_fs], check=True)
    done = run(cmd)
    assert done.returncode == 0, done.stderr
    assert verify_cache(out).ok
    assert_same_samples(out, reference, exact=True)


# -- item 25: a failed dry run ---------------------------------------------------------------------------

def test_a_failed_dry_run_leaves_no_lock_plan_or_directory_behind(embedded, tmp_path, capsys):
    good = [json.loads(line) for line in open(embedded.data)][:8]
    bad = write_jsonl(tmp_path / "bad.jsonl", good[:4] + [{"messages": "not a list"}] + good[4:])
    out = tmp_path / "new" / "cache"
    assert run_produce(embedded.stock, bad, str(out), *ARGS, "--dry-run") == 1
    assert "1 invalid input row" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()  # no lock record, no plan files, no directories it made
    assert (
        run_produce(embedded.stock, write_jsonl(tmp_path / "good.jsonl", good), str(out), *ARGS, "--dry-run")
        == 0
    )
    kept = sorted(
        os.path.relpath(d, out) for d in (CachePaths(str(out)).control_dir, CachePaths(str(out)).plan_dir)
    )
    assert sorted(os.listdir(out)) == kept  # a successful dry run keeps its plan


def test_a_failed_dry_run_keeps_what_was_there(embedded, tmp_path):
    out = str(tmp_path / "cache")
    os.makedirs(out)
    open(os.path.join(out, "notes.txt"), "w").write("the user's")
    good = [json.loads(line) for line in open(embedded.data)][:8]
    bad = write_jsonl(tmp_path / "bad.jsonl", good + [{"no": "messages"}])
    assert run_produce(embedded.stock, bad, out, *ARGS, "--dry-run") == 1
    assert os.listdir(out) == ["notes.txt"]  # its own directories and files removed, nothing else

    assert run_produce(embedded.stock, embedded.data, out, *ARGS, "--dry-run") == 0
    before = {os.path.join(d, n): _stamp(os.path.join(d, n)) for d, _, names in os.walk(out) for n in names}
    broken = str(tmp_path / "no-tokenizer")  # fails after the directory is taken, before tokenising
    shutil.copytree(embedded.stock, broken)
    for name in os.listdir(broken):
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            os.unlink(os.path.join(broken, name))
    assert run_produce(broken, embedded.data, out, *ARGS, "--dry-run") == 1
    after = {os.path.join(d, n): _stamp(os.path.join(d, n)) for d, _, names in os.walk(out) for n in names}
    lock = CachePaths(out).lock
    assert set(after) == set(before)  # the earlier plan and the lock file it was made under are kept
    assert {k: v for k, v in after.items() if k != lock} == {k: v for k, v in before.items() if k != lock}

    from dspark_cache.storage.lock import lock_exclusive

    held = lock_exclusive(CachePaths(out), "another-run", 1)  # a live producer: the dry run touches nothing
    try:
        assert run_produce(embedded.stock, bad, out, *ARGS, "--dry-run") == 1
        now = {os.path.join(d, n): _stamp(os.path.join(d, n)) for d, _, names in os.walk(out) for n in names}
        assert set(now) == set(after) and all(now[k] == v for k, v in after.items() if k != lock)
    finally:
        held.release()
    assert run_produce(embedded.stock, embedded.data, out, *ARGS) == 0


def test_a_lock_file_removed_by_its_holder_is_not_locked_through_an_old_descriptor(tmp_path, monkeypatch):
    """A process that opened the lock file just before its last holder removed it must not lock the
    removed file: it would then 'hold' a lock that a third producer, creating the file anew, shares."""
    from dspark_cache.storage import lock as lock_module

    paths = CachePaths(str(tmp_path / "cache"))
    os.makedirs(paths.control_dir)
    first = lock_module.lock_exclusive(paths, "run-1", 1)
    stale = os.open(paths.lock, os.O_RDWR)  # opened while the first holder still has it
    os.unlink(paths.lock)  # the holder removes its lock file (a failed dry run) ...
    first.release()  # ... and lets go
    opened = iter([stale])
    real_open = lock_module._open
    monkeypatch.setattr(lock_module, "_open", lambda path: next(opened, None) or real_open(path))
    second = lock_module.lock_exclusive(paths, "run-2", 1)
    assert second is not None and os.path.exists(paths.lock)
    with pytest.raises(lock_module.CacheLockedError):  # the second holds the real lock file
        lock_module.lock_exclusive(paths, "run-3", 1)
    second.release()


def test_a_real_run_failing_while_planning_leaves_no_lock_file_and_keeps_its_rows(embedded, tmp_path, capsys):
    """Issue 41, item 14: no lock file is left where there was none; the rows it encoded stay for the rerun
    (with --on-invalid skip it tokenises nothing again: tests/producer/test_plan_store.py)."""
    good = [json.loads(line) for line in open(embedded.data)][:8]
    bad = write_jsonl(tmp_path / "bad.jsonl", good[:4] + [{"messages": "not a list"}] + good[4:])
    out = str(tmp_path / "new" / "cache")
    assert run_produce(embedded.stock, bad, out, *ARGS) == 1
    assert "1 invalid input row" in capsys.readouterr().err
    assert not os.path.lexists(CachePaths(out).lock)
    assert os.listdir(CachePaths(out).plan_dir)  # the encoded part, kept
    assert run_produce(embedded.stock, bad, out, *ARGS, "--on-invalid", "skip") == 0
    assert os.path.exists(CachePaths(out).lock)  # a cache now: its lock file stays, as always
