"""Rebuild a shard's index from its tar, when the tar is provably intact and only the index is not.

The proof is the whole-tar checksum the damaged index still carries: when it matches the tar,
every byte of the tar is what the writer wrote, and the writer's deterministic layout gives back
each sample's entry (offset, size, length from its header, loss tokens from its mask). Without
that checksum nothing proves the tar intact, and the shard must be recomputed instead.
"""

from __future__ import annotations

import json
import os
import re
import struct
import tarfile

import msgspec
import numpy as np
import xxhash

from dspark_cache.format.files import read_regular
from dspark_cache.format.geometry import SampleShape
from dspark_cache.format.paths import CachePaths
from dspark_cache.format.sample import INPUT_IDS, LOSS_MASK
from dspark_cache.format.schema import Manifest, SampleEntry, ShardIndex
from dspark_cache.format.validate import MAX_HEADER, MAX_INDEX_BYTES, check_index

_MEMBER = re.compile(r"^(\d{10})\.safetensors$")
_CHUNK = 8 << 20


class _Salvage(msgspec.Struct):
    """What can still be read from a damaged index: the fields that do not describe samples."""

    tar_xxh3: int | None = None
    nonfinite: list[int] = []
    cache_id: str = ""


def salvage(paths: CachePaths, shard_id: int) -> _Salvage | None:
    try:
        return msgspec.json.decode(read_regular(paths.shard_index(shard_id), MAX_INDEX_BYTES), type=_Salvage)
    except Exception:  # whatever the damage: nothing to salvage
        return None


def rebuild_index(paths: CachePaths, shard_id: int, manifest: Manifest) -> ShardIndex | None:
    """The shard's index rebuilt from its tar, or None when the tar cannot be proven intact."""
    old = salvage(paths, shard_id)
    path = paths.shard_tar(shard_id)
    if old is None or old.tar_xxh3 is None or not os.path.isfile(path) or os.path.islink(path):
        return None
    if old.cache_id != manifest.cache_id:  # another cache's tar, however intact, is not this cache's shard
        return None
    with open(path, "rb") as handle:
        digest = xxhash.xxh3_64()
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    if digest.intdigest() != old.tar_xxh3:
        return None
    shape = SampleShape.from_manifest(manifest)
    try:
        entries = _entries(path, shape)
        index = ShardIndex(shard_id=shard_id, tar_bytes=os.path.getsize(path), tar_xxh3=old.tar_xxh3,
                           samples=entries, nonfinite=list(old.nonfinite), cache_id=old.cache_id)
        check_index(index, shard_id, shape, manifest.seq_length, path)
    except Exception:  # a damaged member can fail to parse in any way: then the tar is not intact
        return None
    return index


def _entries(path: str, shape: SampleShape) -> list[SampleEntry]:
    entries = []
    with tarfile.open(path, "r:") as tar, open(path, "rb") as raw:
        for member in tar:
            match = _MEMBER.match(member.name)
            if not member.isreg() or match is None:
                raise ValueError(f"unexpected member {member.name!r}")
            entries.append(_entry(raw, int(match.group(1)), member.offset_data, member.size, shape))
    return entries


def _entry(raw, sample_id: int, offset: int, size: int, shape: SampleShape) -> SampleEntry:
    raw.seek(offset)
    (header_len,) = struct.unpack("<Q", raw.read(8))
    if header_len > MAX_HEADER or header_len + 8 > size:
        raise ValueError("header too large")
    text = raw.read(header_len)
    header = json.loads(text)
    length = int(header[INPUT_IDS]["shape"][0])
    if shape.header(length, sample_id, offset) != struct.pack("<Q", header_len) + text:
        raise ValueError("header does not match the cache's shape")
    start, end = header[LOSS_MASK]["data_offsets"]
    if shape.compressed:  # the mask lies inside the frame: decode the sample (bounded by its length)
        raw.seek(offset)
        blob = shape.decode(raw.read(size), length)
        mask = memoryview(blob)[8 + header_len + start : 8 + header_len + end]
    else:
        raw.seek(offset + 8 + header_len + start)
        mask = raw.read(end - start)
    loss_tokens = int(np.count_nonzero(np.frombuffer(mask, dtype=np.uint8)))
    digest = xxhash.xxh3_64()
    raw.seek(offset)
    left = size
    while left:
        chunk = raw.read(min(_CHUNK, left))
        if not chunk:
            raise ValueError("tar ends inside a sample")
        digest.update(chunk)
        left -= len(chunk)
    return SampleEntry(sample_id, length, loss_tokens, offset, size, digest.intdigest())
