"""Hand-made cache directories, each a chosen moment of a run, written with the real on-disk structs."""

from __future__ import annotations

import os
import shutil

import msgspec

from dspark_cache.format.atomic import atomic_write_bytes
from dspark_cache.format.paths import CachePaths
from dspark_cache.format.schema import Event, Manifest, RankStatus, SampleEntry, ShardIndex, encode_json

NOW = 1_800_000_000.0  # a fixed clock, so that ages and snapshots are deterministic
SHARD_BYTES = 40_000_000
SHARD_TOKENS = 20_000
PARTIAL_AGE = 30.0  # a .partial last grew this long before NOW: written to only by a rank on its shard
WEIGHT_BYTES = 16_381_000_000  # Qwen3-8B in bf16, held whole by a data-parallel rank
DEVICE_BYTES = 18_950_000_000  # allocated on its GPU: the weights and a batch's activations


def manifest(num_shards: int, complete: bool = False) -> Manifest:
    return Manifest(
        complete=complete,
        target_model="Qwen/Qwen3-8B",
        target_model_type="qwen3",
        target_vocab_size=151936,
        hidden_size=4096,
        num_hidden_layers=36,
        seq_length=4096,
        dtype="bf16",
        num_samples=num_shards * 10,
        planned_samples=num_shards * 10,
        shard_size=10,
        target_hidden_dim=5 * 4096,
        target_last_hidden_dim=4096,
        target_layer_ids=[1, 10, 18, 26, 35],
        train_data_path="/data/regen.jsonl",
        compute_dtype="bf16",
        num_rows=num_shards * 10 + 3,
        num_shards=num_shards,
        planned_tokens=num_shards * SHARD_TOKENS,
        planned_bytes=num_shards * SHARD_BYTES,
        created_at=NOW - 3600,
        completed_at=NOW - 60 if complete else None,
    )


def status(rank: int, world: int, phase: str, age: float, **kw) -> RankStatus:
    fields = dict(
        rank=rank,
        world_size=world,
        run_id="r1",
        pid=1000 + rank,
        host="node-a",
        phase=phase,
        updated_at=NOW - age,
        started_at=NOW - 3000,
        shards_done=3,
        shards_owned=10,
        samples_done=30,
        tokens_done=60_000,
        tokens_per_s=20_000.0,
        bytes_per_s=40e6,
        inflight_bytes=256_000_000,
        stage_seconds={"data": 2.0, "device": 900.0, "copy": 30.0, "backpressure": 5.0, "write": 600.0},
    )
    fields.update(kw)
    return RankStatus(**fields)


def event(rank: int, age: float, kind: str, message: str, **data) -> Event:
    return Event(time=NOW - age, rank=rank, kind=kind, message=message, data=data)


def build(
    root: str,
    *,
    num_shards: int,
    published: list[int],
    writing: list[int] = (),
    complete: bool = False,
    ranks: list[RankStatus] = (),
    events: list[Event] = (),
) -> str:
    shutil.rmtree(root, ignore_errors=True)
    paths = CachePaths(root)
    paths.ensure_dirs()
    atomic_write_bytes(
        paths.manifest, encode_json(manifest(num_shards, complete), pretty=True), durable=False
    )
    for shard in published:
        samples = [
            SampleEntry(shard * 10 + i, SHARD_TOKENS // 10, 100, 512, SHARD_BYTES // 10, 0) for i in range(10)
        ]
        index = ShardIndex(shard_id=shard, tar_bytes=SHARD_BYTES, tar_xxh3=0, samples=samples)
        with open(paths.shard_index(shard), "wb") as handle:
            handle.write(encode_json(index))
    for shard in writing:
        open(paths.shard_partial(shard), "wb").close()
        os.utime(paths.shard_partial(shard), (NOW - PARTIAL_AGE, NOW - PARTIAL_AGE))
    for st in ranks:
        write_status(root, st)
    for ev in events:
        with open(paths.events(ev.rank), "ab") as handle:
            handle.write(encode_json(ev) + b"\n")
    return root


def write_status(root: str, st: RankStatus) -> None:
    """Replace a rank's heartbeat file, as the producer does about once a second."""
    atomic_write_bytes(CachePaths(root).status(st.rank), encode_json(st), durable=False)


# A resumed run: rank 0's counts include the 200k tokens of shards published by an earlier run,
# and its own rate field holds the figure a rate over those counts gives; the monitor must show
# neither as this run's work.
RESUMED_TOKENS = 200_000
INFLATED_RATE = 53_700.0
LIVE_GAP_S = 8.0  # between rank 0's two heartbeats
LIVE_TOKENS = 12_000  # computed by rank 0 in that gap: 1.5k tokens/s


def live_rank0(age: float, tokens: int, written: int) -> RankStatus:
    return status(0, 2, "running", age, shard=20, tokens_done=tokens, bytes_written=written,
                  tokens_per_s=INFLATED_RATE, shards_done=2, shards_owned=20, weight_bytes=WEIGHT_BYTES,
                  device_memory_bytes=DEVICE_BYTES)


def live_run(root: str) -> str:
    """Two ranks working, rank 1 stale; a shard failed earlier; the disk nearly full.

    Rank 0's heartbeat is ``LIVE_GAP_S`` old: :func:`next_heartbeat` writes its next one.
    """
    return build(
        root, num_shards=60, published=list(range(0, 20)) + [24, 25], writing=[20, 21],
        ranks=[live_rank0(LIVE_GAP_S + 0.5, RESUMED_TOKENS, 80_000_000),
               status(1, 2, "running", 42.0, shard=21, last_error=None, weight_bytes=WEIGHT_BYTES,
                      device_memory_bytes=DEVICE_BYTES + 7_000_000)],
        events=[event(0, 900, "started", "computing 30 shards on cuda:0"),
                event(1, 700, "error", "disk full while writing shard 23", shard=23),
                event(1, 650, "resumed", "resuming: 18 of 60 shards already published"),
                event(0, 30, "warning", "sample 177 dropped: non-finite hidden states"),
                event(0, 5, "shard_published", "shard 19 published", shard=19)],
    )


def next_heartbeat(root: str) -> None:
    """Rank 0, ``LIVE_GAP_S`` later: ``LIVE_TOKENS`` more tokens and one more shard (40 MB) published."""
    write_status(root, live_rank0(0.5, RESUMED_TOKENS + LIVE_TOKENS, 80_000_000 + SHARD_BYTES))


def finished(root: str) -> str:
    """A complete cache of 12 shards, all published by its one run of 2940 s."""
    return build(root, num_shards=12, published=list(range(12)), complete=True,
                 ranks=[status(0, 1, "finished", 60.0, shards_done=12, shards_owned=12,
                               # on CPU: no device
                               bytes_written=12 * SHARD_BYTES, weight_bytes=WEIGHT_BYTES)],
                 events=[event(0, 60, "finished", "cache complete", samples=120)])


def writer_lanes_run(root: str) -> str:
    """Ranks writing several shards each (``--writer-threads``), every ``.partial`` last grown
    ``PARTIAL_AGE`` s ago: rank 0's device is on shard 32 of its 30-32, rank 1 has five lanes, rank 2
    is an older producer's, whose heartbeat has no ``writing`` and names only its device's shard, and
    rank 3 failed on shard 55 (its writer's: the one its heartbeat names)."""
    build(
        root,
        num_shards=60,
        published=list(range(30)),
        writing=[30, 31, 32, 40, 41, 42, 43, 44, 50],
        ranks=[
            status(0, 4, "running", 1.0, shard=32, writing=[30, 31, 32]),
            status(1, 4, "running", 1.0, shard=44, writing=[40, 41, 42, 43, 44]),
            status(3, 4, "failed", 1.0, shard=55, writing=[54, 55], last_error="disk full writing shard 55"),
        ],
    )
    older = msgspec.json.decode(encode_json(status(2, 4, "running", 1.0, shard=50)))
    del older["writing"]
    atomic_write_bytes(CachePaths(root).status(2), msgspec.json.encode(older), durable=False)
    return root


OOM = "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 3; 139.8 GiB total capacity)"


def tensor_parallel_run(root: str) -> str:
    """``--tp-size 2`` on 4 GPUs: each rank holds half the weights; rank 3 ran out of device memory."""
    def rank(r: int, phase: str = "running", **kw) -> RankStatus:
        return status(r, 4, phase, 1.0, shard=r, group=r // 2, group_size=2, weight_bytes=WEIGHT_BYTES // 2,
                      device_memory_bytes=DEVICE_BYTES // 2 + r * 100_000_000, **kw)

    return build(root, num_shards=8, published=[], writing=[0, 2],
                 ranks=[rank(0), rank(1), rank(2), rank(3, phase="failed", last_error=OOM)],
                 events=[event(3, 2, "error", OOM)])


LONG_DIR = "/lustre/projects/speculative-decoding/caches/" + "qwen3-235b-a22b-regen-" * 6 + "v2"
LONG_ERROR = (
    f"OSError: [Errno 28] No space left on device: '{LONG_DIR}/shards/shard-000123.tar.partial' while "
    "writing 1073741824 bytes (rerun dspark-produce with the same arguments to resume)"
)


def huge_run(root: str) -> str:
    """A run of 10^12 tokens from a long path: every number wide, every path and error longer than a line."""
    build(
        root,
        num_shards=10,
        published=[0],
        writing=[1],
        ranks=[
            status(
                0,
                2,
                "running",
                1.0,
                shard=1,
                shards_done=123_456,
                shards_owned=1_234_567,
                weight_bytes=WEIGHT_BYTES,
                device_memory_bytes=DEVICE_BYTES,
                host="gpu-node-" + "x" * 60,
            ),
            status(
                12_345,
                24_690,
                "incomplete",
                3 * 86400.0,
                group=6789,
                group_size=2,
                shards_done=1_234_567,
                shards_owned=1_234_567,
                weight_bytes=WEIGHT_BYTES,
                device_memory_bytes=DEVICE_BYTES,
                last_error=LONG_ERROR,
            ),
        ],
        events=[event(0, 30, "error", LONG_ERROR, shard=3), event(0, 20, "warning", "x" * 120)],
    )
    big = manifest(10)
    big.target_model = "meta-llama/" + "Llama-4-Maverick-17B-128E-Instruct-" * 4 + "FP8"
    big.train_data_path = f"{LONG_DIR}/inputs/{'regenerated-conversations-' * 5}part-00001-of-00064.jsonl"
    big.num_samples = big.planned_samples = 987_654_321_000
    big.planned_tokens, big.planned_bytes, big.num_shards, big.shard_size = (
        10**12,
        2 * 10**15,
        9_876_543,
        2 * 10**5,
    )
    atomic_write_bytes(CachePaths(root).manifest, encode_json(big, pretty=True), durable=False)
    return root
