"""The saved plan: what it is keyed by, how parts are merged, how it is checked and loaded.

Two keys decide what a rerun may reuse. The *encode key* covers everything the tokens depend
on (input bytes, split, shuffle, tokenizer, template, sequence length, mask rules, this
version): parts with the same key are reused, whatever the number of ranks that wrote them.
The *batching key* adds what batching and shard sizes depend on (sample shape, shard size, batch
budget): a plan with the same batching key is loaded as it is. Everything loaded is checked
(sizes before checksums, then values: a plan forged with matching checksums is still refused),
and anything wrong is rebuilt, never trusted.
"""

from __future__ import annotations

import errno
import hashlib
import logging
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import xxhash

from dspark_cache import __version__
from dspark_cache.format.errors import CacheError
from dspark_cache.format.files import read_regular
from dspark_cache.format.geometry import SampleShape
from dspark_cache.format.paths import PLAN_ARRAYS, PLAN_PART_KINDS, CachePaths
from dspark_cache.format.plan import (
    BOUNDARY,
    LOSS_MASK,
    MAX_HEADER_BYTES,
    PART_ROW,
    PLAN_SAMPLE,
    TOKEN_ID,
    ArrayRecord,
    PartHeader,
    PlanError,
    PlanHeader,
    load_array,
    read_header,
    token_problem,
    write_array,
    write_header,
)
from dspark_cache.format.schema import SkippedRow
from dspark_cache.producer.encode.template import sha256_text, tokenizer_sha256
from dspark_cache.producer.plan.batches import MAX_PAD_FRACTION, Plan, TokenStore, plan_from_rows
from dspark_cache.producer.plan.parts import NO_SUPERVISED_TOKEN, plan_disk_full
from dspark_cache.storage.output import CacheOutput

log = logging.getLogger(__name__)

MAX_LISTED_INVALID = 20  # invalid rows described one by one in the error; the rest are counted


class InvalidInputError(Exception):
    """Rows are invalid and the policy is ``error``; raised while planning, before device work."""


@dataclass(frozen=True)
class PlanSpec:
    """What a saved plan must have been made for, and the bounds every value in it must keep."""

    keys: tuple[str, str]  # (encode key, batching key)
    vocab_size: int  # the target's embedding rows: every token id is below it
    seq_length: int  # no sample is longer
    shape: SampleShape
    shard_size: int
    max_batch_tokens: int


def _key(fields: dict[str, Any]) -> str:
    return hashlib.sha256(msgspec.json.encode(fields, order="sorted")).hexdigest()


def encode_key(cfg: Any, tokenizer: Any, input_sha256: str, vocab_size: int) -> str:
    """What every sample's tokens depend on (``cfg``: the producer's settings; ``vocab_size``: the
    target's, which decides which rows are invalid)."""
    return _key(
        {
            "version": __version__,
            "input": str(cfg.input_data),
            "input_sha256": input_sha256,
            "split": cfg.split,
            "shuffle_seed": cfg.shuffle_seed,
            "max_row_bytes": cfg.max_row_bytes,
            "seq_length": cfg.seq_length,
            "tokenizer_sha256": tokenizer_sha256(tokenizer),
            "chat_template_sha256": sha256_text(tokenizer.chat_template),
            "mask_reasoning_content": cfg.mask_reasoning_content,
            "mask_generation_prompt": cfg.mask_generation_prompt,
            "vocab_size": vocab_size,
        }
    )


def batching_key(key: str, shape: SampleShape, shard_size: int, max_batch_tokens: int) -> str:
    """What the batches, shards and their sizes depend on, besides the tokens."""
    return _key(
        {
            "encode_key": key,
            "shape": [list(shape.layer_ids), shape.num_layers, shape.hidden_size, shape.dtype],
            "shard_size": shard_size,
            "max_batch_tokens": max_batch_tokens,
            "max_pad": MAX_PAD_FRACTION,
        }
    )


def _header_digest(path: str) -> ArrayRecord:
    try:
        raw = read_regular(path, MAX_HEADER_BYTES)
    except FileNotFoundError:
        raise PlanError(f"{path} is missing") from None
    except CacheError as exc:
        raise PlanError(str(exc)) from exc
    return ArrayRecord(len(raw), xxhash.xxh3_64_hexdigest(raw))


# -- parts -------------------------------------------------------------------------------------

def read_parts(paths: CachePaths, spec: PlanSpec, verify: bool = False) -> list[PartHeader] | None:
    """Every part of an earlier tokenisation with this encode key, or None when any is missing or
    differs (``verify``: or when any of their arrays does not match its header and ``spec``)."""
    key = spec.keys[0]
    try:
        first = read_header(paths.plan_part_header(0), PartHeader)
        if first is None or first.encode_key != key or first.part != 0:
            return None
        # every part has a header there: a count past that is a lie
        on_disk = len(CacheOutput(paths.root).plan_files())
        if not 1 <= first.num_parts <= on_disk:
            raise PlanError(
                f"{paths.plan_part_header(0)} claims {first.num_parts} parts, and {paths.plan_dir} "
                f"holds {on_disk} plan files"
            )
        parts = [first]
        for k in range(1, first.num_parts):  # stops at the first part that is not there
            p = read_header(paths.plan_part_header(k), PartHeader)
            if p is None or p.encode_key != key or p.num_parts != first.num_parts or p.part != k:
                return None
            parts.append(p)
        for p in parts:
            _check_part_header(p, spec)
        if verify:
            open_store(paths, parts, spec)  # type: ignore[arg-type]
    except (PlanError, KeyError) as exc:
        log.warning("saved plan part unusable (%s); the input is tokenised again", exc)
        return None
    return parts  # type: ignore[return-value]


def _check_part_header(p: PartHeader, spec: PlanSpec) -> None:
    """What a part's header says must fit together before any of its arrays is read."""
    a = p.arrays
    if sorted(a) != sorted(PLAN_PART_KINDS):
        raise PlanError(f"part {p.part} lists arrays {sorted(a)}, not {sorted(PLAN_PART_KINDS)}")
    samples = a["rows"].length
    if not (a["ids"].length == a["mask"].length == p.tokens and 0 <= samples <= p.rows
            and samples + len(p.skipped) == p.rows and 0 <= p.tokens <= samples * spec.seq_length):
        raise PlanError(
            f"part {p.part}: {p.rows} rows, {samples} samples, {len(p.skipped)} skipped, {p.tokens} "
            f"tokens ({a['ids'].length} ids, {a['mask'].length} mask values) do not fit together"
        )


def open_store(
    paths: CachePaths, parts: list[PartHeader], spec: PlanSpec
) -> tuple[TokenStore, list[np.ndarray]]:
    """Memory-map every part's tokens, checked against its header and by value (``spec``: the
    bounds); also returns their row tables."""
    token_parts, tables = [], []
    for p in parts:
        _check_part_header(p, spec)
        table = load_array(paths.plan_part(p.part, "rows"), PART_ROW, p.arrays["rows"])
        _check_rows(p, table, spec)  # before the tokens are read: their size must follow from it
        check = _TokenCheck(table, spec.vocab_size)
        ids = load_array(paths.plan_part(p.part, "ids"), TOKEN_ID, p.arrays["ids"], inspect=check.ids)
        mask = load_array(paths.plan_part(p.part, "mask"), LOSS_MASK, p.arrays["mask"], inspect=check.mask)
        if check.bad:  # read through the map for the message's position: a refused part only
            raise PlanError(f"part {p.part}: {token_problem(ids, mask, spec.vocab_size)}")
        if not np.array_equal(check.loss_tokens(), table["loss_tokens"]):
            raise PlanError(f"part {p.part}: its row table's loss token counts are not its masks'")
        token_parts.append((ids, mask))
        tables.append(table)
    # Every input row is one sample or one skipped row, once: a row twice would be merged twice.
    rows = np.concatenate(
        [t["sample_id"] for t in tables]
        + [np.array([r.row for p in parts for r in p.skipped], dtype=np.int64)]
    )
    if np.unique(rows).shape[0] != rows.shape[0]:
        raise PlanError("the saved parts hold the same row twice")
    return TokenStore(token_parts), tables


_SUM_SLICE = 1 << 16  # mask values summed at a time (an int64 running sum and its cast: ~1 MiB)
_NO_IDS, _NO_MASK = np.zeros(0, TOKEN_ID), np.zeros(0, LOSS_MASK)


class _TokenCheck:
    """:func:`token_problem`'s verdict and each row's loss tokens, gathered chunk by chunk as
    ``load_array`` reads a part's ids and masks for their checksums. Checked through the memory
    map instead, every token page stayed resident and the mask was widened to int64 whole (~13
    bytes per token: planning's memory grew with the input, issue 41 item 13)."""

    def __init__(self, table: np.ndarray, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.ends = np.cumsum(table["length"], dtype=np.int64)  # the rows tile the tokens (_check_rows)
        self.sums_at_ends = np.zeros(self.ends.shape[0], dtype=np.int64)  # mask sum up to each row's end
        self.bad = False
        self.seen = self.total = 0  # mask values read so far, and their sum

    def ids(self, chunk: np.ndarray) -> None:
        self.bad = self.bad or token_problem(chunk, _NO_MASK, self.vocab_size) is not None

    def mask(self, chunk: np.ndarray) -> None:
        self.bad = self.bad or token_problem(_NO_IDS, chunk, self.vocab_size) is not None
        for first in range(0, chunk.shape[0], _SUM_SLICE):
            piece = np.cumsum(chunk[first:first + _SUM_SLICE], dtype=np.int64)
            lo, hi = self.seen, self.seen + piece.shape[0]
            i, j = np.searchsorted(self.ends, [lo, hi], side="right")  # the rows that end in (lo, hi]
            self.sums_at_ends[i:j] = self.total + piece[self.ends[i:j] - lo - 1]
            self.seen, self.total = hi, self.total + int(piece[-1])

    def loss_tokens(self) -> np.ndarray:
        """Each row's mask sum (rows not reached, in a mask cut short, come out wrong, as they should)."""
        return np.diff(self.sums_at_ends, prepend=0)


def _check_rows(p: PartHeader, table: np.ndarray, spec: PlanSpec) -> None:
    """A part's rows lie back to back in its tokens, in order, each within ``--seq-length``."""
    lengths = table["length"].astype(np.int64)
    ends = np.cumsum(lengths)
    tiled = (ends[-1] if table.size else 0) == p.tokens and (not table.size or (
        table["offset"][0] == 0 and np.array_equal(table["offset"][1:], ends[:-1])))
    if not tiled:
        raise PlanError(f"part {p.part}: its row table does not tile its {p.tokens} tokens in order")
    if table.size and not (
        1 <= lengths.min()
        and lengths.max() <= spec.seq_length
        and table["sample_id"].min() >= 0
        and 1 <= table["loss_tokens"].min()
        and bool(np.all(table["loss_tokens"] <= lengths))
    ):
        raise PlanError(f"part {p.part}: a row's length (1..{spec.seq_length}), loss token count or id is "
                        "out of range")


def merge_parts(parts: list[PartHeader], store: TokenStore, tables: list[np.ndarray], spec: PlanSpec) -> Plan:
    """One plan from every part (as :func:`open_store` checked them): their samples batched
    together, their skipped rows together."""
    rows = np.zeros(sum(t.shape[0] for t in tables), dtype=PLAN_SAMPLE)
    at = 0
    for k, table in enumerate(tables):
        span = rows[at:at + table.shape[0]]
        for name in PART_ROW.names:
            span[name] = table[name]
        span["part"] = k
        at += table.shape[0]
    skipped = [row for p in parts for row in p.skipped]
    return plan_from_rows(
        sum(p.rows for p in parts),
        rows,
        store,
        skipped,
        spec.shape,
        shard_size=spec.shard_size,
        max_batch_tokens=spec.max_batch_tokens,
    )


def listed_rows(parts: list[PartHeader], rows: list[SkippedRow]) -> list[str]:
    """``where: why`` for the first ``MAX_LISTED_INVALID`` of ``rows`` (in input order), then how many more."""
    details = {n.row: n.detail for p in parts for n in p.invalid}
    first = sorted(rows, key=lambda r: r.row)[:MAX_LISTED_INVALID]
    lines = [f"  {r.where}: {details.get(r.row, r.reason)}" for r in first]
    if len(rows) > len(first):
        lines.append(f"  ... and {len(rows) - len(first)} more")
    return lines


def check_invalid_rows(parts: list[PartHeader], on_invalid: str) -> None:
    """Apply ``--on-invalid error`` to the whole input: every invalid row counted, the first listed."""
    invalid = [row for p in parts for row in p.skipped if row.reason != NO_SUPERVISED_TOKEN]
    if on_invalid != "error" or not invalid:
        return
    lines = listed_rows(parts, invalid)
    raise InvalidInputError(
        f"{len(invalid)} invalid input row{'s' if len(invalid) != 1 else ''}:\n" + "\n".join(lines) +
        "\nFix or remove these rows, or pass --on-invalid skip to skip invalid rows (they are counted and "
        "listed in the manifest)"
    )


# -- the merged plan ---------------------------------------------------------------------------

_PLAN_ARRAYS = dict(zip(PLAN_ARRAYS, (PLAN_SAMPLE, BOUNDARY, BOUNDARY, BOUNDARY)))  # names from format.paths


def save_plan(paths: CachePaths, plan: Plan, parts: list[PartHeader], keys: tuple[str, str]) -> None:
    """Write the merged plan's arrays, then its header (an earlier header goes first: it must not
    describe arrays that are being replaced)."""
    values = {"samples": plan.samples, "batches": plan.batch_starts, "shards": plan.shard_starts,
              "shard_bytes": plan.shard_bytes}
    try:
        CacheOutput(paths.root).remove([paths.plan_header])
        arrays = {name: write_array(paths.plan_array(name), values[name], dtype)
                  for name, dtype in _PLAN_ARRAYS.items()}
        header = PlanHeader(
            encode_key=keys[0],
            batching_key=keys[1],
            num_rows=plan.num_rows,
            num_parts=len(parts),
            parts=[_header_digest(paths.plan_part_header(p.part)) for p in parts],
            arrays=arrays,
            shard_samples_sha256=plan.shard_samples_sha256(),
            skipped=plan.skipped,
            invalid=sorted((n for p in parts for n in p.invalid), key=lambda n: n.row),
        )
        write_header(paths.plan_header, header)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        needed = sum(v.nbytes for v in values.values()) + _HEADER_ROOM * (1 + len(plan.skipped))
        raise plan_disk_full(paths, exc, needed, f"the merged plan of {plan.num_samples} samples") from exc


_HEADER_ROOM = 256  # bytes: a .npy header, or about one skipped row's line in the plan's JSON header


def load_plan(paths: CachePaths, spec: PlanSpec) -> tuple[Plan, list[PartHeader]] | None:
    """The saved plan when its keys match and every file checks out; None otherwise (rebuild)."""
    try:
        header = read_header(paths.plan_header, PlanHeader)
        if header is None or (header.encode_key, header.batching_key) != spec.keys:
            return None
        parts = read_parts(paths, spec)
        if parts is None or len(parts) != header.num_parts or header.parts != [
                _header_digest(paths.plan_part_header(p.part)) for p in parts]:
            raise PlanError("its parts are not the ones it was merged from")
        store, tables = open_store(paths, parts, spec)
        a = {name: load_array(paths.plan_array(name), dtype, header.arrays[name])
             for name, dtype in _PLAN_ARRAYS.items()}
        plan = Plan(
            header.num_rows, a["samples"], a["batches"], a["shards"], a["shard_bytes"], store, header.skipped
        )
        _check_plan(plan, header, merge_parts(parts, store, tables, spec))
    except (PlanError, KeyError, OSError) as exc:
        log.warning("saved plan in %s unusable (%s); it is rebuilt", paths.plan_dir, exc)
        return None
    return plan, parts


def _check_plan(plan: Plan, header: PlanHeader, derived: Plan) -> None:
    """A plan whose files are whole can still be hostile: it must be exactly the plan its checked
    parts give (same samples, batches, shards and sizes). Batching the row tables again costs
    about 3 s per million samples, against minutes to tokenise them."""
    same = (plan.num_rows == derived.num_rows and plan.samples.tobytes() == derived.samples.tobytes()
            and all(np.array_equal(getattr(plan, n), getattr(derived, n))
                    for n in ("batch_starts", "shard_starts", "shard_bytes"))
            and header.skipped == derived.skipped)
    if not same:
        raise PlanError("its samples, batches, shards or sizes are not the ones its parts give")
    if derived.shard_samples_sha256() != header.shard_samples_sha256:
        raise PlanError("its shard layout does not match its header")
