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


#: SMs per green-context partition on sm_90 and later (the CUDA driver API's
#: ``cuDevSmResourceSplitByCount``: a multiple of 8, at least 8)
GREEN_CONTEXT_GRANULARITY = 8
#: per ``(device index, carve-out)``: the green context and its stream
_green: dict[tuple[int, int], tuple[Any, Any]] = {}


def green_context_sms(total: int, carveout: int) -> int:
    """The SMs a green context leaves compute when ``carveout`` of ``total`` are kept free:
    ``total - carveout`` rounded down to :data:`GREEN_CONTEXT_GRANULARITY` (132 SMs less 24:
    104, so 28 stay free).

    Raises:
        DboConfigError: fewer than one partition would remain.
    """
    sms = (total - carveout) // GREEN_CONTEXT_GRANULARITY * GREEN_CONTEXT_GRANULARITY
    if sms < GREEN_CONTEXT_GRANULARITY:
        raise DboConfigError(f"SM carve-out of {carveout} of the device's {total} SMs leaves "
                             f"{total - carveout} for compute, less than one green-context "
                             f"partition ({GREEN_CONTEXT_GRANULARITY} SMs): carve out fewer")
    return sms


def _green_stream(index: int, carveout: int) -> Any:
    """The stream of a green context of ``cuda:index`` with :func:`green_context_sms` SMs
    (created once per device and carve-out: a step looks it up and nothing else)."""
    if (index, carveout) not in _green:
        sms = green_context_sms(torch.cuda.get_device_properties(index).multi_processor_count,
                                carveout)
        gc_mod = getattr(torch.cuda, "green_contexts", None)
        if gc_mod is None or not getattr(gc_mod, "SUPPORTED", False) \
                or not hasattr(gc_mod.GreenContext, "Stream"):
            raise DboConfigError(
                f"sm_carveout_mode='green_context' needs torch.cuda.green_contexts with "
                f"GreenContext.Stream (a CUDA build of torch >= 2.10 on CUDA >= 12.4); this "
                f"torch {torch.__version__} has none: use sm_carveout_mode='cublas'")
        ctx = gc_mod.GreenContext.create(num_sms=sms, device_id=index)
        _green[(index, carveout)] = (ctx, ctx.Stream())
    return _green[(index, carveout)][1]


@contextlib.contextmanager
def sm_carveout(sms: int, device: torch.device | None, mode: str = "cublas"):
    """Within the block, compute leaves ``sms`` SMs free for comm kernels (CUDA only; on CPU a
    no-op). ``mode`` (``DboConfig.sm_carveout_mode``):

    - ``"cublas"``: cuBLAS GEMMs leave them (``torch._C._set_sm_carveout_experimental``,
      where torch has it; otherwise a no-op); other kernels take every SM.
    - ``"green_context"``: the block runs on the stream of a CUDA green context of the
      device's SMs less ``sms`` (:func:`green_context_sms`), forked from the current stream
      and joined back to it at the end (event edges; inside a CUDA-graph capture both
      become graph dependencies), so every kernel launched on the current stream in the
      block leaves them; streams the block makes current itself (the comm stream) keep
      every SM. The rule is SGLang's beside DeepEP's normal kernels: DeepGEMM's
      ``set_num_sms(device SMs - DeepEP's SMs)``, here for every compute kernel.

    Raises:
        DboConfigError: ``"green_context"`` where torch has no green contexts, or a carve-out
            that leaves less than one partition.
    """
    if device is None or device.type != "cuda":
        yield
        return
    if mode == "green_context":
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = _green_stream(index, sms)
        current = torch.cuda.current_stream(index)
        stream.wait_stream(current)
        try:
            with torch.cuda.stream(stream):
                yield
        finally:
            current.wait_stream(stream)
        return
    setter = getattr(torch._C, "_set_sm_carveout_experimental", None)
    if setter is None:
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
