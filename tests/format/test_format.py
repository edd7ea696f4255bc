"""Format v1: round trips, alignment, integrity checks, publication, plain WebDataset reads."""

from __future__ import annotations

import json
import os
import shutil
import struct
import tarfile

import pytest
import torch
import webdataset as wds

import dspark_cache
from dspark_cache.format.errors import CacheError, CorruptShardError
from dspark_cache.format.geometry import SampleShape
from dspark_cache.format.paths import CachePaths
from dspark_cache.format.sample import CACHE_DTYPES, is_fp8, sample_metadata, sample_specs
from dspark_cache.format.tar.reader import ShardReader
from dspark_cache.format.tar.writer import ShardWriter, predict_shard_bytes
from dspark_cache.format.wds import decode_dspark_arrays
from dspark_cache.loader.tensors import decode_dspark_sample, sample_to_torch, torch_dtype
from dspark_cache.producer.pipeline.tensors import byte_views


def _tensors(length, k, h, code, seed, stores_last):
    g, dtype = torch.Generator().manual_seed(seed), torch_dtype(code)
    t = {
        "target_hidden_states": torch.randn(length, k * h, generator=g).to(dtype),
        "input_ids": torch.randint(0, 50000, (length,), generator=g, dtype=torch.int32),
        "loss_mask": torch.randint(0, 2, (length,), generator=g, dtype=torch.uint8),
    }
    if stores_last:
        t["target_last_hidden_states"] = torch.randn(length, h, generator=g).to(dtype)
    return t


def _write_shard(root, code, lengths, layer_ids=(1, 2, 3, 4), num_layers=5, h=24):
    paths = CachePaths(str(root))
    paths.ensure_dirs()
    writer = ShardWriter(paths, 0)
    k, stores_last = len(layer_ids), layer_ids[-1] != num_layers - 1
    written = {}
    for sid, length in enumerate(lengths):
        t = _tensors(length, k, h, code, sid, stores_last)
        specs = sample_specs(length, k * h, h, code, stores_last)
        md = sample_metadata(sid, list(layer_ids), num_layers, h)
        writer.append(sid * 3, int(t["loss_mask"].sum()), specs, md, byte_views(t))
        written[sid * 3] = t
    index = writer.publish()
    shape = SampleShape(layer_ids, num_layers, h, code)  # the metadata above names sample ids 0, 1, ...
    assert (
        index.tar_bytes
        == predict_shard_bytes(shape, range(len(lengths)), lengths)
        == os.path.getsize(paths.shard_tar(0))
    )
    return paths, index, written


# FP8 samples also carry scales: their round trips are in test_fp8.py.
@pytest.mark.parametrize("dtype_name", sorted(d for d, code in CACHE_DTYPES.items() if not is_fp8(code)))
@pytest.mark.parametrize("layer_ids", [(1, 2, 3, 4), (-1, 2)], ids=["final-in-ids", "final-apart"])
def test_round_trip_every_dtype(tmp_path, dtype_name, layer_ids):
    code = CACHE_DTYPES[dtype_name]
    paths, index, written = _write_shard(tmp_path, code, [1, 7, 300, 64], layer_ids=layer_ids)
    with ShardReader(paths, 0) as reader:
        reader.verify()
        for entry in index.samples:
            stored = reader.read_sample(entry)  # numpy views tagged with their code: no torch in format
            assert stored["target_hidden_states"].code == code and stored["input_ids"].code == "I32"
            got = sample_to_torch(stored)
            t = written[entry.sample_id]
            assert got["target_hidden_states"].dtype == torch_dtype(code)
            assert torch.equal(got["target_hidden_states"], t["target_hidden_states"])
            # The final state is stored once: as the last H columns, or on its own.
            last = t.get("target_last_hidden_states", t["target_hidden_states"][:, -24:])
            assert torch.equal(got["target_last_hidden_states"], last)
            assert torch.equal(got["input_ids"], t["input_ids"]) and torch.equal(
                got["loss_mask"], t["loss_mask"]
            )


def test_tensor_data_is_page_aligned_and_64_byte_aligned(tmp_path):
    paths, index, _ = _write_shard(tmp_path, "BF16", [5, 33, 129], h=20)
    with open(paths.shard_tar(0), "rb") as handle:
        data = handle.read()
    for entry in index.samples:
        (hlen,) = struct.unpack_from("<Q", data, entry.offset)
        base = entry.offset + 8 + hlen
        assert base % 4096 == 0
        header = json.loads(data[entry.offset + 8 : base])
        header.pop("__metadata__")
        real = {k: v for k, v in header.items() if not k.startswith("__pad")}
        assert len(real) == 3 and all((base + v["data_offsets"][0]) % 64 == 0 for v in real.values())


def test_flipped_byte_is_named(tmp_path):
    paths, index, _ = _write_shard(tmp_path, "BF16", [50, 60])
    victim = index.samples[1]
    with open(paths.shard_tar(0), "r+b") as handle:
        handle.seek(victim.offset + victim.size - 10)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0x01]))
    with ShardReader(paths, 0) as reader:
        reader.read_sample(index.samples[0])  # the untouched sample still reads
        with pytest.raises(CorruptShardError, match=r"shard-000000\.tar \(sample 3\)"):
            reader.read_sample(victim)
        with pytest.raises(CorruptShardError, match="checksum"):
            reader.verify()


def test_truncated_shard_is_named(tmp_path):
    paths, _, _ = _write_shard(tmp_path, "BF16", [50, 60])
    with open(paths.shard_tar(0), "r+b") as handle:
        handle.truncate(os.path.getsize(paths.shard_tar(0)) - 700)
    with pytest.raises(CorruptShardError, match=r"shard-000000\.tar.*truncated"):
        ShardReader(paths, 0)


def test_partial_files_are_never_read(small_cache, tmp_path):
    cache_dir = tmp_path / "c"
    shutil.copytree(small_cache, cache_dir)
    paths = CachePaths(str(cache_dir))
    n = len(dspark_cache.open_cache(str(cache_dir)))
    # A leftover .partial (say, from a crash) next to published shards is invisible to readers.
    with open(paths.shard_partial(99), "wb") as handle:
        handle.write(b"garbage" * 100)
    assert len(dspark_cache.open_cache(str(cache_dir))) == n
    # A shard without its index (killed between rename and index) is not published either,
    # and a complete manifest missing one then refuses to open, naming the shard.
    os.unlink(paths.shard_index(2))
    with pytest.raises(CacheError, match=r"shards \[2\]"):
        dspark_cache.open_cache(str(cache_dir))


def test_plain_webdataset_reads_our_shards(small_cache):
    cache = dspark_cache.open_cache(small_cache)
    expected = {s["sample_id"]: s for s in cache.samples()}
    urls = [cache.paths.shard_tar(i) for i in range(cache.manifest.num_shards)]
    seen = 0
    for sample in wds.WebDataset(urls, shardshuffle=False).decode(decode_dspark_sample):
        got = sample["safetensors"]
        want = expected[got["sample_id"]]
        assert sample["__key__"] == f"{got['sample_id']:010d}"
        for key in ("input_ids", "loss_mask", "target_hidden_states", "target_last_hidden_states"):
            assert torch.equal(got[key], want[key])
        seen += 1
    assert seen == len(expected)
    # The torch-free handler gives the same bytes as numpy views tagged with their dtype code.
    for sample in wds.WebDataset(urls[:1], shardshuffle=False).decode(decode_dspark_arrays):
        got = sample["safetensors"]
        want = expected[got["sample_id"]]
        codes = {"input_ids": "I32", "loss_mask": "U8"}
        for key in ("input_ids", "loss_mask", "target_hidden_states", "target_last_hidden_states"):
            assert got[key].code == codes.get(key, CACHE_DTYPES[cache.manifest.dtype])
            stored = (
                want[key].to(torch.int32 if key == "input_ids" else torch.uint8)
                if key in codes
                else want[key]
            )
            assert got[key].array.tobytes() == stored.contiguous().view(torch.uint8).numpy().tobytes()
    # And the shard is a normal tar to the standard library too.
    with tarfile.open(urls[0]) as tar:
        assert all(m.name.endswith(".safetensors") and "." not in m.name[:-12] for m in tar.getmembers())


def test_atomic_writes_from_many_threads_never_collide(tmp_path):
    # The producer's heartbeat thread and main loop both rewrite status/rank-N.json; with one
    # temporary name per process, one thread's rename took the other's file away (ENOENT).
    import threading

    from dspark_cache.format.atomic import atomic_write_bytes

    path = str(tmp_path / "status.json")
    payloads = [json.dumps({"writer": i, "pad": "x" * 4096}).encode() for i in range(8)]
    errors: list[BaseException] = []

    def writer(data: bytes) -> None:
        try:
            for _ in range(200):
                atomic_write_bytes(path, data, durable=False)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(p,)) for p in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    with open(path, "rb") as handle:
        assert handle.read() in payloads  # whole, never a mix of two writers
    assert os.listdir(tmp_path) == ["status.json"]  # no temporary left behind


@pytest.mark.parametrize("layer_ids, num_layers", [((1, 8, 14, 20, 27), 28), ((1, 2), 8)])
def test_reader_headers_equal_the_writers(layer_ids, num_layers):
    """Readers check each sample's header against the one derived from its index entry."""
    import random

    from dspark_cache.format.geometry import SampleShape
    from dspark_cache.format.sample import layout_payload

    rng = random.Random(0)
    for dtype in ("BF16", "F32"):
        shape = SampleShape(layer_ids, num_layers, 1024, dtype)
        for _ in range(200):
            length, sample_id, offset = (
                rng.randint(1, 5000),
                rng.randint(0, 10**9),
                rng.randint(1, 10**7) * 512,
            )
            want = layout_payload(shape.specs(length), shape.metadata(sample_id), offset).header
            assert shape.header(length, sample_id, offset) == want


def test_shard_ids_past_a_million_are_listed(tmp_path):
    paths = CachePaths(str(tmp_path))
    os.makedirs(paths.shards_dir)
    for shard_id in (5, 1_234_567):
        open(paths.shard_index(shard_id), "w").close()
    assert paths.indexed_shard_ids() == [5, 1_234_567]


# sha256[:16] of tar + index, as written before the format stopped importing torch (v0.2.0):
# the buffers-in writer must keep every byte (headers, padding, fills) identical.
GOLDEN = {("bf16", (1, 2, 3, 4)): "f97af11857d112f7", ("bf16", (-1, 2)): "f028efe267ec0131",
          ("fp16", (1, 2, 3, 4)): "77f12aae0c53e564", ("fp16", (-1, 2)): "6aa97d618f11debc",
          ("fp32", (1, 2, 3, 4)): "6fb32bc26abdcdfd", ("fp32", (-1, 2)): "d488ef27ae4b814d"}


@pytest.mark.parametrize("dtype_name, layer_ids", sorted(GOLDEN))
def test_shard_bytes_equal_the_golden_ones(tmp_path, dtype_name, layer_ids):
    import hashlib

    import numpy as np

    paths = CachePaths(str(tmp_path))
    paths.ensure_dirs()
    writer = ShardWriter(paths, 0, durable=False)
    k, h, num_layers, code = len(layer_ids), 24, 5, CACHE_DTYPES[dtype_name]
    stores_last = layer_ids[-1] != num_layers - 1
    rng = np.random.default_rng(7)
    for sid, n in enumerate([1, 7, 300, 64, 2]):
        t = {"target_hidden_states": torch.from_numpy(rng.standard_normal((n, k * h), dtype=np.float32)),
             "input_ids": torch.from_numpy(rng.integers(0, 50000, n, dtype=np.int32)),
             "loss_mask": torch.from_numpy(rng.integers(0, 2, n, dtype=np.uint8))}
        if stores_last:
            t["target_last_hidden_states"] = torch.from_numpy(rng.standard_normal((n, h), dtype=np.float32))
        for key in ("target_hidden_states", "target_last_hidden_states"):
            if key in t:
                t[key] = t[key].to(torch_dtype(code))
        writer.append(sid, n, sample_specs(n, k * h, h, code, stores_last),
                      sample_metadata(sid, list(layer_ids), num_layers, h), byte_views(t))
    writer.publish()
    with open(paths.shard_tar(0), "rb") as tar, open(paths.shard_index(0), "rb") as idx:
        # The index gained cache_id (empty for a writer given none) after these hashes were taken: the
        # bytes without it are the same, so caches written before it read as they did.
        digest = hashlib.sha256(tar.read() + idx.read().replace(b',"cache_id":""', b"")).hexdigest()[:16]
    assert digest == GOLDEN[(dtype_name, layer_ids)]
