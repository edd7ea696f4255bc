"""How the ranks of one job see each other's files when they may not share a directory.

The ranks of a job read files the others write: the plan's parts and the merged plan, heartbeats,
shard indexes, the target weights, the manifest, and the run's completion claim. Where every rank
writes one directory (a local or shared ``--output-dir``) they read them there, and
:class:`Exchange` moves nothing. A cache on object storage is written through a staging directory
per node (``storage.remote.output.RemoteOutput``): ranks whose staging directory is not rank 0's
get those files through the store (:class:`StoreExchange`). :func:`exchange_for` picks one for
the output; :meth:`Exchange.meet` (a collective, as planning starts) finds out which ranks share
rank 0's directory.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Iterable

from dspark_cache.format.paths import CachePaths
from dspark_cache.producer.device.topology import Topology
from dspark_cache.storage.output import CacheOutput
from dspark_cache.storage.remote.output import RemoteOutput
from dspark_cache.storage.remote.staging import claim_staging, staging_identity
from dspark_cache.storage.remote.store import ConditionFailedError
from dspark_cache.storage.remote.sync import sync_interval


def exchange_for(output: CacheOutput) -> Exchange:
    """The exchange between the ranks writing ``output``: through the store for a cache on object storage."""
    return StoreExchange(output) if isinstance(output, RemoteOutput) else Exchange(output.paths)


def claim_here(paths: CachePaths, run_id: str) -> bool:
    """True for exactly one process of those sharing ``paths``: the one that creates the run's claim first
    (``O_EXCL``)."""
    os.makedirs(paths.control_dir, exist_ok=True)
    try:
        fd = os.open(paths.completion_claim(run_id), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True


class Exchange:
    """Every rank of the job writes the directory ``paths``: each reads the others' files there, and
    nothing is moved. ``apart``: this rank's directory is not rank 0's (never, here)."""

    def __init__(self, paths: CachePaths) -> None:
        self.paths = paths
        self.apart = False

    def meet(self, me: Topology) -> None:
        """Learn which ranks share rank 0's directory (every rank calls it, as planning starts)."""

    def put_files(self, files: Iterable[str]) -> None:
        """Make these files of this rank's readable by the job's other ranks."""

    def fetch(self, directory: str) -> None:
        """Read the other ranks' files of ``directory`` from here on."""

    def fetch_file(self, path: str) -> None:
        """Read the latest ``path`` another rank wrote (the weights, the complete manifest) from here on."""

    def refresh(self) -> None:
        """See the shards and heartbeats the other ranks wrote since (called while waiting for them)."""

    def claim_completion(self, run_id: str) -> bool:
        """True for exactly one rank of the run: the one that creates the run's completion claim first."""
        return claim_here(self.paths, run_id)


class StoreExchange(Exchange):
    """The ranks of a job writing ``output``, a cache on object storage: a rank whose node's staging
    directory is not rank 0's gets the files it reads of the others' through the store (the plan's parts
    and merged plan, heartbeats, shard indexes, the weights and the manifest), each brought down only
    when it changed; rank 0 brings down what those ranks put. Where every rank shares rank 0's staging
    directory nothing moves, except the completion claim, which is always also made on the store."""

    def __init__(self, output: RemoteOutput) -> None:
        super().__init__(output.paths)
        self.output = output
        self._spread = False  # some rank's staging directory is not rank 0's: files go through the store
        self._brings_down = False  # reads what other nodes put: it is apart, or rank 0 of a spread job
        self._refresh_every = max(2.0, sync_interval())
        self._refreshed = 0.0
        self._fetched: dict[str, float] = {}  # path -> when fetch_file last asked the store

    def identity(self) -> str:
        """The staging directory as the job's ranks compare it: the same only on the same machine's same
        directory (made here, and checked to stage this cache: a rank on another node than rank 0's starts
        with this)."""
        claim_staging(self.paths, str(self.output.url))
        return staging_identity(self.paths.root)

    def meet(self, me: Topology) -> None:
        from dspark_cache.producer.device.ranks import all_texts  # torch, only once ranks meet

        identities = all_texts(me, self.identity())
        self.apart = identities[me.rank] != identities[0]
        self._spread = len(set(identities)) > 1
        self._brings_down = self.apart or (self._spread and me.is_leader)

    def put_files(self, files: Iterable[str]) -> None:
        if self._spread:
            self.output.push([f for f in files if os.path.exists(f)])

    def fetch(self, directory: str) -> None:
        if self._brings_down:
            self.output.pull_directory(directory)

    def fetch_file(self, path: str) -> None:
        """Asked again within a second, the store is not asked again."""
        now = time.monotonic()
        if self._spread and now - self._fetched.get(path, -1.0) >= 1.0:
            self._fetched[path] = now
            self.output.pull_file(path)

    def refresh(self) -> None:
        """At most every sync interval (two seconds at least): the other ranks of a node read what its
        rank that brings files down brought."""
        if not self._brings_down or time.monotonic() - self._refreshed < self._refresh_every:
            return
        self._refreshed = time.monotonic()
        self.output.pull_indexes()
        self.output.pull_directory(self.paths.status_dir)

    def claim_completion(self, run_id: str) -> bool:
        """One rank of this node (the directory's ``O_EXCL``), then one of the job (a conditional create on
        the store)."""
        if not claim_here(self.paths, run_id):
            return False
        relative = self.paths.relative(self.paths.completion_claim(run_id))
        mine = f"{run_id} rank {self.output.rank} pid {os.getpid()} on {socket.gethostname()}\n".encode()
        try:
            self.output.store.put(relative, mine, create=True)  # ours also where it landed, its answer lost
        except ConditionFailedError:  # another rank's
            return False
        return True
