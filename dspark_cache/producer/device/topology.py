"""Where this rank sits in its job: data-parallel groups x one model-parallel group's ranks.

The world of a torchrun job is ``groups x group_size`` ranks: ranks ``g*M .. g*M+M-1`` form
group ``g`` (consecutive ranks, so a group sits inside a node when ``--nproc_per_node`` is a
multiple of ``M``). Without ``--tp-size``/``--ep-size`` a group is one rank. A group owns shards;
its first rank, the *writer*, stages and publishes them; the others run the same forwards and
write nothing but their heartbeat. Rank 0, the *leader*, prepares the directory and merges the plan.

Facts only: nothing here talks to another rank (``ranks`` does, and ``model_group`` for a
group), and nothing imports torch until a check needs it (``dspark-produce --help`` stays instant).
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass

log = logging.getLogger(__name__)


class ParallelError(ValueError):
    """``--tp-size`` / ``--ep-size`` / ``--device-map`` do not fit the job or the target."""


@dataclass(frozen=True)
class Topology:
    """This rank's place in the job, for data and model parallelism alike."""

    rank: int = 0
    world_size: int = 1
    local_world_size: int = 1  # ranks torchrun started on this node
    tp_size: int = 1
    ep_size: int = 1

    @classmethod
    def from_environment(cls, tp_size: int = 1, ep_size: int = 1) -> Topology:
        """This process in its torchrun job (``RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``; a job of
        one rank without torchrun)."""
        return cls(int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")),
                   int(os.environ.get("LOCAL_WORLD_SIZE", "1")), tp_size, ep_size)

    @property
    def is_leader(self) -> bool:
        """Rank 0: it prepares the directory for the job and merges the plan."""
        return self.rank == 0

    @property
    def group_size(self) -> int:
        """Ranks per model-parallel group (transformers spreads experts over the tensor-parallel ranks)."""
        return max(self.tp_size, self.ep_size)

    @property
    def model_parallel(self) -> bool:
        """Whether a group of several ranks computes each batch together."""
        return self.group_size > 1

    @property
    def groups(self) -> int:
        """Data-parallel groups: each owns and writes its own shards."""
        return self.world_size // self.group_size

    @property
    def group(self) -> int:
        return self.rank // self.group_size

    @property
    def group_rank(self) -> int:
        return self.rank % self.group_size

    @property
    def writer(self) -> bool:
        """The group's first rank stages and writes its shards."""
        return self.group_rank == 0

    def group_ranks(self) -> list[int]:
        """The ranks of this rank's group, writer first."""
        first = self.group * self.group_size
        return list(range(first, first + self.group_size))

    def partners(self) -> list[int]:
        """The other ranks of this rank's group."""
        return [r for r in self.group_ranks() if r != self.rank]


def _world_problem(size: int, world_size: int) -> str | None:
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
    problem = _world_problem(size, int(os.environ.get("WORLD_SIZE", "1")))
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return size


def check_topology(topology: Topology, device: str = "auto", device_map: str | None = None) -> None:
    """Raise :class:`ParallelError` for a combination that cannot run; warn about one that runs slowly."""
    tp, ep = topology.tp_size, topology.ep_size
    for option, value in (("--tp-size", tp), ("--ep-size", ep)):
        if value < 1:
            raise ParallelError(f"{option} must be >= 1, got {value}")
    if ep > 1 and tp not in (1, ep):
        raise ParallelError(
            f"--ep-size {ep} with --tp-size {tp}: transformers spreads the experts over the "
            "tensor-parallel ranks, so --ep-size must equal --tp-size (or leave --tp-size out)"
        )
    size = topology.group_size
    problem = _world_problem(size, topology.world_size)
    if problem:
        raise ParallelError(f"--{'tp' if tp >= ep else 'ep'}-size {size}: {problem}")
    if device_map is not None:
        if topology.model_parallel:
            raise ParallelError(
                "--device-map auto spreads one process over the GPUs; it does not combine with "
                "--tp-size/--ep-size (use one or the other)"
            )
        if topology.local_world_size > 1:
            raise ParallelError(
                f"--device-map auto gives one process every GPU of its node, but torchrun started "
                f"{topology.local_world_size} per node; use --nproc_per_node 1, or --tp-size to "
                "share the GPUs between ranks"
            )
    if topology.model_parallel and topology.local_world_size % size and topology.is_leader:
        log.warning(
            "model-parallel groups of %d ranks with %d ranks per node: some groups span two nodes, and "
            "their collectives cross the network; make --nproc_per_node a multiple of %d",
            size,
            topology.local_world_size,
            size,
        )
    _check_device(topology, device)


def _check_device(topology: Topology, device: str) -> None:
    """transformers puts the shards on the machine's accelerator: ``--device cpu`` cannot hold them there."""
    if not topology.model_parallel or device != "cpu":
        return
    import torch

    if torch.cuda.is_available():
        raise ParallelError(
            "--tp-size/--ep-size with --device cpu on a machine with CUDA: transformers places "
            "tensor-parallel shards on the GPUs; use --device cuda (or hide the GPUs with "
            "CUDA_VISIBLE_DEVICES= to test on CPU)"
        )
