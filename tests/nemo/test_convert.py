"""dspark-convert: NeMo's layout byte for byte, real tokens back, partial sources, SIGKILL, resume."""

from __future__ import annotations

import json
import os
import shutil
import signal

import pytest
import torch
from safetensors.torch import save
from transformers import AutoConfig

import dspark_cache
from dspark_cache.format.paths import CachePaths
from dspark_cache.format.sample import decode_payload
from dspark_cache.nemo import calls, nemo_format
from dspark_cache.nemo.convert import convert_to_dspark, convert_to_nemo
from tests.support.scripts import convert as main
from dspark_cache.nemo.convert.stfile import header_bytes
from dspark_cache.verify import verify_cache
from tests.support.convert_fixture import write_tiny_nemo
from tests.support.nemo_fixture import write_nemo_cache
from tests.support.proc import BIN, run
from tests.support.remote import KEYS as CACHE_KEYS

KEYS = ("input_ids", "loss_mask", "target_hidden_states", "target_last_hidden_states")
P = 7  # the tiny caches' pad id
# Rows of 8 tokens (pad = 7) and their masks; what each teaches is in test_real_lengths.
TINY_IDS = [[5, 6, 9, P, P, P, P, P], [5, 6, P, P, P, P, P, P], [5, 6, 9, 9, 9, 9, 9, 9], [P] * 8,
            [5, P, 9, P, P, P, P, P]]
TINY_MASKS = [[0, 1, 1, 0, 0, 0, 0, 0], [0, 1, 1, 0, 0, 0, 0, 0], [0, 1, 1, 1, 1, 1, 1, 1], [0] * 8,
              [0, 1, 1, 0, 0, 0, 0, 0]]


def _convert(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([*argv, "--quiet"])
    out, err = capsys.readouterr()
    return code, out, err


def _files(root: str) -> dict[str, bytes]:
    out = {}
    for base, _, names in os.walk(root):
        for name in names:
            with open(os.path.join(base, name), "rb") as handle:
                out[os.path.relpath(os.path.join(base, name), root)] = handle.read()
    return out


def _shard_files(root: str) -> dict[str, bytes | dict]:
    """The shard files, each index decoded without its ``cache_id`` (every cache draws its own)."""
    paths = CachePaths(root)
    indexes = {os.path.relpath(paths.shard_index(i), root) for i in paths.indexed_shard_ids()}
    shards = os.path.relpath(paths.shards_dir, root)
    out: dict[str, bytes | dict] = {}
    for name, data in _files(root).items():
        if name in indexes:
            out[name] = {k: v for k, v in json.loads(data).items() if k != "cache_id"}
        elif name.startswith(shards):
            out[name] = data
    return out


def _weights(root: str) -> bytes:
    with open(CachePaths(root).target_weights, "rb") as handle:
        return handle.read()


def _assert_same_as_padded(dst: str, source_samples: list[dict], renumbered: bool = True) -> None:
    """Our cache ``dst`` holds ``source_samples`` in order, exactly (ids dense from 0 if renumbered)."""
    cache = dspark_cache.open_cache(dst)
    got = list(cache.samples())
    assert len(got) == len(source_samples)
    for position, (a, b) in enumerate(zip(got, source_samples)):
        assert a["sample_id"] == (position if renumbered else b["sample_id"])
        for key in KEYS:
            assert torch.equal(a[key], b[key]), (position, key)
            assert a[key].dtype == b[key].dtype


@pytest.fixture(scope="module")
def exported(small_cache, tmp_path_factory) -> str:
    dst = str(tmp_path_factory.mktemp("export") / "nemo")
    result = convert_to_nemo(small_cache, dst, shard_size=5, progress=None)
    assert result.samples == len(dspark_cache.open_cache(small_cache))
    return dst


def test_streamed_header_is_save_files():
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        tensors = {
            "input_ids": torch.zeros(3, 5, dtype=torch.int64),
            "loss_mask": torch.ones(3, 5, dtype=torch.int64),
            "target_hidden_states": torch.zeros(3, 5, 12, dtype=dtype),
            "target_last_hidden_states": torch.zeros(3, 5, 4, dtype=dtype),
        }
        header, _ = header_bytes([(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()])
        assert save(tensors)[: len(header)] == header, dtype


def test_export_is_nemos_layout_byte_for_byte(small_cache, exported, embedded, tmp_path):
    """The export equals what NeMo's writer (save_file + json.dump) makes of the same padded rows."""
    reference = write_nemo_cache(small_cache, str(tmp_path / "ref"), shard_size=5)
    assert _files(exported) == _files(reference)
    manifest = calls.read_manifest(exported)
    assert set(manifest) == {*nemo_format.MANIFEST_FIELDS, "format_version", "complete"}
    assert manifest["format_version"] == 1 and manifest["complete"] is True
    # NeMo's consumer: contiguous shards, complete, and the recipe's manifest checks for this target.
    dataset = nemo_format.NemoCacheDataset(exported)
    assert len(dataset) == manifest["num_samples"] == len(dspark_cache.open_cache(small_cache))
    config = AutoConfig.from_pretrained(embedded.stock)
    calls.validate_cached_dspark_manifest(exported, manifest, config, manifest["target_layer_ids"],
                                          target_model=embedded.stock, target_model_type=config.model_type,
                                          seq_length=512, compute_dtype=torch.bfloat16)
    row = dataset[len(dataset) - 1]
    assert [row[k].dtype for k in KEYS[:2]] == [torch.int64, torch.int64]
    assert row["target_hidden_states"].shape == (512, manifest["target_hidden_dim"])


def test_round_trip_dspark_nemo_dspark(small_cache, exported, tmp_path, capsys):
    back = str(tmp_path / "back")
    code, out, err = _convert(capsys, exported, back, "--to", "dspark")
    assert code == 0, err
    assert "0 samples with an ambiguous length" in out and "0 rows skipped" in out
    assert "(from the tokenizer in " in out  # the manifest's target_model is a local directory
    original = dspark_cache.open_cache(small_cache)
    in_id_order = sorted(original.samples(), key=lambda s: s["sample_id"])
    assert [s["sample_id"] for s in in_id_order] != list(range(len(original)))  # the source has gaps
    _assert_same_as_padded(back, in_id_order)  # ids renumbered densely: 0..n-1
    a, b = original.manifest, dspark_cache.open_cache(back).manifest
    for name in nemo_format.MANIFEST_FIELDS:
        if name != "shard_size":
            assert getattr(a, name) == getattr(b, name), name
    assert (b.shard_size, b.num_shards, b.compute_dtype) == (5, -(-len(original) // 5), "")
    assert b.pad_token_id == a.pad_token_id
    assert b.planned_tokens == a.planned_tokens and b.planned_loss_tokens == a.planned_loss_tokens
    assert verify_cache(back).ok  # checksums as the producer computes them
    assert _weights(back) == _weights(small_cache)


def test_import_strips_padding_and_keeps_numbering(tmp_path, capsys):
    """NeMo stores the target's outputs at pad positions: only the real tokens come back."""
    src, dst = str(tmp_path / "nemo"), str(tmp_path / "ours")
    full = write_tiny_nemo(src, TINY_IDS, TINY_MASKS, shard_size=2)
    code, out, err = _convert(capsys, src, dst, "--to", "dspark", "--pad-token-id", str(P))
    assert code == 0, err
    assert "1 rows skipped (all padding)" in out
    cache = dspark_cache.open_cache(dst)
    lengths = {0: 3, 1: 3, 2: 8, 4: 3}  # row 3 is all padding: skipped, the others keep their NeMo index
    assert cache.sample_ids == sorted(lengths)
    for sample in cache.samples():
        i, n = sample["sample_id"], lengths[sample["sample_id"]]
        assert torch.equal(sample["input_ids"], full["input_ids"][i, :n].int())
        assert torch.equal(sample["loss_mask"], full["loss_mask"][i, :n].to(torch.uint8))
        assert torch.equal(sample["target_hidden_states"], full["target_hidden_states"][i, :n])
        assert torch.equal(sample["target_last_hidden_states"], full["target_last_hidden_states"][i, :n])
    shards = {s.shard_id: [e.sample_id for e in s.samples] for s in cache.shards}
    assert shards == {0: [0, 1], 1: [2], 2: [4]}  # NeMo shard k -> our shard k
    m = cache.manifest
    assert (m.num_rows, m.num_samples, m.pad_token_id, m.skipped_rows) == (
        5,
        4,
        P,
        {"no real token (all padding)": 1},
    )
    shard = cache.shards[0]
    stored, _ = decode_payload(cache.reader(shard).read_blob(shard.samples[0]))
    assert set(stored) == {"target_hidden_states", "input_ids", "loss_mask"}  # the final state is stored once


def test_real_lengths_and_ambiguous_count_when_pad_is_eos(tmp_path, capsys):
    src, dst = str(tmp_path / "nemo"), str(tmp_path / "ours")
    write_tiny_nemo(src, TINY_IDS, TINY_MASKS, shard_size=2)
    code, out, err = _convert(
        capsys, src, dst, "--to", "dspark", "--pad-token-id", str(P), "--eos-token-id", str(P)
    )
    assert code == 0, err
    # NeMo keeps one trailing eos when pad == eos (rows 0, 3, 4: ambiguous, the eos may be the
    # sample's own); row 1's first pad-id token is supervised, so it is real and not ambiguous;
    # row 2 has no padding at all.
    assert "3 samples with an ambiguous length" in out
    lengths = [int(s["input_ids"].shape[0]) for s in dspark_cache.open_cache(dst).samples()]
    assert lengths == [4, 3, 8, 1, 4]


def test_pad_is_eos_when_the_tokenizer_has_no_pad_token(embedded, tmp_path, capsys):
    """NeMo pads with eos when the tokenizer has no pad token: the tokenizer decides both ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedded.stock)
    tokenizer.pad_token = None
    tokenizer.save_pretrained(str(tmp_path / "tok"))
    eos = tokenizer.eos_token_id
    ids = [[eos if t == P else t for t in row] for row in TINY_IDS]
    src, dst = str(tmp_path / "nemo"), str(tmp_path / "ours")
    write_tiny_nemo(src, ids, TINY_MASKS, target_model=str(tmp_path / "tok"))
    code, out, err = _convert(capsys, src, dst, "--to", "dspark")
    assert code == 0, err
    assert f"pad id {eos} (from the tokenizer in" in out and "3 samples with an ambiguous length" in out
    assert [int(s["input_ids"].shape[0]) for s in dspark_cache.open_cache(dst).samples()] == [4, 3, 8, 1, 4]


def test_layer_ids_without_final_state_keep_both_tensors(tmp_path, capsys):
    src, dst = str(tmp_path / "nemo"), str(tmp_path / "ours")
    full = write_tiny_nemo(src, TINY_IDS[:2], TINY_MASKS[:2], layer_ids=[-1, 0], num_layers=3)
    code, _, err = _convert(capsys, src, dst, "--to", "dspark", "--pad-token-id", str(P))
    assert code == 0, err
    for i, sample in enumerate(dspark_cache.open_cache(dst).samples()):
        assert torch.equal(sample["target_last_hidden_states"], full["target_last_hidden_states"][i, :3])


def test_damaged_duplicate_fails_and_keeps_published_shards(tmp_path, capsys):
    src, dst = str(tmp_path / "nemo"), str(tmp_path / "ours")
    write_tiny_nemo(src, TINY_IDS, TINY_MASKS, shard_size=2)
    path = nemo_format.shard_path(src, 1)
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    tensors["target_last_hidden_states"][0, 5, 0] += 1  # row 0 = sample 2, a real token
    save_file(tensors, path)
    code, _, err = _convert(capsys, src, dst, "--to", "dspark", "--pad-token-id", str(P))
    assert code == 1
    assert "shard-000001.safetensors row 0 (sample 2)" in err and "differs" in err
    assert err.count("\n") == 1
    paths = CachePaths(dst)
    # shard 0 kept, nothing half-written
    assert paths.indexed_shard_ids() == [0] and not paths.partial_files()
    assert not dspark_cache.open_cache(dst, allow_incomplete=True).manifest.complete


def test_partial_source_is_refused(tmp_path, capsys):
    src = str(tmp_path / "nemo")
    write_tiny_nemo(src, TINY_IDS, TINY_MASKS, shard_size=2, complete=False)
    code, _, err = _convert(capsys, src, str(tmp_path / "a"), "--to", "dspark", "--pad-token-id", str(P))
    assert code == 1 and "manifest.json says complete: false" in err and "Re-run" in err
    write_tiny_nemo(src, TINY_IDS, TINY_MASKS, shard_size=2)
    os.unlink(nemo_format.shard_path(src, 1))
    code, _, err = _convert(capsys, src, str(tmp_path / "b"), "--to", "dspark", "--pad-token-id", str(P))
    assert code == 1 and "is partial" in err and os.path.basename(nemo_format.shard_path(src, 1)) in err
    assert not os.path.exists(tmp_path / "a") and not os.path.exists(tmp_path / "b")  # nothing written


def test_bad_shard_names_file_and_reason(tmp_path, capsys):
    src = str(tmp_path / "nemo")
    write_tiny_nemo(src, TINY_IDS, TINY_MASKS, shard_size=2)
    path = nemo_format.shard_path(src, 2)
    with open(path, "r+b") as handle:
        handle.truncate(os.path.getsize(path) - 10)
    code, _, err = _convert(capsys, src, str(tmp_path / "a"), "--to", "dspark", "--pad-token-id", str(P))
    assert code == 1 and os.path.basename(path) in err and "truncated" in err


def test_corrupt_source_sample_fails_export_and_keeps_published_shards(small_cache, tmp_path, capsys):
    src, dst = str(tmp_path / "ours"), str(tmp_path / "nemo")
    shutil.copytree(small_cache, src)
    cache = dspark_cache.open_cache(src)
    # The sample at position 6 in ascending id: NeMo shard 1 of 5-row shards, whichever of our
    # shards holds it (ours group samples by length, not by id).
    located = sorted(((e.sample_id, shard.shard_id, e) for shard in cache.shards for e in shard.samples),
                     key=lambda item: item[0])
    _, shard_id, entry = located[6]
    with open(CachePaths(src).shard_tar(shard_id), "r+b") as handle:
        handle.seek(entry.offset + entry.size - 1)
        last = handle.read(1)
        handle.seek(entry.offset + entry.size - 1)
        handle.write(bytes([last[0] ^ 0xFF]))
    code, _, err = _convert(capsys, src, dst, "--to", "nemo", "--shard-size", "5")
    assert code == 1 and os.path.basename(CachePaths(src).shard_tar(shard_id)) in err
    assert f"sample {entry.sample_id}" in err and "checksum" in err
    assert nemo_format.shard_indices(dst) == [0] and not [
        n for n in os.listdir(dst) if n.endswith(".partial")
    ]
    assert nemo_format.read_manifest(dst, allow_incomplete=True)["complete"] is False


def test_late_manifest_fields_default_as_nemo_reads_them(tmp_path, capsys):
    src, dst = str(tmp_path / "nemo"), str(tmp_path / "ours")
    write_tiny_nemo(src, TINY_IDS, TINY_MASKS, mask_reasoning_content=True)
    manifest_path = nemo_format.manifest_path(src)
    with open(manifest_path) as handle:
        manifest = json.load(handle)
    del manifest["mask_generation_prompt"]  # written by a NeMo older than the field
    with open(manifest_path, "w") as handle:
        json.dump(manifest, handle)
    assert _convert(capsys, src, dst, "--to", "dspark", "--pad-token-id", str(P))[0] == 0
    m = dspark_cache.open_cache(dst).manifest
    assert (m.mask_reasoning_content, m.mask_generation_prompt) == (True, False)


def test_pad_id_needed_when_tokenizer_is_not_local(tmp_path, capsys):
    src = str(tmp_path / "nemo")
    write_tiny_nemo(src, TINY_IDS, TINY_MASKS)
    code, _, err = _convert(capsys, src, str(tmp_path / "a"), "--to", "dspark")
    assert code == 2 and "--pad-token-id is required" in err and "hub-only/tiny-model" in err
    assert err.count("\n") == 1


@pytest.mark.parametrize("argv,needle", [
    (["--to", "dspark", "--shard-size", "4"], "--shard-size applies to --to nemo"),
    (["--to", "nemo", "--pad-token-id", "1"], "apply to --to dspark"),
    (["--to", "zip"], "invalid choice"),
])
def test_usage_errors_are_one_line(tmp_path, capsys, argv, needle):
    code, _, err = _convert(capsys, str(tmp_path), str(tmp_path / "x"), *argv)
    assert code == 2 and needle in err and err.count("\n") == 1


def test_wrong_direction_and_same_directory(small_cache, exported, capsys):
    code, _, err = _convert(capsys, small_cache, small_cache, "--to", "nemo")
    assert code == 2 and "same directory" in err
    code, _, err = _convert(capsys, small_cache, small_cache + "-x", "--to", "dspark")
    assert code == 2 and "--to nemo" in err
    code, _, err = _convert(capsys, exported, exported + "-x", "--to", "nemo")
    assert code == 2 and "--to dspark" in err


def test_different_cache_in_dst_needs_overwrite(small_cache, tmp_path, capsys):
    dst = str(tmp_path / "nemo")
    assert _convert(capsys, small_cache, dst, "--to", "nemo")[0] == 0
    assert nemo_format.read_manifest(dst)["shard_size"] == 8  # the source's
    code, _, err = _convert(capsys, small_cache, dst, "--to", "nemo", "--shard-size", "7")
    assert code == 1 and "shard_size: DST has 8, this conversion gives 7" in err and "--overwrite" in err
    assert len(nemo_format.NemoCacheDataset(dst)) > 0  # refused: the cache there is untouched
    code, _, err = _convert(capsys, small_cache, dst, "--to", "nemo", "--shard-size", "7", "--overwrite")
    assert code == 0, err
    # no stale shard left
    assert len(nemo_format.NemoCacheDataset(dst)) == len(dspark_cache.open_cache(small_cache))
    ours = str(tmp_path / "ours")
    tiny = str(tmp_path / "tiny")
    write_tiny_nemo(tiny, TINY_IDS, TINY_MASKS)
    assert _convert(capsys, tiny, ours, "--to", "dspark", "--pad-token-id", str(P))[0] == 0
    code, _, err = _convert(capsys, dst, ours, "--to", "dspark")
    assert code == 1 and "holds a different cache" in err and "hidden_size: DST has 4" in err
    assert _convert(capsys, dst, ours, "--to", "dspark", "--overwrite")[0] == 0
    assert verify_cache(ours).ok
    code, _, err = _convert(capsys, small_cache, ours, "--to", "nemo")  # a dspark cache is in the way
    assert code == 1 and "is not a NeMo manifest" in err
    assert _convert(capsys, small_cache, ours, "--to", "nemo", "--overwrite")[0] == 0
    assert len(nemo_format.NemoCacheDataset(ours)) == len(dspark_cache.open_cache(small_cache))
    assert not os.path.exists(CachePaths(ours).shards_dir)  # our layout's files are gone


def test_overwrite_never_deletes_through_a_symlink(tmp_path, capsys):
    src, dst, elsewhere = str(tmp_path / "nemo"), tmp_path / "ours", tmp_path / "elsewhere"
    write_tiny_nemo(src, TINY_IDS, TINY_MASKS)
    elsewhere.mkdir()
    (elsewhere / "precious.tar").write_bytes(b"keep me")
    dst.mkdir()
    os.symlink(elsewhere, CachePaths(str(dst)).shards_dir)
    for extra in ((), ("--overwrite",)):
        code, _, err = _convert(capsys, src, str(dst), "--to", "dspark", "--pad-token-id", str(P), *extra)
        assert code == 1 and "is a symbolic link" in err
    assert (
        os.listdir(elsewhere) == ["precious.tar"] and (elsewhere / "precious.tar").read_bytes() == b"keep me"
    )


def test_a_running_producer_or_conversion_holds_dst(tmp_path, capsys):
    """The producer's lock on control/lock: a conversion into a directory in use is refused."""
    from dspark_cache.storage.lock import lock_exclusive

    src, dst = str(tmp_path / "nemo"), str(tmp_path / "ours")
    write_tiny_nemo(src, TINY_IDS, TINY_MASKS)
    os.makedirs(CachePaths(dst).control_dir)
    held = lock_exclusive(CachePaths(dst), "a-live-run", 1)
    try:
        code, _, err = _convert(capsys, src, dst, "--to", "dspark", "--pad-token-id", str(P), "--overwrite")
        assert code == 1 and "a-live-run" in err
    finally:
        held.release()
    assert _convert(capsys, src, dst, "--to", "dspark", "--pad-token-id", str(P))[0] == 0
    assert os.path.exists(CachePaths(dst).lock)  # the lock file stays: deleting it would break the lock


def _cmd(*argv: str) -> list[str]:
    return [os.path.join(BIN, "dspark-convert"), *argv]


def test_sigkill_mid_import_then_rerun_equals_uninterrupted(exported, tmp_path, capsys):
    reference, dst = str(tmp_path / "ref"), str(tmp_path / "ours")
    convert_to_dspark(exported, reference, progress=None)
    killed = run(_cmd(exported, dst, "--to", "dspark"), env={"DSPARK_CRASH_AT": "mid_shard:8"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert "dspark-convert: shard 1/" in killed.stderr  # progress, one line per shard
    paths = CachePaths(dst)
    # shard 0 published, shard 1 half-written
    assert paths.indexed_shard_ids() == [0] and paths.partial_files()
    assert not dspark_cache.open_cache(dst, allow_incomplete=True).manifest.complete
    code, out, err = _convert(capsys, exported, dst, "--to", "dspark")
    assert code == 0, err
    assert "1 kept from an earlier run" in out and not paths.partial_files()
    assert _shard_files(dst) == _shard_files(reference)
    a, b = dspark_cache.open_cache(dst).manifest, dspark_cache.open_cache(reference).manifest
    assert a.identity() == b.identity() and a.complete and a.num_samples == b.num_samples


def test_sigkill_mid_export_then_rerun_equals_uninterrupted(small_cache, exported, tmp_path, capsys):
    dst = str(tmp_path / "nemo")
    killed = run(_cmd(small_cache, dst, "--to", "nemo", "--shard-size", "5"),
                 env={"DSPARK_CRASH_AT": "nemo_after_rename:2"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert nemo_format.shard_indices(dst) == [0, 1]
    with pytest.raises(ValueError, match="incomplete"):
        nemo_format.read_manifest(dst)  # NeMo's reader refuses it until the last shard is in
    with pytest.raises(ValueError, match="shard indices"):
        nemo_format.NemoCacheDataset(dst)
    with open(nemo_format.partial_path(nemo_format.shard_path(dst, 2)), "wb") as handle:
        handle.write(b"half a shard")  # what a kill inside a shard leaves
    code, out, err = _convert(capsys, small_cache, dst, "--to", "nemo", "--shard-size", "5")
    assert code == 0, err
    assert "2 kept from an earlier run" in out and "allocated on disk" in out
    assert _files(dst) == _files(exported)
    code, out, _ = _convert(capsys, small_cache, dst, "--to", "nemo", "--shard-size", "5")
    assert code == 0 and f"{len(nemo_format.shard_indices(dst))} kept" in out  # complete: nothing redone


def _flip_last_byte(path: str) -> None:
    with open(path, "r+b") as handle:
        handle.seek(-1, os.SEEK_END)
        last = handle.read(1)
        handle.seek(-1, os.SEEK_END)
        handle.write(bytes([last[0] ^ 0x01]))


def test_weights_are_checked_recorded_and_never_kept_when_they_differ(
    small_cache, exported, tmp_path, capsys
):
    src = str(tmp_path / "ours")
    shutil.copytree(small_cache, src)
    _flip_last_byte(CachePaths(src).target_weights)  # same size, other bytes: the manifest's checksum says no
    code, _, err = _convert(capsys, src, str(tmp_path / "nemo"), "--to", "nemo")
    assert code == 1 and os.path.basename(CachePaths(src).target_weights) in err and "xxh3" in err
    assert not os.path.exists(nemo_format.manifest_path(str(tmp_path / "nemo")))  # refused: DST never made

    back = str(tmp_path / "back")
    assert _convert(capsys, exported, back, "--to", "dspark")[0] == 0
    recorded = dspark_cache.open_cache(back).manifest.target_weights_xxh3
    weights = CachePaths(back).target_weights
    assert recorded is not None and verify_cache(back).ok
    _flip_last_byte(weights)  # a damaged copy of the right size: a rerun must replace it, not keep it
    assert not verify_cache(back).ok
    assert _convert(capsys, exported, back, "--to", "dspark")[0] == 0
    assert _weights(back) == _weights(small_cache)
    assert verify_cache(back).ok


def test_import_into_object_storage_equals_import_into_a_directory(
    exported, tmp_path, capsys, s3_bucket, s3_env
):
    """--to dspark with DST on S3 writes through its staging directory: the same samples as a local import,
    every tar uploaded and gone from staging, and a rerun keeps what the store holds."""
    from dspark_cache.storage.remote.store import ObjectStore
    from tests.support.proc import assert_same_samples

    local, url, staging = str(tmp_path / "local"), f"{s3_bucket}/imported", str(tmp_path / "staging")
    assert _convert(capsys, exported, local, "--to", "dspark")[0] == 0
    code, out, err = _convert(capsys, exported, url, "--to", "dspark", "--staging-dir", staging)
    assert code == 0, err
    assert assert_same_samples(local, url) == len(dspark_cache.open_cache(local))
    assert verify_cache(url).ok
    assert not [n for n in os.listdir(CachePaths(staging).shards_dir) if n.endswith(".tar")]
    store = ObjectStore(url)
    assert store.get(CACHE_KEYS.target_weights)[0] == _weights(local)
    assert store.head(CACHE_KEYS.lease) is None
    code, out, err = _convert(
        capsys, exported, url, "--to", "dspark", "--staging-dir", str(tmp_path / "elsewhere")
    )
    assert code == 0, err
    shards = dspark_cache.open_cache(local).manifest.num_shards
    assert f"{shards} kept from an earlier run" in out  # resumed from the store into an empty staging dir
    assert _convert(capsys, local, url, "--to", "nemo")[0] == 2  # DST of an export is a directory
