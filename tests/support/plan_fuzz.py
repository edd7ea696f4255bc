"""Seeded mutations of a saved plan (``plan/``) for the "plan arrays" fuzz class in test_fuzz_cache.py.

Each mutation damages one plan file the way a bug, a full disk, an editor or a forger would:
values in the arrays (forged with matching checksums, or not), header fields, sizes (cut,
extended, sparse), and files of the wrong kind (directory, FIFO, symlink, device, missing).
A rerun of the producer must reuse an intact plan or rebuild it, and write the same cache.
"""

from __future__ import annotations

import json
import os
import random

import numpy as np
import xxhash

from dspark_cache.format.paths import CachePaths
from tests.support.plan_files import rechecksum

_NAMES = CachePaths("")  # only the names of the files inside plan/
_PART_ARRAYS = {kind: os.path.basename(_NAMES.plan_part(0, kind)) for kind in ("ids", "mask", "rows")}
ARRAYS = (
    *_PART_ARRAYS.values(),
    *(os.path.basename(_NAMES.plan_array(name)) for name in ("samples", "batches", "shards", "shard_bytes")),
)
PLAN_HEADER = os.path.basename(_NAMES.plan_header)
HEADERS = (os.path.basename(_NAMES.plan_part_header(0)), PLAN_HEADER)


def _value(rng: random.Random, plan: str, vocab: int) -> str:
    name = rng.choice(ARRAYS)
    array = np.load(os.path.join(plan, name), mmap_mode="r+", allow_pickle=False)
    at = rng.randrange(array.shape[0])
    field = rng.choice(array.dtype.names) if array.dtype.names else None
    target = array[field] if field else array
    old = int(target[at])
    # Never a forged id that is valid but other: no check short of tokenising again can see it.
    choices = {"ids": [vocab, vocab + rng.randrange(1, 1000), -1, -rng.randrange(2, 1 << 30)],
               "mask": [2, 255, 1 - old]}.get({v: k for k, v in _PART_ARRAYS.items()}.get(name, ""),
                                              [old + 1, old - 1, -1, 0, old * 2 + 7, 1 << 40])
    value = rng.choice(choices)
    info = np.iinfo(target.dtype)
    target[at] = min(max(value, info.min), info.max)
    array.flush()
    forged = rng.random() < 0.75
    if forged:
        rechecksum(CachePaths(os.path.dirname(plan)))
    return f"value: {name}[{at}]{'.' + field if field else ''} {old} -> {int(target[at])}{' forged' if forged else ''}"


def _header(rng: random.Random, plan: str, vocab: int) -> str:
    name = rng.choice(HEADERS)
    path = os.path.join(plan, name)
    header = json.load(open(path))
    field = rng.choice(["num_parts", "num_rows", "format", "arrays", "tokens", "rows", "skipped", "part"])
    if field == "arrays":
        kind = rng.choice(sorted(header["arrays"]))
        header["arrays"][kind]["length"] = rng.choice([0, 1 << 40, header["arrays"][kind]["length"] + 1, -1])
    elif field == "format":
        header["format"] = "dspark-plan/0"
    elif field == "skipped":
        header["skipped"] = header.get("skipped", [])[1:] if header.get("skipped") else [
            {"row": 0, "reason": "invented", "where": "nowhere"}]
    else:
        header[field] = rng.choice([0, -1, 2, 10 ** 9, 1 << 62])
    open(path, "w").write(json.dumps(header))
    forged = name != PLAN_HEADER and rng.random() < 0.5
    if forged:  # the plan's record of its part header made to match
        plan_header = json.load(open(os.path.join(plan, PLAN_HEADER)))
        raw = open(path, "rb").read()
        plan_header["parts"][0] = {"length": len(raw), "xxh3_64": xxhash.xxh3_64_hexdigest(raw)}
        open(os.path.join(plan, PLAN_HEADER), "w").write(json.dumps(plan_header))
    return f"header: {name} {field}{' forged' if forged else ''}"


def _size(rng: random.Random, plan: str, vocab: int) -> str:
    name = rng.choice(ARRAYS + HEADERS)
    path = os.path.join(plan, name)
    size = os.path.getsize(path)
    how = rng.choice(["cut", "extend", "sparse", "empty"])
    if how == "cut":
        os.truncate(path, rng.randrange(size))
    elif how == "extend":
        with open(path, "ab") as handle:
            handle.write(os.urandom(rng.randrange(1, 4096)))
    elif how == "sparse":
        os.truncate(path, 1 << rng.randrange(32, 41))
    else:
        os.truncate(path, 0)
    return f"size: {name} {how}"


def _kind(rng: random.Random, plan: str, vocab: int) -> str:
    name = rng.choice(ARRAYS + HEADERS)
    path = os.path.join(plan, name)
    how = rng.choice(["directory", "fifo", "symlink-copy", "symlink-zero", "missing"])
    if how == "symlink-copy":  # the right bytes, but not a plain file of the plan
        copy = os.path.join(os.path.dirname(os.path.dirname(plan)), f"elsewhere-{name}")
        os.replace(path, copy)
        os.symlink(copy, path)
        return f"kind: {name} {how}"
    os.unlink(path)
    if how == "directory":
        os.mkdir(path)
    elif how == "fifo":
        os.mkfifo(path)
    elif how == "symlink-zero":
        os.symlink("/dev/zero", path)
    return f"kind: {name} {how}"


MUTATIONS = (_value, _value, _header, _size, _kind)


def mutate(seed: int, case: int, plan: str, vocab: int) -> str:
    """Apply case ``case``'s mutation to ``plan``; every tenth case leaves the plan intact."""
    rng = random.Random(seed * 100_003 + case)
    if case % 10 == 0:
        return "intact"
    return rng.choice(MUTATIONS)(rng, plan, vocab)
