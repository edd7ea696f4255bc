"""The multi-rank completion protocol: exactly one rank marks the cache complete, once.

No rank waits on another in a collective. Each rank, its own shards done, waits (by
heartbeats) until every planned shard is published or the owner of a missing one is gone. A
rank that sees them all tries to create the run's completion claim (``exchange.claim_completion``:
a file made with ``O_EXCL``, and on object storage a conditional create): the one that creates it
writes the complete manifest; the others wait for that manifest to appear.
"""

from __future__ import annotations

import logging
import time

from dspark_cache.format.schema import EventKind, Manifest, RankPhase
from dspark_cache.format.weights import TargetWeightsError, check_cache_weights
from dspark_cache.producer.device.ranks import await_other_ranks
from dspark_cache.producer.device.topology import Topology
from dspark_cache.producer.prepare import Prepared
from dspark_cache.producer.report.status import StatusReporter
from dspark_cache.producer.resume import read_existing

log = logging.getLogger(__name__)


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
            p.exchange.fetch_file(p.paths.target_weights)  # a rank on another node than the leader's
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
    status.update(force=True, phase=RankPhase.WAITING)
    missing = await_other_ranks(p.paths, planned, me, run_id, p.cfg.rank_timeout, refresh=p.exchange.refresh)
    if missing:
        return p.manifest, sorted(missing)
    if p.exchange.claim_completion(run_id):
        p.manifest.target_weights_xxh3 = target_weights_checksum(p)
        p.output.complete(p.manifest)
        status.event(
            EventKind.FINISHED, "cache complete", samples=p.manifest.num_samples, bytes=p.plan.num_bytes
        )
        return p.manifest, []
    deadline = time.time() + p.cfg.rank_timeout  # another rank claimed it: let it finish writing
    while time.time() < deadline:
        p.exchange.fetch_file(p.paths.manifest)
        manifest = read_existing(p.output)
        if manifest is not None and manifest.complete:
            return manifest, []
        time.sleep(0.1)
    return p.manifest, []
