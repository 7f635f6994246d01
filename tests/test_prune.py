"""Time only what can win (runtime/prune.py, issue 26): the split candidates a bucket captures,
ranked by the calibrated cost model; and the runner on CPU capturing only those."""

from __future__ import annotations

import json

import pytest
import torch

from dbo_compile.errors import GraphRunnerError
from dbo_compile.models.deepseek import DeepseekMoEModel, get_config
from dbo_compile.runtime.cudagraph_runner import CudaGraphRunner
from dbo_compile.passes.predict import predict_bucket
from dbo_compile.runtime.prune import BucketPrediction, agreed, plan

CANDS = ["list", "list@link/16+sms16", "list+join", "list@link/16+join"]


def _pred(unsplit, *split, error=0.05):
    return BucketPrediction({"unsplit": unsplit, **dict(zip(CANDS, split))}, error)


def test_the_best_and_those_within_the_margin_are_timed():
    p = plan(CANDS, _pred(200.0, 100.0, 109.0, 111.0, 150.0), margin=0.10, min_gain=0.03)
    assert p.timed == ("list", "list@link/16+sms16")
    assert set(p.pruned) == {"list+join", "list@link/16+join"}
    assert "list 100.0 us" in p.pruned["list+join"] and p.skip_split is None
    # a wider margin keeps more, the order stays the artifact's
    assert plan(CANDS, _pred(200.0, 111.0, 100.0, 130.0, 150.0), margin=0.35,
                min_gain=0.03).timed == ("list", "list@link/16+sms16", "list+join")


@pytest.mark.parametrize("prediction, margin, why", [
    (BucketPrediction(None, why="no calibration"), 0.10, "no prediction (no calibration)"),
    (_pred(200.0, 100.0, 300.0, 300.0, 300.0), None, "pruning off"),
    (_pred(200.0, 100.0, float("nan"), 300.0, 300.0), 0.10, "no usable prediction"),
    (BucketPrediction({"unsplit": 200.0, "list": 100.0}), 0.10, "no usable prediction"),
])
def test_without_a_usable_prediction_every_candidate_is_timed(prediction, margin, why):
    p = plan(CANDS, prediction, margin=margin, min_gain=0.03)
    assert p.timed == tuple(CANDS) and not p.pruned and p.skip_split is None
    assert why in p.why


@pytest.mark.parametrize("unsplit, best, error, mode, skipped", [
    (100.0, 140.0, 0.10, "auto", True),    # 140 * 0.9 = 126 > 0.97 * 100 * 1.1 = 106.7
    (100.0, 115.0, 0.10, "auto", False),   # 103.5 < 106.7: the error could make it win
    (100.0, 140.0, None, "auto", False),   # error unknown: never skip
    (100.0, 140.0, 0.30, "auto", False),   # 98 < 126.1: a large error, keep
    (100.0, 300.0, 0.10, "always", False),  # forced split: the candidates are still needed
    (100.0, 90.0, 0.10, "auto", False),
])
def test_a_bucket_is_not_split_only_where_no_error_could_make_a_split_win(
        unsplit, best, error, mode, skipped):
    pred = BucketPrediction({"unsplit": unsplit, **{c: best + 50 * i for i, c in enumerate(CANDS)}},
                            error)
    p = plan(CANDS, pred, margin=0.10, min_gain=0.03, mode=mode)
    assert (p.skip_split is not None) == skipped
    assert p.timed == (() if skipped else ("list",))
    if skipped:
        assert set(p.pruned) == set(CANDS) and "min_gain 3%" in p.skip_split


def test_the_error_used_is_at_least_the_margin():
    # error 0.01 but margin 0.20: e = 0.2 -> 140 * 0.8 = 112 < 0.97 * 100 * 1.2: kept
    pred = BucketPrediction({"unsplit": 100.0, **{c: 140.0 for c in CANDS}}, 0.01)
    assert plan(CANDS, pred, margin=0.20, min_gain=0.03).skip_split is None
    assert plan(CANDS, pred, margin=0.01, min_gain=0.03).skip_split is not None


def test_predictions_are_agreed_over_the_ranks():
    """The max over every rank (two ranks simulated): one rank without a prediction or
    without an error bound leaves none on every rank."""
    names = CANDS[:2]
    other = [120.0, 90.0, 95.0, 0.05]

    def ranks(values):
        return [max(a, b) for a, b in zip(values, other)]
    got = agreed(BucketPrediction({"unsplit": 100.0, "list": 80.0, "list@link/16+sms16": 99.0},
                                  0.02), names, ranks)
    assert got.us == {"unsplit": 120.0, "list": 90.0, "list@link/16+sms16": 99.0}
    assert got.error == 0.05
    assert agreed(BucketPrediction(None, why="x"), names, ranks).us is None
    other[-1] = float("inf")
    assert agreed(BucketPrediction({"unsplit": 1.0, "list": 1.0, "list@link/16+sms16": 1.0},
                                   0.02), names, ranks).error is None


def _model():
    cfg = get_config("tiny", num_layers=1)
    model = DeepseekMoEModel(cfg, seed=0)
    model.allocate_kv_cache(64, 16)
    return model


def _compiled(**options):
    return torch.compile(_model(), backend="dbo", options={
        "split": "auto", "decode_token_threshold": 2, "prefill_token_threshold": 2,
        "schedule_candidates": True, **options})


def test_the_runner_captures_and_times_only_the_kept_candidates(monkeypatch):
    """Synthetic predictions: the pruned candidates are never captured nor timed, the choice
    is among the timed ones, and the plan is in ``runner.stats``."""
    predicted = {}

    def predictor(art, tokens, names):
        predicted[tokens] = list(names)
        us = {n: 100.0 + 50.0 * i for i, n in enumerate(names)}
        us[names[1]] = 105.0  # the second candidate within 10 % of the first
        return BucketPrediction({"unsplit": 150.0, **us}, 0.05)

    runner = CudaGraphRunner(_compiled(), [16, 32], max_blocks_per_req=4, timing_iters=1,
                             keep_candidates=True, predictor=predictor)
    captured = []
    graph = runner._graph
    monkeypatch.setattr(runner, "_graph", lambda b, name, fn, cuda: captured.append(
        (b.tokens, name)) or graph(b, name, fn, cuda))
    # the second-predicted candidate measures fastest: the choice follows the timing
    monkeypatch.setattr(runner, "_time", lambda b, names: {
        n: {"unsplit": 200.0}.get(n, 100.0 if n == list(b.artifact.candidates)[1] else 150.0)
        for n in names})
    runner.capture()
    for t in (16, 32):
        b = runner.graphs[t]
        names = list(b.artifact.candidates)
        assert predicted[t] == names and len(names) > 2
        kept = names[:2]
        assert [n for tok, n in captured if tok == t] == ["unsplit", *kept]
        assert set(b.graphs) == {"unsplit", *kept} and set(b.times_us) == {"unsplit", *kept}
        assert b.choice == names[1]
        stats = runner.stats["buckets"][t]["prune"]
        assert stats["timed"] == kept and set(stats["pruned"]) == set(names[2:])


def test_the_runner_skips_splitting_where_no_split_can_win():
    def predictor(art, tokens, names):
        return BucketPrediction({"unsplit": 100.0, **{n: 200.0 for n in names}}, 0.05)

    runner = CudaGraphRunner(_compiled(), [16], max_blocks_per_req=4, timing_iters=1,
                             predictor=predictor)
    runner.capture()
    b = runner.graphs[16]
    assert set(b.graphs) == {"unsplit"} and b.choice == "unsplit" and b.split_args is None
    assert b.prune.skip_split and not b.times_us


def test_without_a_calibration_every_candidate_is_captured():
    runner = CudaGraphRunner(_compiled(), [16], max_blocks_per_req=4, timing_iters=1,
                             keep_candidates=True)
    runner.capture()
    b = runner.graphs[16]
    assert set(b.graphs) == {"unsplit", *b.artifact.candidates}
    assert "no calibration" in b.prune.why and not b.prune.pruned


@pytest.mark.parametrize("bad", [-0.1, True, "0.1", float("nan")])
def test_a_bad_prune_margin_is_refused(bad):
    with pytest.raises(GraphRunnerError, match="prune_margin"):
        CudaGraphRunner(lambda *a: None, [16], max_blocks_per_req=4, prune_margin=bad)


def test_a_calibration_predicts_every_candidate_at_the_buckets_size(tmp_path):
    """With a calibration file, the cost model predicts each program at the bucket's own
    token count: larger buckets predict longer steps."""
    figs = {c: {"tflops": 100.0, "gbps": 1000.0, "launch_us": 2.0, "us_per_row": 0.0}
            for c in ("gemm", "experts", "attention", "other")}
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"figures": figs, "overlap_slowdown": {"compute": 1.1, "comm": 1.0},
                                "check": {"worst_abs_err": 0.12}}))
    compiled = _compiled(calibration=str(path))
    runner = CudaGraphRunner(compiled, [16, 256], max_blocks_per_req=4, timing_iters=1)
    runner.capture()
    art = runner.graphs[16].artifact
    names = list(art.candidates)
    small, large = (predict_bucket(art, t, names) for t in (16, 256))
    assert small.us is not None and set(small.us) == {"unsplit", *names}
    assert all(large.us[k] > small.us[k] > 0 for k in small.us)
    assert small.error is None  # comm ops not covered by this calibration: never skip
    # the runner on CPU makes none: a calibration is a GPU's; every candidate is timed
    plan_cpu = runner.graphs[16].prune
    assert plan_cpu.predicted_us is None and "calibration is a GPU's" in plan_cpu.why
    assert predict_bucket(art, 16, names, device=torch.device("cpu")).us is None


def test_a_fused_calibration_is_predicted_on_fused_runs(tmp_path):
    """A calibration fitted on Inductor's fused runs (``"fusion": "runs"``, a ``fused`` class
    instead of ``other``) predicts the programs on their fused runs: each run's launch counts
    once; read as per-node figures no node would meet the ``fused`` class."""
    figs = {c: {"tflops": 1000.0, "gbps": 1000.0, "launch_us": 0.0, "us_per_row": 0.0}
            for c in ("gemm", "experts", "attention")}
    figs["fused"] = {"gbps": 1000.0, "launch_us": 500.0}
    paths = {}
    for name, extra in (("fused", {"fusion": "runs"}), ("plain", {})):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps({"figures": figs, **extra,
                                           "overlap_slowdown": {"compute": 1.0, "comm": 1.0}}))
    us = {}
    for name, path in paths.items():
        compiled = _compiled(calibration=str(path))
        runner = CudaGraphRunner(compiled, [16], max_blocks_per_req=4, timing_iters=1)
        runner.capture()
        art = runner.graphs[16].artifact
        us[name] = predict_bucket(art, 16, list(art.candidates)).us
    assert us["fused"]["unsplit"] > us["plain"]["unsplit"] + 500.0


def test_a_warm_restart_prunes_from_the_stored_predictions(tmp_path):
    """With cache_dir the predictions are stored beside the compile cache: an artifact read
    back from it (no traced graph to predict from) plans as the cold compile did."""
    cal = tmp_path / "cal.json"
    figs = {c: {"tflops": 100.0, "gbps": 1000.0, "launch_us": 2.0}
            for c in ("gemm", "experts", "attention", "other")}
    cal.write_text(json.dumps({"figures": figs}))
    options = dict(calibration=str(cal), cache_dir=str(tmp_path / "cache"))
    predictions = []
    for _ in range(2):
        torch._dynamo.reset()
        runner = CudaGraphRunner(_compiled(**options), [16], max_blocks_per_req=4,
                                 timing_iters=1)
        runner.capture()
        art = runner.graphs[16].artifact
        predictions.append((art.token_symbols is None,
                            predict_bucket(art, 16, list(art.candidates)),
                            predict_bucket(art, 32, list(art.candidates))))
    (cold_read, cold, cold_32), (warm_read, warm, warm_32) = predictions
    assert not cold_read and warm_read  # the second artifact came from the compile cache
    assert cold.us is not None and warm == cold and warm_32 == cold_32
    assert (tmp_path / "cache" / "prune").is_dir()
    # a bucket no cold run predicted has no prediction on a warm one
    assert predict_bucket(art, 64, list(art.candidates)).us is None
