"""A model-parallel group: whether the target splits over it, joining it, agreeing on each batch.

``--tp-size N`` (tensor parallelism) and ``--ep-size N`` (expert parallelism, for mixture-of-experts
targets) use transformers' own parallelism: ``from_pretrained(..., distributed_config=...)`` reads
each rank's slice of every weight straight from the checkpoint (no rank ever holds the whole
model) and puts the collectives into the forward.

A group meets only itself. After the job's set-up (``ranks.share_setup``) each rank joins its
group's own process group, as the process's default group (transformers builds its device mesh
over the default group), through the job's rendezvous store. A rank that dies stalls only its
own group, and :class:`PartnerWatch` makes that group exit: gloo reports a dead peer at once,
NCCL only after its timeout, so the watch also reads the partners' heartbeats and ends this
process when one has failed, died or gone silent.

Before each batch the group agrees, over a small gloo group on the host (the device is never waited on), to
compute it (:class:`GroupAgreement`): the writer says yes before each forward and no when its pipeline
ends (done, stopped or failed); the others say no to stop at a shard boundary. So every rank
runs the same forwards, and no rank waits in a collective for one that has left.

This module imports no torch until a group is joined (``dspark-produce --help`` stays instant).
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable

import msgspec

from dspark_cache.format.errors import CacheError
from dspark_cache.format.paths import CachePaths
from dspark_cache.format.schema import RankPhase
from dspark_cache.format.status import process_gone, rank_is_stale, read_rank_status
from dspark_cache.producer.device.topology import ParallelError, Topology

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# Where configs keep their expert count (Qwen3-MoE / Mixtral, gpt-oss / DeepSeek, Kimi).
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")
GROUP_TIMEOUT = timedelta(minutes=60)  # as the set-up group: loading a large target skews ranks by minutes
_joins = 0  # groups this process has joined: each meets under its own store prefix


def check_target(path: str, topology: Topology, trust_remote_code: bool = False) -> None:
    """Refuse a target the group cannot split, from its config alone (before anything is loaded)."""
    if not topology.model_parallel:
        return
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    problem = target_problem(config, topology.tp_size, topology.ep_size)
    if problem:
        raise ParallelError(f"target {path}: {problem}")


def target_problem(config: Any, tp_size: int, ep_size: int) -> str | None:
    """Why transformers cannot split a model with this config over ``max(tp, ep)`` ranks, or None."""
    import transformers

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    kind = getattr(config, "model_type", "") or type(config).__name__
    size = max(tp_size, ep_size)
    if not getattr(text, "base_model_tp_plan", None):
        return (
            f"{kind} has no tensor-parallel plan in transformers {transformers.__version__} "
            "(base_model_tp_plan), so --tp-size/--ep-size cannot split it; on one node, --device-map auto runs "
            "it as one process spread over the GPUs (slower: one GPU computes at a time)"
        )
    if ep_size > 1 and not getattr(text, "base_model_ep_plan", None):
        return f"{kind} has no expert-parallel plan (base_model_ep_plan); use --tp-size instead of --ep-size"
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    for what, count in (("attention heads", heads), ("key/value heads", kv_heads)):
        if isinstance(count, int) and count % size:
            return (
                f"its {count} {what} do not divide over {size} ranks; pick a group size that divides {count}"
            )
    if ep_size > 1:
        experts = next(
            (getattr(text, n) for n in EXPERT_COUNTS if isinstance(getattr(text, n, None), int)), None
        )
        if experts is None:
            return f"--ep-size needs a mixture-of-experts target; {kind} has no experts ({'/'.join(EXPERT_COUNTS)})"
        if experts % ep_size:
            return f"its {experts} experts do not divide over --ep-size {ep_size}"
    return None


def distributed_config(topology: Topology) -> Any:
    """transformers' ``DistributedConfig`` for this group: the model's own TP plan (and EP plan)."""
    import transformers
    from transformers.distributed import DistributedConfig

    kwargs: dict[str, Any] = {"tp_size": topology.group_size, "tp_plan": "auto"}
    if topology.ep_size > 1:
        kwargs["ep_size"] = topology.ep_size
    try:
        return DistributedConfig(**kwargs)
    except TypeError as exc:  # a transformers without ep_size
        raise ParallelError(
            f"transformers {transformers.__version__} cannot take {kwargs} ({exc}); --ep-size "
            "needs a newer transformers (tested with 5.24)"
        ) from exc


GO, DRAIN, END = 2, 1, 0  # what a group agrees before a batch: the least any rank says wins


class GroupAgreement:
    """The group's agreement before each batch: a one-int all-reduce on a gloo group (host only)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.ended = False  # some rank said no: every rank has left the agreement
        self.in_forward = False  # set by the writer around its forwards (see close)

    def agree(self, word: int) -> int:
        """The least of every rank's ``word``: ``GO``, ``DRAIN`` (begin no shard), ``END`` (no more
        batches)."""
        agreed = self.least(word)
        self.ended = self.ended or agreed == END
        return agreed

    def least(self, value: int) -> int:
        """The least of every rank's ``value`` (a collective: every rank must call it)."""
        import torch
        import torch.distributed as dist

        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        return int(tensor.item())

    def close(self) -> None:
        """This rank's last word, ``END``: the others' next agreement meets it. Skipped once the
        agreement has ended, and after a forward that failed midway (the others may still be inside its
        collectives: the watch ends them)."""
        if not self.ended and not self.in_forward:
            self.agree(END)


def join_group(topology: Topology, device: torch.device, store: Any) -> GroupAgreement:
    """Make this group's process group the process's default one (the set-up group must be gone)."""
    import torch.distributed as dist

    global _joins
    _joins += 1  # every rank of a group joins as often as the others (same shards, same steps)
    backend = "nccl" if device.type == "cuda" else "gloo"
    extra = {"device_id": device} if backend == "nccl" else {}  # eager NCCL init: no store needed later
    prefix = f"dspark-model-group-{topology.group}-{_joins}"
    dist.init_process_group(backend, store=dist.PrefixStore(prefix, store), rank=topology.group_rank,
                            world_size=topology.group_size, timeout=GROUP_TIMEOUT, **extra)
    log.info("rank %d joined model-parallel group %d (ranks %s, %s)", topology.rank, topology.group,
             topology.group_ranks(), backend)
    return GroupAgreement(dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT))


def leave_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


class PartnerWatch:
    """Ends this rank when a partner of its group fails, dies or falls silent while the group computes.

    ``on_gone(reason)`` is called from the watch thread after ``grace`` seconds (at most 10, at
    most ``timeout``) in which the main thread did not leave the group by itself (gloo raises at
    once when a peer dies; NCCL waits for its timeout).
    """

    def __init__(self, paths: CachePaths, topology: Topology, run_id: str, timeout: float,
                 on_gone: Callable[[str], None], poll: float = 1.0, grace: float | None = None) -> None:
        self.paths, self.topology, self.run_id, self.timeout = paths, topology, run_id, timeout
        self.on_gone, self.poll = on_gone, poll
        self.grace = min(10.0, timeout) if grace is None else grace
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="dspark-partner-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def gone(self) -> str | None:
        """Why a partner can no longer take part, or None while all of them can (or have not reported yet)."""
        now = time.time()
        for rank in self.topology.partners():
            try:
                s = read_rank_status(self.paths.status(rank))
            # not written yet, or mid-replace: a later poll
            except (OSError, CacheError, msgspec.DecodeError):
                continue
            if s.run_id != self.run_id:
                continue
            who = (f"rank {rank} of model-parallel group {self.topology.group} "
                   f"(ranks {self.topology.group_ranks()})")
            if s.phase == RankPhase.FAILED:
                return f"{who} failed: {s.last_error or 'no message'}"
            if s.phase in RankPhase.ACTIVE and process_gone(s):
                return f"{who} died (process {s.pid} is gone)"
            if rank_is_stale(s, now, self.timeout):
                return (
                    f"{who} has been silent for {now - s.updated_at:.0f} s (--rank-timeout {self.timeout:g})"
                )
        return None

    def wait_gone(self, seconds: float = 2.0) -> str | None:
        """:meth:`gone`, asked a few times over ``seconds`` (a partner's last heartbeat may be on its way)."""
        deadline = time.time() + seconds
        while True:
            reason = self.gone()
            if reason or time.time() >= deadline:
                return reason
            time.sleep(0.2)

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            reason = self.gone()
            if reason is None:
                continue
            log.error("%s; rank %d leaves in %g s unless its own collective fails first", reason,
                      self.topology.rank, self.grace)
            if not self._stop.wait(self.grace):
                self.on_gone(reason)
            return


def group_error(reason: str, topology: Topology) -> CacheError:
    """The error a rank raises when its group lost a partner: what happened and what to do."""
    return CacheError(
        f"{reason}; rank {topology.rank} cannot compute without it. The group's published shards "
        "are kept: rerun the same command to resume"
    )
