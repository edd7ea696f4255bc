"""The multi-rank completion protocol: exactly one rank marks the cache complete, once.

No rank waits on another in a collective. Each rank, its own shards done, waits (by
heartbeats) until every planned shard is published or the owner of a missing one is gone. A
rank that sees them all tries to create the run's completion claim file (``O_EXCL``): the one
that creates it writes the complete manifest; the others wait for that manifest to appear.
"""

from __future__ import annotations

import logging
import os
import time

from dspark_cache.format.paths import CachePaths
from dspark_cache.format.schema import EventKind, Manifest, RankState
from dspark_cache.format.weights import TargetWeightsError, check_cache_weights
from dspark_cache.producer.device.ranks import await_other_ranks
from dspark_cache.producer.device.topology import Topology
from dspark_cache.producer.prepare import Prepared
from dspark_cache.producer.report.status import StatusReporter
from dspark_cache.producer.resume import read_existing

log = logging.getLogger(__name__)


def claim_completion(paths: CachePaths, run_id: str) -> bool:
    """True for exactly one rank of a run: the one that creates the claim file first."""
    os.makedirs(paths.control_dir, exist_ok=True)
    try:
        fd = os.open(paths.completion_claim(run_id), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def target_weights_checksum(p: Prepared) -> int | None:
    """The xxh3-64 of the weights file that the complete manifest records (readers check it).

    Group 0 writes the file; a group without shards writes it after the others' may all be
    published, so the rank completing the cache waits for it as it waits for shards (by the
    rank timeout). ``None`` (nothing recorded, a warning) when it never becomes a good file:
    verify then reports it and a rerun writes it.
    """
    deadline = time.time() + p.cfg.rank_timeout
    while True:
        try:
            return check_cache_weights(p.paths, p.manifest).xxh3
        except (TargetWeightsError, OSError) as exc:
            if time.time() >= deadline:
                log.warning("%s; the cache is marked complete without a checksum of its target weights", exc)
                return None
            time.sleep(0.2)


def finish(p: Prepared, status: StatusReporter, run_id: str, me: Topology) -> tuple[Manifest, list[int]]:
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
        p.manifest.target_weights_xxh3 = target_weights_checksum(p)
        p.output.complete(p.manifest)
        status.event(EventKind.FINISHED, "cache complete", samples=p.manifest.num_samples, bytes=p.plan.num_bytes)
        return p.manifest, []
    deadline = time.time() + p.cfg.rank_timeout  # another rank claimed it: let it finish writing
    while time.time() < deadline:
        manifest = read_existing(p.output)
        if manifest is not None and manifest.complete:
            return manifest, []
        time.sleep(0.1)
    return p.manifest, []
