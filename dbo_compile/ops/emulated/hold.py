"""SMs held by the emulated link's transfers (the emulated backend's option ``hold_sms``,
:mod:`dbo_compile.ops.emulated`): the cost of comm kernels that run on SMs.

DeepEP's normal-mode kernels move the data with 20–24 SMs of their own while the transfer
lasts; the emulated link moves it with the copy engines and holds none, so a compute kernel
beside it has every SM. With ``hold_sms=N`` each transfer of the link also launches, on the
stream that issued it (the comm stream in a split program), a kernel of exactly ``N`` CTAs
that hold one SM each for the transfer's emulated duration (``latency_us + bytes / link``,
µs): each CTA asks for the SM's whole opt-in shared memory (so no two of them, and no kernel
that needs shared memory — GEMMs, attention, Triton reductions — shares an SM with one) and
1024 threads, and one thread per CTA spins on ``%globaltimer`` (``nanosleep`` between
reads) until its SM has been held that long. A kernel without shared memory (a pointwise
Inductor kernel) may still fill the held SMs' remaining thread slots, as it may beside
DeepEP's kernels.

What follows from it, as with DeepEP: the comm stream is busy for the transfer's duration
(the next comm op on it waits), and the held SMs are taken only once they are free — while a
compute kernel fills every SM the CTAs wait for its CTAs to retire, and then hold their SM for
the full duration from there (the copies themselves started at the issue: the transfer's end
is the later of the two).

The kernel is compiled once per process with NVRTC (``torch.cuda._compile_kernel``, torch >=
2.10) at the first eager transfer; a launch is a plain kernel node in a CUDA graph. CPU
tensors: nothing is held (the CPU link copies synchronously; there are no SMs to hold).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from dbo_compile.errors import CommBackendError

log = logging.getLogger(__name__)

__all__ = ["hold_sms", "hold_us"]

_SOURCE = r"""
extern "C" __global__ void dbo_hold_sms(int duration_ns) {
    extern __shared__ unsigned char dbo_held[];
    if (threadIdx.x == 0) {
        unsigned long long start, now;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
        do {
            asm volatile("nanosleep.u32 256;");
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        } while (now - start < (unsigned long long)duration_ns);
        dbo_held[0] = 1;
    }
    __syncthreads();
}
"""
_THREADS = 1024
#: the longest hold one launch may ask for (the kernel's int argument), ns
_MAX_NS = 2**31 - 1

_lock = threading.Lock()
#: device index -> (kernel, dynamic shared memory bytes, SM count)
_kernels: dict[int, tuple[Any, int, int]] = {}


def hold_us(nbytes: int, link_gbps: float, latency_us: float = 0.0) -> float:
    """The emulated duration of a transfer of ``nbytes`` bytes per direction (both directions
    at once) over a link of ``link_gbps`` GB/s per direction, plus ``latency_us``: µs."""
    return latency_us + nbytes / (link_gbps * 1e3)


def _kernel(index: int) -> tuple[Any, int, int]:
    """The compiled kernel of device ``index``, its shared memory per CTA and the SM count."""
    if index in _kernels:
        return _kernels[index]
    with _lock:
        if index in _kernels:
            return _kernels[index]
        compile_kernel = getattr(torch.cuda, "_compile_kernel", None)
        if compile_kernel is None or not hasattr(
                getattr(torch.cuda._utils, "_CudaKernel", None), "set_shared_memory_config"):
            raise CommBackendError(
                f"emulated backend: hold_sms needs torch.cuda._compile_kernel (NVRTC, torch >= "
                f"2.10); this torch {torch.__version__} has none: drop the option hold_sms")
        if torch.cuda.is_current_stream_capturing():
            raise CommBackendError(
                "emulated backend: hold_sms: the SM-holding kernel is compiled at the first "
                "eager transfer, and this one is being captured; run the step once eagerly "
                "before capturing (CudaGraphRunner and dbo_compile.runtime.capture do)")
        with torch.cuda.device(index):
            props = torch.cuda.get_device_properties(index)
            smem = int(getattr(props, "shared_memory_per_block_optin", 48 * 1024))
            kernel = compile_kernel(_SOURCE, "dbo_hold_sms")
            if smem > 48 * 1024:
                kernel.set_shared_memory_config(smem)
        _kernels[index] = (kernel, smem, int(props.multi_processor_count))
        log.info("emulated link on cuda:%d: SM-holding kernel built (%d B shared memory and %d "
                 "threads per CTA, %d SMs)", index, smem, _THREADS, props.multi_processor_count)
        return _kernels[index]


def hold_sms(device: torch.device, sms: int, duration_us: float) -> None:
    """Hold ``sms`` SMs of ``device`` for ``duration_us`` µs from when each is free: one kernel
    launch of ``sms`` CTAs on the current stream (module docstring). Nothing for a CPU device,
    ``sms == 0`` or a duration below 1 ns.

    Raises:
        CommBackendError: ``sms`` exceeds the device's SM count (the CTAs would queue behind
            each other and hold SMs for longer than the transfer), or the kernel cannot be
            built (no NVRTC in this torch, or first built during a capture).
    """
    if device.type != "cuda" or sms <= 0:
        return
    ns = min(_MAX_NS, int(round(duration_us * 1e3)))
    if ns < 1:
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    kernel, smem, count = _kernel(index)
    if sms > count:
        raise CommBackendError(f"emulated backend: hold_sms={sms} but cuda:{index} has {count} "
                               f"SMs; hold at most {count}")
    kernel(grid=(sms, 1, 1), block=(_THREADS, 1, 1), args=[ns], shared_mem=smem,
           stream=torch.cuda.current_stream(device))
