"""The unsplit program on two streams (``DboConfig.unsplit_overlap``, issue 28 item 6).

On CPU the streams are no-ops, so the schedule itself is checked: each MoE layer's shared
experts and its dispatch are on different streams with nothing ordering them (they can
overlap), every dependence between the streams is honoured by event edges, and the program
computes what the serial unsplit program does. The runner captures it beside the serial graph,
times both and serves a step that is not split from the faster by ``min_gain``.
"""

from __future__ import annotations

import pytest
import torch

from dbo_compile.candidates import UNSPLIT_OVERLAP
from dbo_compile.config import DboConfig
from dbo_compile.errors import DboConfigError
from dbo_compile.models.deepseek import DeepseekMoEModel, get_config
from dbo_compile.runtime.cudagraph_runner import CudaGraphRunner
from dbo_compile.schedule import COMM, COMPUTE
from moe_cases import DECODE_64, build, eager_and_compiled, eager_then_restore

from conftest import last_artifact


def _happens_before(schedule) -> set[tuple[int, int]]:
    """(a, b): unit ``a`` finishes before unit ``b`` starts on the device: stream order
    (units of one stream run in host order) and event edges, closed transitively."""
    units = sorted(schedule.units, key=lambda u: u.id)
    succ: dict[int, set[int]] = {u.id: set() for u in units}
    last: dict[str, int] = {}
    for u in units:
        if u.stream in last:
            succ[last[u.stream]].add(u.id)
        last[u.stream] = u.id
    for a, b in schedule.event_edges:
        succ[a].add(b)
    out = set()
    for u in reversed(units):  # successors have larger ids (host order)
        reach = set()
        for v in succ[u.id]:
            reach |= {v} | {w for (x, w) in out if x == v}
        out |= {(u.id, w) for w in reach}
    return out


def _deps_closure(schedule) -> set[tuple[int, int]]:
    succ: dict[int, set[int]] = {u.id: set() for u in schedule.units}
    for a, b in schedule.deps:
        succ[a].add(b)
    out: set[tuple[int, int]] = set()
    for u in sorted(schedule.units, key=lambda u: -u.id):
        for v in succ[u.id]:
            out |= {(u.id, v)} | {(u.id, w) for (x, w) in out if x == v}
    return out


@pytest.fixture(scope="module")
def compiled_case():
    torch._dynamo.reset()
    model, step = build(DECODE_64, layers=2)
    eager, out, _, _ = eager_and_compiled(model, step, {"unsplit_overlap": True,
                                                       "split": "never"})
    return model, step, eager, out, last_artifact()


def test_shared_experts_and_dispatch_run_on_two_streams_unordered(compiled_case):
    *_, art = compiled_case
    sched = art.unsplit_overlap.schedule
    assert sched.num_ubatches == 1
    hb = _happens_before(sched)
    dispatches = [u for u in sched.units if u.label == "D"]
    shared = {u.layer: u for u in sched.units if u.label == "S"}
    assert len(dispatches) == 2 and set(shared) == {0, 1}, [u.name for u in sched.units]
    for d in dispatches:
        s = shared[d.layer]
        assert d.stream == COMM and s.stream == COMPUTE
        # nothing orders them on the device: the shared experts run while the dispatch is in
        # flight (issued after it on the host, with no event edge from it before them)
        assert (d.id, s.id) not in hb and (s.id, d.id) not in hb, (d.name, s.name)
        assert s.id > d.id
        routed = next(u for u in sched.units if u.label == "MLP" and u.layer == d.layer)
        assert (d.id, routed.id) in hb  # the routed experts wait for the dispatch
        assert not any(a == d.id and b <= s.id for a, b in sched.event_edges)


def test_every_dependence_across_the_streams_is_an_event_edge_path(compiled_case):
    *_, art = compiled_case
    sched = art.unsplit_overlap.schedule
    by_id = {u.id: u for u in sched.units}
    hb = _happens_before(sched)
    crossing = [(a, b) for a, b in _deps_closure(sched) if by_id[a].stream != by_id[b].stream]
    assert crossing and sched.event_edges
    missing = [(by_id[a].name, by_id[b].name) for a, b in crossing if (a, b) not in hb]
    assert not missing
    for a, b in sched.event_edges:
        assert by_id[a].stream != by_id[b].stream


def test_same_numbers_and_collectives_as_the_serial_unsplit_program(compiled_case):
    model, step, eager, out, art = compiled_case
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    # one comm unit per collective of the serial program, in its order
    comm = [u for u in sorted(art.unsplit_overlap.schedule.units, key=lambda u: u.id)
            if u.stream == COMM]
    assert [u.label for u in comm] == ["D", "C", "D", "C"]
    assert [u.layer for u in comm] == [0, 0, 1, 1]


def _runner(options, buckets=(16,), **kw):
    cfg = get_config("tiny", num_layers=2)
    model = DeepseekMoEModel(cfg, seed=0)
    model.allocate_kv_cache(64, 16)
    compiled = torch.compile(model, backend="dbo", options=options)
    return model, CudaGraphRunner(compiled, list(buckets), max_blocks_per_req=4, timing_iters=1,
                                  **kw)


def test_runner_captures_both_unsplit_graphs_with_equal_outputs():
    torch._dynamo.reset()
    _, runner = _runner({"unsplit_overlap": True}, buckets=(2, 16), keep_candidates=True)
    runner.capture()
    for t, b in runner.graphs.items():
        assert {"unsplit", UNSPLIT_OVERLAP} <= set(b.graphs), t
        assert {"unsplit", UNSPLIT_OVERLAP} <= set(b.times_us), t  # timed at every bucket
        for got, want in zip(b.outs[UNSPLIT_OVERLAP], b.outs["unsplit"]):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        assert runner.stats["buckets"][t]["unsplit_choice"] == b.unsplit_choice
    assert UNSPLIT_OVERLAP in runner.describe()


@pytest.mark.parametrize("overlap_us, unsplit_choice", [
    (98.0, "unsplit"),  # inside the default min_gain (3 %)
    (90.0, UNSPLIT_OVERLAP)])
def test_the_faster_unsplit_graph_serves_and_equals_eager(monkeypatch, overlap_us, unsplit_choice):
    torch._dynamo.reset()
    model, runner = _runner({"unsplit_overlap": True, "split": "never"})
    monkeypatch.setattr(runner, "_time", lambda b, names: {
        n: {"unsplit": 100.0, UNSPLIT_OVERLAP: overlap_us}.get(n, 50.0) for n in names})
    runner.capture()
    b = runner.graphs[16]
    assert b.unsplit_choice == unsplit_choice and b.choice == "unsplit"
    assert set(b.graphs) == {"unsplit", unsplit_choice}  # the loser is dropped
    from dbo_compile.models.batch import fill_kv_cache, make_step
    step = make_step(get_config("tiny", num_layers=2), block_size=16, seed=3,
                     decode_context_lens=[5 + i for i in range(12)], prefills=[])
    fill_kv_cache(model, step, seed=3)
    eager, eager_kv = eager_then_restore(model, step)
    with torch.no_grad():
        out = runner(step.input_ids, step.positions, step.attn_metadata,
                     step.num_scheduled_tokens)
    assert runner.last_graph == unsplit_choice
    torch.testing.assert_close(out, eager[:step.num_tokens], rtol=1e-5, atol=1e-5)
    for c, e in zip(model.kv_caches(), eager_kv):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("overlap_us, split_us, choice, baseline_us", [
    (90.0, 88.0, "unsplit", 90.0),  # 2 % faster than the overlapped unsplit graph: not enough
    (90.0, 85.0, "split", 90.0),
    (98.0, 96.0, "split", 100.0)])  # overlap inside min_gain: the split races the serial one
def test_the_split_must_beat_the_better_unsplit_graph(monkeypatch, overlap_us, split_us, choice,
                                                      baseline_us):
    torch._dynamo.reset()
    _, runner = _runner({"unsplit_overlap": True, "decode_token_threshold": 2,
                         "prefill_token_threshold": 2, "schedule_candidates": False})
    monkeypatch.setattr(runner, "_time", lambda b, names: {
        n: {"unsplit": 100.0, UNSPLIT_OVERLAP: overlap_us}.get(n, split_us) for n in names})
    runner.capture()
    b = runner.graphs[16]
    assert ("split" if b.use_split else "unsplit") == choice
    assert b.t_unsplit_best_us == baseline_us


def test_off_by_default_and_outside_the_fingerprint():
    assert DboConfig().unsplit_overlap is False
    assert DboConfig(unsplit_overlap=False).fingerprint() == DboConfig().fingerprint()
    assert DboConfig(unsplit_overlap=True).fingerprint() != DboConfig().fingerprint()
    with pytest.raises(DboConfigError, match="unsplit_overlap"):
        DboConfig(unsplit_overlap=1)
    torch._dynamo.reset()
    _, runner = _runner({"split": "never"})
    runner.capture()
    b = runner.graphs[16]
    assert b.artifact.unsplit_overlap is None
    assert set(b.graphs) == {"unsplit"} and b.unsplit_choice == "unsplit" and not b.times_us
