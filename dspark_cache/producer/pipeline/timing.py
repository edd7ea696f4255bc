"""Stage times that mean what they say on a GPU as on a CPU.

On CUDA the host only queues kernels: a host timer around the forward measures queuing, not
the forward. There the device and copy times come from CUDA events, read by the writer once the
batch's copy has finished (so reading them never waits), and the writer's own wait for that copy
is a stage of its own. On a CPU every stage is synchronous and host timers are exact.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass
class StageTimes:
    """Seconds per stage, summed over batches (what the monitor's breakdown shows).

    data: building batches on the host; device: the target's forward (+ finite check);
    copy: device-to-host copies; backpressure: the main thread waiting for room in the host ring;
    wait: the writer waiting for a batch's copy to finish; write: the writer encoding and writing.
    """

    data: float = 0.0
    device: float = 0.0
    copy: float = 0.0
    backpressure: float = 0.0
    wait: float = 0.0
    write: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in self.__dict__.items()}


class BatchClock:
    """Marks the device stages of one batch: CUDA timing events, or host times on a CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self._marks: dict[str, torch.cuda.Event | float] = {}

    def mark(self, name: str, stream: torch.cuda.Stream | None = None) -> None:
        """Note the moment ``name`` on ``stream`` (the current stream when None)."""
        if not self.cuda:
            self._marks[name] = time.perf_counter()
            return
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        self._marks[name] = event

    def seconds(self, start: str, end: str) -> float:
        """Time from ``start`` to ``end``; on CUDA both events must have completed."""
        a, b = self._marks[start], self._marks[end]
        if isinstance(a, float) and isinstance(b, float):
            return b - a
        assert isinstance(a, torch.cuda.Event) and isinstance(b, torch.cuda.Event)
        return a.elapsed_time(b) / 1000.0
