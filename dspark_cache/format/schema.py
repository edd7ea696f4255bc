"""msgspec structs for every on-disk record: manifest, shard index, status and events.

Field names of ``Manifest`` that NeMo Automodel's ``manifest.json`` also has keep NeMo's names
and meaning, so NeMo's consumer checks can read them unchanged.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

T = TypeVar("T")

# The manifest's ``format_version`` is a string so that NeMo Automodel's reader, which accepts
# exactly the integer 1 for its own ``shard-NNNNNN.safetensors`` format, rejects our caches with
# its own clear error instead of failing deep inside its dataset. NeMo will never write a string.
FORMAT_ID = "dspark-wds/2"
# Caches of float8 states with scales (``dtype`` ``fp8``/``fp8_e5m2``) say this instead: a reader
# of FORMAT_ID alone refuses them with its "upgrade dspark-cache" message instead of misreading
# their samples. Every other cache keeps FORMAT_ID, so older readers still read it.
FORMAT_FP8 = "dspark-wds/3"
# Compressed caches (``compression`` other than "none", any dtype) say this: their samples are a
# header and a zstd frame (format.codec), which a reader of the two formats above would refuse as
# damaged; this way it says "upgrade dspark-cache" instead.
FORMAT_COMPRESSED = "dspark-wds/4"
FORMAT_IDS = (FORMAT_ID, FORMAT_FP8, FORMAT_COMPRESSED)
COMPRESSIONS = ("none", "zstd")  # the manifest's ``compression`` (format.codec.CODECS)
FP8_DTYPES = ("fp8", "fp8_e5m2")  # the manifest dtypes stored as float8 (format.sample.CACHE_DTYPES)
# The manifest's ``scale_scheme`` of FP8 caches: one float32 absmax scale per (token, captured
# layer), value = fp8 * scale (format.sample.SCALE_SCHEME, which every FP8 sample also names).
FP8_SCALE_SCHEME = "absmax-per-token-layer/F32"
# The first release wrote ``format_version: 1`` plus ``cache_format: "dspark-wds"``: NeMo's
# reader took such a manifest for its own format.
LEGACY_FORMAT = "dspark-wds"
INDEX_FORMAT_VERSION = 1

# Manifest fields that describe progress or provenance, not what the cache contains. Every
# other field is identity: resume refuses a cache whose identity differs from the new run's.
# ``regenerated`` is provenance: it is read from the input rows, whose bytes ``input_sha256`` already
# makes identity, so it can only differ when the input does (and an older cache without it resumes).
# ``max_batch_tokens`` is a setting whose effect ``planned_padded_tokens`` and ``plan_sha256`` carry.
NON_IDENTITY_FIELDS = frozenset(
    {"complete", "versions", "created_at", "completed_at", "num_samples", "nonfinite_samples", "cache_id",
     "target_weights_xxh3", "regenerated", "max_batch_tokens"}
)
TURN_MODES = ("all", "last")  # dspark-regenerate --turns: every assistant turn, or the last one only


class Regeneration(msgspec.Struct, kw_only=True, frozen=True):
    """How ``dspark-regenerate`` made a row's assistant turns: the served model and the sampling
    settings of its run (``seed`` is the run's ``--seed``; each row's own seed is derived from it)."""

    model: str
    turns: str
    temperature: float
    top_p: float
    max_tokens: int
    seed: int
    chat_template_kwargs: dict[str, Any] = msgspec.field(default_factory=dict)


REGENERATED_KEY = "regenerated"  # the key of a row's RowRegeneration, in dspark-regenerate's output rows


class RowSource(msgspec.Struct, kw_only=True, frozen=True):
    """Where a regenerated row came from: its position in the selected input, and ``file:line`` (or
    ``file row N``) there."""

    index: int
    where: str = ""


class RowRegeneration(Regeneration, kw_only=True, frozen=True):
    """The ``regenerated`` record of one output row: its run's settings, the seed its requests were
    sent with, each regenerated turn's finish reason, the tokens generated, and the input row it was
    made from (inside the record, so that an input column of any name, ``source`` included, is kept
    as it was)."""

    row_seed: int
    finish_reasons: list[str] = msgspec.field(default_factory=list)
    completion_tokens: int = 0
    source: RowSource | None = None

    def run(self) -> Regeneration:
        """The run's settings alone (what rows of one run share)."""
        return Regeneration(**{f: getattr(self, f) for f in Regeneration.__struct_fields__})


class RegeneratedInput(Regeneration, kw_only=True, frozen=True):
    """A manifest's ``regenerated`` entry: ``rows`` input rows were regenerated with these settings."""

    rows: int = 0


class RankPhase:
    """``RankStatus.phase``: where in its run a producer rank is. The producer writes only these."""

    PLANNING = "planning"  # reading and tokenising the input (the heartbeat starts after it)
    LOADING = "loading"  # loading the target onto the device
    RUNNING = "running"  # computing and publishing its shards
    WAITING = "waiting"  # its shards are done; waiting for the other ranks' (multi-rank runs)
    FINISHED = "finished"  # the cache is complete (or was already)
    STOPPED = "stopped"  # stopped on request after the shards in flight: rerun to resume
    INCOMPLETE = "incomplete"  # done, but shards of a rank that died are missing: rerun
    FAILED = "failed"  # raised an error (``last_error`` says which)
    ALL = (PLANNING, LOADING, RUNNING, WAITING, FINISHED, STOPPED, INCOMPLETE, FAILED)
    ACTIVE = (PLANNING, LOADING, RUNNING, WAITING)  # a live rank refreshes its heartbeat


class EventKind:
    """``Event.kind``: one line of a rank's event log. The producer writes only these."""

    RESUMED = "resumed"  # rank 0: shards already published by an earlier run
    PLAN = "plan"  # rank 0: the plan's totals
    SKIPPED_ROW = "skipped_row"  # rank 0: one input row that gives no sample, and why
    STARTED = "started"  # the target is loaded; computing this rank's shards
    SHARD_PUBLISHED = "shard_published"  # data: shard, samples, bytes
    WARNING = "warning"  # e.g. a sample dropped for non-finite hidden states
    STOPPED = "stopped"  # stopped on request
    ERROR = "error"  # the run failed (data.shard: the shard that failed), or shards are missing
    FINISHED = "finished"  # the rank that completed the cache
    ALL = (RESUMED, PLAN, SKIPPED_ROW, STARTED, SHARD_PUBLISHED, WARNING, STOPPED, ERROR, FINISHED)


class SkippedRow(msgspec.Struct, frozen=True):
    """An input row that produced no sample, and why."""

    row: int
    reason: str
    where: str = ""


class Manifest(msgspec.Struct, kw_only=True):
    """Run identity, plan and completion of a cache (``manifest.json``)."""

    format_version: str = FORMAT_ID
    complete: bool = False
    # NeMo's fields, same names and meaning.
    target_model: str
    target_model_type: str
    target_vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    seq_length: int
    dtype: str
    num_samples: int  # samples stored; planned_samples minus any dropped as non-finite
    shard_size: int
    target_hidden_dim: int
    target_last_hidden_dim: int
    target_layer_ids: list[int]
    train_data_path: str
    train_split: str | None = None
    shuffle_seed: int = 42
    mask_reasoning_content: bool = False
    mask_generation_prompt: bool = False
    chat_template_sha256: str = ""
    # What NeMo forgets.
    input_sha256: str = ""
    tokenizer_sha256: str = ""
    compute_dtype: str = ""
    attn_implementation: str | None = None
    pad_token_id: int = 0
    num_rows: int = 0
    planned_samples: int = 0
    num_shards: int = 0
    planned_tokens: int = 0
    planned_loss_tokens: int = 0
    planned_bytes: int = 0
    planned_padded_tokens: int = 0  # tokens the device computes, padding included
    # The padded-token budget the batches were cut with (--max-batch-tokens, else --batch-size x
    # --seq-length): with the fields above, the settings that make the same plan. 0: not recorded.
    max_batch_tokens: int = 0
    plan_sha256: str = ""  # which samples each shard holds (a resume must plan the same)
    scale_scheme: str = ""  # FP8 caches: how their scales were made (FP8_SCALE_SCHEME); else empty
    # How samples are stored: "none" (as they are), or "zstd" (byte planes + one zstd frame a sample,
    # format.codec) at ``compression_level`` (0 when none). One cache holds one codec: both are identity.
    compression: str = "none"
    compression_level: int = 0
    # What was loaded as the target: its weight files' names, sizes and a hash of their headers
    # (producer.target), so a checkpoint replaced at the same path is refused on resume.
    target_fingerprint: str = ""
    # This cache's life: made new when a run starts a cache (fresh or --overwrite), kept by every
    # resume, and written into every shard index, so a reader notices a cache replaced under it.
    cache_id: str = ""
    target_weights_xxh3: int | None = None  # xxh3_64 of target_weights.safetensors once written
    skipped_rows: dict[str, int] = msgspec.field(default_factory=dict)
    skipped: list[SkippedRow] = msgspec.field(default_factory=list)
    nonfinite_samples: list[int] = msgspec.field(default_factory=list)
    versions: dict[str, str] = msgspec.field(default_factory=dict)
    # Input rows that dspark-regenerate made, per distinct run (model and sampling settings); empty
    # when the rows say nothing of it (and in caches made before this field).
    regenerated: list[RegeneratedInput] = msgspec.field(default_factory=list)
    created_at: float = 0.0
    completed_at: float | None = None

    def __post_init__(self) -> None:
        # The format version and the scale scheme follow from the dtype: a new FP8 manifest is
        # marked as such wherever it is built. A decoded one is checked instead (decode_manifest).
        if self.dtype in FP8_DTYPES and self.format_version == FORMAT_ID and not self.scale_scheme:
            self.format_version, self.scale_scheme = FORMAT_FP8, FP8_SCALE_SCHEME
        if self.compression != "none" and self.format_version in (FORMAT_ID, FORMAT_FP8):
            self.format_version = FORMAT_COMPRESSED

    def identity(self) -> dict[str, Any]:
        """The fields that must match for a resume to reuse this cache's shards."""
        return {
            k: v for k, v in msgspec.structs.asdict(self).items() if k not in NON_IDENTITY_FIELDS
        }


def identity_diff(old: Manifest, new: Manifest) -> list[tuple[str, Any, Any]]:
    """Every identity field whose value differs, as ``(field, old, new)``."""
    a, b = old.identity(), new.identity()
    return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


class SampleEntry(msgspec.Struct, array_like=True, frozen=True):
    """Where one sample's safetensors payload lies inside its shard tar."""

    sample_id: int
    length: int
    loss_tokens: int
    offset: int  # byte offset of the payload (the safetensors blob) in the tar file
    size: int  # payload size in bytes
    xxh3: int  # xxh3_64 of the payload


class ShardIndex(msgspec.Struct, kw_only=True):
    """The ``shard-N.idx`` file: published last; a shard exists only when this matches it."""

    format_version: int = INDEX_FORMAT_VERSION
    shard_id: int
    tar_bytes: int
    tar_xxh3: int
    samples: list[SampleEntry]
    nonfinite: list[int] = msgspec.field(default_factory=list)  # planned ids dropped (--on-nonfinite skip)
    cache_id: str = ""  # the manifest's cache_id when this shard was written

    @property
    def num_samples(self) -> int:
        return len(self.samples)


class RankStatus(msgspec.Struct, kw_only=True):
    """A producer rank's heartbeat (``status/rank-N.json``), replaced about once a second."""

    rank: int
    world_size: int
    run_id: str = ""
    pid: int
    host: str
    # One of RankPhase.ALL; spelled "state" on disk, as every producer has written it.
    phase: str = msgspec.field(name="state")
    updated_at: float
    started_at: float
    shard: int | None = None  # the shard the device computes now
    # The shards this rank's writers have open (a batch of each queued, not yet published), in
    # order: several at once with --writer-threads. An older producer wrote none: ``shard`` then.
    writing: list[int] = msgspec.field(default_factory=list)
    shards_done: int = 0
    shards_owned: int = 0
    samples_done: int = 0
    tokens_done: int = 0
    bytes_written: int = 0
    samples_total: int = 0
    tokens_total: int = 0
    tokens_per_s: float = 0.0
    bytes_per_s: float = 0.0
    inflight_bytes: int = 0
    stage_seconds: dict[str, float] = msgspec.field(default_factory=dict)
    device_memory_bytes: int | None = None
    # the target's weights this rank holds (its shards under --tp-size/--ep-size)
    weight_bytes: int | None = None
    # Under --tp-size/--ep-size: the model-parallel group of ``group_size`` consecutive ranks this
    # rank computes with; its first rank writes the group's shards, the others write nothing.
    group: int | None = None
    group_size: int = 1
    last_error: str | None = None


class Lease(msgspec.Struct, kw_only=True):
    """The producer job's claim on a cache on object storage (``control/lease.json``): created only where
    none exists, renewed only over the version its holder wrote, free once ``renewed_at + ttl`` has passed."""

    host: str
    pid: int
    run_id: str
    world_size: int = 1
    started_at: float
    renewed_at: float
    ttl: float
    # Where ``pid`` lives: the machine's boot id and the pid namespace ("" when unknown, or written by an
    # earlier release); a taker on the same one may see that the holder's process is gone.
    node: str = ""


class Event(msgspec.Struct, kw_only=True):
    """One line of ``events/rank-N.jsonl``."""

    time: float
    rank: int
    kind: str  # one of EventKind.ALL
    message: str
    data: dict[str, Any] = msgspec.field(default_factory=dict)


_json_encoder = msgspec.json.Encoder()


def encode_json(obj: Any, *, pretty: bool = False) -> bytes:
    """Encode a struct to JSON; manifests are written indented and sorted for humans."""
    data = _json_encoder.encode(obj)
    return msgspec.json.format(data, indent=2) + b"\n" if pretty else data


class _FormatProbe(msgspec.Struct):
    format_version: Any = None
    cache_format: Any = None


def decode_json(data: bytes, kind: type[T]) -> T:
    """``msgspec.json.decode`` to ``kind``, where JSON nested past the decoder's depth limit is a
    ``DecodeError`` like any other bad file: msgspec raises RecursionError for it even when the deep
    value sits in a field the struct ignores, and every reader of our files handles DecodeError."""
    try:
        return msgspec.json.decode(data, type=kind)
    except RecursionError:
        raise msgspec.DecodeError("JSON nested too deep") from None


_DAMAGED = "it was damaged or edited: restore it, or re-produce the cache (dspark-produce ... --overwrite)"


def decode_manifest(data: bytes, where: str) -> Manifest:
    """Decode ``manifest.json``; a NeMo-format or older dspark manifest gets a message saying what to do."""
    try:
        probe = decode_json(data, _FormatProbe)
    except msgspec.DecodeError as exc:
        raise msgspec.DecodeError(f"{where}: not a valid dspark-cache manifest ({exc}); {_DAMAGED}") from exc
    if probe.format_version not in FORMAT_IDS:
        raise msgspec.DecodeError(f"{where}: {_foreign_format(probe)}")
    try:
        manifest = decode_json(data, Manifest)
    except msgspec.DecodeError as exc:
        raise msgspec.DecodeError(f"{where}: not a valid dspark-cache manifest ({exc}); {_DAMAGED}") from exc
    if manifest.format_version != probe.format_version:  # __post_init__ upgraded a manifest marked older
        what = (f"compression {manifest.compression!r}" if manifest.format_version == FORMAT_COMPRESSED
                else f"dtype {manifest.dtype!r} is stored as float8, which")
        raise msgspec.DecodeError(f"{where}: {what} format {probe.format_version!r} cannot hold (it needs "
                                  f"{manifest.format_version!r}); the manifest was edited: re-produce the "
                                  "cache (dspark-produce ... --overwrite)")
    return manifest


def _foreign_format(probe: _FormatProbe) -> str:
    if probe.cache_format == LEGACY_FORMAT:
        return (f"written by dspark-cache 0.1 (format {LEGACY_FORMAT} v{probe.format_version}), which this "
                f"version ({FORMAT_ID}) no longer reads; re-produce it: rerun dspark-produce with the same "
                "arguments plus --overwrite")
    if probe.format_version == 1:
        return ("a NeMo Automodel cache (shard-NNNNNN.safetensors layout), not a dspark cache; train from it "
                "through dspark_cache.nemo, or import it with: dspark-convert SRC DST --to dspark")
    return (f"format_version {probe.format_version!r} is not one of {list(FORMAT_IDS)}; upgrade dspark-cache "
            "or re-produce the cache")


def decode_shard_index(data: bytes) -> ShardIndex:
    return decode_json(data, ShardIndex)
