"""Streams and events the generated wrapper uses, and their no-op CPU versions.

On CUDA the compute stream is the caller's current stream (the capture stream under CUDA-graph
capture) and the comm stream is created once per device with high priority; events are created
once per producer unit and reused every step. On CPU every helper is a no-op, so the same
generated code runs.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


class StreamSet:
    """The comm stream and the events of one compiled schedule.

    Args:
        num_events: events the generated code indexes (``ev[i]``).
    """

    def __init__(self, num_events: int):
        self.num_events = num_events
        self._cuda: dict[int, tuple[Any, list[Any]]] = {}

    def get(self, device: torch.device | None) -> tuple[Any, Any, list[Any]]:
        """``(compute stream, comm stream, events)`` for ``device``; ``None``s on CPU."""
        if device is None or device.type != "cuda":
            return None, None, [None] * self.num_events
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._cuda:
            low, high = torch.cuda.Stream.priority_range()
            comm = torch.cuda.Stream(device=index, priority=high)
            events = [torch.cuda.Event() for _ in range(self.num_events)]
            self._cuda[index] = (comm, events)
        comm, events = self._cuda[index]
        return torch.cuda.current_stream(index), comm, events


def use(stream: Any):
    """Context manager making ``stream`` current (no-op for ``None``)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def record(event: Any, stream: Any) -> None:
    if event is not None:
        event.record(stream)


def wait(stream: Any, event: Any) -> None:
    if event is not None:
        stream.wait_event(event)


def keep(value: Any, stream: Any) -> None:
    """``record_stream`` every CUDA tensor in ``value`` on ``stream`` (DESIGN.md invariant 4)."""
    if stream is None:
        return
    if isinstance(value, torch.Tensor):
        if value.is_cuda:
            value.record_stream(stream)
    elif isinstance(value, (list, tuple)):
        for v in value:
            keep(v, stream)


def device_of(values: Any) -> torch.device | None:
    """The device of the first tensor in ``values``."""
    for v in values:
        if isinstance(v, torch.Tensor):
            return v.device
    return None
