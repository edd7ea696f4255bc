"""A torchrun job across two "nodes" that share no filesystem, producing to object storage.

Each node is its own torchrun agent (``--nnodes 2``) with its own staging directory, as two machines
with local disks would be; the only thing they share is the S3-compatible server (moto, on
127.0.0.1). The cache must be the one a single process writes, and each node must have uploaded
its own shards.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from dspark_cache.format.paths import CachePaths
from tests.support.remote import KEYS
from dspark_cache.storage.remote.store import ObjectStore
from tests.support.ports import free_port
from tests.support.proc import BIN, assert_same_samples, kill_group, run, start
from tests.support.produce import produce_args

ARGS = ("--shard-size", "6", "--num-workers", "0", "--rank-timeout", "60")

pytestmark = pytest.mark.slow


def _node(node: int, port: int, target: str, data: str, url: str, staging: str) -> subprocess.Popen:
    cmd = [os.path.join(BIN, "torchrun"), "--nnodes=2", f"--node_rank={node}", "--nproc_per_node=1",
           "--master_addr=127.0.0.1", f"--master_port={port}", "-m", "dspark_cache.producer",
           *produce_args(target, data, url, *ARGS, "--staging-dir", staging)]
    return start(cmd, env={"DSPARK_SYNC_INTERVAL": "1"})


def test_two_nodes_without_a_shared_filesystem(embedded, produced, s3_bucket, s3_env, tmp_path):
    url = f"{s3_bucket}/cache"
    stagings = [str(tmp_path / "node-a"), str(tmp_path / "node-b")]
    # Node B's directory staged this cache before, and an old run's stop request (brought down from the
    # store then) is still in it: it is no request of this run's.
    old = CachePaths(stagings[1])
    os.makedirs(old.control_dir)
    with open(old.staging_mark, "w") as handle:
        handle.write(f"{url}\n")
    with open(old.stop_request, "w") as handle:
        handle.write("stop requested by dspark-monitor\n")
    port = free_port()
    nodes = [_node(n, port, embedded.stock, embedded.data, url, stagings[n]) for n in range(2)]
    try:
        outputs = [node.communicate(timeout=400) for node in nodes]
    finally:
        for node in nodes:
            kill_group(node)
    for node, (out, err) in zip(nodes, outputs):
        assert node.returncode == 0, err[-3000:]
    assert "cache complete" in outputs[0][0], outputs[0]

    assert assert_same_samples(produced(*ARGS[:2]), url) > 0
    assert run([os.path.join(BIN, "dspark-verify"), url]).returncode == 0

    # Each node staged, uploaded and indexed only what it computed, and heard of the rest through the store.
    store = ObjectStore(url)
    listed = store.list(KEYS.shards_dir)
    shard_ids = sorted(p[0] for p in map(KEYS.shard_file, listed) if p is not None and p[1] == "idx")
    assert shard_ids == list(range(len(shard_ids))) and len(shard_ids) >= 4
    for staging in stagings:
        names = os.listdir(CachePaths(staging).shards_dir)
        assert not [n for n in names if n.endswith(".tar")], names  # every tar went up and left staging
    events = {n for n in store.list(KEYS.events_dir) if KEYS.events_segment_of(n) is not None}
    assert {KEYS.events_segment_of(n)[0] for n in events} == {0, 1}, events  # both ranks' logs are there
    assert store.head(KEYS.lease) is None  # given back
    # The completion was claimed once, on the store, by one of the ranks.
    claims = [n for n in store.list(KEYS.control_dir) if CachePaths.is_completion_claim(n)]
    assert len(claims) == 1, claims
