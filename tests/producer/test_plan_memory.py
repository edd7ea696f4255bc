"""Planning's memory does not grow with the input (issue 41, item 13).

Checking a saved part's token values (ids within the vocabulary, masks 0/1, each row's loss
tokens) went through the part's memory maps: every token page became resident in the planner and
the mask was widened to int64 whole, ~13 bytes per token held at once (301 MB at 20k rows, 588 MB
at 160k on the issue's machine). These tests measure what checking a part of millions of tokens
holds: Python/numpy allocations through tracemalloc, and the pages of the token files mapped into
this process through ``/proc/self/smaps``. Neither depends on timing or on what else runs.
"""

from __future__ import annotations

import os
import tracemalloc

import numpy as np
import pytest
import xxhash

from dspark_cache.format.geometry import SampleShape
from dspark_cache.format.paths import CachePaths
from dspark_cache.format.plan import ArrayRecord, PartHeader, PlanError
from dspark_cache.producer.encode.chat import EncodedRow
from dspark_cache.producer.inputs.rows import RawRow
from dspark_cache.producer.plan.parts import PartWriter
from dspark_cache.producer.plan.store import PlanSpec, open_store

ROWS, LENGTH, VOCAB = 2000, 2000, 1000  # 4M tokens: 16 MB of ids, 4 MB of masks
MB = 1 << 20


def _write_part(paths: CachePaths, *, loss_fudge: int = 0) -> tuple[PlanSpec, PartHeader]:
    rng = np.random.default_rng(0)
    writer = PartWriter(paths, 0, 1, "key", VOCAB)
    for row in range(ROWS):
        ids = rng.integers(0, VOCAB, LENGTH, dtype=np.int32)
        mask = (rng.random(LENGTH) < 0.5).astype(np.uint8)
        mask[-1] = 1
        writer.add(RawRow(row, f"data.jsonl:{row + 1}", {}), EncodedRow(ids, mask, LENGTH))
    header = writer.close()
    if loss_fudge:  # one row's count off by one, with a checksum to match (as a forger would)
        rows = np.load(paths.plan_part(0, "rows"), mmap_mode="r+")
        rows["loss_tokens"][ROWS // 2] += loss_fudge
        rows.flush()
        with open(paths.plan_part(0, "rows"), "rb") as handle:
            handle.seek(rows.offset)
            header.arrays["rows"] = ArrayRecord(ROWS, xxhash.xxh3_64_hexdigest(handle.read()))
    shape = SampleShape([1], 2, 64, "BF16")
    spec = PlanSpec(keys=("key", "batching"), vocab_size=VOCAB, seq_length=LENGTH, shape=shape, shard_size=64,
                    max_batch_tokens=4 * LENGTH)
    return spec, header


def _resident(path: str) -> int:
    """Bytes of ``path``'s mappings resident in this process (its smaps ``Rss`` lines)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split(maxsplit=1)[0]
            if "-" in first and not first.endswith(":"):  # a mapping's header line, its path last
                inside = line.rstrip("\n").endswith(path)
            elif inside and first == "Rss:":
                total += int(line.split()[1]) * 1024
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads the process's mappings (Linux)")
def test_checking_a_parts_tokens_holds_no_memory_per_token(tmp_path):
    paths = CachePaths(str(tmp_path))
    spec, header = _write_part(paths)
    tracemalloc.start()
    try:
        store, tables = open_store(paths, [header], spec)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    ids, mask = store.parts[0]
    assert ids.nbytes == 4 * ROWS * LENGTH and mask.nbytes == ROWS * LENGTH
    # Before: the mask widened to int64 whole (32 MB here). Now: one 4 MiB read buffer and small sums.
    assert peak < 8 * MB, f"checking {ids.size} tokens allocated {peak / MB:.1f} MB at once"
    # Before: every page of the maps resident (20 MB here). Now: nothing read through them.
    resident = _resident(paths.plan_part(0, "ids")) + _resident(paths.plan_part(0, "mask"))
    assert resident < MB, f"{resident / MB:.1f} MB of the token maps resident after the check"
    assert tables[0]["loss_tokens"].sum() == int(np.asarray(mask, dtype=np.int64).sum())  # the maps read


def test_a_loss_token_count_off_by_one_is_still_refused(tmp_path):
    paths = CachePaths(str(tmp_path))
    spec, header = _write_part(paths, loss_fudge=1)
    with pytest.raises(PlanError, match="loss token counts are not its masks'"):
        open_store(paths, [header], spec)
