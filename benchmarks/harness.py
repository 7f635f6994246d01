"""The benchmarks' one harness: how they time, name the machine, and write markdown.

Every script under ``benchmarks/`` times through here, so a figure in ``docs/results.md`` means
the same thing whichever script wrote it:

- :func:`median_us` / :func:`samples_us`: µs per call, CUDA events on the current stream with
  the calls issued back to back (device time), ``perf_counter`` without CUDA; the package's
  own timer (:mod:`dbo_compile.timing`), which ``CudaGraphRunner`` and the experts backend use
  for their warm-up choices.
- :func:`graph_us`: ``reps`` calls captured as one CUDA graph and timed by replay; captured with
  the runtime's :func:`dbo_compile.runtime.capture.capture` (warm-up on a side stream, the
  comm drained on failure): :func:`dbo_compile.testing.measure.graph_us`, which the package's
  benchmark model (:mod:`dbo_compile.testing.moe`) times with too.
- :func:`capture`: a CUDA graph of a call, or on CPU the runtime's own stand-in
  (:class:`~dbo_compile.runtime.cudagraph_runner.EagerGraph`), for the CPU smoke runs.
- :func:`machine`: the header every results file carries (``"2x NVIDIA H200 (x86_64)"``).
- :func:`fmt`, :func:`table`: the cells and the pipe table of every markdown writer.

Import it as the scripts do (``sys.path`` holds the script's folder when Python runs a script);
the tests import no benchmark script: what a test and a benchmark share (the MoE model, its
steps, the stand-in kernels) is the package's :mod:`dbo_compile.testing.moe`.
"""

from __future__ import annotations

import platform
from typing import Any, Callable, Sequence

import torch

from dbo_compile.runtime import capture as cg_capture
from dbo_compile.runtime.cudagraph_runner import EagerGraph
from dbo_compile.testing.measure import graph_us
from dbo_compile.timing import median_us, samples_us

__all__ = ["EagerGraph", "capture", "fmt", "graph_us", "machine", "median_us", "samples_us",
           "table"]


def capture(fn: Callable[[], Any], warmup: int = 2) -> tuple[Any, Any]:
    """``(graph, static_out)``: ``fn`` as a CUDA graph (the runtime's ``capture``), or without
    CUDA the runtime's :class:`EagerGraph` (``replay()`` re-runs ``fn``)."""
    if torch.cuda.is_available():
        return cg_capture.capture(fn, warmup=warmup)
    graph = EagerGraph(fn)
    return graph, graph.out


def machine(ranks: int = 1, device: Any = None) -> str:
    """The results files' machine header: ``"{ranks}x {GPU name} ({arch})"`` on CUDA,
    ``"{ranks} CPU rank(s) ({arch})"`` without it."""
    arch = platform.machine()
    if torch.cuda.is_available():
        return f"{ranks}x {torch.cuda.get_device_name(device)} ({arch})"
    return f"{ranks} CPU rank{'s' if ranks != 1 else ''} ({arch})"


def fmt(v: Any, nd: int = 0) -> str:
    """A table cell: floats with thousands separators and ``nd`` decimals, ``None`` as ``–``."""
    if v is None:
        return "–"
    return f"{v:,.{nd}f}" if isinstance(v, float) else str(v)


def table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """A markdown pipe table's lines: the header, its ``|---|`` rule, one line per row (a row
    may have fewer cells than the header, e.g. a failed run's message)."""
    line = lambda cells: "| " + " | ".join(str(c) for c in cells) + " |"  # noqa: E731
    return [line(head), "|" + "---|" * len(head)] + [line(r) for r in rows]
