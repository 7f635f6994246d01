"""The split decision measured on a bucket's captured graphs: which graphs are timed, their
replay times (interleaved rounds, median, max over every rank) and the choice
(:mod:`~dbo_compile.runtime.cudagraph_runner`'s module docstring, warm-up step 3)."""

from __future__ import annotations

import logging
import statistics
from typing import Sequence

import torch
import torch.distributed as dist

from dbo_compile.candidates import UNSPLIT_GRAPHS, UNSPLIT_OVERLAP
from dbo_compile.runtime.buckets import BucketGraphs
from dbo_compile.runtime.vote import vote_device
from dbo_compile.timing import samples_us

log = logging.getLogger(__name__)


def timed_graphs(b: BucketGraphs, mode: str) -> list[str]:
    """The graphs of ``b`` whose times can change its choice (``split`` mode ``mode``), in
    capture order: the split candidates where there are several, or with ``"auto"`` (they
    race the unsplit graph); the unsplit graphs where there are two (the serial one and
    ``"unsplit-overlap"``), or with ``"auto"`` and a split candidate; none where fewer than
    two remain."""
    split = [k for k in b.graphs if k not in UNSPLIT_GRAPHS]
    unsplit = [k for k in b.graphs if k in UNSPLIT_GRAPHS]
    races = mode == "auto" and bool(split)
    names = set(split if len(split) > 1 or races else ()) | set(
        unsplit if len(unsplit) > 1 or races else ())
    names = [k for k in b.graphs if k in names]
    return names if len(names) > 1 else []


def max_over_ranks(values: list[float]) -> list[float]:
    """Elementwise max over every rank of the job (the default group), not only the DP vote's
    group: the graphs' collectives may span other ranks (EP), which must replay the same
    schedule candidate."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=vote_device(dist.group.WORLD))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def time_graphs(b: BucketGraphs, names: Sequence[str], iters: int, cuda: bool
                ) -> dict[str, float]:
    """Replay time of the graphs ``names`` of ``b`` (µs): interleaved rounds, median, max
    over every rank (``names`` must be the same on every rank); ``iters`` timed replays
    per graph and round after one untimed one, CUDA events where ``cuda``, else host time
    (:func:`dbo_compile.timing.samples_us`).

    Raises:
        TimingError: ``iters`` below 1.
    """
    if not names:
        return {}
    samples: dict[str, list[float]] = {n: [] for n in names}
    for _round in range(3):
        for name in names:  # one untimed replay, then ``iters`` timed ones
            samples[name] += samples_us(b.graphs[name].replay, iters, warmup=1, cuda=cuda)
    med = max_over_ranks([statistics.median(samples[n]) for n in names])
    return dict(zip(names, med))


def decide(b: BucketGraphs, min_gain: float, keep_candidates: bool) -> None:
    """The unsplit graph a step that is not split runs (``"unsplit-overlap"`` where it beats
    the serial one by ``min_gain``), the fastest split candidate, and whether it runs at all
    (``split`` mode; with ``"auto"`` it must beat the unsplit graph chosen by ``min_gain``);
    the other graphs are dropped at once (unless ``keep_candidates``; the serial unsplit
    graph is always kept), so that later captures reuse their memory; ``min_gain``: see
    :class:`~.cudagraph_runner.CudaGraphRunner`."""
    mode = b.artifact.config.split
    times = b.times_us
    b.unsplit_choice = "unsplit"
    if (UNSPLIT_OVERLAP in times and "unsplit" in times
            and times[UNSPLIT_OVERLAP] <= (1.0 - min_gain) * times["unsplit"]):
        b.unsplit_choice = UNSPLIT_OVERLAP
    split = [k for k in b.graphs if k not in UNSPLIT_GRAPHS]
    best = min(split, key=lambda k: (times[k], k)) if len(split) > 1 else (
        split[0] if split else None)
    b.best_candidate = best
    if best is None or mode == "never":
        b.choice = "unsplit"
    elif mode == "always":
        b.choice = best
    else:
        faster = times[best] <= (1.0 - min_gain) * times[b.unsplit_choice]
        b.choice = best if faster else "unsplit"
    if not keep_candidates:
        for name in [k for k in b.graphs if k not in ("unsplit", b.unsplit_choice, best)]:
            del b.graphs[name], b.outs[name]
