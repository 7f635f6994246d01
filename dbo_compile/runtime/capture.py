"""CUDA-graph capture of a zero-argument callable (the split or unsplit program over static
inputs): :func:`capture`. The per-bucket serving runner
(:mod:`dbo_compile.runtime.cudagraph_runner`) captures with it; the measurement aids that
patch artifacts (split serial, static split steps) are in :mod:`dbo_compile.testing.measure`.

The generated wrapper never synchronises with the host, so it captures whole; the per-step
guard (:meth:`~dbo_compile.runtime.artifact.CompiledArtifact.decide_step`: metadata checks and
the DP vote) runs on the host *outside* the graph, before each replay.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["capture"]


def capture(fn: Callable[[], Any], warmup: int = 3, pool: Any = None,
            stream: torch.cuda.Stream | None = None) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Capture ``fn()`` as one CUDA graph after ``warmup`` eager calls on a side stream.

    Returns:
        ``(graph, static_out)``: ``graph.replay()`` rewrites ``static_out`` in place.
    """
    side = stream or torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    torch.cuda.synchronize()
    return graph, out
