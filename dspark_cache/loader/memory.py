"""Batch memory for the reader: recycled once nobody holds it, and zeroed only where needed.

Pad slots must be zeros (finite: ``NaN * 0`` would poison the loss). Zeroing every pad slot of
a batch padded to ``seq_length`` writes several times more bytes than reading the samples, and
fresh memory is faulted in page by page, which makes a copy into it more than twice as slow.
So batch memory the loader owns is recycled, and each slab remembers which token slots an
earlier batch wrote: only those are zeroed again. A slab is reused only when no tensor outside
the loader still views it (its storage's use count is back to what the slab alone holds), so
a batch that training keeps is never overwritten.

Pinned memory (CUDA) is recycled too, with one more condition: a non-blocking copy of a batch
to the GPU may still be running when training drops the batch. When a pinned slab is first
seen unheld, a CUDA event is recorded on the stream that was current for the training thread
when it asked for the batch being read (where its copies were queued); the slab is handed out
again only once that event has completed, i.e. once every copy queued before it has finished.
A copy queued on another stream (or on another device's stream: call ``torch.cuda.set_device``
per rank, as training scripts do) must be waited for by the caller before it drops the batch.
"""

from __future__ import annotations

import mmap
import threading
from dataclasses import dataclass

import numpy as np
import torch

_ALIGN = 4096


@dataclass(frozen=True)
class Field:
    """A batch tensor of ``[rows, width, per_token]`` elements (``[rows, width]`` when ``scalar``:
    one value per token, such as the token ids; a one-layer scale field stays 3-D)."""

    name: str
    per_token: int
    dtype: torch.dtype
    tracked: bool  # pad slots are zeroed only where an earlier batch wrote (wide fields)
    scalar: bool = False

    def nbytes(self, slots: int) -> int:
        return slots * self.per_token * self.dtype.itemsize


def page_aligned_zeros(nbytes: int) -> np.ndarray:
    """``nbytes`` zero bytes starting on a page boundary.

    numpy's zeros is calloc: large blocks are fresh zero pages, touched only when used. malloc
    aligns to 16 bytes only, and the kernel copies into 16-byte-misaligned memory 1.34x slower
    than into page-aligned memory.
    """
    block = np.zeros(nbytes + _ALIGN, dtype=np.uint8)
    skip = -block.ctypes.data % _ALIGN
    return block[skip : skip + nbytes]


def fresh_pages(nbytes: int) -> np.ndarray:
    """``nbytes`` of fresh zero pages from the kernel (page-aligned, 4 KiB pages), for batch slabs.

    Not numpy's allocation: numpy asks for transparent huge pages on large arrays, and a batch
    row touches a few MiB here and there of a slab, so the kernel zeroed (and sometimes
    compacted memory for) a whole 2 MiB page at each first touch. With 4 KiB pages the first
    epoch ran 1.3-2x faster and the steady state the same (BENCHMARKS.md), and memory that no
    row reaches is never resident.
    """
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(region, dtype=np.uint8)  # the array keeps the mapping alive


def _use_count(t: torch.Tensor) -> int:
    """Tensors (and views) sharing ``t``'s storage, or a huge number where torch cannot say."""
    counter = getattr(torch._C, "_storage_Use_Count", None)
    if counter is None:  # never recycle when we cannot prove nobody holds the memory
        return 1 << 30
    return counter(t.untyped_storage()._cdata)


class Slab:
    """One allocation holding every field of a batch of up to ``capacity`` token slots."""

    def __init__(self, fields: tuple[Field, ...], capacity: int, *, pinned: bool) -> None:
        self.fields, self.capacity = fields, capacity
        offsets, total = {}, 0
        for f in fields:
            offsets[f.name] = total
            total += -(-f.nbytes(capacity) // _ALIGN) * _ALIGN
        if pinned:
            raw = torch.empty(total, dtype=torch.uint8, pin_memory=True)
            self.dirty = np.ones(capacity, dtype=bool)  # cached blocks hold stale bytes
        else:
            raw = torch.from_numpy(fresh_pages(total))
            self.dirty = np.zeros(capacity, dtype=bool)
        self._flat = {
            f.name: raw[offsets[f.name] : offsets[f.name] + f.nbytes(capacity)].view(f.dtype) for f in fields
        }
        # The batch program addresses each field's bytes; made once per slab (a torch reshape
        # and view per field and batch cost ~45 us each, a sixth of the filler's Python time).
        self._bytes = {name: flat.view(torch.uint8).numpy() for name, flat in self._flat.items()}
        self._raw = raw
        self._baseline = _use_count(raw)  # counted after every view the slab itself keeps
        self.pinned = pinned
        self._fence: torch.cuda.Event | None = None

    def idle(self) -> bool:
        """True when no batch (or view of one) outside this slab is alive."""
        return _use_count(self._raw) <= self._baseline

    def reusable(self, stream: "torch.cuda.Stream | None" = None) -> bool:
        """Idle, and (pinned) every copy queued on ``stream`` (the training thread's stream; the
        current one when None) before it became idle has finished."""
        if not self.idle():
            self._fence = None
            return False
        if not self.pinned:
            return True
        if self._fence is None:  # first seen unheld: fence the copies queued until now
            self._fence = torch.cuda.Event()
            self._fence.record(stream if stream is not None else torch.cuda.current_stream())
        return self._fence.query()

    def handed_out(self) -> None:
        self._fence = None

    def field_bytes(self, name: str, nbytes: int) -> np.ndarray:
        """The first ``nbytes`` of field ``name`` as flat uint8 (what a batch's program writes)."""
        return self._bytes[name][:nbytes]

    def views(self, rows: int, width: int) -> dict[str, torch.Tensor]:
        """The batch tensors for ``rows`` rows padded to ``width`` token slots."""
        out = {}
        for f in self.fields:
            flat = self._flat[f.name][: rows * width * f.per_token]
            out[f.name] = flat.view(rows, width) if f.scalar else flat.view(rows, width, f.per_token)
        return out

    def zero_spans(self, ranges: list[tuple[int, int]]) -> list[tuple[str, int, int]]:
        """``(field, byte offset, nbytes)`` to zero for these slot ranges (from :meth:`claim`)."""
        return [(f.name, start * f.nbytes(1), f.nbytes(end - start))
                for f in self.fields if f.tracked for start, end in ranges]

    def stale(self, width: int, lengths: list[int]) -> list[tuple[int, int]]:
        """Slot ranges of the tracked fields that an earlier batch wrote and that a batch of these row
        lengths, padded to ``width``, shows as pads: what :meth:`claim` zeroes (one range per row:
        from its first stale pad slot to its last)."""
        zero = []
        for row, n in enumerate(lengths):
            start, end = row * width + n, (row + 1) * width
            written = np.flatnonzero(self.dirty[start:end])
            if written.size:
                zero.append((start + int(written[0]), start + int(written[-1]) + 1))
        return zero

    def claim(self, width: int, lengths: list[int]) -> list[tuple[int, int]]:
        """Slot ranges of the tracked fields to zero before a batch of these row lengths is read.

        Row ``r`` writes slots ``[r*width, r*width + n)`` and must show zeros in the rest of its
        row; only pad slots that an earlier batch may have written need zeroing.
        """
        zero = self.stale(width, lengths)
        for row, n in enumerate(lengths):
            start = row * width + n
            self.dirty[row * width : start] = True
            self.dirty[start : (row + 1) * width] = False
        return zero


class BatchMemory:
    """Hands out a slab per batch: a recycled idle one if any, else a new one."""

    def __init__(self, fields: tuple[Field, ...], max_slots: int, *, pinned: bool, keep: int) -> None:
        self.fields, self.max_slots, self.pinned, self.keep = fields, max_slots, pinned, keep
        self._pool: list[Slab] = []
        self._replaced = 0
        self._lock = threading.Lock()

    def checkout(self, rows: int, width: int, lengths: list[int], stream: "torch.cuda.Stream | None" = None
                 ) -> tuple[Slab, dict[str, torch.Tensor], list[tuple[int, int]]]:
        """A slab for a batch of these row ``lengths`` padded to ``width``, its batch tensors and the
        slot ranges to zero. Thread-safe: reader threads check slabs out (allocating off the
        training thread); ``stream`` is where the training thread queues its copies (pinned)."""
        with self._lock:  # the views make the slab busy before another thread can look at it
            slab = self.take(rows, width, stream, lengths)
            return slab, slab.views(rows, width), slab.claim(width, lengths)

    def take(self, rows: int, width: int, stream: "torch.cuda.Stream | None" = None,
             lengths: list[int] | None = None) -> Slab:
        """A reusable slab, or a new one. With the batch's row ``lengths``, the reusable slab with the
        fewest stale pad slots to zero for it: zeroing writes 30-45% as many bytes as the reads
        (long-tailed lengths), and two slabs are usually idle to choose from (BENCHMARKS.md)."""
        idle = [slab for slab in self._pool if slab.reusable(stream)]
        if idle:
            slab = idle[0]
            if lengths is not None and len(idle) > 1:
                slab = min(idle, key=lambda s: sum(end - start for start, end in s.stale(width, lengths)))
            slab.handed_out()
            return slab
        # Every kept slab is in flight, held by training or (pinned) still being copied from:
        # allocate. Slabs are sized for the longest possible batch, so a recycled one always fits.
        slab = Slab(self.fields, self.max_slots, pinned=self.pinned)
        if len(self._pool) < self.keep:
            self._pool.append(slab)
        else:  # the slab dropped from the pool is freed when its holder lets go of it
            self._pool[self._replaced % self.keep] = slab
            self._replaced += 1
        return slab

    def release(self) -> None:
        """Let go of every slab: each is freed now, or once training drops the batch it holds."""
        with self._lock:
            self._pool.clear()
