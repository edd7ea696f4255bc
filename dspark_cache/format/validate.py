"""Everything read from a cache is checked before it shapes anything: manifest, indexes, headers.

A checksum proves that a blob holds the bytes the writer wrote, not that the index describes it
right: a wrong ``length`` in an index would lay the right bytes out as the wrong tensors. So
every index field is checked against the manifest's geometry and against the shard's real size
(members tile the tar exactly as the writer places them), and each sample's header, which the
writer derives from the same fields, must be byte-identical to what the index implies.
Limits bound what a damaged or crafted file can make a reader allocate.
"""

from __future__ import annotations

from typing import Iterable, Mapping

import numpy as np

from dspark_cache.format.errors import CacheError, CorruptShardError
from dspark_cache.format.geometry import SampleShape
from dspark_cache.format.layers import validate_target_layer_ids
from dspark_cache.format.sample import (
    CACHE_DTYPES, HIDDEN, HIDDEN_SCALE, INPUT_IDS, LAST_HIDDEN, LAST_HIDDEN_SCALE, LOSS_MASK, StoredTensor,
    fp8_bad_codes, fp8_bad_scales, fp8_code_reason, fp8_scale_reason, is_fp8,
)
from dspark_cache.format.codec import LEVELS, frame_bound
from dspark_cache.format.schema import (
    COMPRESSIONS, FORMAT_COMPRESSED, FORMAT_FP8, FORMAT_ID, FP8_SCALE_SCHEME, TURN_MODES, Manifest,
    ShardIndex,
)
from dspark_cache.format.tar.members import END_OF_ARCHIVE, TAR_BLOCK, block_padding

MAX_MANIFEST_BYTES = 256 << 20  # the skipped-row list of a huge input stays far below
MAX_INDEX_BYTES = 256 << 20  # ~60 bytes per sample
MAX_SHARDS = 10_000_000
MAX_SEQ_LENGTH = 1 << 24
MAX_HIDDEN_SIZE = 1 << 20
MAX_LAYERS = 1 << 16
# A writer's header is 8 bytes, ~1 KiB of JSON and under 4 KiB of alignment spaces.
MAX_HEADER = 16 << 10
PAGE_ALIGN = 4096
_U64 = 1 << 64
# Token ids are int32 in a shard, so no vocabulary beyond this can be indexed by one.
MAX_VOCAB_SIZE = 1 << 31
# Loss mask values lie in [0, MASK_LIMIT): the batch fillers check widened masks against it.
MASK_LIMIT = 2


class InvalidManifestError(CacheError):
    """The manifest's fields contradict each other or are out of range."""


class ForeignShardError(CorruptShardError):
    """A shard index written for another cache (another ``cache_id``) than the manifest describes."""


def check_cache_id(index: ShardIndex, cache_id: str, path: str) -> None:
    """A shard belongs to the cache whose ``cache_id`` its index carries (``""``: caches from before ids)."""
    if index.cache_id != cache_id:
        raise ForeignShardError(
            path,
            f"the index was written for cache {index.cache_id or '(no id)'}, but the "
            f"manifest is cache {cache_id or '(no id)'}",
        )


def check_manifest(m: Manifest, where: str) -> None:
    """Raise one error listing every field of ``m`` that is out of range or contradicts another."""
    problems = list(manifest_problems(m))
    if problems:
        raise InvalidManifestError(
            f"{where} is not a valid dspark-cache manifest:\n  " + "\n  ".join(problems)
            + "\nIt was damaged or edited: re-produce the cache (dspark-produce ... --overwrite)."
        )


def manifest_problems(m: Manifest) -> Iterable[str]:
    """Every field of ``m`` out of range or contradicting another, in words (none: a valid manifest)."""
    if m.dtype not in CACHE_DTYPES:
        yield f"dtype {m.dtype!r} is not one of {sorted(CACHE_DTYPES)}"
    else:
        yield from _scheme_problems(m)
    # target_vocab_size bounds every token id (token_problem); the fillers read a limit of 0 as "unchecked"
    for name, value, top in (
        ("seq_length", m.seq_length, MAX_SEQ_LENGTH),
        ("hidden_size", m.hidden_size, MAX_HIDDEN_SIZE),
        ("num_hidden_layers", m.num_hidden_layers, MAX_LAYERS),
        ("shard_size", m.shard_size, _U64),
        ("target_vocab_size", m.target_vocab_size, MAX_VOCAB_SIZE),
    ):
        if not 1 <= value <= top:
            yield f"{name} {value} is not in [1, {top}]"
    try:
        validate_target_layer_ids(list(m.target_layer_ids), m.num_hidden_layers)
    except ValueError as exc:
        yield f"target_layer_ids: {exc}".replace("--target-layer-ids ", "")
    if m.target_hidden_dim != m.hidden_size * len(m.target_layer_ids):
        yield (f"target_hidden_dim {m.target_hidden_dim} is not hidden_size {m.hidden_size} x "
               f"{len(m.target_layer_ids)} layer ids")
    if m.target_last_hidden_dim != m.hidden_size:
        yield f"target_last_hidden_dim {m.target_last_hidden_dim} is not hidden_size {m.hidden_size}"
    if not 0 <= m.num_shards <= MAX_SHARDS:
        yield f"num_shards {m.num_shards} is not in [0, {MAX_SHARDS}]"
    if not 0 <= m.num_samples <= m.planned_samples:
        yield f"num_samples {m.num_samples} is not in [0, planned_samples {m.planned_samples}]"
    least = -(-m.planned_samples // m.shard_size) if m.shard_size >= 1 else 0
    if m.planned_samples >= 0 and not least <= m.num_shards <= max(m.planned_samples, least):
        yield (
            f"num_shards {m.num_shards} does not fit planned_samples {m.planned_samples} in shards of at most "
            f"shard_size {m.shard_size}"
        )
    if not 0 <= m.pad_token_id < max(m.target_vocab_size, 1):  # loaders pad input_ids with it
        yield f"pad_token_id {m.pad_token_id} is not in [0, target_vocab_size {m.target_vocab_size})"
    yield from _regenerated_problems(m)


def _regenerated_problems(m: Manifest) -> Iterable[str]:
    """Each ``regenerated`` entry names a model, a --turns mode and counts rows the input holds."""
    for i, entry in enumerate(m.regenerated):
        if not entry.model:
            yield f"regenerated[{i}] names no model"
        if entry.turns not in TURN_MODES:
            yield f"regenerated[{i}].turns {entry.turns!r} is not one of {list(TURN_MODES)}"
        if not 1 <= entry.rows <= m.num_rows:
            yield f"regenerated[{i}].rows {entry.rows} is not in [1, num_rows {m.num_rows}]"
    if sum(entry.rows for entry in m.regenerated) > m.num_rows:
        yield f"regenerated lists {sum(e.rows for e in m.regenerated)} rows, more than num_rows {m.num_rows}"


def _scheme_problems(m: Manifest) -> Iterable[str]:
    """FP8 caches say format FORMAT_FP8 and how their scales were made; others neither. Compressed
    caches (of any dtype) say FORMAT_COMPRESSED, a known codec and a level it takes."""
    fp8 = is_fp8(CACHE_DTYPES[m.dtype])
    version, scheme = (FORMAT_FP8, FP8_SCALE_SCHEME) if fp8 else (FORMAT_ID, "")
    if m.compression not in COMPRESSIONS:
        yield f"compression {m.compression!r} is not one of {list(COMPRESSIONS)}"
    elif m.compression != "none":
        version = FORMAT_COMPRESSED
        if not LEVELS[0] <= m.compression_level <= LEVELS[1]:
            yield f"compression_level {m.compression_level} is not in [{LEVELS[0]}, {LEVELS[1]}]"
    elif m.compression_level != 0:
        yield f"compression_level {m.compression_level} is not 0, but nothing is compressed"
    if m.format_version != version:
        yield f"format_version {m.format_version!r} does not fit dtype {m.dtype!r} (it needs {version!r})"
    if m.scale_scheme != scheme:
        yield f"scale_scheme {m.scale_scheme!r} does not fit dtype {m.dtype!r} (it needs {scheme!r})"


def check_fp8_sample(sample: Mapping[str, StoredTensor], path: str, sample_id: int | None) -> None:
    """An assembled sample (``assemble_sample``) whose FP8 scales or codes break the FP8 rule
    (``format.sample.fp8_bad_scales``, ``fp8_bad_codes``) is refused, naming its first bad token;
    any other sample passes. Scales are checked before the states they scale, as the fillers do."""
    hidden = sample.get(HIDDEN)
    if hidden is None or not is_fp8(hidden.code):
        return
    for name, scale_name in ((HIDDEN, HIDDEN_SCALE), (LAST_HIDDEN, LAST_HIDDEN_SCALE)):
        states, scales = sample[name].array, sample[scale_name].array
        rows, groups = scales.shape if scales.ndim == 2 else (-1, 0)
        if states.ndim != 2 or rows != states.shape[0] or not groups or states.shape[1] % groups:
            raise CorruptShardError(
                path,
                f"{scale_name} of shape {list(scales.shape)} does not fit {name} of shape "
                f"{list(states.shape)}",
                sample_id,
            )
        bad = fp8_bad_scales(scales, hidden.code)
        if bad.any():
            token, column = (int(i) for i in np.argwhere(bad)[0])
            raise CorruptShardError(
                path, fp8_scale_reason(token, column, float(scales[token, column])), sample_id
            )
        bad = fp8_bad_codes(states, hidden.code)
        if bad.any():
            token, at = (int(i) for i in np.argwhere(bad)[0])
            raise CorruptShardError(
                path, fp8_code_reason(token, at // (states.shape[1] // groups)), sample_id
            )


def token_problem(ids: np.ndarray, mask: np.ndarray, vocab_size: int | None) -> str | None:
    """Why these token ids and loss mask cannot be a sample's, or None: every id must index the
    target's embedding (``0 <= id < vocab_size``, the manifest's ``target_vocab_size``) and every
    mask value be 0 or 1. The one rule for what a shard may hold: the producer rebuilds a saved plan
    that breaks it, and every reader refuses a sample that does (:func:`check_token_values`; the
    batch fillers check the same bounds as they widen, and name the sample by this function). A
    reader without the manifest (``vocab_size`` None: a plain WebDataset decoder) checks ``id >= 0``."""
    if ids.size:
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or (vocab_size is not None and high >= vocab_size):
            bad = (ids < 0) if vocab_size is None else (ids < 0) | (ids >= vocab_size)
            at = int(np.argmax(bad))
            if vocab_size is None:
                return f"token id {int(ids[at])} at token {at} is negative (no embedding row has that index)"
            return (
                f"token id {int(ids[at])} at token {at} is outside the target's vocabulary size {vocab_size} "
                "(its embedding rows)"
            )
    if mask.size and not 0 <= int(mask.min()) <= int(mask.max()) < MASK_LIMIT:
        at = int(np.argmax((mask < 0) | (mask >= MASK_LIMIT)))
        return f"loss mask value {int(mask[at])} at token {at} is not 0 or 1"
    return None


def check_token_values(sample: Mapping[str, StoredTensor], vocab_size: int | None, path: str,
                       sample_id: int | None) -> None:
    """A decoded sample whose token ids or loss mask break :func:`token_problem`'s rule is refused:
    training would index the embedding out of range (a device-side assert naming no file) or weight
    its loss wrongly. The checksum cannot catch it: such bytes can be the writer's own."""
    problem = token_problem(sample[INPUT_IDS].array, sample[LOSS_MASK].array, vocab_size)
    if problem is not None:
        raise CorruptShardError(path, problem, sample_id)


def check_index(index: ShardIndex, shard_id: int, shape: SampleShape, seq_length: int, path: str) -> None:
    """Every entry in range, members tiling the tar exactly as the writer places them, ids unique."""
    if index.shard_id != shard_id:
        raise CorruptShardError(path, f"the index says it belongs to shard {index.shard_id}")
    if not 0 <= index.tar_xxh3 < _U64:
        raise CorruptShardError(path, f"tar_xxh3 {index.tar_xxh3} is not a 64-bit checksum")
    cursor = 0
    seen: set[int] = set()
    for entry in index.samples:
        _check_entry(entry, shape, seq_length, cursor, path)
        if entry.sample_id in seen:
            raise CorruptShardError(path, "the index lists this sample twice", entry.sample_id)
        seen.add(entry.sample_id)
        cursor = entry.offset + entry.size + block_padding(entry.size)
    if cursor + END_OF_ARCHIVE != index.tar_bytes:
        raise CorruptShardError(
            path,
            f"the indexed samples end at byte {cursor}, but the tar has {index.tar_bytes} "
            "bytes: entries are missing or sizes are wrong",
        )
    if any(not 0 <= sid for sid in index.nonfinite):
        raise CorruptShardError(path, "a dropped (non-finite) sample id is negative")


def _check_entry(entry, shape: SampleShape, seq_length: int, cursor: int, path: str) -> None:
    def bad(reason: str) -> CorruptShardError:
        return CorruptShardError(path, f"index entry: {reason}", entry.sample_id)

    if entry.sample_id < 0:
        raise bad("negative sample id")
    if not 1 <= entry.length <= seq_length:
        raise bad(f"length {entry.length} is not in [1, seq_length {seq_length}]")
    if not 0 <= entry.loss_tokens <= entry.length:
        raise bad(f"loss_tokens {entry.loss_tokens} is not in [0, length {entry.length}]")
    if entry.offset != cursor + TAR_BLOCK:
        raise bad(f"offset {entry.offset} is not where the writer puts it ({cursor + TAR_BLOCK})")
    if shape.compressed:  # the exact header, then a frame no longer than zstd's bound for the data
        header = shape.header_size(entry.length, entry.sample_id, entry.offset, entry.size)
        if not header < entry.size <= header + frame_bound(shape.data_size(entry.length)):
            raise bad(f"size {entry.size} does not fit a compressed {entry.length}-token sample of this "
                      "cache's shape")
    else:
        header = entry.size - shape.data_size(entry.length)
        if not 8 <= header <= MAX_HEADER or (entry.offset + header) % PAGE_ALIGN:
            raise bad(f"size {entry.size} does not fit a {entry.length}-token sample of this cache's shape")
    if not 0 <= entry.xxh3 < _U64:
        raise bad(f"xxh3 {entry.xxh3} is not a 64-bit checksum")


def check_header(actual: bytes | memoryview, entry, shape: SampleShape, path: str) -> None:
    """The sample's header must be exactly what the writer derives from its index entry."""
    if bytes(actual) != shape.header(entry.length, entry.sample_id, entry.offset):
        raise CorruptShardError(
            path, "the sample's header does not match its index entry (length, id or shape)", entry.sample_id
        )


def check_catalog(manifest: Manifest, indexes: dict[int, ShardIndex], where: str) -> None:
    """Across shards of a complete cache: the listed shards, unique ids, the manifest's sample count."""
    extra = sorted(s for s in indexes if not 0 <= s < manifest.num_shards)
    if extra:
        raise CacheError(
            f"{where}: shards {extra[:5]} are published but the manifest plans {manifest.num_shards} "
            "shards; the manifest or the shard directory was tampered with: run dspark-verify"
        )
    seen: set[int] = set()
    total = 0
    for shard_id, index in indexes.items():
        for entry in index.samples:
            if entry.sample_id in seen:
                raise CorruptShardError(
                    where,
                    f"sample {entry.sample_id} is listed by two shards (one is shard "
                    f"{shard_id}); run dspark-verify --repair",
                    entry.sample_id,
                )
            seen.add(entry.sample_id)
        total += index.num_samples
    if manifest.complete and len(indexes) == manifest.num_shards and total != manifest.num_samples:
        raise CacheError(
            f"{where}: the shards hold {total} samples but the manifest says {manifest.num_samples}; "
            "run dspark-verify, then rerun dspark-produce to repair"
        )
