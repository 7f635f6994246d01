"""The package's one timer: median time of a callable, or of a CUDA-graph replay, in µs.

The package times things itself: the experts backend picks its faster CUDA path per shape at
warm-up (:mod:`dbo_compile.ops.experts`), and ``CudaGraphRunner`` times its schedule candidates
per bucket (:mod:`dbo_compile.runtime.cudagraph_runner`); the benchmarks build on the same
functions (``benchmarks/harness.py``). Ground floor: torch and the standard library only.

How a sample is taken:

- **CUDA** (``cuda=True``, the default where ``torch.cuda.is_available()``): after the warm-up
  calls and one ``torch.cuda.synchronize()``, every timed call sits between two CUDA events
  recorded on the current stream; all calls are issued back to back and the host synchronises
  once at the end, so the samples are device time, without the host's gaps between calls.
- **CPU** (``cuda=False``): ``time.perf_counter()`` around each call (wall time).

Times are µs per call of ``fn``; with ``reps`` a timed call runs ``fn`` ``reps`` times and the
sample is divided by ``reps`` (for calls too short to time alone).
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any, Callable

import torch

from dbo_compile.errors import TimingError

log = logging.getLogger(__name__)

__all__ = ["capture_graph", "graph_median_us", "median_us", "paired_us", "samples_us"]


def samples_us(fn: Callable[[], Any], iters: int, *, warmup: int = 0, reps: int = 1,
               cuda: bool | None = None) -> list[float]:
    """``iters`` timed calls of ``fn`` after ``warmup`` untimed ones: µs per call, in order.

    Args:
        fn: a zero-argument callable (a step over static inputs, ``graph.replay``).
        iters: timed calls (>= 1).
        warmup: untimed calls first (compiles, caches, clocks).
        reps: calls of ``fn`` per sample; each sample is divided by ``reps``.
        cuda: CUDA events (``True``) or ``perf_counter`` (``False``); default: CUDA where it
            is available.

    Raises:
        TimingError: ``iters`` or ``reps`` below 1, or ``warmup`` below 0.
    """
    if iters < 1 or reps < 1 or warmup < 0:
        raise TimingError(f"samples_us(iters={iters}, reps={reps}, warmup={warmup}): iters and "
                          "reps must be >= 1 and warmup >= 0; pass at least one timed call")
    cuda = torch.cuda.is_available() if cuda is None else cuda
    for _ in range(warmup):
        fn()
    if not cuda:
        out = []
        for _ in range(iters):
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            out.append((time.perf_counter() - t0) * 1e6 / reps)
        return out
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(iters)]
    for start, end in events:
        start.record()
        for _ in range(reps):
            fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) * 1e3 / reps for start, end in events]


def median_us(fn: Callable[[], Any], iters: int, *, warmup: int = 0, reps: int = 1,
              cuda: bool | None = None) -> float:
    """The median of :func:`samples_us` (µs per call of ``fn``; same arguments and errors)."""
    return statistics.median(samples_us(fn, iters, warmup=warmup, reps=reps, cuda=cuda))


def paired_us(fa: Callable[[], Any], fb: Callable[[], Any], iters: int, *, rounds: int = 5,
              warmup: int = 0, cuda: bool | None = None) -> dict[str, Any]:
    """``fa`` and ``fb`` timed side by side: ``rounds`` rounds, each ``iters`` samples of one
    then ``iters`` of the other (:func:`samples_us`), the first side alternating (a b, b a,
    ...), after ``warmup`` untimed calls of each. A drift that reaches both sides (clocks, a
    neighbour's PCIe traffic across a shared host, thermals) cancels in each round's ratio,
    where two medians taken minutes apart would carry it.

    Returns:
        ``{"a_us", "b_us"}``: medians of all samples of each side (µs per call);
        ``"ratio"``: the median over rounds of ``median(b) / median(a)`` within the round
        (> 1: ``fb`` slower); ``"ratios"``: those per round; ``"rounds"``.

    Raises:
        TimingError: ``rounds`` below 1, or :func:`samples_us`'s errors.
    """
    if rounds < 1:
        raise TimingError(f"paired_us(rounds={rounds}): rounds must be >= 1")
    for _ in range(warmup):
        fa()
        fb()
    sa: list[float] = []
    sb: list[float] = []
    ratios = []
    for i in range(rounds):
        if i % 2 == 0:
            ra = samples_us(fa, iters, cuda=cuda)
            rb = samples_us(fb, iters, cuda=cuda)
        else:
            rb = samples_us(fb, iters, cuda=cuda)
            ra = samples_us(fa, iters, cuda=cuda)
        sa += ra
        sb += rb
        ratios.append(statistics.median(rb) / statistics.median(ra))
    return {"a_us": statistics.median(sa), "b_us": statistics.median(sb),
            "ratio": statistics.median(ratios), "ratios": ratios, "rounds": rounds}


def capture_graph(fn: Callable[[], Any], warmup: int = 1) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``fn()`` captured as one CUDA graph after ``warmup`` eager calls on a side stream (where
    Triton kernels compile and allocators settle): ``(graph, static_out)``.

    The serving runtime captures with :func:`dbo_compile.runtime.capture.capture` (memory
    pool, warm-up timing, comm drained on failure); this is the plain form, for the ops'
    measurements below the runtime.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def graph_median_us(fn: Callable[[], Any], iters: int, *, reps: int = 1, replays: int = 1,
                    capture: Callable[[Callable[[], Any]], tuple[Any, Any]] | None = None
                    ) -> tuple[float, Any]:
    """``reps`` calls of ``fn`` captured as one CUDA graph, timed by replay: the median µs per
    call of ``iters`` CUDA-event-timed replays (after ``replays`` untimed ones), and the
    graph's static output (the last call's).

    Args:
        capture: ``(zero-argument callable) -> (graph, static_out)``; default
            :func:`capture_graph` (one eager warm-up call).

    Raises:
        TimingError: as :func:`samples_us`.
    """
    def calls() -> Any:
        out = None
        for _ in range(reps):
            out = fn()
        return out

    graph, out = (capture or capture_graph)(calls)
    try:
        per_replay = median_us(graph.replay, iters, warmup=replays, cuda=True)
    finally:
        del graph
    return per_replay / reps, out
