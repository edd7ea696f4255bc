"""The loader's options, checked once when the loader is built."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from dspark_cache.loader.verify import VERIFY_MODES
from dspark_cache.storage.backing import StorageOptions

PAD_MODES = ("seq_length", "longest")
# Options that shape the global order: a resume state must have been made with the same ones
# (world size and batch size may change: the global order depends on neither, and a state is a
# position in it; DSparkLoader.load_state_dict).
ORDER_OPTIONS = ("seed", "shuffle", "window", "drop_last", "partial_last", "follow")


@dataclass(frozen=True)
class LoaderConfig:
    """Every option of :class:`~.dataloader.DSparkLoader`.

    ``batch_size`` samples per rank and step; ``shuffle``/``seed``/``window``: the order
    (:mod:`.order`); ``epoch`` to start at; ``rank``/``world_size`` (default: torch.distributed's,
    or 0 of 1); ``num_workers`` reader threads in this process (default ``min(4, cpus)``; 0 means
    one: batches are always read off the training thread, never in worker processes); ``pad_to``
    ``"seq_length"`` or ``"longest"``; ``drop_last``/``partial_last``: the epoch's last step;
    ``follow`` a growing cache, polling every ``poll_interval`` s and giving up after
    ``follow_timeout`` s without a new shard; ``expect``: training-config fields the manifest must
    match; ``prefetch`` batches read ahead; ``pin_memory`` (default: where CUDA exists);
    ``nemo_keys_only`` drops our extra keys; ``verify`` ``"once"`` or ``"always"``; ``dtype`` of the
    hidden states handed out: ``None`` (as stored; an FP8 cache dequantised to bf16), ``"bf16"`` or
    ``"fp32"`` (an FP8 cache dequantised to it), or ``"raw"`` (FP8 bytes plus scales, for
    ``dspark_cache.dequantize`` on the GPU); ``target_layer_ids``: the layers whose states are handed
    out, any subset of the cache's in any order (default: all, as stored; the final state is handed
    out either way). A cache at an object-store URL (``s3://bucket/prefix``)
    is read through a node-local copy: ``local_cache_dir`` (default ``$DSPARK_LOCAL_CACHE_DIR`` or
    ``~/.cache/dspark-cache/remote``, shared by the node's processes), ``cache_limit`` bytes of shards
    kept there (default: half its free space), ``storage_options`` for the client (endpoint, region,
    credentials; see README "Caches on object storage"). ``epoch_size``: a mixture's samples per
    epoch when its sources give proportions (default: all their samples; README "Training on a mixture").
    """

    batch_size: int
    shuffle: bool = True
    seed: int = 0
    epoch: int = 0
    rank: int | None = None
    world_size: int | None = None
    num_workers: int | None = None
    pad_to: str = "seq_length"
    drop_last: bool = False
    partial_last: bool = False
    follow: bool = False
    expect: dict[str, Any] | None = None
    window: int = 4
    prefetch: int = 2
    pin_memory: bool | None = None
    nemo_keys_only: bool = False
    poll_interval: float = 0.5
    follow_timeout: float | None = None
    verify: str = "once"
    dtype: Any = None  # checked against the cache when the loader opens it (reader.resolve_out_code)
    target_layer_ids: Sequence[int] | None = None  # checked against the cache when the loader opens it
    storage_options: dict[str, Any] | None = field(default=None, repr=False)  # may hold secrets
    local_cache_dir: str | None = None
    cache_limit: int | None = None
    epoch_size: int | None = None  # a mixture with proportions: samples per epoch (loader.sources)

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.window < 1:
            raise ValueError("batch_size and window must be >= 1")
        if self.num_workers is not None and self.num_workers < 0:
            raise ValueError(f"num_workers={self.num_workers}: it is the number of reader threads, 0 or more "
                             "(0 and 1 both mean one thread); leave it unset for min(4, cpus)")
        if self.pad_to not in PAD_MODES:
            raise ValueError(f"pad_to must be 'seq_length' or 'longest', not {self.pad_to!r}")
        if self.verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {VERIFY_MODES}, not {self.verify!r}")
        if self.target_layer_ids is not None:  # checked against the cache's layers when it is opened
            object.__setattr__(self, "target_layer_ids", tuple(self.target_layer_ids))
        if self.cache_limit is not None and self.cache_limit <= 0:
            raise ValueError(
                f"cache_limit={self.cache_limit}: the bytes of shards kept on this node, more than 0"
            )

    @property
    def storage(self) -> StorageOptions:
        return StorageOptions(self.storage_options, self.local_cache_dir, self.cache_limit)

    @property
    def read_ahead(self) -> int:
        """Batches in flight: at least one."""
        return max(1, self.prefetch)

    @property
    def threads(self) -> int:
        return self.num_workers if self.num_workers is not None else min(4, os.cpu_count() or 1)

    @property
    def pinned(self) -> bool:
        return torch.cuda.is_available() if self.pin_memory is None else self.pin_memory

    def ranks(self) -> tuple[int, int]:
        """``(rank, world_size)``: the given ones, else torch.distributed's; checked."""
        dist_rank, dist_world = _distributed_defaults()
        rank = dist_rank if self.rank is None else self.rank
        world = dist_world if self.world_size is None else self.world_size
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in [0, {world})")
        return rank, world


def _distributed_defaults() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1
