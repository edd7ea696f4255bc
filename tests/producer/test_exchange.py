"""How the ranks of a job read each other's files: nothing moves in one shared directory; through the
store (moto), between two staging directories, as two nodes without a shared filesystem do."""

from __future__ import annotations

import os


import dspark_cache.producer.device.ranks as ranks
from dspark_cache.producer.device.topology import Topology
from dspark_cache.producer.exchange import Exchange, StoreExchange, exchange_for
from dspark_cache.storage.output import CacheOutput
from dspark_cache.storage.remote.output import RemoteOutput
from dspark_cache.storage.remote.store import ObjectStore


def _write(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as handle:
        handle.write(data)


def _files(root: str) -> dict[str, bytes]:
    out = {}
    for directory, _, names in os.walk(root):
        for name in names:
            with open(os.path.join(directory, name), "rb") as handle:
                out[os.path.relpath(os.path.join(directory, name), root)] = handle.read()
    return out


def test_ranks_sharing_a_directory_move_nothing_and_one_claims_completion(tmp_path, monkeypatch):
    def no_collective(*_):
        raise AssertionError("ranks sharing a directory have nothing to compare")

    monkeypatch.setattr(ranks, "all_texts", no_collective)
    output = CacheOutput(tmp_path / "cache")
    output.create()
    paths = output.paths
    _write(paths.plan_part_header(1), b"part one")
    exchanges = [exchange_for(output) for _ in range(2)]  # two ranks of one job
    assert all(type(e) is Exchange for e in exchanges)
    before = _files(paths.root)
    for rank, exchange in enumerate(exchanges):
        exchange.meet(Topology(rank=rank, world_size=2))
        exchange.put_files([paths.plan_part_header(1)])
        exchange.fetch(paths.plan_dir)
        exchange.fetch_file(paths.manifest)
        exchange.refresh()
        assert not exchange.apart
    assert _files(paths.root) == before
    assert [e.claim_completion("run-a") for e in exchanges] == [True, False]
    assert os.path.isfile(paths.completion_claim("run-a"))
    assert exchanges[1].claim_completion("run-b")  # another run's claim is its own


def test_two_staging_directories_exchange_files_through_the_store(s3_bucket, s3_env, tmp_path, monkeypatch):
    url = f"{s3_bucket}/cache"
    outputs = [RemoteOutput(url, staging_dir=str(tmp_path / f"node-{n}"), rank=n) for n in range(2)]
    exchanges = [exchange_for(o) for o in outputs]
    assert all(type(e) is StoreExchange for e in exchanges)
    identities = [e.identity() for e in exchanges]  # made and claimed for this cache, as planning starts
    assert identities[0] != identities[1]
    monkeypatch.setattr(ranks, "all_texts", lambda me, mine: identities)
    for rank, exchange in enumerate(exchanges):
        exchange.meet(Topology(rank=rank, world_size=2))
    leader, apart = exchanges
    assert (leader.apart, apart.apart) == (False, True)
    for output in outputs:
        output.create()  # as rank 0's lock and the other node's join make them
    a, b = (o.paths for o in outputs)

    # Rank 1's part goes up; rank 0 brings its plan directory down from the store.
    _write(b.plan_part_header(1), b'{"part": 1}')
    apart.put_files([b.plan_part_header(1), b.plan_part(1, "tokens")])  # a file not written is skipped
    leader.fetch(a.plan_dir)
    with open(a.plan_part_header(1), "rb") as handle:
        assert handle.read() == b'{"part": 1}'
    assert not os.path.exists(a.plan_part(1, "tokens"))

    # Rank 0's weights and merged plan reach rank 1.
    _write(a.target_weights, b"weights")
    _write(a.plan_header, b'{"plan": 0}')
    leader.put_files([a.target_weights, a.plan_header])
    apart.fetch_file(b.target_weights)
    apart.fetch(b.plan_dir)
    with open(b.target_weights, "rb") as handle:
        assert handle.read() == b"weights"
    with open(b.plan_header, "rb") as handle:
        assert handle.read() == b'{"plan": 0}'

    # While waiting: rank 1's heartbeat and a shard index it published reach rank 0.
    _write(b.status(1), b'{"rank": 1}')
    apart.put_files([b.status(1)])
    store = ObjectStore(url)
    store.put(a.relative(a.shard_index(0)), b'{"shard_id": 0}')
    leader.refresh()
    with open(a.status(1), "rb") as handle:
        assert handle.read() == b'{"rank": 1}'
    with open(a.shard_index(0), "rb") as handle:
        assert handle.read() == b'{"shard_id": 0}'

    # One rank of the job claims completion, though each node's own claim file is made.
    assert [e.claim_completion("run-a") for e in exchanges] == [True, False]
    assert os.path.isfile(b.completion_claim("run-a"))
    got = store.get(a.relative(a.completion_claim("run-a")), 4096)
    assert got is not None and got[0].startswith(b"run-a rank 0 ")


def test_ranks_sharing_one_staging_directory_put_nothing_up(s3_bucket, s3_env, tmp_path, monkeypatch):
    url = f"{s3_bucket}/cache"
    staging = str(tmp_path / "node")
    outputs = [RemoteOutput(url, staging_dir=staging, rank=n) for n in range(2)]
    exchanges = [StoreExchange(o) for o in outputs]
    identities = [e.identity() for e in exchanges]
    assert identities[0] == identities[1]
    monkeypatch.setattr(ranks, "all_texts", lambda me, mine: identities)
    for rank, exchange in enumerate(exchanges):
        exchange.meet(Topology(rank=rank, world_size=2))
    paths = outputs[1].paths
    _write(paths.plan_part_header(1), b'{"part": 1}')
    exchanges[1].put_files([paths.plan_part_header(1)])
    assert not exchanges[1].apart
    store = ObjectStore(url)
    assert store.list(paths.relative(paths.plan_dir)) == {}
