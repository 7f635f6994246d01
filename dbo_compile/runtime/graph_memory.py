"""GPU memory at capture: DBO's optional graphs give way, the unsplit graph says why it cannot.

Per bucket the CUDA-graph runner (:mod:`~dbo_compile.runtime.cudagraph_runner`) captures the
unsplit graph, which every step that is not split runs, and then DBO's optional graphs:
``"unsplit-overlap"`` and the split schedule candidates that pruning kept. All of them go into
one memory pool shared by the buckets, largest bucket first, so that the last candidates of a
large bucket are the ones that find the GPU full (one H100 80 GB, a DeepSeek-V3-shaped model
at an emulated EP-32 world: the prefill 8192 bucket's split candidates with 38.6 GiB in graph
pools). A serving engine must never fail to start for an optional graph:

1. an optional graph whose capture (or a warm-up run inside it) raises
   ``torch.OutOfMemoryError`` is dropped (:func:`capture_optional`): its references are let go,
   the allocator's free cached blocks are released, why is recorded in the bucket
   (``BucketGraphs.dropped``; for a split candidate also its ``PrunePlan.dropped``) and the
   bucket chooses among the graphs captured. A failing program's collectives in flight were
   received already (the capture's runs go through
   :func:`~dbo_compile.runtime.capture.run_draining`). Every rank drops a graph that any rank
   dropped (a max over the job of one flag per graph): the ranks time the same graphs;
2. with a budget (``CudaGraphRunner(graph_memory_budget=...)``, bytes), an optional graph is
   not captured once the optional graphs captured so far, over every bucket, grew the pool by
   the budget (:func:`optional_bytes`: ``memory_report``'s ``split_all``; the maximum over
   the job, so every rank skips the same ones). Off CUDA no graph holds pool memory
   (``graph_bytes`` is ``None``): the budget has no effect;
3. the unsplit graph's OOM is a :class:`~dbo_compile.errors.GraphRunnerError`
   (:func:`unsplit_oom_error`) saying which bucket, what the allocator held and what to do.

A rank that runs out of memory in a warm-up run of a program whose collectives go through a
library that cannot be drained (NCCL's) leaves its peers waiting in that collective: as any
failure of a warm-up run, which this module does not change.
"""

from __future__ import annotations

import gc
import logging
from typing import Any, Callable, Iterable, Sequence

import torch

from dbo_compile.errors import GraphRunnerError
from dbo_compile.runtime.capture import reserved_bytes

log = logging.getLogger(__name__)

__all__ = ["capture_optional", "oom_head", "oom_in", "optional_bytes", "unsplit_oom_error"]

#: what a bucket's warning says to do about graphs dropped for memory
_TODO = ("to leave room for them, capture fewer or smaller buckets or leave the graphs more "
         "memory; to capture fewer optional graphs instead, ask for fewer split candidates "
         "(DboConfig schedule_candidates, sm_carveout_candidates) or give "
         "CudaGraphRunner(graph_memory_budget=bytes) so that they stop at a budget instead of "
         "at the GPU's end")

_GIB = float(1 << 30)


def oom_head(e: BaseException, limit: int = 160) -> str:
    """The head of the allocator's message (its first sentence, e.g. ``"CUDA out of memory.
    Tried to allocate 2.00 GiB"``), at most ``limit`` characters."""
    text = " ".join(str(e).split())
    head = ". ".join(text.split(". ")[:2])
    return head if len(head) <= limit else head[:limit - 3] + "..."


def oom_in(e: BaseException) -> torch.OutOfMemoryError | None:
    """The ``torch.OutOfMemoryError`` that ``e`` is, or that caused it (``__cause__`` /
    ``__context__``, transitively): an allocation that fails inside a CUDA-graph capture can
    leave the capture invalidated, and ending it (``torch.cuda.graph``'s exit) then raises a
    second error with the OOM as its context. ``None``: no OOM behind ``e``."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, torch.OutOfMemoryError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def optional_bytes(buckets: Iterable[Any]) -> int:
    """What DBO's optional graphs of ``buckets`` (``BucketGraphs``) grew the shared pool by
    (bytes): their ``graph_bytes`` of every graph but ``"unsplit"``, the dropped candidates'
    included (``memory_report``'s ``split_all``); 0 off CUDA (``None`` counts 0)."""
    return sum(v or 0 for b in buckets for k, v in b.graph_bytes.items() if k != "unsplit")


def _release(cuda: bool) -> None:
    """Free what a failed capture left: its graph and outputs (once no reference is left: call
    outside the ``except`` block, whose exception's traceback holds the capture's frames),
    and on CUDA the caching allocator's free cached blocks."""
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _try(b: Any, name: str, fn: Callable[[], Any], graph: Callable[..., None],
         cuda: bool) -> str | None:
    """``graph(b, name, fn, cuda)``; ``None``, or why it ran out of memory (nothing of it kept)."""
    try:
        graph(b, name, fn, cuda)
        return None
    except Exception as e:  # noqa: BLE001 - an OOM, or an error with one as its cause
        oom = oom_in(e)
        if oom is None:
            raise
        why = (f"bucket {b.tokens}: {name} ran out of GPU memory at capture "
               f"({oom_head(oom)})")
    for held in (b.graphs, b.outs):
        held.pop(name, None)
    _release(cuda)
    return why


def capture_optional(b: Any, entries: Sequence[tuple[str, Callable[[], Any] | str]],
                     graph: Callable[..., None], *, cuda: bool, budget: int | None,
                     earlier: Sequence[Any], over_ranks: Callable[[list[float]], list[float]],
                     warned: set[str]) -> dict[str, str]:
    """Capture DBO's optional graphs of bucket ``b`` (``BucketGraphs``), dropping those that
    do not fit (the module docstring's rules 1 and 2).

    Args:
        entries: ``(name, fn)`` in capture order; ``fn`` the zero-argument program, or why it
            cannot be captured (a string: its inputs ran out of memory).
        graph: the runner's capture of one graph, ``graph(b, name, fn, cuda)``: on success it
            sets ``b.graphs[name]``, ``b.outs[name]`` and ``b.graph_bytes[name]``.
        budget: bytes the optional graphs of every bucket may grow the pool by (``None``: no
            limit).
        earlier: the buckets captured before ``b`` (their ``graph_bytes`` count to the budget).
        over_ranks: elementwise max over every rank of the job.
        warned: keys of the warnings given once per runner.

    Returns:
        The graphs dropped, name -> why (also in ``b.dropped``, and a split candidate's in
        ``b.prune``); one WARNING names those dropped for memory, with what to do.
    """
    if budget is not None and not cuda and "budget off CUDA" not in warned:
        warned.add("budget off CUDA")
        log.warning("dbo graphs: graph_memory_budget=%d has no effect off CUDA (the graphs are "
                    "eager re-runs that hold no pool memory)", budget)
    oom: dict[str, str] = {}
    skipped: dict[str, str] = {}
    for name, fn in entries:
        if budget is not None:
            used = int(over_ranks([float(optional_bytes([*earlier, b]))])[0])
            if used >= budget:
                skipped[name] = (f"bucket {b.tokens}: {name} not captured: memory budget "
                                 f"(graph_memory_budget={budget} bytes, {budget / _GIB:.2f} GiB) "
                                 f"reached: DBO's optional graphs grew the graph pool by "
                                 f"{used / _GIB:.2f} GiB")
                continue
        why = fn if isinstance(fn, str) else _try(b, name, fn, graph, cuda)
        if why is not None:
            oom[name] = why
    # every rank times the same graphs: drop what any rank could not capture
    names = [n for n, _ in entries if n not in skipped]
    flags = over_ranks([1.0 if n in oom else 0.0 for n in names]) if names else []
    for name, flag in zip(names, flags):
        if flag and name not in oom:
            oom[name] = (f"bucket {b.tokens}: {name} ran out of GPU memory at capture on "
                         "another rank (every rank keeps the graphs all ranks captured)")
            b.graphs.pop(name, None)
            b.outs.pop(name, None)
    dropped = {n: (oom.get(n) or skipped[n]) for n, _ in entries if n in oom or n in skipped}
    b.dropped.update(dropped)
    if b.prune is not None:  # the split candidates it planned ("unsplit-overlap" is none)
        for name, why in dropped.items():
            if name in b.prune.timed:
                b.prune.drop(name, why)
    if oom:
        left = [n for n in b.graphs if n != "unsplit"]
        log.warning("dbo graphs: bucket %d: %s not captured: out of GPU memory (%s); the bucket "
                    "chooses among %s%s; %s", b.tokens, ", ".join(oom), next(iter(oom.values())),
                    ", ".join(b.graphs),
                    "" if left else " (no split graph left: its steps run unsplit, whatever "
                    "the split option)", _TODO)
    if skipped:
        if "budget reached" not in warned:
            warned.add("budget reached")
            log.warning("dbo graphs: graph_memory_budget=%d bytes (%.2f GiB) reached at bucket "
                        "%d: its graphs %s and the split graphs of smaller buckets are not "
                        "captured", budget, budget / _GIB, b.tokens, ", ".join(skipped))
        else:
            log.info("dbo graphs: bucket %d: %s not captured (graph_memory_budget)", b.tokens,
                     ", ".join(skipped))
    return dropped


def unsplit_oom_error(b: Any, e: BaseException, cuda: bool,
                      earlier: Sequence[Any]) -> GraphRunnerError:
    """The error for bucket ``b``'s unsplit graph out of memory (raise it ``from e``)."""
    held = reserved_bytes(cuda)
    pool = sum(v or 0 for x in earlier for v in x.graph_bytes.values())
    where = ("off CUDA" if held is None else
             f"the CUDA caching allocator held {held / _GIB:.2f} GiB (every pool), of which the "
             f"graphs of the {len(earlier)} bucket(s) captured before grew the shared graph pool "
             f"by {pool / _GIB:.2f} GiB")
    return GraphRunnerError(
        f"bucket {b.tokens}: the unsplit graph, which every step of the bucket runs that is not "
        f"split, ran out of GPU memory at capture ({oom_head(e)}); {where}. Capture fewer "
        "buckets or smaller ones (the largest is captured first), or leave more GPU memory to "
        "the graphs (a smaller KV cache or model), then capture again")
