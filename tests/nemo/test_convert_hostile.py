"""dspark-convert on hostile sources and destinations: FIFOs, devices, directories, lying manifests
and headers, pad ids that would keep padding. Each is refused in one line naming the file and what
to do (exit 1, or 2 for an argument), never hangs, never outgrows the worker's memory limit."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from safetensors.torch import load_file

import dspark_cache
from dspark_cache.format.paths import CachePaths
from dspark_cache.nemo import nemo_format
from dspark_cache.nemo.convert import convert_to_dspark
from tests.support.scripts import convert as main
from tests.support.convert_fixture import write_tiny_nemo
from tests.support.convert_worker import run_jobs

P = 7
IDS = [[5, 6, 9, P, P, P, P, P], [5, 6, P, P, P, P, P, P], [5, 6, 9, 9, 9, 9, 9, 9], [5, P, 9, P, P, P, P, P]]
MASKS = [
    [0, 1, 1, 0, 0, 0, 0, 0],
    [0, 1, 1, 0, 0, 0, 0, 0],
    [0, 1, 1, 1, 1, 1, 1, 1],
    [0, 1, 1, 0, 0, 0, 0, 0],
]
SPECIALS = {"fifo": os.mkfifo, "dev_zero": lambda path: os.symlink("/dev/zero", path), "directory": os.mkdir}


def _replace(path: str, kind: str) -> None:
    if os.path.lexists(path):
        os.unlink(path)
    SPECIALS[kind](path)


def _to_dspark(src: str, dst: str, *extra: str) -> list[str]:
    return [src, dst, "--to", "dspark", "--pad-token-id", str(P), "--quiet", *extra]


def _assert_refused(result: dict, code: int, *needles: str) -> str:
    """Exit ``code``, one line on stderr, containing every needle."""
    assert "escaped" not in result, result["escaped"]
    err = result["stderr"]
    assert result["code"] == code, err
    assert err.count("\n") == 1 and err.startswith("dspark-convert: error: "), err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


def test_special_files_in_the_source_are_refused(tmp_path):
    """A FIFO (used to hang the open), /dev/zero (used to fill memory) or a directory in place of
    the manifest, a shard or the target weights."""
    jobs, names = [], {}
    # Names relative to the cache's root (os.path.join("", name) is name).
    relative = (nemo_format.manifest_path(""), nemo_format.shard_path("", 1),
                nemo_format.target_weights_path(""))
    for name in relative:
        for kind in SPECIALS:
            src = str(tmp_path / f"{name}-{kind}" / "nemo")
            write_tiny_nemo(src, IDS, MASKS)
            _replace(os.path.join(src, name), kind)
            case = f"{name} {kind}"
            names[case] = os.path.join(src, name)
            jobs.append({"name": case, "argv": _to_dspark(src, src + "-out")})
    results = run_jobs(jobs, str(tmp_path), timeout=120)
    for case, result in results.items():
        kind = {"fifo": "a FIFO", "dev_zero": "a character device", "directory": "a directory"}[
            case.split()[1]
        ]
        _assert_refused(result, 1, f"{names[case]} is {kind}, not a regular file")
        assert not os.path.exists(os.path.dirname(names[case]) + "-out")  # refused before DST was made


def test_special_files_in_the_destination_are_refused_and_kept(tmp_path):
    """What an earlier run left in DST is read (manifest, shard index), kept (weights) or replaced:
    a FIFO there used to hang the conversion, a symlink to /dev/zero to fill memory or be replaced.
    Refused without --overwrite (the entry stays as it was); --overwrite removes a FIFO itself,
    never a directory."""
    nemo = str(tmp_path / "nemo")
    write_tiny_nemo(nemo, IDS, MASKS)
    ours = str(tmp_path / "ours")
    convert_to_dspark(nemo, ours, pad_token_id=P, progress=None)  # a dspark source for --to nemo
    jobs, where = [], {}
    mine = CachePaths(ours)  # our files, named relative to a cache's root
    cases = [
        ("dspark", os.path.relpath(p, ours))
        for p in (mine.manifest, mine.target_weights, mine.shard_index(0))
    ]
    cases += [("nemo", nemo_format.manifest_path("")), ("nemo", nemo_format.shard_path("", 0)),
              ("nemo", nemo_format.target_weights_path(""))]
    for to, name in cases:
        for kind in SPECIALS:
            dst = str(tmp_path / f"{to}-{name.replace('/', '_')}-{kind}")
            os.makedirs(os.path.dirname(os.path.join(dst, name)))
            SPECIALS[kind](os.path.join(dst, name))
            where[f"{to} {name} {kind}"] = os.path.join(dst, name)
            argv = _to_dspark(nemo, dst) if to == "dspark" else [ours, dst, "--to", "nemo", "--quiet"]
            jobs.append({"name": f"{to} {name} {kind}", "argv": argv})
    fifo_dst = str(tmp_path / "overwrite-fifo")
    os.makedirs(fifo_dst)
    os.mkfifo(CachePaths(fifo_dst).manifest)
    jobs.append({"name": "overwrite fifo", "argv": _to_dspark(nemo, fifo_dst, "--overwrite")})
    dir_dst = str(tmp_path / "overwrite-dir")
    os.makedirs(CachePaths(dir_dst).manifest)
    jobs.append({"name": "overwrite directory", "argv": _to_dspark(nemo, dir_dst, "--overwrite")})
    results = run_jobs(jobs, str(tmp_path), timeout=120)
    for case, path in where.items():
        kind = {"fifo": "a FIFO", "dev_zero": "a symlink", "directory": "a directory"}[case.split()[2]]
        _assert_refused(results[case], 1, f"{path} is {kind}, not a regular file", "choose another DST")
        assert os.path.lexists(path) and (os.path.islink(path) or not os.path.isfile(path))  # left as it was
    assert results["overwrite fifo"]["code"] == 0, results["overwrite fifo"]
    assert len(dspark_cache.open_cache(fifo_dst)) == 4
    dir_manifest = CachePaths(dir_dst).manifest
    _assert_refused(results["overwrite directory"], 1, f"{dir_manifest} is a directory", "Remove or rename")
    assert os.path.isdir(dir_manifest)


def _edit_manifest(src: str, **fields) -> None:
    path = nemo_format.manifest_path(src)
    with open(path) as handle:
        manifest = json.load(handle)
    manifest.update(fields)
    with open(path, "w") as handle:
        json.dump(manifest, handle)


def _write_header(path: str, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(raw)) + raw + data)


def _overlapping_last_state(src: str) -> None:
    """Shard 0 rewritten so target_last_hidden_states' offsets point into target_hidden_states."""
    path = nemo_format.shard_path(src, 0)
    tensors = load_file(path)
    header, data, cursor = {}, b"", 0
    for key in ("input_ids", "loss_mask", "target_hidden_states"):
        raw = tensors[key].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        code = {"input_ids": "I64", "loss_mask": "I64"}.get(key, "BF16")
        header[key] = {
            "dtype": code,
            "shape": list(tensors[key].shape),
            "data_offsets": [cursor, cursor + len(raw)],
        }
        data, cursor = data + raw, cursor + len(raw)
    last = tensors["target_last_hidden_states"]
    start = header["target_hidden_states"]["data_offsets"][0]
    header["target_last_hidden_states"] = {"dtype": "BF16", "shape": list(last.shape),
                                           "data_offsets": [start, start + last.numel() * 2]}
    _write_header(path, header, data)


def _nested_header(src: str) -> None:
    header = b'{"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with open(nemo_format.shard_path(src, 0), "wb") as handle:
        handle.write(struct.pack("<Q", len(header)) + header)


def _nested_manifest(src: str) -> None:
    path = nemo_format.manifest_path(src)
    with open(path) as handle:
        text = handle.read().rstrip().rstrip("}")
    with open(path, "w") as handle:
        handle.write(text + ', "extra": ' + "[" * 100_000 + "]" * 100_000 + "}")


def _appended(src: str) -> None:
    with open(nemo_format.shard_path(src, 1), "ab") as handle:
        handle.write(b"\0" * 64)


# name: (how the source lies, layer ids, shard size, expected exit code, what stderr must say)
LIES = {
    "manifest nested 1e5 deep": (
        _nested_manifest,
        None,
        2,
        1,
        ["manifest.json: not a JSON manifest", "RecursionError"],
    ),
    "num_samples 1e12": (
        lambda s: _edit_manifest(s, num_samples=10**12),
        None,
        2,
        1,
        ["is partial", "declares 1000000000000 samples", "Re-run NeMo's precompute"],
    ),
    "num_samples and shard_size 1e12, one shard": (
        lambda s: _edit_manifest(s, num_samples=10**12, shard_size=10**12),
        None,
        4,
        1,
        ["shard-000000.safetensors: input_ids is", "implies"],
    ),
    "seq_length 1e30": (
        lambda s: _edit_manifest(s, seq_length=10**30),
        None,
        2,
        1,
        ["field seq_length must be a 64-bit integer"],
    ),
    "shuffle_seed 1e30": (
        lambda s: _edit_manifest(s, shuffle_seed=10**30),
        None,
        2,
        1,
        ["field shuffle_seed must be a 64-bit integer"],
    ),
    "mask flag a string": (
        lambda s: _edit_manifest(s, mask_reasoning_content="no"),
        None,
        2,
        1,
        ["field mask_reasoning_content must be true or false"],
    ),
    "safetensors header nested 1e5 deep": (
        _nested_header,
        None,
        2,
        1,
        ["shard-000000.safetensors: unreadable safetensors header"],
    ),
    "overlapping tensors": (
        _overlapping_last_state,
        [-1, 0],
        2,
        1,
        ["shard-000000.safetensors: tensor 'target_", "overlapping or gapped offsets"],
    ),
    "bytes after the tensors": (_appended, None, 2, 1, ["shard-000001.safetensors: the tensors end at byte"]),
}


def test_lying_sources_are_refused_in_one_line_with_bounded_memory(tmp_path):
    """Each lie used to escape as a traceback (RecursionError, MemoryError under the worker's
    address-space limit, msgspec's overflow) or to convert wrong data silently (overlapping
    tensors, a mask flag "no" read as true)."""
    jobs = []
    for name, (lie, layer_ids, shard_size, _, _) in LIES.items():
        src = str(tmp_path / name.replace(" ", "_") / "nemo")
        write_tiny_nemo(src, IDS, MASKS, shard_size=shard_size, layer_ids=layer_ids,
                        num_layers=2 if layer_ids is None else 3)
        lie(src)
        jobs.append({"name": name, "argv": _to_dspark(src, src + "-out")})
    results = run_jobs(jobs, str(tmp_path), timeout=120)
    for name, (_, _, _, code, needles) in LIES.items():
        src = str(tmp_path / name.replace(" ", "_") / "nemo")
        _assert_refused(results[name], code, src, *needles)
        assert not os.path.exists(src + "-out")  # everything is checked before DST is created


def _convert(capsys, *argv: str) -> tuple[int, str]:
    code = main([*argv, "--quiet"])
    return code, capsys.readouterr().err


def test_pad_ids_outside_the_vocabulary_are_usage_errors(tmp_path, capsys):
    """An id no token has strips nothing: every row used to keep its padding as real tokens."""
    src = str(tmp_path / "nemo")
    write_tiny_nemo(src, IDS, MASKS)  # target_vocab_size 100
    for extra, needle in ((["--pad-token-id", "100"], "the pad id 100 (--pad-token-id) is not a token"),
                          (["--pad-token-id", str(P), "--eos-token-id", "10000"], "the eos id 10000")):
        code, err = _convert(capsys, src, str(tmp_path / "out"), "--to", "dspark", *extra)
        assert code == 2 and needle in err and "target_vocab_size 100" in err and err.count("\n") == 1, err
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("wrong", [5, 9])
def test_a_wrong_pad_id_is_refused_naming_the_likely_one(tmp_path, capsys, wrong):
    """5 occurs only inside rows, 9 ends row 2 as supervised content: with either, nothing would
    be stripped. The rows' unsupervised tails of 7s say NeMo padded with 7."""
    src = str(tmp_path / "nemo")
    write_tiny_nemo(src, IDS, MASKS)
    code, err = _convert(capsys, src, str(tmp_path / "out"), "--to", "dspark", "--pad-token-id", str(wrong))
    assert code == 2 and err.count("\n") == 1, err
    assert f"the pad id {wrong} (--pad-token-id) pads 0 of the 4 rows of {src}" in err
    assert "3 end in a run of unsupervised token 7" in err and "Pass --pad-token-id 7" in err
    assert not os.path.exists(tmp_path / "out")
    code, err = _convert(capsys, src, str(tmp_path / "out"), "--to", "dspark", "--pad-token-id", str(P))
    assert code == 0, err


def test_token_ids_outside_the_vocabulary_are_refused(tmp_path, capsys):
    """Training would index the embedding with them."""
    src = str(tmp_path / "nemo")
    ids = [row[:] for row in IDS]
    ids[3][2] = 100
    write_tiny_nemo(src, ids, MASKS, shard_size=2)
    code, err = _convert(capsys, src, str(tmp_path / "out"), "--to", "dspark", "--pad-token-id", str(P))
    assert code == 1 and err.count("\n") == 1, err
    assert "shard-000001.safetensors row 1 (sample 3): token id 100 at token 2 is outside the target's" in err
    assert "vocabulary size 100" in err and not os.path.exists(tmp_path / "out")


def test_export_of_a_source_nested_too_deep_is_refused(tmp_path, capsys):
    """--to nemo reads a dspark manifest: nested 10^5 deep it used to escape as a RecursionError (format's
    decode_json makes it a bad manifest like any other)."""
    nemo, ours = str(tmp_path / "nemo"), str(tmp_path / "ours")
    write_tiny_nemo(nemo, IDS, MASKS)
    convert_to_dspark(nemo, ours, pad_token_id=P, progress=None)
    _nested_manifest(ours)
    code, err = _convert(capsys, ours, str(tmp_path / "out"), "--to", "nemo")
    assert code == 1 and err.count("\n") == 1, err
    assert f"{ours}/manifest.json: not a valid dspark-cache manifest (JSON nested too deep)" in err
    assert "re-produce the cache" in err
