"""Which split schedule candidates a bucket captures and times: the calibrated cost model ranks
them at the bucket's token count, and only those that can win are captured (issue 26).

:class:`~dbo_compile.runtime.cudagraph_runner.CudaGraphRunner` captures, per bucket, the
unsplit graph and the split candidates of :func:`plan`; the others are neither captured nor
timed (their Inductor stages never compile for the bucket's signature either).

**Prediction** (:func:`dbo_compile.passes.predict.predict_bucket`, which the compile puts on
the artifact as ``artifact.predict``: the runtime imports no compile stage): with a calibration (``DboConfig.calibration``) and
the artifact's traced graphs, each program's step time (µs) at the bucket's ``tokens`` rows
per rank: the unsplit program its nodes in turn
(:func:`~dbo_compile.passes.calibrate.predict_unsplit`), each split candidate the makespan
of its schedule with every unit's cost at ``tokens / num_ubatches`` rows per ubatch and the
calibration's overlap slowdown (:func:`~dbo_compile.passes.calibrate.predict_split`). The
cost model's sizes are symbolic in the token dim, so the features are evaluated at the
bucket's own count, not at ``cost_model_tokens``. Comm ops take the calibration's comm fit
for the emulated world (its link round trip at ``min(link_gbps, copy_gbps)``), else the
config's link figures (``comm_latency_us``, ``link_gbps``: uncalibrated, so the bucket is
never skipped on them). A carve-out variant (``+smsN``) is predicted as its schedule (the
cost model does not model the SMs it gives up): the margin and the measured comparison
(``benchmarks/capture_time.py --prune-compare``) cover it. The predictions are maxed over
every rank of the job, so every rank captures and times the same graphs. With ``cache_dir``
they are stored beside the compile cache (``cache_dir/prune/<key>.json``), so that a warm
restart, whose artifact has no traced graph to predict from, prunes as the cold start did.

**Rule** (:func:`plan`), with ``margin`` (``CudaGraphRunner(prune_margin=...)``) and the
calibration's measured error ``err`` (its ``check.worst_abs_err``: the worst relative error of
its whole-step predictions on its own rows):

1. no prediction (no calibration; graphs not on CUDA, or on a GPU other than the
   calibration's ``machine``; an artifact read from the compile cache without a stored
   prediction for the bucket; a failed prediction), or ``margin is None``: every candidate is
   timed, as before;
2. the predicted best split candidate and every candidate predicted within ``margin`` of it
   (``pred <= (1 + margin) * best``) are captured and timed; the others are pruned;
3. with ``split="auto"`` the bucket captures no split graph at all when even an error of
   ``e = max(err, margin)`` in both predictions could not make the best candidate win by the
   runner's ``min_gain``: ``best * (1 - e) > (1 - min_gain) * unsplit * (1 + e)``. Without a
   measured ``err`` (a calibration that recorded no check), or with comm ops not covered by
   the calibration, no bucket is skipped (uncertain).

Every decision is recorded with its reason (:class:`PrunePlan`, ``runner.stats``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_PRUNE_MARGIN", "BucketPrediction", "PrunePlan", "agreed", "artifact_predictor",
           "plan"]

#: ``CudaGraphRunner(prune_margin=...)``'s default: a candidate predicted within 10 % of the
#: predicted best is timed. The calibration in use on 1x H200 predicts whole steps within 12 %
#: (``benchmarks/calibration/h200_inductor_pipelined_2026-12-01.json``, ``check``), and errors
#: of candidates of one graph at one bucket are largely shared (the same nodes, the same
#: figures); that it picks what timing all picks is measured by ``benchmarks/capture_time.py
#: --prune-compare``.
DEFAULT_PRUNE_MARGIN = 0.10


@dataclass(frozen=True)
class BucketPrediction:
    """Predicted step times of one bucket's programs.

    Attributes:
        us: µs per program, ``"unsplit"`` and each split candidate; ``None`` where there is
            no prediction (``why`` says why).
        error: the calibration's measured relative error of a whole-step prediction (``None``:
            unknown, or comm ops the calibration does not cover: no bucket is skipped).
        why: why there is no prediction (``None``: there is one).
    """

    us: dict[str, float] | None
    error: float | None = None
    why: str | None = None


@dataclass
class PrunePlan:
    """What one bucket captures, and why (:func:`plan`).

    Attributes:
        timed: the split candidates captured and timed, in the artifact's order.
        pruned: each candidate not captured -> why.
        skip_split: why the bucket captures no split graph (``None``: it captures ``timed``).
        predicted_us: the predictions the plan rests on (``None``: none).
        why: the plan's rule in words (e.g. no prediction: every candidate timed).
        dropped: each planned candidate that was not captured after all -> why: it ran out of
            GPU memory at capture (on this rank or another), or the runner's
            ``graph_memory_budget`` was reached (:mod:`~.graph_memory`); no longer in ``timed``.
    """

    timed: tuple[str, ...]
    pruned: dict[str, str] = field(default_factory=dict)
    skip_split: str | None = None
    predicted_us: dict[str, float] | None = None
    why: str = ""
    dropped: dict[str, str] = field(default_factory=dict)

    def drop(self, name: str, why: str) -> None:
        """Candidate ``name`` of ``timed`` was not captured, for ``why``."""
        self.timed = tuple(k for k in self.timed if k != name)
        self.dropped[name] = why

    def to_dict(self) -> dict[str, Any]:
        """JSON-able (``runner.stats``, benchmark results)."""
        return {"timed": list(self.timed), "pruned": dict(self.pruned),
                "skip_split": self.skip_split, "why": self.why, "dropped": dict(self.dropped),
                "predicted_us": None if self.predicted_us is None else
                {k: round(v, 1) for k, v in self.predicted_us.items()}}


def plan(candidates: Sequence[str], prediction: BucketPrediction, *, margin: float | None,
         min_gain: float, mode: str = "auto") -> PrunePlan:
    """The split candidates a bucket captures (the module docstring's rule).

    Args:
        candidates: the artifact's split candidates (names), in its order.
        prediction: the artifact's prediction for the bucket (:func:`agreed` over the ranks).
        margin: fraction >= 0 (``None``: off, every candidate timed).
        min_gain: the runner's (fraction): a split must win by it.
        mode: ``DboConfig.split``; only ``"auto"`` skips a bucket's split graphs.
    """
    names = list(candidates)
    if margin is None:
        return PrunePlan(tuple(names), why="pruning off (prune_margin=None): every candidate timed")
    pred = prediction.us
    if pred is None:
        return PrunePlan(tuple(names), why=f"no prediction ({prediction.why}): every candidate timed")
    bad = [k for k in ["unsplit", *names]
           if not (isinstance(pred.get(k), (int, float)) and math.isfinite(pred[k]) and pred[k] > 0)]
    if bad:
        return PrunePlan(tuple(names), predicted_us=pred,
                         why=f"no usable prediction for {bad}: every candidate timed")
    best = min(names, key=lambda k: (pred[k], k))
    limit = (1.0 + margin) * pred[best]
    timed = tuple(k for k in names if pred[k] <= limit)
    pruned = {k: (f"predicted {pred[k]:.1f} us > {1 + margin:.2f} x the predicted best "
                  f"{best} {pred[best]:.1f} us") for k in names if k not in timed}
    why = f"predicted best {best}; candidates within {margin:.0%} of it timed"
    if mode == "auto" and prediction.error is not None:
        e = max(prediction.error, margin)
        if pred[best] * (1 - e) > (1 - min_gain) * pred["unsplit"] * (1 + e):
            skip = (f"the predicted best split {best} {pred[best]:.1f} us cannot beat unsplit "
                    f"{pred['unsplit']:.1f} us by min_gain {min_gain:.0%} even with an error "
                    f"of {e:.0%} in both predictions")
            return PrunePlan((), {k: "bucket not split: " + skip for k in names}, skip, pred,
                             why="no split graph: " + skip)
    return PrunePlan(timed, pruned, None, pred, why)


def agreed(prediction: BucketPrediction, names: Sequence[str],
           over_ranks: Callable[[list[float]], list[float]]) -> BucketPrediction:
    """``prediction`` maxed over every rank (``over_ranks``: elementwise max over the job), so
    that every rank makes the same plan; a rank without one (``inf``) leaves none on all."""
    keys = ["unsplit", *names]
    us = prediction.us
    values = [math.inf if us is None or k not in us else float(us[k]) for k in keys]
    values.append(math.inf if prediction.error is None else float(prediction.error))
    values = over_ranks(values)
    if any(math.isinf(v) for v in values[:-1]):
        return BucketPrediction(None, why=prediction.why or "no prediction on another rank")
    # an error unknown on any rank (inf) is unknown on all: no rank skips a bucket alone
    error = None if math.isinf(values[-1]) else values[-1]
    return BucketPrediction(dict(zip(keys, values[:-1])), error)


def artifact_predictor(device: Any) -> Callable[[Any, int, Sequence[str]], BucketPrediction]:
    """The runner's default predictor: the artifact's own (``artifact.predict``, set by the
    compile: :func:`dbo_compile.passes.predict.predict_bucket`) for graphs on ``device``."""
    def predict(artifact: Any, tokens: int, names: Sequence[str]) -> BucketPrediction:
        if artifact.predict is None:
            return BucketPrediction(None, why="the artifact has no predictor")
        return artifact.predict(artifact, tokens, names, device=device)
    return predict
