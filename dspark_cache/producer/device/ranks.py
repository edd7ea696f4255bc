"""The job's ranks with each other: one store, one set-up agreement, votes, who owns which shard.

Ranks exchange no tensors: every rank plans the same plan, rank 0 prepares the directory and
broadcasts the outcome once (over gloo, on CPU, whatever the device), then the process group
is released. From there each rank writes only its own shards, status and events, so a rank
that dies cannot block the others in a collective; they finish their shards, wait for the
owners of the rest while those heartbeat, and name what is missing if an owner is gone.

With ``--tp-size``/``--ep-size`` the owner is a model-parallel group instead of a rank (see
``model_group``): its ranks meet in collectives of their own, through the job's rendezvous
store, which is kept for them after the set-up group is released.
"""

from __future__ import annotations

import json
import secrets
import time
from datetime import timedelta
from typing import Any, Callable, Protocol, Sequence, TypeVar

import numpy as np
import torch

from dspark_cache.format.paths import CachePaths
from dspark_cache.format.schema import RankPhase, RankStatus
from dspark_cache.format.status import rank_is_live, read_rank_statuses
from dspark_cache.producer.device.topology import Topology

_PAYLOAD_BYTES = 65536
_SETUP_TIMEOUT = timedelta(minutes=60)
_store: Any = None  # the job's rendezvous store: the set-up group's, then the model-parallel groups'


class Shard(Protocol):
    """What owning a shard needs to know of it."""

    @property
    def shard_id(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...


S = TypeVar("S", bound=Shard)


def job_store(topology: Topology) -> Any:
    """The job's rendezvous store (torchrun's, or rank 0's from ``MASTER_ADDR``/``MASTER_PORT``).

    Kept for the life of the process: rank 0 may host it, and model-parallel groups meet through
    it after the set-up group is gone.
    """
    global _store
    if _store is None:
        import torch.distributed as dist

        _store, _, _ = next(dist.rendezvous("env://", rank=topology.rank, world_size=topology.world_size,
                                            timeout=_SETUP_TIMEOUT))
    return _store


def _init_group(topology: Topology) -> None:
    import torch.distributed as dist

    if topology.world_size > 1 and not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.PrefixStore("dspark-setup", job_store(topology)),
                                rank=topology.rank, world_size=topology.world_size, timeout=_SETUP_TIMEOUT)


def new_run_id() -> str:
    return secrets.token_hex(8)


def share_setup(topology: Topology, error: str | None, run_id: str) -> tuple[str | None, str]:
    """Rank 0's set-up outcome and run id, known to every rank; then the group is released.

    Returns ``(error or None, run_id)``. Other ranks pass ``error=None``; their ``run_id`` is replaced.
    """
    payload = json.dumps({"error": error, "run_id": run_id})
    if topology.world_size == 1:
        return error, run_id
    import torch.distributed as dist

    shared = json.loads(all_texts(topology, payload if topology.is_leader else "")[0])
    dist.destroy_process_group()
    return shared["error"], shared["run_id"]


def all_true(topology: Topology, flag: bool) -> bool:
    """True when ``flag`` is true on every rank (a collective: every rank must call it)."""
    if topology.world_size == 1:
        return flag
    import torch.distributed as dist

    _init_group(topology)
    value = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


def all_texts(topology: Topology, text: str) -> list[str]:
    """Every rank's ``text`` (at most ~64 KiB each), in rank order (a collective)."""
    if topology.world_size == 1:
        return [text]
    import torch.distributed as dist

    _init_group(topology)
    raw = text.encode()[: _PAYLOAD_BYTES - 8]
    mine = torch.zeros(_PAYLOAD_BYTES, dtype=torch.uint8)
    mine.numpy()[: 8 + len(raw)] = np.frombuffer(len(raw).to_bytes(8, "little") + raw, dtype=np.uint8)
    bufs = [torch.zeros_like(mine) for _ in range(topology.world_size)]
    dist.all_gather(bufs, mine)
    out = []
    for buf in bufs:
        data = buf.numpy().tobytes()
        out.append(data[8 : 8 + int.from_bytes(data[:8], "little")].decode(errors="replace"))
    return out


def barrier_before_setup(topology: Topology) -> None:
    """Everyone has planned before rank 0 touches the directory (it may clear it)."""
    if topology.world_size > 1:
        import torch.distributed as dist

        _init_group(topology)
        dist.barrier()


def assign_shards(todo: Sequence[S], owners: int) -> list[list[S]]:
    """Each owner's shards, in id order: largest shard first to the least loaded owner (ties: lowest),
    so the planned tokens are balanced."""
    owned: list[list[S]] = [[] for _ in range(owners)]
    load = [0] * owners
    for shard in sorted(todo, key=lambda s: (-s.num_tokens, s.shard_id)):
        owner = min(range(owners), key=lambda r: (load[r], r))
        owned[owner].append(shard)
        load[owner] += shard.num_tokens
    return [sorted(o, key=lambda s: s.shard_id) for o in owned]


def _may_publish(status: RankStatus) -> bool:
    """Whether the rank can still publish shards: it has not finished its own work yet, and it
    writes (a model-parallel group's first rank; its partners only compute)."""
    working = status.phase in (RankPhase.PLANNING, RankPhase.LOADING, RankPhase.RUNNING)
    return working and status.rank % max(1, status.group_size) == 0


def await_other_ranks(
    paths: CachePaths,
    planned: set[int],
    topology: Topology,
    run_id: str,
    rank_timeout: float,
    poll: float = 1.0,
    refresh: Callable[[], None] = lambda: None,
) -> set[int]:
    """Wait while shards are missing and some other rank of this run is alive and may still
    publish them; return missing. (Ranks that wait, as this one does, publish nothing more: two
    of them must not wait for each other.) ``refresh`` brings other nodes' files in before each look."""
    while True:
        refresh()
        missing = planned - set(paths.indexed_shard_ids())
        if not missing:
            return missing
        now = time.time()
        alive = [
            s for s in read_rank_statuses(paths) if s.rank != topology.rank and s.run_id == run_id
            and rank_is_live(s, now, rank_timeout) and _may_publish(s)
        ]
        if not alive:
            return missing
        time.sleep(poll)
