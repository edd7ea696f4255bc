"""The token rule (issue 23, item 5): every reader refuses a sample whose token ids lie outside the
target's vocabulary or whose loss mask holds a value other than 0 or 1, naming shard and sample.

The damage is crafted, not flipped: the bytes are rewritten and both checksums (the sample's in the
index, the tar's) made to match, as a buggy writer or an edited cache would leave them, so only the
rule itself can refuse them. Training would otherwise index the embedding out of range (a CUDA
device-side assert naming no file) or weight its loss wrongly.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import struct

import numpy as np
import pytest
import webdataset as wds
import xxhash

import dspark_cache
from dspark_cache.format.errors import CacheError, CorruptShardError
from dspark_cache.format.validate import token_problem
from dspark_cache.format.wds import decode_dspark_arrays
from tests.support.fuzz_worker import _sample_tensors

SHARD, TOKEN = 1, 3  # the damaged sample: shard 1's second entry, at token 3


def rewrite_tokens(root: str, value: int, name: str) -> tuple[str, int]:
    """Set token ``TOKEN`` of one sample's ``name`` ("input_ids" or "loss_mask") to ``value``, then
    rewrite the sample's xxh3 in the index and the tar's to match; (tar path, sample id)."""
    cache = dspark_cache.open_cache(root)
    tar, idx = cache.paths.shard_tar(SHARD), cache.paths.shard_index(SHARD)
    cache.close()
    raw = bytearray(open(tar, "rb").read())
    index = json.load(open(idx))
    entry = index["samples"][1]  # [sample_id, length, loss_tokens, offset, size, xxh3]
    assert entry[1] > TOKEN
    code, start, _ = _sample_tensors(bytes(raw), entry[3])[name]
    fmt, width = {"I32": ("<i", 4), "U8": ("<B", 1)}[code]
    raw[start + width * TOKEN : start + width * (TOKEN + 1)] = struct.pack(fmt, value)
    entry[5] = xxhash.xxh3_64_intdigest(bytes(raw[entry[3] : entry[3] + entry[4]]))
    index["tar_xxh3"] = xxhash.xxh3_64_intdigest(bytes(raw))
    open(tar, "wb").write(bytes(raw))
    json.dump(index, open(idx, "w"))
    return tar, entry[0]


@pytest.fixture(scope="module")
def vocab(small_cache) -> int:
    return dspark_cache.open_cache(small_cache).manifest.target_vocab_size


# (name, tensor, value as a function of the vocabulary size, what the message says)
DAMAGES = [
    (
        "id-at-vocab",
        "input_ids",
        lambda v: v,
        r"token id {v} at token 3 is outside the target's vocabulary size {v}",
    ),
    ("id-max-int32", "input_ids", lambda v: 2**31 - 1, r"token id 2147483647 at token 3 is outside"),
    ("id-negative", "input_ids", lambda v: -1, r"token id -1 at token 3 is (outside|negative)"),
    ("mask-2", "loss_mask", lambda v: 2, r"loss mask value 2 at token 3 is not 0 or 1"),
    ("mask-255", "loss_mask", lambda v: 255, r"loss mask value 255 at token 3 is not 0 or 1"),
]


@pytest.fixture(params=DAMAGES, ids=[d[0] for d in DAMAGES])
def damaged(request, small_cache, vocab, tmp_path):
    """A copy of the small cache with one sample's token damaged; (root, tar, sample id, message regex)."""
    name, tensor, value, says = request.param
    root = str(tmp_path / "c")
    shutil.copytree(small_cache, root)
    tar, sample_id = rewrite_tokens(root, value(vocab), tensor)
    return root, tar, sample_id, says.format(v=vocab), name


def _named(tar: str, sample_id: int, says: str) -> str:
    return rf"{re.escape(tar)} \(sample {sample_id}\): {says}"


def test_open_cache_and_convert_refuse(damaged, tmp_path):
    from dspark_cache.nemo.convert import convert_to_nemo

    root, tar, sample_id, says, _ = damaged
    with pytest.raises(CorruptShardError, match=_named(tar, sample_id, says)):
        list(dspark_cache.open_cache(root).samples())
    with pytest.raises(CacheError, match=_named(tar, sample_id, says)):  # dspark-convert --to nemo
        convert_to_nemo(root, str(tmp_path / "nemo"), progress=None)


@pytest.mark.parametrize("pad_to", ["longest", "seq_length"])
def test_both_fillers_refuse(damaged, executor, pad_to):
    root, tar, sample_id, says, _ = damaged
    for verify in ("once", "always"):
        loader = dspark_cache.build_dataloader(
            root, 4, shuffle=False, pin_memory=False, pad_to=pad_to, verify=verify
        )
        try:
            with pytest.raises(CorruptShardError, match=_named(tar, sample_id, says)):
                list(loader)
        finally:
            loader.close()


def test_the_nemo_dataset_refuses(damaged, executor):
    from dspark_cache.nemo.dataset import DSparkMapDataset

    root, tar, sample_id, says, _ = damaged
    dataset = DSparkMapDataset(root, batch_size=4)
    try:
        position = dataset.sample_ids.index(sample_id)
        with pytest.raises(CorruptShardError, match=_named(tar, sample_id, says)):
            # the bad row second: its row's buffers, not row 0's
            dataset.__getitems__([position - 1, position])
        with pytest.raises(CorruptShardError, match=_named(tar, sample_id, says)):
            dataset[position]
    finally:
        dataset.close()


def test_the_webdataset_decoder_refuses(damaged, vocab):
    root, tar, sample_id, says, name = damaged
    handlers = [functools.partial(decode_dspark_arrays, vocab_size=vocab)]
    # a blob does not know its vocabulary: only these need it
    if name != "id-at-vocab" and name != "id-max-int32":
        handlers.append(decode_dspark_arrays)
    for handler in handlers:
        with pytest.raises(wds.autodecode.DecodingError) as raised:  # WebDataset's own error names the tar
            list(wds.WebDataset([tar], shardshuffle=False).decode(handler))
        assert isinstance(raised.value.__cause__, CorruptShardError)
        assert re.search(rf"\(sample {sample_id}\): {says}", str(raised.value.__cause__))


def test_dspark_verify_reports_it_and_repair_deletes_the_shard(damaged):
    from dspark_cache.verify import repair, verify_cache

    root, tar, sample_id, says, _ = damaged
    report = verify_cache(root)
    assert not report.ok and len(report.corrupt) == 1
    problem = report.corrupt[0]
    assert (problem["shard"], problem["path"], problem["sample"]) == (SHARD, tar, sample_id)
    assert re.search(says, problem["reason"]) and problem["rebuildable"] is False  # the index is right
    repair(root, report)
    assert problem["repaired"] == "deleted"
    assert verify_cache(root).missing == [SHARD]


def test_the_rule_itself():
    ids, mask = np.array([0, 5, 9], np.int32), np.array([0, 1, 1], np.uint8)
    assert token_problem(ids, mask, 10) is None and token_problem(ids[:0], mask[:0], 1) is None
    assert "token id 10 at token 1" in token_problem(np.array([0, 10, 11]), mask, 10)
    assert "token id -3 at token 2" in token_problem(np.array([0, 1, -3]), mask, 10)
    assert "token id -3 at token 2 is negative" in token_problem(np.array([0, 1, -3]), mask, None)
    assert token_problem(np.array([0, 10**6]), mask[:2], None) is None  # no vocabulary known: no upper bound
    assert "loss mask value 2 at token 0" in token_problem(ids, np.array([2, 1, 1]), 10)
    assert "loss mask value -1 at token 1" in token_problem(ids, np.array([0, -1, 1]), 10)
    assert "token id" in token_problem(np.array([10, 0, 0]), np.array([2, 0, 0]), 10)  # ids are judged first


@pytest.mark.parametrize("blob", [
    b"",  # no header length at all
    (8).to_bytes(8, "little") + b"not json",
    (40).to_bytes(8, "little") + b'{"x": {"dtype": "BF16"}}'.ljust(40),  # a tensor without shape or offsets
    (2 ** 40).to_bytes(8, "little") + b"{}",  # a header length past the blob
    (30000).to_bytes(8, "little") + b"[" * 15000 + b"]" * 15000,  # nested past the parser
    (16).to_bytes(8, "little") + b'{"a": 1, "b": 2}',  # no tensors of ours
])
def test_a_blob_whose_header_does_not_parse_is_a_corrupt_sample(blob):
    """Issue 41, item 15: plain webdataset users get the same error as every reader, naming the member."""
    from dspark_cache.format.errors import CorruptShardError

    with pytest.raises(CorruptShardError, match="000007.safetensors"):
        decode_dspark_arrays("000007.safetensors", blob)
