"""What makes compile time linear and small (issue 17): one AOT trace per distinct decoder
layer, the schedule candidates sharing their units, linear-time event edges and list
scheduling, one GraphModule per distinct unit. Each is checked against the slow way it
replaced (same graph, same schedule, same numbers); speed itself is measured by
``benchmarks/compile_time.py``, never here."""

from __future__ import annotations

import collections
import logging
import random

import networkx as nx
import pytest
import torch
import torch.fx as fx

import dbo_compile.lowering as lowering
from dbo_compile.lowering import aot, aten
from conftest import last_artifact
from dbo_compile.errors import UnsplittableGraphError
from dbo_compile.models import deepseek
from dbo_compile.passes import stream_assign
from dbo_compile.passes.ordering import list_order
from dbo_compile.passes.pools import PoolState, check_escapes
from dbo_compile.schedule import COMM, COMPUTE, Timeline, Unit, predecessors
from dbo_compile.models.batch import fill_kv_cache
from moe_cases import MIXED_CUT, build, eager_and_compiled, eager_then_restore


def _lower_both(model, args, monkeypatch):
    """Lower ``model``'s Dynamo graph by layers and whole; the two graphs, the AOT trace
    counts and the example inputs."""
    out = {}
    traces = []
    real_trace = aot.trace

    def counting(gm, fakes):
        traces.append(sum(1 for n in gm.graph.nodes if n.op not in ("placeholder", "output")))
        return real_trace(gm, fakes)

    monkeypatch.setattr(aot, "trace", counting)

    def recorder(gm, example_inputs):
        specs = lowering.classify_inputs(gm, example_inputs)
        out["layers"] = lowering.lower_to_aten(gm, example_inputs, specs).gm
        out["layer_traces"] = list(traces)
        traces.clear()
        with monkeypatch.context() as m:
            m.setattr(aten, "trace_by_layers", lambda *a: None)
            out["whole"] = lowering.lower_to_aten(gm, example_inputs, specs).gm
        out["whole_traces"] = list(traces)
        out["inputs"] = list(example_inputs)
        out["dynamo_nodes"] = sum(1 for n in gm.graph.nodes if n.op not in ("placeholder", "output"))
        return gm.forward

    with torch.no_grad():
        torch.compile(model, backend=recorder)(*args)
    return out


def _ops(gm: fx.GraphModule) -> collections.Counter:
    return collections.Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


def test_identical_layers_are_traced_once_and_lower_to_the_whole_graph(monkeypatch):
    model, step = build(MIXED_CUT, layers=4)
    out = _lower_both(model, (step.input_ids, step.positions, step.attn_metadata), monkeypatch)
    # the prologue (embedding), one decoder layer, the epilogue (norm, lm_head): 3 traces of
    # small graphs instead of one of the whole
    assert len(out["layer_traces"]) == 3
    assert sum(out["layer_traces"]) < out["dynamo_nodes"] / 2
    assert out["whole_traces"] == [out["dynamo_nodes"]]
    assert _ops(out["layers"]) == _ops(out["whole"])
    results = []
    for name in ("layers", "whole"):
        for c in model.kv_caches():  # (the recording call wrote this step's keys already)
            c.zero_()
        with torch.no_grad():
            logits = out[name](*out["inputs"])[0]
        results.append((logits, [c.clone() for c in model.kv_caches()]))
    (a, ca), (b, cb) = results
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    for x, y in zip(ca, cb):  # each layer's KV-cache write lands in its own cache
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert all(x.count_nonzero() for x in ca)


def _dynamo_graph(model, args):
    """Dynamo's graph of ``model`` (as the backend receives it) and its example inputs."""
    seen = {}

    def recorder(gm, example_inputs):
        seen["gm"], seen["inputs"] = gm, list(example_inputs)
        return gm.forward

    with torch.no_grad():
        torch.compile(model, backend=recorder)(*args)
    return seen["gm"], seen["inputs"]


def _layer_runs(gm):
    """The decoder layers of ``gm``'s nodes in graph order, consecutive repeats merged."""
    runs = []
    for n in gm.graph.nodes:
        layer = lowering.layer_of(n) if n.op not in ("placeholder", "output") else None
        if layer is not None and (not runs or runs[-1] != layer):
            runs.append(layer)
    return runs


@pytest.mark.skipif(deepseek._decoder_layer_region is None,
                    reason="this torch's Dynamo does not reuse a compile region's trace")
def test_dynamo_traces_one_decoder_layer_and_the_backend_inlines_the_calls(monkeypatch):
    """The decoder layer is a compile region: Dynamo's graph calls one subgraph per layer, and
    inline_regions makes it the flat graph Dynamo traces without the region (same ops, each
    copy under its own layer's module path), with the same logits and KV-cache writes."""
    model, step = build(MIXED_CUT, layers=4)
    args = (step.input_ids, step.positions, step.attn_metadata)
    gm, inputs = _dynamo_graph(model, args)
    hop = torch.ops.higher_order.invoke_subgraph
    calls = list(gm.graph.find_nodes(op="call_function", target=hop))
    assert len(calls) == 4 and len({c.args[0].target for c in calls}) == 1  # traced once
    assert lowering.inline_regions(gm) == 4
    gm.recompile()
    assert not list(gm.graph.find_nodes(op="call_function", target=hop))
    assert not any(isinstance(m, fx.GraphModule) for m in gm.children())
    gm.graph.lint()
    torch._dynamo.reset()
    monkeypatch.setattr(deepseek, "_decoder_layer_region", None)
    flat, flat_inputs = _dynamo_graph(model, args)
    assert _ops(gm) == _ops(flat)
    assert _layer_runs(gm) == _layer_runs(flat) == [f"L['self'].layers.{i}" for i in range(4)]
    for n in gm.graph.nodes:  # a copy's submodules are its own layer's (layers.3.self_attn)
        paths = [p for p, *_ in (n.meta.get("nn_module_stack") or {}).values()]
        layer = lowering.layer_of(n)
        if layer is not None and n.op != "placeholder":
            assert all(p.startswith(layer) for p in paths[paths.index(layer):]), (n, paths)
    results = []
    for g, xs in ((gm, inputs), (flat, flat_inputs)):
        for c in model.kv_caches():
            c.zero_()
        with torch.no_grad():
            logits = g(*xs)[0]
        results.append((logits, [c.clone() for c in model.kv_caches()]))
    (a, ca), (b, cb) = results
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    for x, y in zip(ca, cb):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert all(x.count_nonzero() for x in ca)


def test_without_compile_regions_the_graph_is_inlined_to_nothing(monkeypatch):
    """Under ``dynamic=True`` (and on a torch whose Dynamo does not reuse regions) the layers
    are traced flat: nothing to inline, and the backend splits the graph as before."""
    model, step = build(MIXED_CUT, layers=2)
    torch._dynamo.reset()
    seen = {}

    def recorder(gm, example_inputs):
        seen["calls"] = lowering.inline_regions(gm)
        return gm.forward

    with torch.no_grad():
        torch.compile(model, backend=recorder, dynamic=True)(
            step.input_ids, step.positions, step.attn_metadata)
    assert seen["calls"] == 0


def _compiled_matches_eager(model, step, calls=1, before_call=None, on_graph=None):
    """Compile ``model`` with the default options; per call (``before_call(k)`` first) the
    logits equal eager's; returns the artifacts. ``on_graph(gm)`` (if given) sees each Dynamo
    graph before the backend does (one Dynamo trace for both)."""
    from dbo_compile.backend import compiled_artifacts, dbo_backend, reset_artifacts

    torch._dynamo.reset()
    reset_artifacts()
    options = {"split": "always"}
    if on_graph is None:
        compiled = torch.compile(model, backend="dbo", options=options)
    else:
        def backend(gm, example_inputs):
            on_graph(gm)
            return dbo_backend(gm, example_inputs, options=options)

        compiled = torch.compile(model, backend=backend)
    for k in range(calls):
        if before_call is not None:
            before_call(k)
        eager, _ = eager_then_restore(model, step)
        with torch.no_grad():
            out = compiled(step.input_ids, step.positions, step.attn_metadata)
        torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    return compiled_artifacts()


def test_more_distinct_layers_than_dynamo_reuses_by_default_compile():
    """Each layer reads a constant of its own (10 variants of the region; Dynamo keeps 8 by
    default and raised at the 9th): every layer traced, split, right."""
    model, step = build(MIXED_CUT, layers=10)
    for i, layer in enumerate(model.layers):
        layer.mlp.routed_scaling_factor = 1.0 + 0.1 * i
    arts = _compiled_matches_eager(model, step)
    assert len(arts) == 1 and arts[0].is_split


def test_a_float_attribute_that_changes_between_calls():
    """A float attribute the region reads changes: Dynamo recompiles with it as a tensor, and
    its stamp-out of the reused region passes the later layers the float itself; the inlining
    reads the float where the subgraph read the tensor (a crash before). Two layers: the
    second is the stamp-out."""
    model, step = build(MIXED_CUT, layers=2)

    def scale(k):
        for layer in model.layers:
            layer.mlp.routed_scaling_factor = 1.5 + 0.5 * k

    arts = _compiled_matches_eager(model, step, calls=3, before_call=scale)
    assert all(a.is_split for a in arts)


def test_dense_first_layers_are_a_second_kind_of_region(monkeypatch):
    """``first_k_dense_replace=2`` (DeepSeek-V2/V3's dense first layers; building it failed
    before: the dense MLP's ``w13`` was taken for routed experts): two layer kinds, two
    traces under regions, split, eager's answer."""
    cfg = deepseek.get_config("tiny", num_layers=5, first_k_dense_replace=2)
    model = deepseek.DeepseekMoEModel(cfg, seed=0)
    assert model.routed_expert_params() == {f"layers.{i}.mlp.{w}" for i in (2, 3, 4)
                                            for w in ("w13", "w2")}
    _, step = build(MIXED_CUT, layers=5)
    model.allocate_kv_cache(step.num_blocks, step.block_size)
    fill_kv_cache(model, step, seed=0)
    seen = []

    def regions(gm):  # Dynamo's graph, before the backend inlines its regions
        calls = list(gm.graph.find_nodes(op="call_function",
                                         target=torch.ops.higher_order.invoke_subgraph))
        seen.append((len(calls), len({c.args[0].target for c in calls})))

    arts = _compiled_matches_eager(model, step, on_graph=regions)
    if deepseek._decoder_layer_region is not None:
        (counts,) = seen
        assert counts[0] == 5 and counts[1] == 2
    assert len(arts) == 1 and arts[0].is_split


class _BreakingMoE(deepseek.MoE):
    def route(self, x):
        topk = super().route(x)
        torch._dynamo.graph_break()  # a host read, a print: Dynamo cuts the graph here
        return topk


def test_a_layer_that_breaks_the_graph_compiles_without_regions():
    """A region refuses a graph break inside it; ``compile_regions=False`` traces the layers
    flat: the pieces compile (the ones without a comm op unsplit) and the answer is eager's."""
    cfg = deepseek.get_config("tiny", num_layers=2)
    model = deepseek.DeepseekMoEModel(cfg, seed=0, compile_regions=False)
    _, step = build(MIXED_CUT, layers=2)
    model.allocate_kv_cache(step.num_blocks, step.block_size)
    fill_kv_cache(model, step, seed=0)
    for layer in model.layers:
        layer.mlp.__class__ = _BreakingMoE
    arts = _compiled_matches_eager(model, step)
    assert len(arts) > 1 and any(a.is_split for a in arts)


class _SharedStateLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x, acc):
        acc.add_(1.0)  # every layer writes the model's one buffer
        return torch.relu(x @ self.w) + acc


class _SharedStateModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(_SharedStateLayer() for _ in range(3))
        self.register_buffer("acc", torch.zeros(8))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x, self.acc)
        return x


def test_layers_writing_a_shared_input_are_lowered_as_one_graph(monkeypatch, caplog):
    model = _SharedStateModel()
    x = torch.randn(5, 8)
    with torch.no_grad():
        expected = _SharedStateModel.forward(model, x.clone())
    model.acc.zero_()
    with caplog.at_level(logging.INFO, logger="dbo_compile.lowering"):
        out = _lower_both(model, (x,), monkeypatch)
    assert "lowering the whole graph at once" in caplog.text
    assert "mutates" in caplog.text
    assert _ops(out["layers"]) == _ops(out["whole"])
    model.acc.zero_()
    with torch.no_grad():
        got = out["layers"](*out["inputs"])[0]
    torch.testing.assert_close(got, expected)


def test_a_graph_without_repeated_layers_is_traced_whole(monkeypatch):
    model, step = build(MIXED_CUT, layers=1)
    out = _lower_both(model, (step.input_ids, step.positions, step.attn_metadata), monkeypatch)
    assert out["layer_traces"] == [out["dynamo_nodes"]]


def _reference_event_edges(units, deps):
    """The transitive reduction by networkx, as stream_assign computed it before issue 17."""
    g = nx.DiGraph()
    g.add_nodes_from(u.id for u in units)
    last = {}
    for u in units:
        if u.stream in last:
            g.add_edge(last[u.stream], u.id)
        last[u.stream] = u.id
    stream = {u.id: u.stream for u in units}
    g.add_edges_from(sorted(deps))
    reduced = nx.transitive_reduction(g)
    return sorted((a, b) for a, b in reduced.edges if stream[a] != stream[b])


def _random_units(rng, n, p):
    units = [Unit(i, "x", rng.choice([COMPUTE, COMM]), rng.choice([None, 0, 1]), "A", 0, [],
                  round(rng.uniform(0, 10), 1)) for i in range(n)]
    for u in units:
        u.kind = u.stream
    deps = [(a, b) for a in range(n) for b in range(a + 1, n) if rng.random() < p]
    return units, deps + rng.sample(deps, min(len(deps), 2))  # and some duplicates


def test_event_edges_equal_the_transitive_reduction():
    rng = random.Random(0)
    for _ in range(400):
        units, deps = _random_units(rng, rng.randint(1, 24), rng.random() * 0.5)
        assert stream_assign.minimal_event_edges(units, deps) == _reference_event_edges(units, deps)


def _reference_list_order(units, deps, plan):
    """The list scheduler as it was before issue 17 (with issue 18's result pools): a min over
    the ready list of a key that recomputes every start time."""
    preds = predecessors(units, deps)
    succs = {u.id: [] for u in units}
    for a, b in deps:
        succs[a].append(b)
    missing = {u.id: len(preds[u.id]) for u in units}
    ready = sorted(i for i, m in missing.items() if m == 0)
    timeline = Timeline(preds)
    by_id = {u.id: u for u in units}
    check_escapes(plan, by_id)
    pools = PoolState(plan, by_id)
    placed, dep_set = set(), set(deps)
    bottom = {}
    dag = nx.DiGraph(sorted(deps))
    dag.add_nodes_from(by_id)
    for i in reversed(list(nx.lexicographical_topological_sort(dag))):
        bottom[i] = by_id[i].cost_us + by_id[i].latency_us + max(
            (bottom[s] for s in succs[i]), default=0.0)

    def key(i):
        u = by_id[i]
        return (round(timeline.start_of(u, pools.needs(i)), 6), 0 if u.kind == COMM else 1,
                -round(bottom[i], 6), -1 if u.ubatch is None else u.ubatch, i)

    order = []
    while ready:
        candidates = [i for i in ready if pools.ready(i, placed)]
        if not candidates:
            raise UnsplittableGraphError(pools.infeasible(ready, placed, 2))
        best = min(candidates, key=key)
        ready.remove(best)
        timeline.place(by_id[best], pools.needs(best))
        pools.place(best, dep_set)
        order.append(best)
        placed.add(best)
        for s in succs[best]:
            missing[s] -= 1
            if missing[s] == 0:
                ready.append(s)
    return order, pools.added


def _random_pool(rng, units, deps):
    """A result pool over some of the comm units (limits at random; readers: their users)."""
    plan = stream_assign.PoolPlan()
    comms = [u.id for u in units if u.kind == COMM]
    if comms and rng.random() < 0.7:
        plan.pools["s|p|"] = {"live": rng.choice([None, 1, 2, 3]),
                              "in_flight": rng.choice([None, 1, 2])}
        for c in comms:
            if rng.random() < 0.8:
                plan.pool_of[c] = "s|p|"
                plan.readers[c] = {b for a, b in deps if a == c}
    return plan


def _order_or_why(order, *args):
    try:
        return order(*args)
    except UnsplittableGraphError as e:
        return str(e)


def test_list_order_equals_the_ready_list_scan():
    rng = random.Random(1)
    outcomes = collections.Counter()
    for _ in range(600):
        units, deps = _random_units(rng, rng.randint(1, 30), rng.random() * 0.3)
        if rng.random() < 0.3:  # ties in start times
            for u in units:
                u.cost_us = float(rng.randint(0, 2))
        for u in units:  # a transfer in flight after the issue (a backend with a receive)
            u.latency_us = rng.choice([0.0, 0.0, 3.0]) if u.kind == COMM else 0.0
        plan = _random_pool(rng, units, deps)
        got = _order_or_why(list_order, units, deps, plan, 2)
        assert got == _order_or_why(_reference_list_order, units, deps, plan)
        outcomes["infeasible" if isinstance(got, str) else "pool edges" if got[1] else "plain"] += 1
    assert min(outcomes.values()) > 50, outcomes  # every kind of outcome was compared


def test_units_computing_the_same_share_one_graph_module():
    model, step = build(MIXED_CUT, layers=3)
    eager, out, eager_caches, caches = eager_and_compiled(
        model, step, {"split": "always", "compute_backend": "aten", "link_gbps": 0.5})
    art = last_artifact()
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    for a, b in zip(caches, eager_caches):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    program = art.split_program
    distinct = {id(fn) for fn in program.units}
    # the two ubatches' copies of a stage, and the stage in every layer, are one module
    assert len(distinct) < len(program.units) / 2
    labels = {}
    for unit, fn in zip(program.schedule.units, program.units):
        labels.setdefault(unit.label, set()).add(id(fn))
    assert len(labels["D"]) == 1 and len(labels["C"]) == 1
    # every candidate program shares them too (the joined graph's unjoined stages included)
    every = {id(fn) for p in art.candidates.values() for fn in p.units}
    assert len(every) < sum(len(p.units) for p in art.candidates.values()) / 4


def test_candidates_share_one_unit_graph_per_split_graph(monkeypatch):
    calls = []
    real = stream_assign.unit_graph

    def counting(graph):
        calls.append(id(graph))
        return real(graph)

    monkeypatch.setattr(stream_assign, "unit_graph", counting)
    model, step = build(MIXED_CUT, layers=2)
    eager, out, _, _ = eager_and_compiled(model, step, {"split": "always", "link_gbps": 0.5,
                                                        "schedule_candidates": True})
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    art = last_artifact()
    assert sum(k.startswith("stream_assign[") for k in art.compile_times) == 8  # candidates
    assert len(calls) == len(set(calls)) == 2  # the unjoined and the joined split graph


#: step shapes that cross 0/1 in the request count or the block-table width (issue 17):
#: (decode context lengths, prefills (context, query))
SWEEP = [
    ([], []),                       # no request (a DP rank without work)
    ([5], []),                      # 1 decode, block table 1 wide
    ([40], []),                     # 1 decode, 3 wide
    ([], [(0, 7)]),                 # 1 prefill
    ([3, 9], []),                   # 2 decodes, 1 wide
    ([3, 90], []),                  # 2 decodes, 6 wide
    ([10 + i for i in range(40)], []),  # many decodes (splits)
    ([5, 60], [(0, 12)]),           # mixed
    ([], [(0, 1)]),                 # a 1-token prefill
    ([2], [(16, 9)]),               # mixed, chunked prefill
    ([1] * 33, []),                 # many decodes, 1 wide (splits)
    ([], [(0, 40), (0, 30)]),       # 2 prefills
]


@pytest.mark.parametrize("through", ["run_step", "runner"])
def test_one_dynamo_graph_serves_every_step_shape(through):
    """Before issue 17 this sweep compiled 5 Dynamo graphs through run_step (Dynamo
    specialised request counts and block-table widths of 0 and 1); now 1. Through the runner
    (its buckets pad every step to fixed shapes; a step beyond them runs run_step) it stays 1."""
    from dbo_compile.backend import compiled_artifacts
    from dbo_compile.models.batch import fill_kv_cache, make_step
    from dbo_compile.models.deepseek import DeepseekMoEModel, get_config
    from dbo_compile.runtime.engine import run_step
    from dbo_compile.runtime.cudagraph_runner import CudaGraphRunner
    from moe_cases import eager_then_restore

    cfg = get_config("tiny", num_layers=1)
    model = DeepseekMoEModel(cfg, seed=0)
    model.allocate_kv_cache(320, 16)
    compiled = torch.compile(model, backend="dbo", options={
        "decode_token_threshold": 32, "compute_backend": "aten"})
    runner = None
    if through == "runner":
        runner = CudaGraphRunner(compiled, [16, 48], max_blocks_per_req=8, block_size=16,
                                 timing_iters=1, device="cpu")
        runner.capture()
    splits = 0
    for i, (dec, pre) in enumerate(SWEEP):
        step = make_step(cfg, decode_context_lens=dec, prefills=pre, block_size=16,
                         num_blocks=320, seed=i)
        fill_kv_cache(model, step, seed=i)
        eager, _ = eager_then_restore(model, step)
        with torch.no_grad():
            args = (step.input_ids, step.positions, step.attn_metadata, step.num_scheduled_tokens)
            out = runner(*args) if runner else run_step(compiled, *args, block_size=16)
        assert out.shape[0] == step.num_tokens
        if step.num_tokens:
            torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
        splits = compiled_artifacts()[-1].stats.split_steps
    assert len(compiled_artifacts()) == 1, [type(a).__name__ for a in compiled_artifacts()]
    assert compiled_artifacts()[0].split_program is not None
    if runner is None:
        assert splits == 2  # the two decode steps of >= 32 tokens
