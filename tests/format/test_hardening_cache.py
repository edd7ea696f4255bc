"""A valid cache is never reported corrupt; a damaged or crafted one is refused, naming the file."""

from __future__ import annotations

import json
import os
import shutil
import sys
from operator import attrgetter, methodcaller

import msgspec
import pytest
import torch

import dspark_cache
from dspark_cache.format.errors import CacheError, CorruptShardError
from dspark_cache.format.paths import CachePaths
from dspark_cache.format.schema import ShardIndex, encode_json
from dspark_cache.cli import verify as verify_main
from tests.support.produce import run_produce
from tests.support import warm


@pytest.fixture(scope="module")
def one_sample_shards(embedded, tmp_path_factory) -> str:
    """More one-sample shards than the loader keeps descriptors open (128)."""
    from dspark_cache.embedded.data import write_sample_data

    root = tmp_path_factory.mktemp("many")
    data = write_sample_data(str(root / "rows.jsonl"), num_rows=170, seed=5)
    out = str(root / "cache")
    assert (
        run_produce(embedded.stock, data, out, "--seq-length", "96", "--shard-size", "1", "--dtype", "fp32")
        == 0
    )
    return out


def _expected(cache_dir: str) -> dict[int, dict[str, torch.Tensor]]:
    return {s["sample_id"]: s for s in dspark_cache.open_cache(cache_dir).samples()}


def _check_batches(loader, expected) -> int:
    seen = 0
    for batch in loader:
        for row, sample_id in enumerate(batch["sample_ids"].tolist()):
            want = expected[sample_id]
            n = want["input_ids"].shape[0]
            assert torch.equal(batch["input_ids"][row, :n], want["input_ids"].long())
            assert torch.equal(batch["target_hidden_states"][row, :n], want["target_hidden_states"])
            seen += 1
    return seen


def test_batch_wider_than_the_descriptor_pool(one_sample_shards, executor):
    expected = _expected(one_sample_shards)
    assert len(expected) > 130
    loader = dspark_cache.build_dataloader(one_sample_shards, batch_size=130, drop_last=True)
    assert _check_batches(loader, expected) == 130 * len(loader)


def test_many_threads_and_epochs_over_many_shards(one_sample_shards, executor):
    expected = _expected(one_sample_shards)
    loader = dspark_cache.build_dataloader(one_sample_shards, batch_size=50, num_workers=3, prefetch=3)
    for _ in range(10):
        assert _check_batches(loader, expected) >= len(expected)


def _edit_index(cache_dir: str, shard_id: int, change) -> None:
    paths = CachePaths(cache_dir)
    index = msgspec.json.decode(open(paths.shard_index(shard_id), "rb").read(), type=ShardIndex)
    change(index)
    with open(paths.shard_index(shard_id), "wb") as handle:
        handle.write(encode_json(index))


def _entry(index: ShardIndex, k: int, **fields) -> None:
    index.samples[k] = msgspec.structs.replace(index.samples[k], **fields)


@pytest.mark.parametrize("delta", [1, -1])
def test_a_wrong_length_in_the_index_names_shard_and_sample(small_cache, tmp_path, executor, delta):
    copy = str(tmp_path / "c")
    shutil.copytree(small_cache, copy)
    victim = dspark_cache.open_cache(copy).shards[1].samples[2]
    _edit_index(copy, 1, lambda index: _entry(index, 2, length=victim.length + delta))
    with pytest.raises(CorruptShardError, match=rf"shard-000001\.idx \(sample {victim.sample_id}\)"):
        list(dspark_cache.build_dataloader(copy, batch_size=4))
    with pytest.raises(CorruptShardError, match=rf"sample {victim.sample_id}"):
        dspark_cache.open_cache(copy)
    assert verify_main([copy]) == 1


def test_a_swapped_sample_id_is_caught_by_the_header(small_cache, tmp_path, executor):
    """The index stays self-consistent (unique ids, exact tiling): only the header disagrees."""
    copy = str(tmp_path / "c")
    shutil.copytree(small_cache, copy)
    index = dspark_cache.open_cache(copy).shards[0]
    a, b = index.samples[0].sample_id, index.samples[1].sample_id

    def swap(index):
        _entry(index, 0, sample_id=b)
        _entry(index, 1, sample_id=a)

    _edit_index(copy, 0, swap)
    with pytest.raises(CorruptShardError, match="header does not match"):
        list(dspark_cache.build_dataloader(copy, batch_size=4, shuffle=False))
    with pytest.raises(CorruptShardError, match="header does not match"):
        list(dspark_cache.open_cache(copy).samples())
    assert verify_main([copy]) == 1


@pytest.mark.parametrize("damage, needle", [
    (lambda index: _entry(index, 1, offset=index.samples[1].offset + 512), "offset"),
    (lambda index: index.samples.pop(1), "offset"),
    (lambda index: index.samples.pop(), "entries are missing"),
    (lambda index: index.samples.insert(1, index.samples[1]), "offset"),
    (lambda index: _entry(index, 0, size=2_000_000_000), "size"),
    (lambda index: _entry(index, 0, size=-5), "size"),
    (lambda index: _entry(index, 0, offset=10**30), "offset"),
    (lambda index: _entry(index, 0, loss_tokens=10**6), "loss_tokens"),
    (lambda index: setattr(index, "shard_id", 7), "belongs to shard 7"),
])
def test_index_damage_is_named(small_cache, tmp_path, damage, needle, capsys):
    copy = str(tmp_path / "c")
    shutil.copytree(small_cache, copy)
    _edit_index(copy, 0, damage)
    with pytest.raises(CorruptShardError, match=needle) as err:
        dspark_cache.open_cache(copy)
    assert os.path.basename(CachePaths(copy).shard_index(0)) in str(err.value)
    with pytest.raises(CorruptShardError, match=needle):
        list(dspark_cache.build_dataloader(copy, batch_size=4))
    assert verify_main([copy, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert [p["shard"] for p in report["corrupt"]] == [0] and needle in report["corrupt"][0]["reason"]


@pytest.mark.parametrize("change, needle", [
    ({"num_shards": 2, "planned_samples": 16, "num_samples": 16}, "published but"),  # consistent, but a lie
    ({"num_shards": 2}, "num_shards"),
    ({"num_shards": -1}, "num_shards"),
    ({"num_shards": 10**9}, "num_shards"),
    ({"dtype": "int4"}, "dtype"),
    ({"target_hidden_dim": 8}, "target_hidden_dim"),
    ({"num_hidden_layers": 3}, "target_layer_ids"),
    ({"hidden_size": 32}, "hidden_size"),
    ({"num_samples": 10**6}, "num_samples"),
    # the loader pads input_ids with it: it must index the embedding
    ({"pad_token_id": 10**6}, "pad_token_id"),
])
def test_manifest_damage_is_named(small_cache, tmp_path, change, needle, capsys):
    copy = str(tmp_path / "c")
    shutil.copytree(small_cache, copy)
    path = CachePaths(copy).manifest
    data = json.load(open(path))
    data.update(change)
    json.dump(data, open(path, "w"))
    with pytest.raises(CacheError, match=needle) as err:
        list(dspark_cache.build_dataloader(copy, batch_size=4))
    assert os.path.basename(path) in str(err.value) or copy in str(err.value)
    with pytest.raises(CacheError, match=needle):
        dspark_cache.open_cache(copy)
    capsys.readouterr()
    assert verify_main([copy]) == 1
    captured = capsys.readouterr()
    assert needle in captured.out + captured.err


HANG_PROBE = r"""
import sys, dspark_cache
from dspark_cache.format.errors import CacheError
from dspark_cache.cli import verify as main
try:
    list(dspark_cache.build_dataloader(sys.argv[1], batch_size=4))
except CacheError as exc:
    print("loader:", exc)
try:
    list(dspark_cache.open_cache(sys.argv[1]).samples())
except CacheError as exc:
    print("open_cache:", exc)
print("verify:", main([sys.argv[1]]))
"""


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "directory"])
def test_special_files_never_hang_or_stream_forever(small_cache, tmp_path, kind):
    copy = str(tmp_path / "c")
    shutil.copytree(small_cache, copy)
    tar = CachePaths(copy).shard_tar(2)
    os.unlink(tar)
    {"fifo": lambda: os.mkfifo(tar), "dev_zero": lambda: os.symlink("/dev/zero", tar),
     "directory": lambda: os.mkdir(tar)}[kind]()
    out = warm.run(
        [sys.executable, "-c", HANG_PROBE, copy], capture_output=True, text=True, timeout=120, code=True
    )
    assert out.returncode == 0, out.stderr
    assert "verify: 1" in out.stdout
    for who in ("loader:", "open_cache:"):
        line = next(line for line in out.stdout.splitlines() if line.startswith(who))
        named = os.path.basename(tar) in line
        assert named and ("not a regular file" in line or "is a directory" in line), line


def test_repair_rebuilds_an_index_when_the_tar_is_intact(small_cache, tmp_path, capsys):
    copy = str(tmp_path / "c")
    shutil.copytree(small_cache, copy)
    original = open(CachePaths(copy).shard_index(3), "rb").read()
    _edit_index(copy, 3, lambda index: _entry(index, 1, length=index.samples[1].length + 1))
    assert verify_main([copy, "--repair"]) == 1
    assert "index rebuilt" in capsys.readouterr().out
    assert open(CachePaths(copy).shard_index(3), "rb").read() == original
    assert verify_main([copy]) == 0


def test_repair_deletes_a_shard_whose_tar_is_damaged(small_cache, tmp_path):
    copy = str(tmp_path / "c")
    shutil.copytree(small_cache, copy)
    paths = CachePaths(copy)
    with open(paths.shard_tar(4), "r+b") as handle:
        handle.seek(6000)
        byte = handle.read(1)
        handle.seek(6000)
        handle.write(bytes([byte[0] ^ 1]))
    assert verify_main([copy, "--repair"]) == 1
    assert not os.path.exists(paths.shard_tar(4)) and not os.path.exists(paths.shard_index(4))


def test_repair_never_deletes_through_a_symlinked_shard_dir(small_cache, tmp_path):
    elsewhere = str(tmp_path / "elsewhere")
    shutil.copytree(CachePaths(small_cache).shards_dir, elsewhere)
    copy = str(tmp_path / "c")
    paths = CachePaths(copy)
    shutil.copytree(small_cache, copy, ignore=shutil.ignore_patterns(os.path.basename(paths.shards_dir)))
    os.symlink(elsewhere, paths.shards_dir)
    with open(os.path.join(elsewhere, os.path.basename(paths.shard_tar(0))), "r+b") as handle:
        handle.seek(6000)
        handle.write(b"\x00\x01")
    before = sorted(os.listdir(elsewhere))
    assert verify_main([copy, "--repair"]) == 2
    assert sorted(os.listdir(elsewhere)) == before


def test_rank_statuses_skip_fifos_and_huge_files(tmp_path):
    from dspark_cache.format.status import MAX_STATUS_BYTES

    paths = CachePaths(str(tmp_path))
    os.makedirs(paths.status_dir)
    os.mkfifo(paths.status(0))
    with open(paths.status(1), "wb") as handle:
        handle.write(b" " * (MAX_STATUS_BYTES + 1))
    done = warm.run([sys.executable, "-c", "import sys; from dspark_cache.format.paths import CachePaths; "
                     "from dspark_cache.format.status import read_rank_statuses; "
                     "print(len(read_rank_statuses(CachePaths(sys.argv[1]))))", str(tmp_path)],
                    code=True, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "0", done.stderr


DEEP = "[" * 100_000 + "]" * 100_000  # past every JSON decoder's depth limit


@pytest.mark.parametrize(
    "where", [attrgetter("manifest"), methodcaller("shard_index", 0)], ids=["manifest", "index"]
)
def test_json_nested_too_deep_is_a_named_error(small_cache, tmp_path, where, capsys):
    copy = str(tmp_path / "c")
    shutil.copytree(small_cache, copy)
    path = where(CachePaths(copy))
    text = open(path).read()
    with open(path, "w") as f:  # the deep value in a field every struct ignores
        f.write(text.replace("{", '{"x": ' + DEEP + ", ", 1))
    with pytest.raises(CacheError, match="nested too deep") as err:
        dspark_cache.open_cache(copy)
    assert os.path.basename(path) in str(err.value)
    with pytest.raises(CacheError, match="nested too deep"):
        list(dspark_cache.build_dataloader(copy, batch_size=4))
    capsys.readouterr()
    assert verify_main([copy]) in (1, 2)
    captured = capsys.readouterr()
    assert "nested too deep" in captured.out + captured.err and "Traceback" not in captured.err


def test_a_heartbeat_or_event_nested_too_deep_is_skipped_like_a_damaged_one(tmp_path):
    from dspark_cache.format.status import read_rank_statuses
    from dspark_cache.tui.eventfeed import decode_events

    paths = CachePaths(str(tmp_path))
    os.makedirs(paths.status_dir)
    with open(paths.status(0), "w") as handle:  # 200 KB: under the heartbeat's size bound
        handle.write('{"x": ' + DEEP + "}")
    assert read_rank_statuses(paths) == []  # a waiting rank and the monitor go on
    good = b'{"time": 1.0, "rank": 0, "kind": "warning", "message": "m"}'
    deep = b'{"x": ' + DEEP.encode() + b', "time": 1.0, "rank": 0, "kind": "warning", "message": "m"}'
    assert [e.message for e in decode_events([deep, good])] == ["m"]


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/fd")
def test_a_reader_dropped_without_close_keeps_no_descriptor(one_sample_shards, executor):
    """A loader built per epoch, or a one-off open_cache, must not hold its shard files until exit:
    each kept up to max_open_files descriptors (256 a test here, over a thousand by the suite's end)."""
    import gc

    before = _open_fds()
    assert sum(1 for _ in dspark_cache.open_cache(one_sample_shards).samples()) > 130
    for _ in range(3):
        loader = dspark_cache.build_dataloader(one_sample_shards, batch_size=130, drop_last=True)
        assert sum(1 for _ in loader) >= 1
    del loader
    gc.collect()
    assert _open_fds() <= before + 2
