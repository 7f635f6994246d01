"""What a calibration measures and predicts: the cost model's inputs per node of a compiled
artifact at any token count, and the step time they predict.

A calibration (``benchmarks/calibrate.py``) times compute stages and comm ops of compiled
programs on a machine, fits the per-class figures of the calibrated cost model
(:mod:`dbo_compile.passes.cost_model`: ``t = launch + max(flops / tflops, bytes / gbps) + rows *
us_per_row`` per node class) to them, and checks the fit on whole steps:

- the **unsplit** program runs its nodes one after another on one stream: its predicted time
  is the sum of its nodes' costs at the bucket's token count (:func:`predict_unsplit`);
- a **split** program runs its schedule's units on two streams in host order with the
  schedule's dependencies: its predicted time is the makespan of that timeline with every
  unit's cost re-evaluated at the bucket's per-ubatch token count (:func:`predict_split`,
  :func:`~dbo_compile.schedule.simulate`), the units that overlap the other stream optionally
  slowed down by fitted factors (:func:`simulate_overlapped`: units are measured alone, and
  run beside the other stream's kernels in the step).

Features are plain data (``(class, flops, bytes, rows)`` per node, :func:`step_features`), so a
fit and its predictions run anywhere from a results file, without the graph or a GPU.

**Fused runs** (``fusion="runs"``, a calibration fitted on Inductor stages): Inductor compiles
each run of element-wise / reduction nodes (class ``other``) between two extern kernels (GEMMs,
the experts and attention ops, comm) into fused kernels that read the run's inputs and write its
outputs once, so per-node figures of ``other`` become effective rates (above the device's memory
bandwidth, a fraction of a launch per node) that do not carry to another graph. With fusion,
each run is one ``fused`` feature (:func:`fuse_runs`) costed with the ``fused`` class's figures.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

from dbo_compile.errors import DboConfigError
from dbo_compile.passes.cost_model import CostModel, Figures, predict_us
from dbo_compile.schedule import COMM, Schedule, placed_timeline

__all__ = ["FUSED", "FUSIONS", "fuse_runs", "fused_features", "node_cost", "predict_split",
           "predict_unsplit", "simulate_overlapped", "step_features", "unit_features"]

Feature = tuple[str, float, float, float]

#: the class of a fused run of element-wise nodes (:func:`fuse_runs`)
FUSED = "fused"
#: what a calibration's ``fusion`` may be: ``None`` (node by node) or ``"runs"``
FUSIONS = (None, "runs")


def fuse_runs(features: list[Feature]) -> list[Feature]:
    """``features`` (one unit's or program's, in node order) with each maximal run of
    consecutive ``other`` nodes as one ``(FUSED, 0, bytes, rows)`` feature: ``bytes`` the
    largest of its nodes' (a fused kernel reads the run's inputs and writes its outputs once;
    the intermediates stay on chip), ``rows`` the widest. Other classes break a run and are
    kept as they are.

    Example::

        >>> fuse_runs([("other", 0, 10, 4), ("other", 0, 30, 2), ("gemm", 8, 5, 4)])
        [('fused', 0.0, 30.0, 4.0), ('gemm', 8, 5, 4)]
    """
    out: list[Feature] = []
    run: list[Feature] = []
    for f in [*features, None]:
        if f is not None and f[0] == "other":
            run.append(f)
            continue
        if run:
            out.append((FUSED, 0.0, float(max(r[2] for r in run)), float(max(r[3] for r in run))))
            run = []
        if f is not None:
            out.append(f)
    return out


def fused_features(features: list, fusion: str | None) -> list[Feature]:
    """``features`` as tuples, fused as ``fusion`` says (:data:`FUSIONS`).

    Raises:
        DboConfigError: ``fusion`` is not one of :data:`FUSIONS`.
    """
    if fusion not in FUSIONS:
        raise DboConfigError(f"calibration fusion {fusion!r} is not one of {FUSIONS}: refit it "
                             "with benchmarks/calibrate.py (--fusion runs, or none)")
    feats = [tuple(f) for f in features]
    return fuse_runs(feats) if fusion == "runs" else feats


def _traced(artifact: Any) -> None:
    """Raises DboConfigError: ``artifact`` was read from the compile cache, whose graphs
    carry no traced shapes (``meta["val"]``) and no token symbols to compute features from."""
    if getattr(artifact, "token_symbols", None) is None:
        raise DboConfigError("calibration features need the traced graphs, and this artifact "
                             "was read from the compile cache (cache_dir), which stores none: "
                             "compile without cache_dir to calibrate")


def _features(gm: Any, config: Any, symbols: frozenset, tokens: int, num_ubatches: int,
              names: set[str] | None = None) -> dict[str, Feature]:
    cost = CostModel(config.replace(cost_model_tokens=max(tokens, num_ubatches)), symbols,
                     num_ubatches)
    out = {}
    for n in gm.graph.nodes:
        if names is not None and n.name not in names:
            continue
        f = cost.node_features(n)
        if f is not None:
            out[n.name] = (f[0], float(f[1]), float(f[2]), float(f[3]))
    return out


def unit_features(artifact: Any, candidate: str, tokens: int) -> dict[int, list[Feature]]:
    """Per unit id of the split candidate ``candidate`` of ``artifact`` (a compiled
    :class:`~dbo_compile.runtime.program.SplitArtifact`), its nodes' features at
    ``tokens`` tokens per rank (``tokens / num_ubatches`` per ubatch)."""
    _traced(artifact)
    program = artifact.candidates[candidate]
    n = artifact.config.num_ubatches
    feats = _features(program.split_gm, artifact.config, artifact.token_symbols, tokens, n)
    return {u.id: [feats[name] for name in u.nodes if name in feats]
            for u in program.schedule.units}


def unsplit_features(artifact: Any, tokens: int) -> list[Feature]:
    """The unsplit program's nodes' features at ``tokens`` tokens, in graph order."""
    _traced(artifact)
    feats = _features(artifact.lowered_gm, artifact.config, artifact.token_symbols, tokens, 1)
    return list(feats.values())


def step_features(artifact: Any, candidate: str, tokens: int) -> dict[str, Any]:
    """Everything a prediction of one bucket needs, as JSON-able data: ``unsplit`` (the
    unsplit program's features) and ``schedule`` (the candidate's schedule,
    :meth:`~dbo_compile.schedule.Schedule.to_dict`) with ``features`` per unit id."""
    program = artifact.candidates[candidate]
    feats = unit_features(artifact, candidate, tokens)
    return {"tokens": tokens, "candidate": candidate,
            "unsplit": [list(f) for f in unsplit_features(artifact, tokens)],
            "schedule": program.schedule.to_dict(),
            "features": {str(i): [list(f) for f in fs] for i, fs in feats.items()}}


#: a node's cost from its features (µs), or the per-class figures it comes from
NodeCost = Callable[[Feature], float]


def node_cost(figures: dict[str, Any] | NodeCost) -> NodeCost:
    """The per-node cost function of ``figures`` (``{class: Figures or its fields}``; a
    callable is returned as it is)."""
    if callable(figures):
        return figures
    figs = {c: f if isinstance(f, Figures) else Figures(**f) for c, f in figures.items()}
    return lambda f: predict_us(figs, [tuple(f)])


def predict_unsplit(figures: dict[str, Any] | NodeCost, step: dict[str, Any],
                    fusion: str | None = None) -> float:
    """Predicted µs of the unsplit program of ``step`` (:func:`step_features`): its nodes in
    turn on one stream, comm included. ``figures``: per-class figures, or a cost per node;
    ``fusion``: the calibration's (:data:`FUSIONS`; ``"runs"``: costed on :func:`fuse_runs`).

    Raises:
        DboConfigError: an unknown ``fusion``.
    """
    cost = node_cost(figures)
    return sum(cost(f) for f in fused_features(step["unsplit"], fusion))


Slowdown = float | tuple[float, float]


def _placed(sched: Schedule) -> tuple[float, dict[int, tuple[float, float]]]:
    """Simulate ``sched`` (:class:`~dbo_compile.schedule.Timeline`, with the hold model of
    its ``meta["hold_fraction"]`` where the schedule was made with one; sets the units'
    times): the makespan and, per send (a unit with ``latency_us``), its transfer's interval
    on the link (µs)."""
    timeline = placed_timeline(sched.units, sched.deps, sched.meta.get("hold_fraction", 0.0))
    return timeline.makespan, timeline.transfers


def simulate_overlapped(sched: Schedule, slowdown: Slowdown, rounds: int = 3) -> float:
    """The makespan of ``sched`` (its units' ``cost_us`` as measured alone) when the units run
    slower over the part of them that overlaps the other stream: ``slowdown`` = ``(compute,
    comm)`` factors (a float: compute only). Units are timed alone; in the step, the comm
    stream's kernels compete with compute for SMs (and SM-holding comm kernels take them), and
    the comm ops' own kernels wait for SMs that large GEMMs hold. A send's transfer (its
    ``latency_us``, on the link while the comm stream runs other units) takes the comm factor
    over the part of it that overlaps the compute stream, and counts as comm for the compute
    units it overlaps. A fixed point of ``rounds``
    simulations; sets the units' times; ``1``: the plain timeline."""
    k_compute, k_comm = (slowdown, 1.0) if isinstance(slowdown, (int, float)) else slowdown
    base = {u.id: (u.cost_us, u.latency_us) for u in sched.units}
    span, link = _placed(sched)
    for _ in range(rounds if (k_compute, k_comm) != (1.0, 1.0) else 0):
        busy = {s: [(u.start_us, u.end_us) for u in sched.units if u.stream == s]
                for s in {u.stream for u in sched.units}}
        busy[COMM] += list(link.values())  # the transfers in flight: comm beside compute

        def overlap(a: float, b: float, stream: str) -> float:
            other = [iv for s, ivs in busy.items() if s != stream for iv in ivs]
            return sum(max(0.0, min(b, y) - max(a, x)) for x, y in other) / (b - a)

        for u in sched.units:
            cost, latency = base[u.id]
            k = k_comm if u.stream == COMM else k_compute
            if u.end_us > u.start_us:
                u.cost_us = cost * (1 + (k - 1) * min(1.0, overlap(u.start_us, u.end_us,
                                                                   u.stream)))
            if u.id in link and link[u.id][1] > link[u.id][0]:
                u.latency_us = latency * (1 + (k_comm - 1) * min(1.0, overlap(*link[u.id],
                                                                              COMM)))
        span, link = _placed(sched)
    return span


def predict_split(figures: dict[str, Any] | NodeCost, step: dict[str, Any],
                  serial: bool = False, slowdown: Slowdown = 1.0,
                  fusion: str | None = None) -> tuple[float, Schedule]:
    """Predicted µs of the split candidate of ``step``: the makespan of its schedule with the
    calibrated unit costs (``serial``: every unit on one stream, the "split serial" step;
    ``slowdown``: of units overlapping the other stream, :func:`simulate_overlapped`;
    ``fusion``: each unit's features fused as the calibration's, :func:`predict_unsplit`), and
    the schedule with those costs and times (for the viewer).

    Raises:
        DboConfigError: an unknown ``fusion``.
    """
    cost = node_cost(figures)
    sched = Schedule.from_dict(copy.deepcopy(step["schedule"]))
    for u in sched.units:
        feats = fused_features(step["features"][str(u.id)], fusion)
        us = round(sum(cost(f) for f in feats), 3)
        if u.latency_us > 0:  # a send: the comm op's time is its transfer; the issue and
            u.latency_us = us  # its receive keep the schedule's launch
        elif u.phase != "receive":
            u.cost_us = us
    if serial:
        return sum(u.cost_us + u.latency_us for u in sched.units), sched
    sched.predicted_step_us = round(simulate_overlapped(sched, slowdown), 3)
    sched.serial_us = round(sum(u.cost_us + u.latency_us for u in sched.units), 3)
    sched.meta["calibrated"] = True
    return sched.predicted_step_us, sched
