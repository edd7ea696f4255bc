"""``target_weights.safetensors``: recorded by checksum in the complete manifest, checked by
dspark-verify and by the readers (regular files only), and rewritten by a rerun when it is missing
or damaged, without recomputing a shard."""

from __future__ import annotations

import os
import shutil
import sys

import pytest
import xxhash

import dspark_cache
from dspark_cache.format.errors import CacheError
from dspark_cache.format.paths import CachePaths
from dspark_cache.verify import verify_cache
from tests.support.produce import run_produce
from tests.support import warm

ARGS = ("--seq-length", "64", "--shard-size", "16", "--batch-size", "8", "--dtype", "fp32")


def _mtimes(cache: str) -> dict[str, int]:
    shards = CachePaths(cache).shards_dir
    return {n: os.stat(os.path.join(shards, n)).st_mtime_ns for n in sorted(os.listdir(shards))}


@pytest.fixture(scope="module")
def weights_cache(embedded, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("weights") / "cache")
    assert run_produce(embedded.stock, embedded.data, out, *ARGS) == 0
    return out


def test_complete_manifest_records_the_weights_checksum(weights_cache):
    path = CachePaths(weights_cache).target_weights
    recorded = dspark_cache.open_cache(weights_cache).manifest.target_weights_xxh3
    assert recorded == xxhash.xxh3_64_intdigest(open(path, "rb").read())


def _damage(path: str, how: str) -> None:
    from safetensors.numpy import load_file, save_file

    if how == "truncated":
        os.truncate(path, os.path.getsize(path) - 100)
    elif how == "missing":
        os.unlink(path)
    elif how == "fifo":
        os.unlink(path)
        os.mkfifo(path)
    elif how == "data bit flip":
        with open(path, "r+b") as handle:
            handle.seek(os.path.getsize(path) - 5)
            byte = handle.read(1)
            handle.seek(-1, os.SEEK_CUR)
            handle.write(bytes([byte[0] ^ 0x10]))
    elif how == "wrong shapes":
        tensors = load_file(path)
        save_file({k: v[:-1] for k, v in tensors.items()}, path)
    else:
        raise AssertionError(how)


KINDS = ["truncated", "missing", "fifo", "data bit flip", "wrong shapes"]


@pytest.mark.parametrize("how", KINDS)
def test_damaged_weights_are_reported_refused_and_rewritten(embedded, weights_cache, tmp_path, how):
    cache = shutil.copytree(weights_cache, str(tmp_path / "cache"))
    path = CachePaths(cache).target_weights
    original = open(path, "rb").read()
    _damage(path, how)
    report = verify_cache(cache)
    assert not report.ok and any(
        path in p and "rerun dspark-produce" in p.lower() for p in report.problems
    ), report.problems
    # The reader refuses it (a FIFO at once, never waiting for a writer): the file is named. Run in a
    # child so that a reader that would block cannot hang the test run.
    code = ("import sys, dspark_cache.nemo as n\n"
            "try:\n    n.read_target_weight_modules(sys.argv[1])\n"
            "except (FileNotFoundError, ValueError) as e:\n    print('REFUSED', type(e).__name__, e)\n")
    done = warm.run(
        [sys.executable, "-c", code, cache], capture_output=True, text=True, timeout=120, code=True
    )
    assert done.stdout.startswith("REFUSED") and path in done.stdout, done.stdout + done.stderr
    shards_before = _mtimes(cache)
    assert run_produce(embedded.stock, embedded.data, cache, *ARGS) == 0
    assert open(path, "rb").read() == original  # rewritten from the target, byte for byte
    assert _mtimes(cache) == shards_before  # no shard recomputed
    assert verify_cache(cache).ok


def test_reader_error_is_a_cache_error_naming_the_file(weights_cache, tmp_path):
    from dspark_cache.nemo import read_target_weight_modules

    cache = shutil.copytree(weights_cache, str(tmp_path / "cache"))
    path = CachePaths(cache).target_weights
    _damage(path, "data bit flip")
    with pytest.raises(CacheError, match="xxh3") as caught:
        read_target_weight_modules(cache)
    assert path in str(caught.value) and "dspark-produce" in str(caught.value)


_NEMO_READER = """
import sys
import dspark_cache.nemo as n
from dspark_cache.nemo.nemo_format import NemoCacheDataset
root, what = sys.argv[1], sys.argv[2]
try:
    {"weights": n.read_target_weight_modules, "manifest": n.read_manifest,
     "shard": lambda r: NemoCacheDataset(r)[2]}[what](root)
    print("READ")
except ValueError as exc:
    print("REFUSED", exc)
"""


@pytest.mark.parametrize("what, damage", [("weights", "fifo"), ("weights", "another vocabulary"),
                                          ("manifest", "fifo"), ("shard", "fifo")])
def test_nemo_layout_reads_refuse_fifos_and_foreign_weights(tmp_path, what, damage):
    import torch
    from safetensors.torch import save_file

    from dspark_cache.nemo import nemo_format
    from tests.support.convert_fixture import write_tiny_nemo

    root = str(tmp_path / "nemo")
    write_tiny_nemo(root, [[5, 6, 9, 0]] * 4, [[0, 1, 1, 0]] * 4, shard_size=2)
    path = {"weights": nemo_format.target_weights_path(root), "manifest": nemo_format.manifest_path(root),
            "shard": nemo_format.shard_path(root, 1)}[what]
    if damage == "fifo":
        os.unlink(path)
        os.mkfifo(path)
    else:  # the manifest says target_vocab_size 100
        save_file({name: torch.zeros(99, 4, dtype=torch.bfloat16) for name in ("embed_tokens.weight",
                                                                               "lm_head.weight")}, path)
    # In a child: a reader that waits on a FIFO would hang the test run, not fail it.
    done = warm.run(
        [sys.executable, "-c", _NEMO_READER, root, what],
        code=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.stdout.startswith("REFUSED") and path in done.stdout, done.stdout + done.stderr[-2000:]
