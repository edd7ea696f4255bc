"""Host memory between the device and the writer: one fixed ring, claimed before the copy, and the
copies into it (:class:`HostCopier`).

Every batch copied to the host lives in a region of one block of host memory (pinned when the device is a
GPU), allocated once and sized by ``--max-inflight-bytes`` (never more than the run needs). The
main thread claims a region *before* it queues the device-to-host copies and waits while the
ring is full; the writer releases it once the bytes are in the shard file. So pinned memory is
the budget, exactly, for the whole run: no per-sample ``cudaHostAlloc`` (slow, and it waits
for the device), and no power-of-two size classes of CUDA's caching host allocator filling up
one after another. The same ring runs unpinned on a CPU, where the tests exercise it.

Regions are claimed in the order the device computes batches and released as the writer lanes
finish with them, which is nearly that order (each lane writes its own batches in order, the
lanes side by side). The ring stays a FIFO: a region released early is free once every region
claimed before it is, so free space is the gap after the newest region, or the start of the
block when that gap is too small (the tail end is then skipped until the ring wraps).

On CUDA the copies run on a side stream that waits for the forward on the device, never on the
host; an event recorded after the last copy tells the writer when the bytes are there.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch

from dspark_cache.producer.pipeline.timing import BatchClock

ALIGN = 256  # every view starts here-aligned: dtype views need it, copy engines like it
PAGE = 4096


def aligned(nbytes: int) -> int:
    return nbytes + (-nbytes % ALIGN)


@dataclass(frozen=True)
class Region:
    """A claimed byte range of the ring; ``carve`` hands out aligned views in order."""

    ring: "HostRing"
    start: int
    size: int
    serial: int = 0  # which claim: a region's start is reused once it is free

    def views(self, shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
        """One tensor per ``(shape, dtype)``, back to back (aligned) from the region's start."""
        out = []
        cursor = self.start
        for shape, dtype in shapes:
            nbytes = _nbytes(shape, dtype)
            out.append(self.ring.block[cursor : cursor + nbytes].view(dtype).view(shape))
            cursor += aligned(nbytes)
        if cursor > self.start + self.size:
            raise ValueError(f"views need {cursor - self.start} bytes, the region has {self.size}")
        return out


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def region_bytes(shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> int:
    """Bytes a region needs for these views (what :meth:`Region.views` will carve)."""
    return sum(aligned(_nbytes(shape, dtype)) for shape, dtype in shapes)


def _page_aligned(nbytes: int) -> torch.Tensor:
    """``nbytes`` of host memory starting on a page (region offsets are then aligned in memory)."""
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8)
    skip = -raw.data_ptr() % PAGE
    return raw[skip : skip + nbytes]


def _pinned_block(nbytes: int) -> tuple[torch.Tensor, bool]:
    """``nbytes`` of page-locked host memory and whether we registered it ourselves.

    ``pin_memory=True`` goes through CUDA's caching host allocator, which rounds every block up
    to a power of two (a 1.1 GB budget would pin 2 GiB): registering a plain block pins exactly
    what the budget says. The allocator is the fallback where registration is refused.
    """
    block = _page_aligned(nbytes)
    if int(torch.cuda.cudart().cudaHostRegister(block.data_ptr(), nbytes, 0)) == 0:
        return block, True
    # A refused registration leaves its error pending on this thread, and the next kernel launch
    # would report it (torch binds no cudaGetLastError): let a throwaway launch take it.
    try:
        torch.zeros(1, device="cuda").add_(1)
    except RuntimeError:
        pass
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), False


class HostRing:
    """``capacity`` bytes of host memory handed out as FIFO regions (thread-safe).

    ``pinned`` (a CUDA device is in use): the block is page-locked, so copies into it are truly
    asynchronous. Call :meth:`close` once no copy into the ring can still be running.
    """

    def __init__(self, capacity: int, pinned: bool) -> None:
        self.capacity = aligned(max(ALIGN, capacity))
        self.pinned = pinned
        if pinned:
            self.block, self._registered = _pinned_block(self.capacity)
        else:
            self.block, self._registered = _page_aligned(self.capacity), False
        self._regions: deque[list[int]] = deque()  # [start, end, released, serial] in claim order
        self._claims = 0
        self._cond = threading.Condition()
        self.inflight = 0  # bytes claimed and not yet released (skipped tail ends not counted)
        self.peak = 0

    def claim(self, nbytes: int, abort: Callable[[], bool] = lambda: False) -> Region | None:
        """Wait for ``nbytes`` of free ring; ``None`` when ``abort()`` turns true while waiting."""
        size = aligned(max(1, nbytes))
        if size > self.capacity:
            raise ValueError(f"a batch of {size} bytes does not fit a host ring of {self.capacity} bytes")
        with self._cond:
            while (start := self._place(size)) is None:
                if abort():
                    return None
                self._cond.wait(0.1)
            self._claims += 1
            self._regions.append([start, start + size, 0, self._claims])
            self.inflight += size
            self.peak = max(self.peak, self.inflight)
            return Region(self, start, size, self._claims)

    def release(self, region: Region) -> None:
        """Give back a region, in any order: its bytes count as free at once, its space is reused once
        the regions claimed before it are released too."""
        with self._cond:
            held = next((r for r in self._regions if r[3] == region.serial), None)
            if held is None or held[2]:
                raise RuntimeError(f"host ring region at {region.start} is not held")
            held[2] = 1
            self.inflight -= region.size
            while self._regions and self._regions[0][2]:
                self._regions.popleft()
            self._cond.notify_all()

    def close(self) -> None:
        """Unpin the block (the ring must not be used afterwards)."""
        if self._registered:
            torch.cuda.cudart().cudaHostUnregister(self.block.data_ptr())
            self._registered = False

    def _place(self, size: int) -> int | None:
        if not self._regions:
            return 0
        first, last_end = self._regions[0][0], self._regions[-1][1]
        wrapped = self._regions[-1][0] < first
        if wrapped:  # used: [first, capacity) and [0, last_end)
            return last_end if first - last_end >= size else None
        if self.capacity - last_end >= size:  # used: [first, last_end)
            return last_end
        return 0 if first >= size else None


def ring_capacity(budget: int, largest_batch: int, total: int) -> int:
    """The budget, but never more than the whole run copies in nor less than its largest batch."""
    return max(largest_batch, min(budget, total))


class HostCopier:
    """Copies a batch's real tokens into its ring region (asynchronously on CUDA)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    def synchronize(self) -> None:
        """Wait for every copy queued on the side stream."""
        if self.stream is not None:
            self.stream.synchronize()

    def copy_in(self, region: Region, shapes: list[tuple[tuple[int, ...], torch.dtype]], names: list[str],
              stored: dict[str, torch.Tensor], finite: torch.Tensor, lengths: list[int], clock: BatchClock
              ) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor, torch.cuda.Event | None]:
        """Queue the copies of each sample's real tokens of every ``stored`` tensor (``names``: in
        the order of ``shapes``) into the region; returns the host views, the flags and the event
        recorded after the last copy (None on a CPU, where the copies are done on return)."""
        views = iter(region.views(shapes))
        in_ring = [{name: next(views) for name in names} for _ in lengths]
        finite_host = next(views)
        if self.stream is not None:
            # Copies wait for the forward on the device, not on the host.
            self.stream.wait_stream(torch.cuda.current_stream(finite.device))
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            clock.mark("copy", self.stream)
            for b, (n, sample) in enumerate(zip(lengths, in_ring)):
                for name, dst in sample.items():
                    dst.copy_(stored[name][b, :n], non_blocking=self.cuda)
            finite_host.copy_(finite, non_blocking=self.cuda)
            clock.mark("copy_done", self.stream)
        if self.stream is None:
            return in_ring, finite_host, None
        ready = torch.cuda.Event()
        ready.record(self.stream)
        for src in (*stored.values(), finite):
            src.record_stream(self.stream)  # keep device memory alive until the copy ends
        return in_ring, finite_host, ready
