"""The multi-rank completion protocol: exactly one rank marks the cache complete, once.

No rank waits on another in a collective. Each rank, its own shards done, waits (by
heartbeats) until every planned shard is published or the owner of a missing one is gone. A
rank that sees them all tries to create the run's completion claim file (``O_EXCL``): the one
that creates it writes the complete manifest; the others wait for that manifest to appear.
"""

from __future__ import annotations

import os
import time

from dspark_cache.format.paths import CachePaths
from dspark_cache.format.schema import EventKind, Manifest, RankState
from dspark_cache.producer.distributed import RankInfo, await_other_ranks
from dspark_cache.producer.manifest import mark_complete, read_manifest_file
from dspark_cache.producer.prepare import Prepared
from dspark_cache.producer.status import StatusReporter


def claim_completion(paths: CachePaths, run_id: str) -> bool:
    """True for exactly one rank of a run: the one that creates the claim file first."""
    os.makedirs(paths.control_dir, exist_ok=True)
    try:
        fd = os.open(paths.completion_claim(run_id), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def finish(p: Prepared, status: StatusReporter, run_id: str, me: RankInfo) -> tuple[Manifest, list[int]]:
    """Wait for the other ranks' shards; the rank that claims completion marks the cache complete.

    Returns the manifest as this rank last knows it and the planned shards still missing
    (their owner stopped without publishing them: a rerun completes them).
    """
    planned = {s.shard_id for s in p.plan.shards}
    status.update(force=True, state=RankState.WAITING)
    missing = await_other_ranks(p.paths, planned, me, run_id, p.cfg.rank_timeout)
    if missing:
        return p.manifest, sorted(missing)
    if claim_completion(p.paths, run_id):
        mark_complete(p.paths, p.manifest)
        status.event(EventKind.FINISHED, "cache complete", samples=p.manifest.num_samples, bytes=p.plan.num_bytes)
        return p.manifest, []
    deadline = time.time() + p.cfg.rank_timeout  # another rank claimed it: let it finish writing
    while time.time() < deadline:
        manifest = read_manifest_file(p.paths)
        if manifest is not None and manifest.complete:
            return manifest, []
        time.sleep(0.1)
    return p.manifest, []
