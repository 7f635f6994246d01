"""The calibrated cost model: a calibration file the config points at (validated, part of the
fingerprint), the per-class formula the scheduler then uses, and the step predictions a
calibration is checked with (dbo_compile/passes/calibrate.py) agreeing with the schedule."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import last_artifact
from dbo_compile.config import DboConfig
from dbo_compile.errors import DboConfigError
from dbo_compile.passes.calibrate import (
    FUSED,
    fuse_runs,
    node_cost,
    predict_split,
    predict_unsplit,
    step_features,
)
from dbo_compile.passes.cost_model import CostModel, Figures, node_class
from dbo_compile.runtime.engine import run_step
from test_emulated import _options, _world_model

FIGURES = {"gemm": {"tflops": 400.0, "gbps": 2000.0, "launch_us": 5.0},
           "experts": {"tflops": 200.0, "gbps": 1500.0, "launch_us": 40.0},
           "attention": {"gbps": 1000.0, "launch_us": 8.0, "us_per_row": 0.02},
           "other": {"gbps": 1800.0, "launch_us": 3.0}}


@pytest.fixture
def calibration(tmp_path):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"machine": "test", "figures": FIGURES}))
    return str(path)


@pytest.mark.parametrize("content, match", [
    (None, "cannot be read"), ("{not json", "cannot be read"), ('{"machine": "x"}', "no 'figures'")])
def test_a_bad_calibration_file_is_refused(tmp_path, content, match):
    path = tmp_path / "cal.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(DboConfigError, match=f"calibration.*{match}"):
        DboConfig.from_options({"calibration": str(path)})


def test_the_fingerprint_covers_the_calibration_content(tmp_path, calibration):
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"figures": {**FIGURES, "gemm": {"tflops": 100.0}}}))
    same = tmp_path / "same.json"
    same.write_text(open(calibration).read())
    fp = [DboConfig(calibration=p).fingerprint() for p in (calibration, str(other), str(same))]
    assert fp[0] != fp[1] and fp[0] == fp[2] != DboConfig().fingerprint()


def _compile(**options):
    model, _, step = _world_model()
    cm = torch.compile(model, backend="dbo", options=_options(
        cost_model_tokens=64, schedule_candidates=False, **options))
    with torch.no_grad():
        run_step(cm, step.input_ids, step.positions, step.attn_metadata, step.num_scheduled_tokens)
    return last_artifact()


def test_calibrated_costs_follow_the_class_formula(calibration):
    art = _compile(calibration=calibration)
    cost = CostModel(art.config, art.token_symbols, 2)
    figs = {c: Figures(**f) for c, f in FIGURES.items()}
    seen = set()
    for n in art.split_gm.graph.nodes:
        feats = cost.node_features(n)
        if feats is None or feats[0] == "comm":
            continue
        seen.add(feats[0])
        assert cost.node_cost_us(n) == pytest.approx(figs[feats[0]].cost_us(*feats[1:]))
    assert seen == {"gemm", "experts", "attention", "other"}
    # the attention node's bytes leave out the KV cache it writes in place
    attn = next(n for n in art.split_gm.graph.nodes if node_class(n) == "attention")
    cache = next(a for a in attn.all_input_nodes if a.name in attn.meta["dbo"].get("mutates", []))
    assert cost.node_features(attn)[2] < cost.nbytes(cache.meta["val"])


def test_predictions_reproduce_the_schedule_at_its_own_count(calibration):
    """At the schedule's reference count, the calibrated prediction of the split step is the
    schedule's own predicted makespan (same features, same formula, same timeline); the
    unsplit prediction is the sum over the unsplit program's nodes."""
    art = _compile(calibration=calibration)
    cand = next(iter(art.candidates))
    step = step_features(art, cand, 64)
    comm = {"launch_us": art.config.comm_latency_us, "gbps": art.config.link_gbps}
    pred, sched = predict_split({**FIGURES, "comm": comm}, step)
    assert pred == pytest.approx(art.candidates[cand].schedule.predicted_step_us, rel=1e-4)
    assert [u.name for u in sched.units] == [u.name for u in art.candidates[cand].schedule.units]
    serial, _ = predict_split({**FIGURES, "comm": comm}, step, serial=True)
    assert serial >= pred
    unsplit = predict_unsplit({**FIGURES, "comm": comm}, step)
    # the unsplit program's compute at 64 tokens vs the split one's two 32-token halves
    assert unsplit > 0 and len(step["unsplit"]) > 10
    # the prediction moves with the bucket: more tokens, more time
    assert predict_split({**FIGURES, "comm": comm}, step_features(art, cand, 1024))[0] > pred


def test_a_send_predicts_its_comm_op_as_its_transfer_on_one_link(calibration):
    """The emulated ops' issues are sends (their receive a unit of its own): the prediction
    puts each comm op's calibrated time on the link as the issue's transfer, one transfer at
    a time (the step lasts at least all of them), and the comm slowdown stretches the
    transfers that overlap the compute stream."""
    art = _compile(calibration=calibration)
    cand = next(iter(art.candidates))
    step = step_features(art, cand, 4096)
    comm = {"launch_us": 30.0, "gbps": 5.0}  # a slow link: the transfers dominate
    pred, sched = predict_split({**FIGURES, "comm": comm}, step)
    sends = [u for u in sched.units if u.latency_us > 0]
    assert len(sends) == 8 and all(u.phase == "issue" and u.cost_us < 10 for u in sends)
    cost = node_cost({**FIGURES, "comm": comm})
    for u in sends:
        assert u.latency_us == pytest.approx(sum(cost(tuple(f))
                                                 for f in step["features"][str(u.id)]), abs=1e-3)
    assert pred >= sum(u.latency_us for u in sends)
    slower, _ = predict_split({**FIGURES, "comm": comm}, step, slowdown=(1.0, 1.5))
    assert slower > pred
    # compute beside a transfer in flight counts as overlapped (the comm stream itself only
    # holds the launches): a compute slowdown stretches the compute it overlaps
    _, plain = predict_split({**FIGURES, "comm": {"launch_us": 30.0, "gbps": 500.0}}, step)
    _, slowed = predict_split({**FIGURES, "comm": {"launch_us": 30.0, "gbps": 500.0}}, step,
                              slowdown=(1.5, 1.0))
    compute = [(a.cost_us, b.cost_us) for a, b in zip(plain.units, slowed.units)
               if a.kind == "compute" and a.ubatch is not None]
    assert sum(b for _, b in compute) > 1.1 * sum(a for a, _ in compute)


def test_a_run_of_elementwise_nodes_is_one_fused_kernel():
    """Inductor compiles each run of element-wise / reduction nodes between two extern kernels
    (GEMMs, the experts and attention ops, comm) into fused kernels that read the run's inputs
    and write its outputs once: the run becomes one ``fused`` feature whose bytes are its
    largest node's and whose rows are its widest node's; extern nodes stay as they are."""
    feats = [("other", 0.0, 10.0, 4.0), ("other", 0.0, 30.0, 2.0), ("gemm", 8.0, 5.0, 4.0),
             ("other", 0.0, 7.0, 4.0), ("attention", 1.0, 3.0, 4.0), ("comm", 0.0, 9.0, 1.0),
             ("other", 0.0, 2.0, 1.0), ("other", 0.0, 1.0, 8.0), ("other", 0.0, 6.0, 1.0)]
    assert fuse_runs(feats) == [(FUSED, 0.0, 30.0, 4.0), ("gemm", 8.0, 5.0, 4.0),
                                (FUSED, 0.0, 7.0, 4.0), ("attention", 1.0, 3.0, 4.0),
                                ("comm", 0.0, 9.0, 1.0), (FUSED, 0.0, 6.0, 8.0)]
    assert fuse_runs([]) == [] and fuse_runs([("gemm", 1.0, 2.0, 3.0)]) == [("gemm", 1.0, 2.0, 3.0)]


def test_a_fused_calibration_costs_each_run_once(calibration):
    """``fusion="runs"``: the unsplit program and every unit of the split one are costed on
    their fused runs (a run's launch paid once); without it the ``fused`` figures meet no
    node; an unknown fusion is refused."""
    art = _compile(calibration=calibration)
    cand = next(iter(art.candidates))
    step = step_features(art, cand, 64)
    comm = {"launch_us": 30.0, "gbps": 50.0}
    figs = {**{c: f for c, f in FIGURES.items() if c != "other"}, "comm": comm,
            FUSED: {"gbps": 1800.0, "launch_us": 100.0}}
    cost = node_cost(figs)
    runs = fuse_runs([tuple(f) for f in step["unsplit"]])
    assert sum(c == FUSED for c, *_ in runs) >= 2
    assert predict_unsplit(figs, step, fusion="runs") == pytest.approx(sum(map(cost, runs)))
    plain = predict_unsplit(figs, step)  # no run costed: the element-wise nodes are free
    assert plain == pytest.approx(sum(cost(tuple(f)) for f in step["unsplit"] if f[0] != "other"))
    assert predict_unsplit(figs, step, fusion="runs") >= plain + 100.0 * sum(
        c == FUSED for c, *_ in runs) - 1e-6
    _, sched = predict_split(figs, step, fusion="runs")
    for u in sched.units:
        if u.kind == "compute" and u.phase != "receive":
            want = sum(map(cost, fuse_runs([tuple(f) for f in step["features"][str(u.id)]])))
            assert u.cost_us == pytest.approx(want, abs=1e-3)
    with pytest.raises(DboConfigError, match="fusion 'nodes'.*'runs'"):
        predict_unsplit(figs, step, fusion="nodes")
