"""Fuzz cases of ``dspark-convert --to dspark`` on hostile NeMo sources and destinations.

:func:`make_cases` copies a small NeMo-layout cache (pad id ``PAD``) once per case and applies one
seeded mutation (manifest fields, nesting, safetensors headers, sizes, the shard set, FIFOs,
``/dev/zero`` links, directories, dangling links, an earlier run's DST, the pad id argument); the
conversions run in one ``tests/support/convert_worker.py`` process under its address-space limit, and
:func:`judge` rates each: ``same`` (exit 0 and exactly the samples of the pristine conversion),
``rejected`` (exit 1 or 2, one line naming a file of the case), or ``FAIL: ...`` (a traceback, a
hang, another code, several lines, different data).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct

import torch

import dspark_cache
from dspark_cache.format.paths import CachePaths
from dspark_cache.nemo import nemo_format

PAD = 7
_VALUES = [
    0,
    -1,
    1,
    2,
    3,
    7,
    100,
    10**12,
    2**63,
    -(2**63),
    10**30,
    "x",
    "",
    None,
    1.5,
    True,
    False,
    [],
    {},
    [1, 2],
]
_HEADER_CHARS = b'0123456789",:{}[]x -'


def make_cases(pristine: str, reference: str, workdir: str, seed: int, count: int) -> list[dict]:
    """``count`` mutated copies of ``pristine`` (``reference``: its conversion), each a job for
    ``tests.support.convert_worker`` plus where it lives and what was done to it."""
    cases = []
    for case in range(count):
        rng = random.Random(seed * 1_000_003 + case)
        root = os.path.join(workdir, f"convert-case-{case}")
        src, dst = os.path.join(root, "nemo"), os.path.join(root, "out")
        shutil.copytree(pristine, src)
        mutation, pad = mutate(src, dst, reference, rng)
        cases.append({"name": str(case), "argv": argv(src, dst, pad), "mutation": mutation, "root": root,
                      "dst": dst})
    return cases


def argv(src: str, dst: str, pad: int = PAD) -> list[str]:
    return [src, dst, "--to", "dspark", "--pad-token-id", str(pad), "--quiet"]


def samples(cache) -> dict:
    return {s["sample_id"]: {k: s[k] for k in ("input_ids", "loss_mask", "target_hidden_states",
                                               "target_last_hidden_states")} for s in cache.samples()}


def judge(result: dict, root: str, dst: str, expected: dict) -> str:
    """``same``, ``rejected`` or ``FAIL: why`` for one conversion's result (see the module doc)."""
    if "escaped" in result:
        return f"FAIL: escaped {result['escaped']}"
    err, code = result["stderr"], result["code"]
    if code in (1, 2):
        if err.count("\n") != 1 or not err.startswith("dspark-convert: error: ") or root not in err:
            return f"FAIL: exit {code} without one line naming a file of the case: {err[-600:]!r}"
        return "rejected"
    if code != 0:
        return f"FAIL: exit {code}: {err[-600:]!r}"
    try:
        got = samples(dspark_cache.open_cache(dst))
    except Exception as exc:  # the conversion said it succeeded: its cache must read
        return f"FAIL: exit 0 but the cache does not read: {type(exc).__name__}: {exc}"
    same = got.keys() == expected.keys() and all(
        torch.equal(got[i][k], expected[i][k]) for i in expected for k in expected[i])
    return "same" if same else "FAIL: exit 0 with different data"


# -- mutations --------------------------------------------------------------------------------


def mutate(src: str, dst: str, reference: str, rng: random.Random) -> tuple[str, int]:
    """Apply one mutation; returns its description and the pad id to convert with."""
    kind = rng.choice(["manifest"] * 3 + ["header"] * 3 + ["special"] * 2 + ["shards", "dst", "dst", "pad"])
    if kind == "pad":
        pad = rng.choice([0, 5, 6, 9, 99, 100, 10**6, 2**63])
        return f"pad: --pad-token-id {pad}", pad
    how = {"manifest": _mutate_manifest, "header": _mutate_header, "special": _mutate_special,
           "shards": _mutate_shard_set, "dst": _mutate_dst}[kind]
    return f"{kind}: {how(src, dst, reference, rng)}", PAD


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _mutate_manifest(src: str, dst: str, reference: str, rng: random.Random) -> str:
    path = nemo_format.manifest_path(src)
    with open(path) as handle:
        text = handle.read()
    data = json.loads(text)
    how = rng.choice(["value", "value", "value", "delete", "nest", "truncate", "flip", "not an object"])
    key = rng.choice(sorted(data))
    if how == "truncate":
        text = text[: rng.randrange(len(text))]
    elif how == "flip":
        at = rng.randrange(len(text))
        text = text[:at] + chr(rng.choice(_HEADER_CHARS)) + text[at + 1:]
    elif how == "nest":
        text = text.rstrip().rstrip("}") + f', "deep": {_nested(rng.choice([1000, 100_000]))}}}'
    elif how == "not an object":
        text = rng.choice(["[]", "1", "null", '"manifest"', _nested(100_000)])
    else:
        if how == "delete":
            del data[key]
        else:
            data[key] = rng.choice(_VALUES)
        text = json.dumps(data)
        how = f"{how} {key}"
    with open(path, "w") as handle:
        handle.write(text)
    return how


def _shards(src: str) -> list[str]:
    return sorted(os.path.join(src, n) for n in os.listdir(src) if n.startswith("shard-"))


def _mutate_header(src: str, dst: str, reference: str, rng: random.Random) -> str:
    """A shard's safetensors header (the length field or its JSON) or its size: where a lie would
    shape the tensors or place their bytes."""
    path = rng.choice(_shards(src))
    name = os.path.basename(path)
    with open(path, "rb") as handle:
        raw = handle.read()
    (length,) = struct.unpack("<Q", raw[:8])
    how = rng.choice(["length", "char", "char", "char", "truncate", "append", "nest"])
    if how == "length":
        value = rng.choice(
            [0, 2, 7, length - 8, length + 8, len(raw), len(raw) - 8, 2**63, 2**64 - 1, 1 << 30]
        )
        raw = struct.pack("<Q", value) + raw[8:]
        how = f"length {value}"
    elif how == "char":
        at = 8 + rng.randrange(length)
        raw = raw[:at] + bytes([rng.choice(_HEADER_CHARS)]) + raw[at + 1:]
        how = f"header byte {at}"
    elif how == "truncate":
        at = rng.randrange(len(raw))
        raw = raw[:at]
        how = f"truncated to {at}"
    elif how == "append":
        raw += b"\0" * rng.choice([1, 8, 4096])
    else:
        header = f'{{"x": {_nested(100_000)}}}'.encode()
        raw = struct.pack("<Q", len(header)) + header + raw[8 + length:]
    with open(path, "wb") as handle:
        handle.write(raw)
    return f"{name} {how}"


_SPECIALS = {"fifo": os.mkfifo, "dev_zero": lambda p: os.symlink("/dev/zero", p), "directory": os.mkdir,
             "dangling": lambda p: os.symlink(p + ".gone", p)}


def _mutate_special(src: str, dst: str, reference: str, rng: random.Random) -> str:
    path = rng.choice(_shards(src) + [nemo_format.manifest_path(src), nemo_format.target_weights_path(src)])
    how = rng.choice(sorted(_SPECIALS))
    os.unlink(path)
    _SPECIALS[how](path)
    return f"{os.path.basename(path)} replaced by {how}"


def _mutate_shard_set(src: str, dst: str, reference: str, rng: random.Random) -> str:
    shards = _shards(src)
    how = rng.choice(["missing", "extra", "gap"])
    if how == "missing":
        victim = rng.choice(shards)
        os.unlink(victim)
        return f"{os.path.basename(victim)} missing"
    if how == "extra":
        shutil.copyfile(shards[-1], nemo_format.shard_path(src, len(shards)))
        return "an extra shard"
    os.rename(shards[-1], nemo_format.shard_path(src, len(shards) + 3))
    return "the last shard renumbered past a gap"


def _mutate_dst(src: str, dst: str, reference: str, rng: random.Random) -> str:
    """DST holds what an earlier run left: a whole conversion (resumed) or a file of it replaced by
    something that is not a plain file, or its manifest damaged."""
    shutil.copytree(reference, dst)
    paths = CachePaths(dst)
    victims = [paths.manifest, paths.target_weights, paths.shard_index(0), paths.shard_tar(1),
               nemo_format.shard_path(dst, 0), paths.shard_partial(2)]  # a NeMo shard's name
    how = rng.choice(["resume", "special", "special", "special", "manifest"])
    if how == "resume":
        return "an earlier complete conversion"
    if how == "manifest":
        path = paths.manifest
        with open(path) as handle:
            text = handle.read()
        text = rng.choice(
            [text[: len(text) // 2], "[]", _nested(100_000), text.replace('"seq_length":', '"x":')]
        )
        with open(path, "w") as handle:
            handle.write(text)
        return "its manifest damaged"
    path, special = rng.choice(victims), rng.choice(sorted(_SPECIALS))
    if os.path.lexists(path):
        os.unlink(path)
    _SPECIALS[special](path)
    return f"{os.path.relpath(path, dst)} replaced by {special}"
