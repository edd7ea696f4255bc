"""Hand-made cache directories in chosen states, written with the real on-disk structs."""

from __future__ import annotations

import shutil

from dspark_cache.format.atomic import atomic_write_bytes
from dspark_cache.format.paths import CachePaths
from dspark_cache.format.schema import Event, Manifest, RankStatus, SampleEntry, ShardIndex, encode_json

NOW = 1_800_000_000.0  # a fixed clock, so that ages and snapshots are deterministic
SHARD_BYTES = 40_000_000
SHARD_TOKENS = 20_000


def manifest(num_shards: int, complete: bool = False) -> Manifest:
    return Manifest(
        complete=complete, target_model="Qwen/Qwen3-8B", target_model_type="qwen3", target_vocab_size=151936,
        hidden_size=4096, num_hidden_layers=36, seq_length=4096, dtype="bf16", num_samples=num_shards * 10,
        planned_samples=num_shards * 10, shard_size=10, target_hidden_dim=5 * 4096, target_last_hidden_dim=4096,
        target_layer_ids=[1, 10, 18, 26, 35], train_data_path="/data/regen.jsonl", compute_dtype="bf16",
        num_rows=num_shards * 10 + 3, num_shards=num_shards, planned_tokens=num_shards * SHARD_TOKENS,
        planned_bytes=num_shards * SHARD_BYTES, created_at=NOW - 3600, completed_at=NOW - 60 if complete else None,
    )


def status(rank: int, world: int, state: str, age: float, **kw) -> RankStatus:
    fields = dict(rank=rank, world_size=world, run_id="r1", pid=1000 + rank, host="node-a", state=state,
                  updated_at=NOW - age, started_at=NOW - 3000, shards_done=3, shards_owned=10, samples_done=30,
                  tokens_done=60_000, tokens_per_s=20_000.0, bytes_per_s=40e6, inflight_bytes=256_000_000,
                  stage_seconds={"data": 2.0, "device": 900.0, "copy": 30.0, "backpressure": 5.0, "write": 600.0})
    fields.update(kw)
    return RankStatus(**fields)


def event(rank: int, age: float, kind: str, message: str, **data) -> Event:
    return Event(time=NOW - age, rank=rank, kind=kind, message=message, data=data)


def build(root: str, *, num_shards: int, published: list[int], writing: list[int] = (), complete: bool = False,
          ranks: list[RankStatus] = (), events: list[Event] = ()) -> str:
    shutil.rmtree(root, ignore_errors=True)
    paths = CachePaths(root)
    paths.ensure_dirs()
    atomic_write_bytes(paths.manifest, encode_json(manifest(num_shards, complete), pretty=True), durable=False)
    for shard in published:
        samples = [SampleEntry(shard * 10 + i, SHARD_TOKENS // 10, 100, 512, SHARD_BYTES // 10, 0) for i in range(10)]
        index = ShardIndex(shard_id=shard, tar_bytes=SHARD_BYTES, tar_xxh3=0, samples=samples)
        with open(paths.shard_index(shard), "wb") as handle:
            handle.write(encode_json(index))
    for shard in writing:
        open(paths.shard_partial(shard), "wb").close()
    for st in ranks:
        with open(paths.status(st.rank), "wb") as handle:
            handle.write(encode_json(st))
    for ev in events:
        with open(paths.events(ev.rank), "ab") as handle:
            handle.write(encode_json(ev) + b"\n")
    return root


def live_run(root: str) -> str:
    """Two ranks working, rank 1 stale; a shard failed earlier; the disk nearly full."""
    return build(
        root, num_shards=60, published=list(range(0, 20)) + [24, 25], writing=[20, 21],
        ranks=[status(0, 2, "running", 0.5, shard=20), status(1, 2, "running", 42.0, shard=21,
                                                             last_error=None)],
        events=[event(0, 900, "started", "computing 30 shards on cuda:0"),
                event(1, 700, "error", "disk full while writing shard 23", shard=23),
                event(1, 650, "resumed", "resuming: 18 of 60 shards already published"),
                event(0, 30, "warning", "sample 177 dropped: non-finite hidden states"),
                event(0, 5, "shard_published", "shard 19 published", shard=19)],
    )
