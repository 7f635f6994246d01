"""CUDA-graph capture of a zero-argument callable (the split or unsplit program over static
inputs): :func:`capture`. The per-bucket serving runner
(:mod:`dbo_compile.runtime.cudagraph_runner`) captures with it; the measurement aids that
patch artifacts (split serial, static split steps) are in :mod:`dbo_compile.testing.measure`.

The generated wrapper never synchronises with the host, so it captures whole; the per-step
guard (:meth:`~dbo_compile.runtime.artifact.CompiledArtifact.decide_step`: metadata checks and
the DP vote) runs on the host *outside* the graph, before each replay.

Runs that are no served step (warm-up, capture, timing replays) leave the model's state as it
was: the KV cache by their padding rows (slot -1 writes nothing), every other buffer the
programs write in place (``CompiledArtifact.state_inputs``) by :func:`state_kept`.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.utils._pytree as pytree

from dbo_compile.ops.comm import abort_pending_receives

__all__ = ["EagerGraph", "capture", "reserved_bytes", "run_draining", "state_kept"]


@contextlib.contextmanager
def state_kept(tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """Put ``tensors`` back as they were at the end of the block (also when it raises): the
    buffers the programs write in place (an expert-load counter, a step counter), which runs
    that are no served step must not change. A copy of each is taken on entry and copied back
    on exit, both on the current stream (stream-ordered after what the block ran there: no
    host sync); extra memory: one copy of each tensor while the block runs."""
    unique = list({id(t): t for t in tensors}.values())
    saved = [t.clone() for t in unique]
    try:
        yield
    finally:
        for t, s in zip(unique, saved):
            t.copy_(s)


def run_draining(fn: Callable[[], Any]) -> Any:
    """``fn()``; where it raises, every comm backend first receives what the failed program
    left in flight (:func:`~dbo_compile.ops.comm.abort_pending_receives`: a deferred call
    without its receive would make the next step's calls find the link's slots taken), then
    the error propagates. Steps through ``run_step`` get this from their transaction; graph
    warm-up, capture and the CPU stand-in's replay run programs outside one."""
    try:
        return fn()
    except BaseException:
        abort_pending_receives()
        raise


def capture(fn: Callable[[], Any], warmup: int = 3, pool: Any = None,
            stream: torch.cuda.Stream | None = None,
            times: dict[str, float] | None = None,
            capture_error_mode: str = "global") -> tuple[torch.cuda.CUDAGraph, Any]:
    """Capture ``fn()`` as one CUDA graph after ``warmup`` eager calls on a side stream.

    Args:
        capture_error_mode: ``torch.cuda.graph``'s (``"thread_local"``: other threads may
            launch onto the capturing stream, as a two-thread ping-pong's do).
        times: if given, gets ``"warmup_s"`` (the eager calls, synchronised: where Inductor
            stages compile for a new signature) and ``"capture_s"`` (the capture), seconds,
            and ``"pool_bytes"``: what the allocator reserved more after the capture than
            before it (bytes; the new segments of the graph's pool: a graph that reuses blocks
            of a shared pool that earlier graphs freed costs less than its own footprint).

    Returns:
        ``(graph, static_out)``: ``graph.replay()`` rewrites ``static_out`` in place.
    """
    t0 = time.perf_counter()
    side = stream or torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            run_draining(fn)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode=capture_error_mode):
        # read after torch.cuda.graph's entry, which empties the allocator's cache: read
        # before it, a capture that grew the pool less than the cache released came out < 0
        # (the allocator's host-side counters; no CUDA call in the capture)
        before = reserved_bytes(True)
        out = run_draining(fn)
    torch.cuda.synchronize()
    if times is not None:
        times["warmup_s"] = t1 - t0
        times["capture_s"] = time.perf_counter() - t1
        times["pool_bytes"] = reserved_bytes(True) - before
    return graph, out


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


class EagerGraph:
    """CPU stand-in for a CUDA graph: ``replay()`` re-runs the function on the same static
    inputs and copies its outputs into the static outputs (tests the buffer plumbing)."""

    def __init__(self, fn: Callable[[], Any]):
        self.fn = fn
        self.out = run_draining(fn)

    def replay(self) -> None:
        for dst, src in zip(_tensors(self.out), _tensors(run_draining(self.fn))):
            dst.copy_(src)


def reserved_bytes(cuda: bool) -> int | None:
    """Bytes the CUDA caching allocator holds on the current device (every pool, the CUDA
    graphs' private ones included: ``reserved_bytes.all.current``); ``None`` off CUDA."""
    if not cuda:
        return None
    return int(torch.cuda.memory_stats().get("reserved_bytes.all.current", 0))
