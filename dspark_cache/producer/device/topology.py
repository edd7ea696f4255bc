"""Targets larger than one device: a model-parallel group of ranks computes each batch together.

``--tp-size N`` (tensor parallelism) and ``--ep-size N`` (expert parallelism, for mixture-of-experts
targets) use transformers' own parallelism: ``from_pretrained(..., distributed_config=...)`` reads
each rank's slice of every weight straight from the checkpoint (no rank ever holds the whole
model) and puts the collectives into the forward.

The world of a torchrun job is ``data-parallel groups x model-parallel group``: ranks
``g*M .. g*M+M-1`` form group ``g`` (consecutive ranks, so a group sits inside a node when
``--nproc_per_node`` is a multiple of ``M``). What is per rank without model parallelism is per
group with it: a group owns shards (``assign_shards(todo, groups)``), and its first rank, the
*writer*, runs the staging ring and the writer thread and publishes them; the other ranks run
the same forwards (the collectives need them) and write nothing but their heartbeat.

A group meets only itself. After the job's set-up (``distributed.share_setup``) each rank joins
its group's own process group, as the process's default group (transformers builds its device
mesh over the default group), through the job's rendezvous store. A rank that dies stalls only
its own group, and :class:`PartnerWatch` makes that group exit: gloo reports a dead peer at
once, NCCL only after its timeout, so the watch also reads the partners' heartbeats and ends
this process when one has failed, died or gone silent.

Before each batch the group agrees, over a small gloo group on the host (no device sync), to
compute it (:class:`GroupSync`): the writer says yes before each forward and no when its pipeline
ends (done, stopped or failed); the others say no to stop at a shard boundary. So every rank
runs the same forwards, and no rank waits in a collective for one that has left.

This module imports no torch until a group is joined (``dspark-produce --help`` stays instant).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable

import msgspec

from dspark_cache.format.errors import CacheError
from dspark_cache.format.paths import CachePaths
from dspark_cache.format.schema import RankState
from dspark_cache.format.status import rank_is_stale, read_rank_status

if TYPE_CHECKING:
    import torch

    from dspark_cache.producer.config import ProduceConfig

log = logging.getLogger(__name__)

# Where configs keep their expert count (Qwen3-MoE / Mixtral, gpt-oss / DeepSeek, Kimi).
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")
GROUP_TIMEOUT = timedelta(minutes=60)  # as the set-up group: loading a large target skews ranks by minutes
_joins = 0  # groups this process has joined: each meets under its own store prefix


class ParallelError(ValueError):
    """``--tp-size`` / ``--ep-size`` / ``--device-map`` do not fit the job or the target."""


@dataclass(frozen=True)
class Layout:
    """Where this rank sits in ``data-parallel groups x model-parallel group``."""

    rank: int
    world_size: int
    tp_size: int = 1
    ep_size: int = 1

    @property
    def size(self) -> int:
        """Ranks per model-parallel group (transformers spreads experts over the tensor-parallel ranks)."""
        return max(self.tp_size, self.ep_size)

    @property
    def sharded(self) -> bool:
        return self.size > 1

    @property
    def groups(self) -> int:
        """Data-parallel groups: each owns and writes its own shards."""
        return self.world_size // self.size

    @property
    def group(self) -> int:
        return self.rank // self.size

    @property
    def group_rank(self) -> int:
        return self.rank % self.size

    @property
    def writer(self) -> bool:
        """The group's first rank stages and writes its shards."""
        return self.group_rank == 0

    def ranks(self) -> list[int]:
        """The ranks of this group, writer first."""
        first = self.group * self.size
        return list(range(first, first + self.size))

    def partners(self) -> list[int]:
        return [r for r in self.ranks() if r != self.rank]


def world_problem(size: int, world_size: int) -> str | None:
    """Why model-parallel groups of ``size`` ranks do not fit a job of ``world_size`` ranks, or None."""
    if size == 1 or world_size % size == 0:
        return None
    if world_size == 1:
        return (f"{size} ranks per model-parallel group need torchrun: torchrun --nproc_per_node {size} -m "
                "dspark_cache.producer ... (this process runs alone)")
    return (f"the {world_size} ranks torchrun started (WORLD_SIZE) are not whole model-parallel groups of "
            f"{size}; start a multiple of {size} ranks")


def size_argument(value: str) -> int:
    """argparse ``type`` for ``--tp-size`` / ``--ep-size``: an int >= 1 that divides the job's ranks
    (checked while parsing, so a wrong launch is a one-line usage error, exit 2)."""
    try:
        size = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {value!r}") from None
    if size < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {size}")
    problem = world_problem(size, int(os.environ.get("WORLD_SIZE", "1")))
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return size


def layout_for(cfg: ProduceConfig, rank: int, world_size: int, local_world_size: int = 1) -> Layout:
    """This rank's layout; raises :class:`ParallelError` for a combination that cannot run."""
    tp, ep = cfg.tp_size, cfg.ep_size
    for option, value in (("--tp-size", tp), ("--ep-size", ep)):
        if value < 1:
            raise ParallelError(f"{option} must be >= 1, got {value}")
    if ep > 1 and tp not in (1, ep):
        raise ParallelError(f"--ep-size {ep} with --tp-size {tp}: transformers spreads the experts over the "
                            "tensor-parallel ranks, so --ep-size must equal --tp-size (or leave --tp-size out)")
    layout = Layout(rank, world_size, tp, ep)
    problem = world_problem(layout.size, world_size)
    if problem:
        raise ParallelError(f"--{'tp' if tp >= ep else 'ep'}-size {layout.size}: {problem}")
    if cfg.device_map is not None:
        if layout.sharded:
            raise ParallelError("--device-map auto spreads one process over the GPUs; it does not combine with "
                                "--tp-size/--ep-size (use one or the other)")
        if local_world_size > 1:
            raise ParallelError(f"--device-map auto gives one process every GPU of its node, but torchrun started "
                                f"{local_world_size} per node; use --nproc_per_node 1, or --tp-size to share "
                                "the GPUs between ranks")
    if layout.sharded and local_world_size % layout.size and rank == 0:
        log.warning("model-parallel groups of %d ranks with %d ranks per node: some groups span two nodes, and "
                    "their collectives cross the network; make --nproc_per_node a multiple of %d",
                    layout.size, local_world_size, layout.size)
    return layout


def check_device(layout: Layout, device: str) -> None:
    """transformers puts the shards on the machine's accelerator: ``--device cpu`` cannot hold them there."""
    if not layout.sharded or device != "cpu":
        return
    import torch

    if torch.cuda.is_available():
        raise ParallelError("--tp-size/--ep-size with --device cpu on a machine with CUDA: transformers places "
                            "tensor-parallel shards on the GPUs; use --device cuda (or hide the GPUs with "
                            "CUDA_VISIBLE_DEVICES= to test on CPU)")


def check_target(path: str, layout: Layout, trust_remote_code: bool = False) -> None:
    """Refuse a target the group cannot split, from its config alone (before anything is loaded)."""
    if not layout.sharded:
        return
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    problem = target_problem(config, layout.tp_size, layout.ep_size)
    if problem:
        raise ParallelError(f"target {path}: {problem}")


def target_problem(config: Any, tp_size: int, ep_size: int) -> str | None:
    """Why transformers cannot split a model with this config over ``max(tp, ep)`` ranks, or None."""
    import transformers

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    kind = getattr(config, "model_type", "") or type(config).__name__
    size = max(tp_size, ep_size)
    if not getattr(text, "base_model_tp_plan", None):
        return (f"{kind} has no tensor-parallel plan in transformers {transformers.__version__} "
                "(base_model_tp_plan), so --tp-size/--ep-size cannot split it; on one node, --device-map auto runs "
                "it as one process spread over the GPUs (slower: one GPU computes at a time)")
    if ep_size > 1 and not getattr(text, "base_model_ep_plan", None):
        return f"{kind} has no expert-parallel plan (base_model_ep_plan); use --tp-size instead of --ep-size"
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    for what, count in (("attention heads", heads), ("key/value heads", kv_heads)):
        if isinstance(count, int) and count % size:
            return f"its {count} {what} do not divide over {size} ranks; pick a group size that divides {count}"
    if ep_size > 1:
        experts = next((getattr(text, n) for n in EXPERT_COUNTS if isinstance(getattr(text, n, None), int)), None)
        if experts is None:
            return f"--ep-size needs a mixture-of-experts target; {kind} has no experts ({'/'.join(EXPERT_COUNTS)})"
        if experts % ep_size:
            return f"its {experts} experts do not divide over --ep-size {ep_size}"
    return None


def distributed_config(layout: Layout) -> Any:
    """transformers' ``DistributedConfig`` for this group: the model's own TP plan (and EP plan)."""
    import transformers
    from transformers.distributed import DistributedConfig

    kwargs: dict[str, Any] = {"tp_size": layout.size, "tp_plan": "auto"}
    if layout.ep_size > 1:
        kwargs["ep_size"] = layout.ep_size
    try:
        return DistributedConfig(**kwargs)
    except TypeError as exc:  # a transformers without ep_size
        raise ParallelError(f"transformers {transformers.__version__} cannot take {kwargs} ({exc}); --ep-size "
                            "needs a newer transformers (tested with 5.24)") from exc


class GroupSync:
    """The group's agreement before each batch: a one-int all-reduce on a gloo group (host only)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.ended = False  # some rank said no: every rank has left the agreement
        self.in_forward = False  # set by the writer around its forwards (see close)

    def vote(self, go: bool) -> bool:
        """True when every rank of the group says ``go`` (a collective: every rank must call it)."""
        import torch
        import torch.distributed as dist

        value = torch.tensor([1 if go else 0], dtype=torch.int32)
        dist.all_reduce(value, op=dist.ReduceOp.MIN, group=self.group)
        agreed = bool(value.item())
        self.ended = self.ended or not agreed
        return agreed

    def close(self) -> None:
        """This rank's last word, "no more batches": the others' next vote meets it. Skipped once the
        agreement has ended, and after a forward that failed midway (the others may still be inside its
        collectives: the watch ends them)."""
        if not self.ended and not self.in_forward:
            self.vote(False)


def join_group(layout: Layout, device: torch.device, store: Any) -> GroupSync:
    """Make this group's process group the process's default one (the set-up group must be gone)."""
    import torch.distributed as dist

    global _joins
    _joins += 1  # every rank of a group joins as often as the others (same shards, same steps)
    backend = "nccl" if device.type == "cuda" else "gloo"
    extra = {"device_id": device} if backend == "nccl" else {}  # eager NCCL init: no store needed later
    prefix = f"dspark-model-group-{layout.group}-{_joins}"
    dist.init_process_group(backend, store=dist.PrefixStore(prefix, store), rank=layout.group_rank,
                            world_size=layout.size, timeout=GROUP_TIMEOUT, **extra)
    log.info("rank %d joined model-parallel group %d (ranks %s, %s)", layout.rank, layout.group, layout.ranks(),
             backend)
    return GroupSync(dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT))


def leave_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _process_gone(pid: int, started_at: float) -> bool:
    """Whether the process that wrote a heartbeat at ``started_at`` is gone from this host."""
    import psutil

    try:
        proc = psutil.Process(pid)
        # A killed child stays a zombie until reaped; a newer process may have taken its pid.
        return proc.status() == psutil.STATUS_ZOMBIE or proc.create_time() > started_at + 1.0
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:  # not ours to inspect: its heartbeat decides
        return False


class PartnerWatch:
    """Ends this rank when a partner of its group fails, dies or falls silent while the group computes.

    ``on_gone(reason)`` is called from the watch thread after ``grace`` seconds (at most 10, at
    most ``timeout``) in which the main thread did not leave the group by itself (gloo raises at
    once when a peer dies; NCCL waits for its timeout).
    """

    def __init__(self, paths: CachePaths, layout: Layout, run_id: str, timeout: float,
                 on_gone: Callable[[str], None], poll: float = 1.0, grace: float | None = None) -> None:
        self.paths, self.layout, self.run_id, self.timeout = paths, layout, run_id, timeout
        self.on_gone, self.poll = on_gone, poll
        self.grace = min(10.0, timeout) if grace is None else grace
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.host = socket.gethostname()

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
        for rank in self.layout.partners():
            try:
                s = read_rank_status(self.paths.status(rank))
            except (OSError, CacheError, msgspec.DecodeError):  # not written yet, or mid-replace: a later poll
                continue
            if s.run_id != self.run_id:
                continue
            who = f"rank {rank} of model-parallel group {self.layout.group} (ranks {self.layout.ranks()})"
            if s.state == RankState.FAILED:
                return f"{who} failed: {s.last_error or 'no message'}"
            if s.state in RankState.ACTIVE and s.host == self.host and _process_gone(s.pid, s.started_at):
                return f"{who} died (process {s.pid} is gone)"
            if rank_is_stale(s, now, self.timeout):
                return f"{who} has been silent for {now - s.updated_at:.0f} s (--rank-timeout {self.timeout:g})"
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
                      self.layout.rank, self.grace)
            if not self._stop.wait(self.grace):
                self.on_gone(reason)
            return


def group_error(reason: str, layout: Layout) -> CacheError:
    """The error a rank raises when its group lost a partner: what happened and what to do."""
    return CacheError(f"{reason}; rank {layout.rank} cannot compute without it. The group's published shards "
                      "are kept: rerun the same command to resume")
