"""The job's plan, made once: reuse the saved plan, or tokenise (split across ranks) and merge.

Every rank calls :func:`plan_job` with the same settings. In order:

1. the saved plan, when its keys match and it checks out on every rank: nothing is tokenised;
2. else the saved parts, when a tokenisation with the same encode key is whole on disk (a
   changed shard size or batch budget re-batches without re-tokenising);
3. else each rank encodes its own rows (``row % world_size == rank``) into its part.

Rank 0 then merges the parts into the plan and saves it; the others load that plan (memory-
mapped: one copy of the tokens per node's page cache, not one per rank). A failure on any rank
is known to all of them, so no rank waits for one that has given up.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, TypeVar

from dspark_cache.format.faults import crash_point
from dspark_cache.format.geometry import SampleShape
from dspark_cache.format.paths import PLAN_ARRAYS, PLAN_PART_KINDS, CachePaths
from dspark_cache.format.plan import PartHeader
from dspark_cache.producer.config import ProduceConfig
from dspark_cache.producer.device.ranks import all_texts, all_true
from dspark_cache.producer.device.target import read_target_info
from dspark_cache.producer.device.topology import Topology
from dspark_cache.producer.encode.messages import normalise_row
from dspark_cache.producer.encode.pool import encode_rows
from dspark_cache.producer.exchange import Exchange
from dspark_cache.producer.inputs.rows import InputError, RawRow
from dspark_cache.producer.inputs.source import InputSource
from dspark_cache.producer.plan.batches import Plan, reason_counts
from dspark_cache.producer.plan.parts import encode_part
from dspark_cache.producer.plan.store import (
    PlanSpec, check_invalid_rows, encode_key, batching_key, listed_rows, load_plan, merge_parts, open_store,
    read_parts, save_plan,
)
from dspark_cache.producer.report.progress import counter
from dspark_cache.storage.output import CacheOutput

log = logging.getLogger(__name__)
T = TypeVar("T")


class PlanningError(Exception):
    """Another rank of the job failed while planning (its message says why)."""


def _together(me: Topology, step: Callable[[], T]) -> T:
    """Run ``step`` on this rank; if it fails on any rank, every rank raises (a collective)."""
    result, error, failure = None, None, ""
    try:
        result = step()
    except Exception as exc:
        if me.world_size == 1:
            raise
        error, failure = exc, str(exc) or type(exc).__name__
    failures = all_texts(me, failure)
    if error is not None:
        raise error
    for rank, text in enumerate(failures):
        if text:
            raise PlanningError(f"rank {rank} could not plan the input: {text}")
    return result  # type: ignore[return-value]


def plan_job(cfg: ProduceConfig, output: CacheOutput, exchange: Exchange, me: Topology, source: InputSource,
             encoder: Any, shape: SampleShape, input_sha256: str, vocab_size: int | None = None) -> Plan:
    """The job's plan (see the module's docstring), saved in ``output``; ``vocab_size``: the target's
    embedding rows (read from its config when not given).

    Ranks on a node whose directory is not rank 0's (a cache on object storage: each node stages its
    own) exchange the parts and the plan through ``exchange`` (``put_files``, ``fetch``); ranks that
    share rank 0's directory read them there."""
    paths = output.paths
    if vocab_size is None:
        vocab_size = read_target_info(
            cfg.target_model, cfg.trust_remote_code, cfg.allow_pickle_weights
        ).vocab_size
    exchange.meet(me)
    exchange.fetch(paths.plan_dir)  # another node than rank 0's: the saved plan rank 0 found
    spec = plan_spec(cfg, encoder, shape, input_sha256, vocab_size)
    saved = None if cfg.overwrite else load_plan(paths, spec)
    if all_true(me, saved is not None):
        plan, parts = saved  # type: ignore[misc]
        log.info("plan: reusing the saved plan in %s (nothing tokenised)", paths.plan_dir)
        check_invalid_rows(parts, cfg.on_invalid)
        return plan
    parts = None if cfg.overwrite else read_parts(paths, spec, verify=True)
    if all_true(me, parts is not None):
        log.info("plan: reusing the tokenised input in %s (batching it again)", paths.plan_dir)
    else:
        _together(me, lambda: _encode_my_part(cfg, paths, me, source, encoder, spec))
        # Every part where every rank reads: its own put by each rank (rank 0: its node's), then brought down.
        _together(me, lambda: exchange.put_files(_part_files(paths, me.rank) if not me.is_leader else
                                                 output.plan_files()))
        exchange.fetch(paths.plan_dir)
        parts = read_parts(paths, spec)
    parts = _together(me, lambda: _require_parts(parts, cfg, source))
    check_invalid_rows(parts, cfg.on_invalid)
    if me.is_leader:
        return _together(me, lambda: _merge_and_save(output, exchange, parts, spec))
    _together(me, lambda: None)  # rank 0 merges
    exchange.fetch(paths.plan_dir)
    loaded = load_plan(paths, spec)
    if loaded is None:
        raise PlanningError(f"the plan rank 0 saved in {paths.plan_dir} cannot be read here; is --output-dir "
                            "the same shared directory on every node?")
    return loaded[0]


def _part_files(paths: CachePaths, part: int) -> list[str]:
    """A part's files, its header last (a reader checks the arrays against it)."""
    return [*(paths.plan_part(part, kind) for kind in PLAN_PART_KINDS), paths.plan_part_header(part)]


def plan_spec(
    cfg: ProduceConfig, encoder: Any, shape: SampleShape, input_sha256: str, vocab_size: int
) -> PlanSpec:
    """The keys and bounds of this job's plan."""
    key = encode_key(cfg, encoder.tokenizer, input_sha256, vocab_size)
    return PlanSpec(
        keys=(key, batching_key(key, shape, cfg.shard_size, cfg.batch_token_budget)),
        vocab_size=vocab_size,
        seq_length=cfg.seq_length,
        shape=shape,
        shard_size=cfg.shard_size,
        max_batch_tokens=cfg.batch_token_budget,
    )


def _encode_my_part(cfg: ProduceConfig, paths: CachePaths, me: Topology, source: InputSource, encoder: Any,
                    spec: PlanSpec) -> PartHeader:
    # every rank, before writing: the plan directory must not lead out of the cache
    CacheOutput(paths.root).check()
    started = time.perf_counter()

    def encode(row: RawRow):
        messages, tools = normalise_row(row.value)
        return encoder.encode(messages, tools)

    world, rank = me.world_size, me.rank
    rows = source.rows(keep=lambda i: i % world == rank) if world > 1 else source.rows()
    total = source.count_hint()
    mine = None if total is None else len(range(rank, total, world))
    with counter("encoding rows", "rows", total=mine) as bar:
        header = encode_part(
            paths,
            encode_rows(rows, encode, cfg.tokenize_workers),
            rank,
            world,
            spec.keys[0],
            bar.update,
            vocab_size=spec.vocab_size,
            total_rows=mine,
        )
    log.info("rank %d encoded %d rows in %.1f s", rank, header.rows, time.perf_counter() - started)
    return header


def _require_parts(
    parts: list[PartHeader] | None, cfg: ProduceConfig, source: InputSource
) -> list[PartHeader]:
    """The parts every rank wrote, and an input that gives at least one sample."""
    if parts is None:
        raise InputError(
            f"the tokenised parts of {cfg.input_data} are incomplete on disk; is --output-dir the "
            "same shared directory on every node?"
        )
    rows = sum(p.rows for p in parts)
    if rows == 0:
        raise InputError(source.empty_split() or f"{cfg.input_data} holds no rows; check --input-data")
    if not sum(p.arrays["rows"].length for p in parts):
        skipped = [r for p in parts for r in p.skipped]
        reasons = ", ".join(f"{n} {r}" for r, n in reason_counts(skipped).items())
        raise InputError(
            f"none of the {rows} rows of {cfg.input_data} gives a supervised sample ({reasons}):\n"
            + "\n".join(listed_rows(parts, skipped))
            + "\nFix these rows, or check that "
            "--input-data (and --split) name the data you meant"
        )
    return parts


def _merge_and_save(output: CacheOutput, exchange: Exchange, parts: list[PartHeader], spec: PlanSpec) -> Plan:
    paths = output.paths
    crash_point("merging_plan")
    store, tables = open_store(paths, parts, spec)
    plan = merge_parts(parts, store, tables, spec)
    save_plan(paths, plan, parts, spec.keys)
    keep = {paths.plan_header, *(paths.plan_array(n) for n in PLAN_ARRAYS)}
    keep |= {
        f
        for p in parts
        for f in (paths.plan_part_header(p.part), *(paths.plan_part(p.part, k) for k in p.arrays))
    }
    # parts of a larger earlier job, temporaries
    output.remove([f for f in output.plan_files() if f not in keep])
    exchange.put_files([*(paths.plan_array(n) for n in PLAN_ARRAYS), paths.plan_header])  # other nodes' ranks
    return plan
