"""Counting the operations that make the host wait for the device.

On CUDA, ``torch.cuda.set_sync_debug_mode`` reports syncs as they happen. On a CPU there is no
device to wait for, but the same code paths run: this dispatch mode counts, on the thread that
enters it, every operation that would wait for a device (reading a value back, data-dependent
output sizes, blocking copies to the host), so a test on a CPU machine proves the producer's
loop has none.
"""

from __future__ import annotations

import traceback
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Each of these needs a value computed on the device before the host can go on.
_WAITING_OPS = {
    aten._local_scalar_dense.default,  # .item(), bool(t), int(t), float(t)
    aten.is_nonzero.default,
    aten.equal.default,
    aten.nonzero.default,  # output size depends on the data
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_consecutive.default,
    aten.unique_dim.default,
}


def _blocking_copy_to_host(func: Any, args: tuple, kwargs: dict) -> bool:
    """A copy from a device to the host that is not ``non_blocking`` waits for the device."""
    if func is aten.copy_.default:
        dst, src = args[0], args[1]
        non_blocking = bool(args[2]) if len(args) > 2 else bool(kwargs.get("non_blocking", False))
        return src.device.type != "cpu" and dst.device.type == "cpu" and not non_blocking
    if func is aten._to_copy.default:
        src = args[0]
        target = kwargs.get("device")
        return (src.device.type != "cpu" and target is not None and torch.device(target).type == "cpu"
                and not kwargs.get("non_blocking", False))
    return False


class HostSyncTrap(TorchDispatchMode):
    """``with HostSyncTrap() as trap: ...`` then ``trap.count`` and ``trap.where`` (one short
    stack per sync, to find it). Only the entering thread is watched."""

    def __init__(self, keep_stacks: int = 5) -> None:
        super().__init__()
        self.count = 0
        self.where: list[str] = []
        self._keep = keep_stacks

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _WAITING_OPS or _blocking_copy_to_host(func, args, kwargs):
            self.count += 1
            if len(self.where) < self._keep:
                frames = traceback.format_stack(limit=8)[:-1]
                self.where.append(f"{func}\n" + "".join(frames[-4:]))
        return func(*args, **kwargs)
