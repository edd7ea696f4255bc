"""Compressed caches (``--compression zstd``, issue 42): every reader gives the uncompressed cache's
samples bit for bit, from fewer bytes; the codec is recorded, kept on resume and checked like the rest."""

from __future__ import annotations

import functools
import json
import os
import shlex
import shutil

import numpy as np
import pytest
import torch
import webdataset as wds

import dspark_cache
from dspark_cache.cli import verify as verify_main
from dspark_cache.format.codec import CodecError, decode_blob, decode_data
from dspark_cache.format.manifest import read_manifest
from dspark_cache.format.paths import CachePaths
from dspark_cache.format.schema import FORMAT_COMPRESSED, FORMAT_FP8, FORMAT_ID
from dspark_cache.format.tar.reader import ShardReader, load_shard_index
from dspark_cache.format.wds import decode_dspark_arrays, decode_wids_sample
from dspark_cache.loader.tensors import sample_to_torch
from dspark_cache.verify import verify_cache
from tests.support.proc import run
from tests.support.produce import run_produce
from tests.support.scripts import convert as convert_main

ARGS = ("--seq-length", "512", "--shard-size", "8", "--batch-size", "4")
ZSTD = ("--compression", "zstd")
KEYS = ("input_ids", "loss_mask", "target_hidden_states", "target_last_hidden_states")


@pytest.fixture(params=[(), ("--dtype", "fp8"), ("--dtype", "fp32", "--target-layer-ids", "1", "3")],
                ids=["bf16", "fp8", "fp32-final-apart"])
def pair(request, produced) -> tuple[str, str]:
    """(uncompressed, compressed) caches of the same rows and settings."""
    return produced(*ARGS, *request.param), produced(*ARGS, *request.param, *ZSTD)


def _tar_bytes(root: str) -> int:
    paths = CachePaths(root)
    return sum(os.path.getsize(paths.shard_tar(i)) for i in paths.indexed_shard_ids())


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit: same dtype, shape and bytes."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _samples(root: str, **options) -> dict[int, dict]:
    with dspark_cache.open_cache(root, **options) as cache:
        return {s["sample_id"]: s for s in cache.samples()}


def _assert_same_samples(got: dict[int, dict], want: dict[int, dict], keys=KEYS) -> None:
    assert got.keys() == want.keys() and got
    for sid in want:
        for key in keys:
            assert _same(got[sid][key], want[sid][key]), (sid, key)


def test_manifest_records_the_codec_and_the_shards_shrink(pair):
    plain, packed = pair
    m, p = read_manifest(plain), read_manifest(packed)
    assert (m.compression, m.compression_level) == ("none", 0) and m.format_version in (FORMAT_ID, FORMAT_FP8)
    assert (p.compression, p.compression_level, p.format_version) == ("zstd", 1, FORMAT_COMPRESSED)
    assert p.num_samples == m.num_samples and p.planned_bytes == m.planned_bytes  # the plan is the same
    # bf16 loses most (its high bytes compress, the low ones barely); fp32's two low planes are noise
    assert _tar_bytes(packed) < (0.8 if m.dtype == "bf16" else 0.95) * _tar_bytes(plain)


def test_open_cache_reads_the_same_samples(pair):
    plain, packed = pair
    _assert_same_samples(_samples(packed), _samples(plain))
    if read_manifest(plain).dtype == "fp8":  # raw FP8 codes and scales too
        keys = (*KEYS, "target_hidden_states_scale", "target_last_hidden_states_scale")
        _assert_same_samples(_samples(packed, dtype="raw"), _samples(plain, dtype="raw"), keys)


def _batches(root: str, **options) -> list[dict[str, torch.Tensor]]:
    loader = dspark_cache.build_dataloader(root, 4, shuffle=True, seed=3, pin_memory=False, **options)
    try:
        return [{k: v.clone() for k, v in batch.items()} for batch in loader]
    finally:
        loader.close()


@pytest.mark.parametrize("options", [{}, {"pad_to": "longest", "verify": "always"}, {"layers": True},
                                     {"dtype": "raw"}], ids=["default", "longest", "layer-subset", "raw"])
def test_loader_batches_are_the_same(pair, executor, options):
    plain, packed = pair
    options = dict(options)
    if options.pop("layers", False):  # a subset, in another order than stored
        options["target_layer_ids"] = list(reversed(read_manifest(plain).target_layer_ids))[:2]
    if options.get("dtype") == "raw" and read_manifest(plain).dtype != "fp8":
        options.pop("dtype")
    want, got = _batches(plain, **options), _batches(packed, **options)
    assert len(got) == len(want) > 0
    for a, b in zip(got, want):
        assert a.keys() == b.keys()
        for key in a:
            assert _same(a[key], b[key]), key


def test_nemo_drop_in_gives_the_same_run(produced):
    from dspark_cache import nemo as dn

    def run(root: str) -> list[dict[str, torch.Tensor]]:
        torch.manual_seed(7)
        loader = dn.build_cached_dspark_dataloader(cache_dir=root, batch_size=5, shuffle=True)
        return [{k: v.clone() for k, v in batch.items()} for _ in range(2) for batch in loader]

    plain, packed = produced(*ARGS), produced(*ARGS, *ZSTD)
    ours, want = run(packed), run(plain)
    assert len(ours) == len(want) > 0
    assert all(_same(a[k], b[k]) for a, b in zip(ours, want) for k in KEYS)


def test_webdataset_and_wids_decode_compressed_samples(pair, tmp_path, monkeypatch):
    plain, packed = pair
    want = _samples(plain)
    vocab = read_manifest(packed).target_vocab_size
    paths = CachePaths(packed)
    urls = [paths.shard_tar(i) for i in paths.indexed_shard_ids()]
    handler = functools.partial(decode_dspark_arrays, vocab_size=vocab)
    got = {}
    for sample in wds.WebDataset(urls, shardshuffle=False).decode(handler):
        decoded = sample["safetensors"]
        got[decoded["sample_id"]] = sample_to_torch({k: decoded[k] for k in KEYS})
    assert got.keys() == want.keys()
    for sid, sample in got.items():
        for key in KEYS:
            assert torch.equal(sample[key].to(want[sid][key].dtype), want[sid][key]), (sid, key)
    wids = pytest.importorskip("wids")
    monkeypatch.setenv("WIDS_CACHE", str(tmp_path / "wids-cache"))
    dataset = wids.ShardListDataset(paths.wids_index, cache_dir=paths.shards_dir,
                                    transformations=[decode_wids_sample])
    first = dataset[0][".safetensors"]
    assert torch.equal(sample_to_torch({"h": first["target_hidden_states"]})["h"],
                       want[first["sample_id"]]["target_hidden_states"])
    dataset.close()


def test_convert_both_ways_keeps_every_bit(produced, tmp_path, capsys):
    plain, packed = produced(*ARGS), produced(*ARGS, *ZSTD)
    exported, back = str(tmp_path / "nemo"), str(tmp_path / "back")
    assert convert_main([packed, exported, "--to", "nemo", "--quiet"]) == 0
    reference = str(tmp_path / "nemo-ref")
    assert convert_main([plain, reference, "--to", "nemo", "--quiet"]) == 0
    for name in sorted(os.listdir(reference)):  # a compressed source exports NeMo's bytes exactly
        if name.endswith(".safetensors"):
            got, want = (open(os.path.join(d, name), "rb").read() for d in (exported, reference))
            assert got == want, name
    assert convert_main([exported, back, "--to", "dspark", "--compression", "zstd",
                         "--compression-level", "3", "--quiet"]) == 0
    m = read_manifest(back)
    assert (m.compression, m.compression_level) == ("zstd", 3) and verify_cache(back).ok
    renumbered = sorted(_samples(plain).values(), key=lambda s: s["sample_id"])
    for position, sample in enumerate(sorted(_samples(back).values(), key=lambda s: s["sample_id"])):
        for key in KEYS:
            assert _same(sample[key], renumbered[position][key]), key
    capsys.readouterr()
    assert convert_main([packed, str(tmp_path / "x"), "--to", "nemo", "--compression", "zstd"]) == 2
    assert "--to dspark" in capsys.readouterr().err


def test_verify_checks_checksums_without_decoding(produced, monkeypatch):
    packed = produced(*ARGS, *ZSTD)
    paths = CachePaths(packed)
    manifest = read_manifest(packed)
    from dspark_cache.format.geometry import SampleShape

    def refuse(*args, **kwargs):
        raise AssertionError("decoded")

    monkeypatch.setattr("dspark_cache.format.geometry.decode_data", refuse)
    for shard in paths.indexed_shard_ids():
        with ShardReader(paths, shard, load_shard_index(paths, shard, manifest),
                         SampleShape.from_manifest(manifest)) as reader:
            reader.verify()  # every checksum and header, no frame decoded


def test_a_damaged_frame_is_a_corrupt_sample_and_repair_rebuilds_a_damaged_index(produced, tmp_path, capsys):
    copy = shutil.copytree(produced(*ARGS, *ZSTD), str(tmp_path / "c"))
    capsys.readouterr()
    paths = CachePaths(copy)
    original = json.load(open(paths.shard_index(1)))
    index = json.load(open(paths.shard_index(1)))
    index["samples"][0][1] += 1  # a wrong length: rebuilt from the tar (loss tokens from the decoded mask)
    json.dump(index, open(paths.shard_index(1), "w"))
    entry = load_shard_index(paths, 0).samples[1]
    with open(paths.shard_tar(0), "r+b") as handle:  # a flipped byte in the middle of a frame
        handle.seek(entry.offset + entry.size // 2)
        byte = handle.read(1)[0]
        handle.seek(entry.offset + entry.size // 2)
        handle.write(bytes([byte ^ 0x10]))
    assert verify_main([copy, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    corrupt = {p["shard"]: p for p in report["corrupt"]}
    assert set(corrupt) == {0, 1}
    assert corrupt[0]["sample"] == entry.sample_id and "checksum mismatch" in corrupt[0]["reason"]
    with pytest.raises(dspark_cache.CorruptShardError, match=f"sample {entry.sample_id}"):
        with ShardReader(paths, 0) as reader:
            reader.read_sample(entry)
    assert verify_main([copy, "--repair"]) == 1
    assert json.load(open(paths.shard_index(1))) == original  # rebuilt from the tar, loss_tokens included
    assert not os.path.exists(paths.shard_index(0))


def test_resume_keeps_the_codec_and_refuses_another(embedded, tmp_path, capsys):
    out = str(tmp_path / "cache")
    assert run_produce(embedded.stock, embedded.data, out, *ARGS, *ZSTD) == 0
    paths = CachePaths(out)
    manifest = open(paths.manifest).read()
    for other in ((), ("--compression", "zstd", "--compression-level", "5")):
        capsys.readouterr()
        assert run_produce(embedded.stock, embedded.data, out, *ARGS, *other) == 1
        err = capsys.readouterr().err
        assert "different configuration" in err and "compression" in err and "--overwrite" in err
        assert open(paths.manifest).read() == manifest
    # A shard lost: the resume recomputes it alone, to the same bytes.
    tar = open(paths.shard_tar(2), "rb").read()
    os.unlink(paths.shard_index(2))
    os.unlink(paths.shard_tar(2))
    stamps = {i: os.stat(paths.shard_tar(i)).st_mtime_ns for i in paths.indexed_shard_ids()}
    assert run_produce(embedded.stock, embedded.data, out, *ARGS, *ZSTD) == 0
    assert open(paths.shard_tar(2), "rb").read() == tar
    assert all(os.stat(paths.shard_tar(i)).st_mtime_ns == t for i, t in stamps.items())
    assert verify_cache(out).ok


@pytest.mark.parametrize("argv, needle", [
    (("--compression-level", "3"), "needs --compression zstd"),
    (("--compression", "zstd", "--compression-level", "40"), "is not in [-7, 19]"),
])
def test_bad_codec_settings_are_usage_errors(embedded, tmp_path, capsys, argv, needle):
    assert run_produce(embedded.stock, embedded.data, str(tmp_path / "c"), *argv) == 2
    assert needle in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "c")


# -- the codec on crafted frames: refused before anything is allocated from them -------------------


def _a_sample(produced) -> tuple[bytes, int, object, int]:
    """A stored compressed sample's blob, its header's length, the cache's shape and the sample's length."""
    from dspark_cache.format.geometry import SampleShape

    packed = produced(*ARGS, *ZSTD)
    paths, manifest = CachePaths(packed), read_manifest(packed)
    entry = load_shard_index(paths, 0, manifest).samples[-1]
    with ShardReader(paths, 0, load_shard_index(paths, 0, manifest)) as reader:
        blob = bytes(reader.read_blob(entry))
    shape = SampleShape.from_manifest(manifest)
    header = shape.header_size(entry.length, entry.sample_id, entry.offset, entry.size)
    return blob, header, shape, entry.length


def _frame(data: bytes, *, size: bool = True, checksum: bool = True) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor(level=1, write_content_size=size, write_checksum=checksum).compress(data)


def _decode(shape, length: int, frame: bytes) -> None:
    out = np.empty(shape.data_size(length), dtype=np.uint8)
    decode_data(frame, shape.placed(length), shape.itemsizes(length), out)


def test_crafted_frames_are_refused_in_bounded_memory(produced):
    import resource

    blob, header, shape, length = _a_sample(produced)
    frame, size = blob[header:], shape.data_size(length)
    middle = len(frame) // 2
    _decode(shape, length, frame)  # the real one decodes
    import zstandard

    packer = zstandard.ZstdCompressor(level=1, write_checksum=True).compressobj(size=1 << 28)
    chunk = bytes(1 << 20)  # 256 MiB of zeros in ~8 KiB, made without holding them: declares its size
    bomb = b"".join(packer.compress(chunk) for _ in range(256)) + packer.flush()
    cases = {
        "declares another size": (bomb, "declares 268435456 bytes"),
        "declares no size": (_frame(bytes(size), size=False), "declares no size"),
        "no content checksum": (_frame(bytes(size), checksum=False), "no content checksum"),
        "not zstd": (os.urandom(len(frame)), "not a zstd frame"),
        "one byte short": (_frame(bytes(size - 1)), f"declares {size - 1} bytes"),
        "trailing bytes": (frame + b"\0" * 7, "does not decode"),
        "damaged inside": (frame[:middle] + bytes([frame[middle] ^ 1]) + frame[middle + 1 :],
                           "does not decode"),
    }
    # The size field patched to the right value on a frame of fewer bytes: zstd refuses it as it decodes.
    short = bytearray(_frame(bytes(size - 8)))
    assert short[4] >> 6 == 2 and not short[4] & 3  # a 4-byte content size field, no dictionary id
    at = 5 + (0 if short[4] & 0x20 else 1)  # after the window byte, absent from a single-segment frame
    short[at : at + 4] = size.to_bytes(4, "little")
    cases["decodes short"] = (bytes(short), "does not decode")
    limit = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for name, (bad, needle) in cases.items():
        with pytest.raises(CodecError, match=needle):
            _decode(shape, length, bad)
        with pytest.raises(ValueError):  # the reader without a shape: bounded by the blob's own header
            decode_blob(blob[:header] + bad)
    # Nothing near the bomb's 256 MiB was ever allocated (resident memory grew by far less).
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - limit < 64 << 10  # KiB


def test_a_shapeless_reader_bounds_what_a_header_declares(produced):
    """A plain WebDataset reader has no manifest: a blob whose header declares more tensor bytes than
    64x its size is refused before its frame is read."""
    blob, header, shape, length = _a_sample(produced)
    meta = json.loads(blob[8:header])
    rows = 1 << 28  # the last tensor (the loss mask, one byte a token) made huge: the tensors still tile
    meta["loss_mask"]["shape"] = [rows]
    meta["loss_mask"]["data_offsets"][1] = meta["loss_mask"]["data_offsets"][0] + rows
    text = json.dumps(meta).encode()
    forged = len(text).to_bytes(8, "little") + text + blob[header:]
    with pytest.raises(CodecError, match="more than 64x"):
        decode_blob(forged)
    with pytest.raises(dspark_cache.CorruptShardError, match="x.safetensors"):
        decode_dspark_arrays("x.safetensors", forged)


def test_monitor_projects_a_compressed_cache_from_its_shards(produced, tmp_path, capsys):
    """The plan's bytes are the uncompressed size; the monitor projects a compressed cache's total from
    what its published shards take a token, so a half-written cache shows about its real total."""
    import re

    from dspark_cache.cli import monitor as monitor_main

    packed = produced(*ARGS, *ZSTD)
    total = _tar_bytes(packed)
    copy = shutil.copytree(packed, str(tmp_path / "c"))
    paths = CachePaths(copy)
    for shard in (1, 3, 5):  # a run that has published some shards
        os.unlink(paths.shard_index(shard))
        os.unlink(paths.shard_tar(shard))
    manifest = json.load(open(paths.manifest))
    manifest["complete"] = False
    json.dump(manifest, open(paths.manifest, "w"))
    capsys.readouterr()
    monitor_main([copy, "--once"])
    text = capsys.readouterr().out
    found = re.search(r"of ~([\d.]+) MB projected", text)
    assert found, text
    assert abs(float(found.group(1)) * 1e6 - total) < 0.1 * total  # the plan's own bytes are 1.3x off
    assert manifest["planned_bytes"] > 1.2 * total


def test_compressed_manifests_are_marked_and_checked(produced):
    """A compressed cache says dspark-wds/4, which older readers refuse with "upgrade"; an edited
    manifest whose codec, level and format disagree is refused naming the field."""
    import msgspec

    from dspark_cache.format.schema import decode_manifest
    from dspark_cache.format.validate import manifest_problems

    raw = json.loads(open(CachePaths(produced(*ARGS, *ZSTD)).manifest).read())
    assert raw["format_version"] == FORMAT_COMPRESSED == "dspark-wds/4"
    older = dict(raw, format_version=FORMAT_ID)
    with pytest.raises(msgspec.DecodeError, match="compression 'zstd' format 'dspark-wds/2' cannot hold"):
        decode_manifest(json.dumps(older).encode(), "m")
    for change, needle in (({"compression": "none"}, "compression_level 1 is not 0"),
                           ({"compression": "none", "compression_level": 0}, "format_version 'dspark-wds/4'"),
                           ({"compression": "lz4"}, "compression 'lz4' is not one of"),
                           ({"compression_level": 40}, "compression_level 40 is not in")):
        problems = list(manifest_problems(decode_manifest(json.dumps(dict(raw, **change)).encode(), "m")))
        assert any(needle in p for p in problems), (change, problems)


def test_a_compressed_cache_on_object_storage_reads_the_same_from_fewer_bytes(produced, s3_bucket, s3_env,
                                                                            tmp_path):
    """Uploaded to a real S3-compatible server (moto): the loader over s3:// hands out the uncompressed
    local cache's batches, and the node's copy of the tars (what was downloaded) is the compressed size."""
    from tests.support.remote import upload_cache

    plain, packed = produced(*ARGS), produced(*ARGS, *ZSTD)
    url = f"{s3_bucket}/zstd/cache"
    upload_cache(packed, url)
    node = tmp_path / "node"
    want = _batches(plain, num_workers=2)
    loader = dspark_cache.build_dataloader(url, 4, shuffle=True, seed=3, pin_memory=False, num_workers=2,
                                           local_cache_dir=str(node))
    try:
        got = [{k: v.clone() for k, v in batch.items()} for batch in loader]
        assert loader.cache.backing.downloads == len(CachePaths(packed).indexed_shard_ids())
    finally:
        loader.close()
    assert len(got) == len(want) > 0
    assert all(_same(a[k], b[k]) for a, b in zip(got, want) for k in a)
    downloaded = sum(p.stat().st_size for p in node.rglob("shard-*.tar") if p.parent.name == "shards")
    assert downloaded == _tar_bytes(packed) < 0.8 * _tar_bytes(plain)


def test_verifys_command_resumes_a_compressed_cache_with_its_codec(produced, tmp_path, capsys):
    """The dspark-produce command dspark-verify prints for a damaged compressed cache keeps its codec:
    run as printed, it recomputes the lost shard instead of being refused as another configuration."""
    copy = shutil.copytree(produced(*ARGS, *ZSTD), str(tmp_path / "c"))
    paths = CachePaths(copy)
    with open(paths.shard_tar(0), "r+b") as handle:
        handle.truncate(1000)
    capsys.readouterr()
    assert verify_main([copy, "--repair"]) == 1
    capsys.readouterr()
    assert verify_main([copy, "--json"]) == 1
    command = shlex.split(json.loads(capsys.readouterr().out)["produce_command"])
    assert command[command.index("--compression") + 1] == "zstd", command
    done = run(command, timeout=600)
    assert done.returncode == 0, done.stderr
    assert verify_main([copy]) == 0
    assert read_manifest(copy).compression == "zstd"
