"""The saved plan: what it is keyed by, how parts are merged, how it is checked and loaded.

Two keys decide what a rerun may reuse. The *encode key* covers everything the tokens depend
on (input bytes, split, shuffle, tokenizer, template, sequence length, mask rules, this
version): parts with the same key are reused, whatever the number of ranks that wrote them.
The *layout key* adds what batching and shard sizes depend on (sample shape, shard size, batch
budget): a plan with the same layout key is loaded as it is. Everything loaded is checked
(checksums, lengths, ranges), and anything wrong is rebuilt, never trusted.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import msgspec
import numpy as np
import xxhash

from dspark_cache import __version__
from dspark_cache.format.geometry import SampleShape
from dspark_cache.format.paths import PLAN_ARRAYS, CachePaths
from dspark_cache.format.plan import (
    BOUNDARY, LOSS_MASK, PART_ROW, PLAN_SAMPLE, TOKEN_ID, ArrayRecord, PartHeader, PlanError, PlanHeader,
    load_array, read_header, write_array, write_header,
)
from dspark_cache.format.schema import SkippedRow
from dspark_cache.producer.layout import check_layout, plan_files, remove_files
from dspark_cache.producer.plan import MAX_PAD_FRACTION, Plan, TokenStore, plan_from_rows
from dspark_cache.producer.plan_parts import NO_SUPERVISED_TOKEN
from dspark_cache.producer.template import sha256_text, tokenizer_sha256

log = logging.getLogger(__name__)

MAX_LISTED_INVALID = 20  # invalid rows described one by one in the error; the rest are counted


class InvalidInputError(Exception):
    """Rows are invalid and the policy is ``error``; raised while planning, before device work."""


def _key(fields: dict[str, Any]) -> str:
    return hashlib.sha256(msgspec.json.encode(fields, order="sorted")).hexdigest()


def encode_key(cfg: Any, tokenizer: Any, input_sha256: str) -> str:
    """What every sample's tokens depend on (``cfg``: the producer's settings)."""
    return _key({
        "version": __version__, "input": str(cfg.input_data), "input_sha256": input_sha256, "split": cfg.split,
        "shuffle_seed": cfg.shuffle_seed, "max_row_bytes": cfg.max_row_bytes, "seq_length": cfg.seq_length,
        "tokenizer_sha256": tokenizer_sha256(tokenizer), "chat_template_sha256": sha256_text(tokenizer.chat_template),
        "mask_reasoning_content": cfg.mask_reasoning_content, "mask_generation_prompt": cfg.mask_generation_prompt,
    })


def layout_key(key: str, shape: SampleShape, shard_size: int, max_batch_tokens: int) -> str:
    """What the batches, shards and their sizes depend on, besides the tokens."""
    return _key({"encode_key": key, "shape": [list(shape.layer_ids), shape.num_layers, shape.hidden_size, shape.dtype],
                 "shard_size": shard_size, "max_batch_tokens": max_batch_tokens, "max_pad": MAX_PAD_FRACTION})


def clear_plan(paths: CachePaths) -> None:
    """Delete the saved plan and its parts (the header first: a half-deleted plan is never loaded)."""
    check_layout(paths)
    remove_files([paths.plan_header])
    remove_files(plan_files(paths))


def _header_digest(path: str) -> ArrayRecord:
    with open(path, "rb") as handle:
        raw = handle.read()
    return ArrayRecord(len(raw), xxhash.xxh3_64_hexdigest(raw))


# -- parts -------------------------------------------------------------------------------------

def read_parts(paths: CachePaths, key: str, verify: bool = False) -> list[PartHeader] | None:
    """Every part of an earlier tokenisation with this encode key, or None when any is missing or
    differs (``verify``: or when any of their arrays does not match its header)."""
    try:
        first = read_header(paths.plan_part_header(0), PartHeader)
        if first is None or first.encode_key != key or first.num_parts < 1:
            return None
        parts = [first] + [read_header(paths.plan_part_header(k), PartHeader) for k in range(1, first.num_parts)]
        if any(p is None or p.encode_key != key or p.num_parts != first.num_parts or p.part != k
               for k, p in enumerate(parts)):
            return None
        if verify:
            open_store(paths, parts)  # type: ignore[arg-type]
    except (PlanError, KeyError) as exc:
        log.warning("saved plan part unusable (%s); the input is tokenised again", exc)
        return None
    return parts  # type: ignore[return-value]


def open_store(paths: CachePaths, parts: list[PartHeader]) -> tuple[TokenStore, list[np.ndarray]]:
    """Memory-map every part's tokens (checked against its header); also returns their row tables."""
    token_parts, tables = [], []
    for p in parts:
        ids = load_array(paths.plan_part(p.part, "ids"), TOKEN_ID, p.arrays["ids"])
        mask = load_array(paths.plan_part(p.part, "mask"), LOSS_MASK, p.arrays["mask"])
        table = load_array(paths.plan_part(p.part, "rows"), PART_ROW, p.arrays["rows"])
        if mask.shape != ids.shape or p.tokens != ids.shape[0]:
            raise PlanError(f"part {p.part}: {ids.shape[0]} token ids, {mask.shape[0]} mask values, header says {p.tokens}")
        ends = table["offset"].astype(np.int64) + table["length"]
        if table.size and (table["offset"].min() < 0 or table["length"].min() < 1 or ends.max() > ids.shape[0]):
            raise PlanError(f"part {p.part}: its row table points outside its tokens")
        token_parts.append((ids, mask))
        tables.append(table)
    return TokenStore(token_parts), tables


def merge_parts(parts: list[PartHeader], store: TokenStore, tables: list[np.ndarray], shape: SampleShape, *,
                shard_size: int, max_batch_tokens: int) -> Plan:
    """One plan from every part: their samples batched together, their skipped rows together."""
    rows = np.zeros(sum(t.shape[0] for t in tables), dtype=PLAN_SAMPLE)
    at = 0
    for k, table in enumerate(tables):
        span = rows[at:at + table.shape[0]]
        for name in PART_ROW.names:
            span[name] = table[name]
        span["part"] = k
        at += table.shape[0]
    if np.unique(rows["sample_id"]).shape[0] != rows.shape[0]:
        raise PlanError("the saved parts hold the same sample twice")
    skipped = [row for p in parts for row in p.skipped]
    return plan_from_rows(sum(p.rows for p in parts), rows, store, skipped, shape, shard_size=shard_size,
                          max_batch_tokens=max_batch_tokens)


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
    """Write the merged plan's arrays, then its header."""
    values = {"samples": plan.samples, "batches": plan.batch_starts, "shards": plan.shard_starts,
              "shard_bytes": plan.shard_bytes}
    arrays = {name: write_array(paths.plan_array(name), values[name], dtype) for name, dtype in _PLAN_ARRAYS.items()}
    header = PlanHeader(encode_key=keys[0], layout_key=keys[1], num_rows=plan.num_rows, num_parts=len(parts),
                        parts=[_header_digest(paths.plan_part_header(p.part)) for p in parts], arrays=arrays,
                        layout_sha256=plan.layout_sha256(), skipped=plan.skipped,
                        invalid=sorted((n for p in parts for n in p.invalid), key=lambda n: n.row))
    write_header(paths.plan_header, header)


def load_plan(paths: CachePaths, keys: tuple[str, str]) -> tuple[Plan, list[PartHeader]] | None:
    """The saved plan when its keys match and every file checks out; None otherwise (rebuild)."""
    try:
        header = read_header(paths.plan_header, PlanHeader)
        if header is None or (header.encode_key, header.layout_key) != keys:
            return None
        parts = read_parts(paths, keys[0])
        if parts is None or len(parts) != header.num_parts or header.parts != [
                _header_digest(paths.plan_part_header(p.part)) for p in parts]:
            raise PlanError("its parts are not the ones it was merged from")
        store, _ = open_store(paths, parts)
        a = {name: load_array(paths.plan_array(name), dtype, header.arrays[name]) for name, dtype in _PLAN_ARRAYS.items()}
        plan = Plan(header.num_rows, a["samples"], a["batches"], a["shards"], a["shard_bytes"], store, header.skipped)
        _check_plan(plan, header)
    except (PlanError, KeyError, OSError) as exc:
        log.warning("saved plan in %s unusable (%s); it is rebuilt", paths.plan_dir, exc)
        return None
    return plan, parts


def _check_plan(plan: Plan, header: PlanHeader) -> None:
    """A plan whose files are whole can still be hostile: every index must lead where it may."""
    b, s, samples = plan.batch_starts, plan.shard_starts, plan.samples
    if not (b.shape[0] >= 1 and b[0] == 0 and b[-1] == samples.shape[0] and bool(np.all(np.diff(b) >= 1))
            and s.shape[0] == plan.shard_bytes.shape[0] + 1 and s[0] == 0 and s[-1] == b.shape[0] - 1
            and bool(np.all(np.diff(s) >= 1))):
        raise PlanError("its batch or shard boundaries are inconsistent")
    if samples.size and (samples["part"].min() < 0 or samples["part"].max() >= len(plan.store.parts)):
        raise PlanError("its samples name parts that do not exist")
    for k, (ids, _) in enumerate(plan.store.parts):
        mine = samples[samples["part"] == k]
        if mine.size and (mine["offset"].min() < 0 or mine["length"].min() < 1
                          or (mine["offset"] + mine["length"]).max() > ids.shape[0]):
            raise PlanError(f"its samples point outside part {k}")
    if plan.layout_sha256() != header.layout_sha256:
        raise PlanError("its shard layout does not match its header")
