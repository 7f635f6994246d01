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
import torch.distributed as dist

from dbo_compile.errors import DboConfigError


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
    """``record_stream`` every CUDA tensor in ``value`` on ``stream`` (allocator safety:
    ``docs/design.md``, invariant 4)."""
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


@contextlib.contextmanager
def sm_carveout(sms: int, device: torch.device | None):
    """Within the block, compute GEMMs leave ``sms`` SMs free (CUDA only, where torch has
    ``torch._C._set_sm_carveout_experimental``; otherwise a no-op)."""
    setter = getattr(torch._C, "_set_sm_carveout_experimental", None)
    if setter is None or device is None or device.type != "cuda":
        yield
        return
    getter = getattr(torch._C, "_get_sm_carveout_experimental", None)
    previous = getter() if getter is not None else None
    setter(sms)
    try:
        yield
    finally:
        setter(previous)


def new_ep_group(ranks: list[int] | None = None, *, comm_sms: int | None = None,
                 high_priority: bool = True) -> Any:
    """A dedicated NCCL process group for the EP dispatch/combine all-to-all.

    Args:
        ranks: the group's global ranks (default: all); every rank of the world must call
            this, as for ``torch.distributed.new_group``.
        comm_sms: cap on the CTAs (~SMs) NCCL uses for this group's kernels
            (``ProcessGroupNCCL.Options().config.max_ctas``), so that compute keeps the other
            SMs; ``None`` leaves NCCL's choice. vLLM reserves 20 SMs for DBO communication.
        high_priority: run the group's NCCL kernels on a high-priority stream, so that they are
            scheduled ahead of queued compute blocks (``is_high_priority_stream``).

    Returns:
        The ``ProcessGroup``; pass it as the model's EP group (e.g.
        ``DeepseekMoEModel(cfg, ep_group=group)``) and its ``group_name`` to the ops.

    Raises:
        DboConfigError: ``comm_sms`` is not a positive int.
    """
    if comm_sms is not None and (not isinstance(comm_sms, int) or isinstance(comm_sms, bool)
                                 or comm_sms < 1):
        raise DboConfigError(f"comm_sms must be None or a positive int (SMs), got {comm_sms!r}")
    opts = dist.ProcessGroupNCCL.Options()
    opts.is_high_priority_stream = high_priority
    if comm_sms is not None:
        opts.config.max_ctas = comm_sms
        opts.config.min_ctas = 1
    return dist.new_group(ranks, backend="nccl", pg_options=opts)
