"""``compute_backend="inductor"``: the stages of the split program and the unsplit program
compiled by Inductor (CPU: C++ kernels), checked against eager and against the ATen backend."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

import moe_cases as mc
from conftest import last_artifact
from dbo_compile.codegen import inductor as ind
from dbo_compile.runtime.context import traced_only
from dbo_compile.codegen.inductor import InductorStage
from dbo_compile.errors import UBatchExecutionError
from dbo_compile.schedule import COMM


def _stages(art) -> list[InductorStage]:
    return list({id(fn): fn for p in art.candidates.values() for fn in p.units
                 if isinstance(fn, InductorStage)}.values())


@pytest.fixture(scope="module")
def compiled_split():
    """One tiny MoE layer, a step that cuts a prefill between the ubatches, split always; the
    compiled model is called twice from the same KV state (tests reset Dynamo between them,
    so everything is done here)."""
    torch._dynamo.reset()
    model, step = mc.build(mc.MIXED_CUT, layers=1)
    eager, eager_kv = mc.eager_then_restore(model, step)
    saved = [c.clone() for c in model.kv_caches()]
    compiled = torch.compile(model, backend="dbo",
                             options={"split": "always", "compute_backend": "inductor"})
    runs = []
    with torch.no_grad():
        for _ in range(2):
            out = compiled(step.input_ids, step.positions, step.attn_metadata)
            art = last_artifact()
            runs.append(dict(out=out, kv=[c.clone() for c in model.kv_caches()], art=art,
                             compiled=[len(s.compiled) for s in _stages(art)],
                             compiles=_stages(art)[0].cache.compiles,
                             split_steps=art.stats.split_steps))
            for c, s in zip(model.kv_caches(), saved):
                c.copy_(s)
    return eager, eager_kv, runs


def test_split_program_matches_eager(compiled_split):
    eager, eager_kv, runs = compiled_split
    assert runs[0]["split_steps"] == 1
    torch.testing.assert_close(runs[0]["out"], eager, rtol=1e-5, atol=1e-5)
    for a, b in zip(runs[0]["kv"], eager_kv):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_compute_units_are_inductor_stages_comm_units_are_not(compiled_split):
    art = compiled_split[2][0]["art"]
    assert isinstance(art.unsplit, InductorStage)
    for program in art.candidates.values():
        for unit, fn in zip(program.schedule.units, program.units):
            if unit.stream == COMM:
                assert isinstance(fn, fx.GraphModule), unit.name
            else:
                assert isinstance(fn, InductorStage), unit.name
    # a unit with the same nodes in several schedule variants of one graph is one stage,
    # compiled once; the joined-experts variants schedule another graph
    plain = [p for n, p in art.candidates.items() if not n.endswith("+join")]
    per_variant = [sum(isinstance(fn, InductorStage) for fn in p.units) for p in plain]
    shared = {id(fn) for p in plain for fn in p.units if isinstance(fn, InductorStage)}
    assert len(plain) > 1 and len(shared) == per_variant[0] < sum(per_variant)
    joined = [p for n, p in art.candidates.items() if n.endswith("+join")]
    assert joined and all(len(p.units) < len(plain[0].units) for p in joined)
    compiled = compiled_split[2][0]["compiled"]  # the run used the primary ("list") only
    assert compiled.count(1) == per_variant[0] and set(compiled) <= {0, 1}


def test_stages_computing_the_same_program_share_one_compilation(compiled_split):
    """The ubatches' copies of a stage (and the same stage in other layers, whose weights are
    graph inputs) are one program: Inductor compiles it once per input signature for all of
    them, and calling the shared code again compiles nothing."""
    runs = compiled_split[2]
    stages = _stages(runs[0]["art"])
    cache = stages[0].cache
    assert all(s.cache is cache for s in stages)
    calls = sum(runs[0]["compiled"])  # (stage, signature) pairs met in the first step
    distinct = {id(fn) for s in stages for fn in s.compiled.values()}
    assert cache.compiles == len(distinct) < calls
    assert cache.compiles + cache.reused == calls
    # the two ubatches' MLP stages of layer 0 see 32 tokens each: same program and signature
    mlp = [fn for p in [runs[0]["art"].split_program]
           for u, fn in zip(p.schedule.units, p.units) if u.label == "MLP"]
    assert len(mlp) == 2 and mlp[0] is not mlp[1]
    assert list(mlp[0].compiled.values())[0] is list(mlp[1].compiled.values())[0]
    assert runs[1]["compiles"] == runs[0]["compiles"]


def test_stage_graphs_carry_no_stream_annotation_split_graph_keeps_it(compiled_split):
    art = compiled_split[2][0]["art"]
    for s in _stages(art):
        assert all("stream" not in n.meta.get("custom", {}) for n in s.gm.graph.nodes)
    annotated = [n for n in art.split_gm.graph.nodes if "stream" in n.meta.get("custom", {})]
    assert annotated, "stream_assign's annotations on the split graph must survive"


def test_same_shapes_run_again_without_recompiling(compiled_split):
    first, second = compiled_split[2]
    assert second["art"] is first["art"] and second["split_steps"] == 2
    assert second["compiled"] == first["compiled"]
    torch.testing.assert_close(second["out"], first["out"], rtol=0, atol=0)
    for a, b in zip(second["kv"], first["kv"]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_unsplit_program_matches_eager():
    torch._dynamo.reset()
    model, step = mc.build(mc.DECODE_64, layers=1)
    eager, out, eager_kv, out_kv = mc.eager_and_compiled(
        model, step, {"split": "never", "compute_backend": "inductor"})
    art = last_artifact()
    assert art.stats.unsplit_steps == 1 and isinstance(art.unsplit, InductorStage)
    assert len(art.unsplit.compiled) == 1
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    for a, b in zip(out_kv, eager_kv):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


class NoComm(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.lin(x)) * 2


def test_unsplittable_graph_still_compiles_with_inductor(caplog):
    torch._dynamo.reset()
    m = NoComm()
    x = torch.randn(5, 8)
    out = torch.compile(m, backend="dbo", options={"compute_backend": "inductor"})(x)
    art = last_artifact()
    assert isinstance(art.unsplit, InductorStage) and len(art.unsplit.compiled) == 1
    assert "no comm op" in art.reason
    torch.testing.assert_close(out, m(x))
    with pytest.raises(Exception, match="UnsplittableGraphError: the graph has no comm op"):
        torch.compile(NoComm(), backend="dbo",
                      options={"compute_backend": "inductor", "on_unsplittable": "raise"}
                      )(torch.randn(5, 8))


def test_first_signature_during_capture_raises_instead_of_compiling(monkeypatch):
    gm = fx.symbolic_trace(NoComm())
    stage = InductorStage(gm, "unit 7 (test)")
    monkeypatch.setattr(ind, "_capturing", lambda args: True)
    with pytest.raises(UBatchExecutionError, match=r"unit 7 .*first time during CUDA-graph capture"):
        stage(torch.randn(3, 8))
    assert not stage.compiled


def test_device_defaults_inductor_and_carveout_on_cuda_aten_elsewhere():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dbo_compile import DboConfig
    from dbo_compile.passes.pipeline import resolve_device_defaults as _resolve_device_defaults

    with FakeTensorMode():
        on_gpu = torch.empty(4, 8, device="cuda")
    assert DboConfig().compute_backend == "auto" and DboConfig().sm_carveout_candidates is None
    gpu = _resolve_device_defaults(DboConfig(), [on_gpu, 3])
    carve = (16,) if hasattr(torch._C, "_set_sm_carveout_experimental") else ()
    assert (gpu.compute_backend, gpu.sm_carveout_candidates) == ("inductor", carve)
    cpu = _resolve_device_defaults(DboConfig(), [torch.ones(4, 8)])
    assert (cpu.compute_backend, cpu.sm_carveout_candidates) == ("aten", ())
    forced = _resolve_device_defaults(
        DboConfig(compute_backend="aten", sm_carveout_candidates=(8, 24)), [on_gpu])
    assert (forced.compute_backend, forced.sm_carveout_candidates) == ("aten", (8, 24))
    # the default on CPU runs the traced ATen ops
    torch._dynamo.reset()
    model, step = mc.build(mc.DECODE_64, layers=1)
    mc.eager_and_compiled(model, step, {"split": "always"})
    art = last_artifact()
    assert art.config.compute_backend == "aten" and art.config.sm_carveout_candidates == ()
    assert not any("+sms" in name for name in art.candidates)
    assert not any(isinstance(fn, InductorStage) for fn in art.split_program.units)
    assert isinstance(art.unsplit, fx.GraphModule)


def test_stage_stops_compiling_after_max_signatures_and_stays_correct(monkeypatch, caplog):
    monkeypatch.setattr(ind, "MAX_SIGNATURES", 2)
    m = NoComm()
    stage = InductorStage(fx.symbolic_trace(m), "unit 3 (test)")
    with caplog.at_level("WARNING", logger="dbo_compile"):
        for rows in (3, 5, 7, 9, 3):
            x = torch.randn(rows, 8)
            torch.testing.assert_close(stage(x), m(x))
    assert len(stage.compiled) == 2 and stage.uncompiled_calls == 2
    warned = [r for r in caplog.records if "compiled by Inductor for 2 input signatures" in r.message]
    assert len(warned) == 1 and "compute_backend='aten'" in warned[0].message


def _counting_inductor(monkeypatch) -> list:
    """Replace Inductor by the traced graph (fast); the returned list gets one entry per
    compilation."""
    import torch._inductor

    calls = []

    def fake_compile(gm, inputs):
        calls.append(gm)
        return gm.forward

    monkeypatch.setattr(torch._inductor, "compile", fake_compile)
    return calls


def _renamed_trace(m: nn.Module, suffix: str) -> fx.GraphModule:
    gm = fx.symbolic_trace(m)
    for n in gm.graph.nodes:
        if n.op != "output":
            n._rename(n.name + suffix)
    gm.recompile()
    return gm


def test_stages_share_a_compilation_only_for_the_same_program_weights_and_signature(monkeypatch):
    calls = _counting_inductor(monkeypatch)
    m, other = NoComm(), NoComm()
    cache = ind.StageCache()
    a = InductorStage(_renamed_trace(m, "_u0"), "unit 1 (L0.A0)", cache)
    b = InductorStage(_renamed_trace(m, "_u1"), "unit 2 (L0.A1)", cache)  # names differ only
    c = InductorStage(_renamed_trace(other, "_u1"), "unit 3 (L1.A1)", cache)  # other weights
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    torch.testing.assert_close(a(x), m(x))
    torch.testing.assert_close(b(y), m(y))
    assert len(calls) == 1 and (cache.compiles, cache.reused) == (1, 1)
    assert list(b.compiled.values()) == list(a.compiled.values())
    torch.testing.assert_close(c(y), other(y))  # its own weights, its own compilation
    assert len(calls) == 2
    b(torch.randn(6, 8))  # another signature: compiled again
    assert (cache.compiles, cache.reused) == (3, 1)
    # inputs that alias each other are another program for Inductor (it may assume not)
    twice = InductorStage(fx.symbolic_trace(lambda p, q: p.add_(1) + q), "unit 4 (X0)", cache)
    twin = InductorStage(fx.symbolic_trace(lambda p, q: p.add_(1) + q), "unit 5 (X1)", cache)
    twice(torch.zeros(4), torch.zeros(4))
    z = torch.zeros(4)
    torch.testing.assert_close(twin(z, z), torch.full((4,), 2.0))
    assert cache.compiles == 5


def test_traced_only_runs_new_signatures_without_compiling(monkeypatch):
    calls = _counting_inductor(monkeypatch)
    m = NoComm()
    stage = InductorStage(fx.symbolic_trace(m), "unit 6 (test)", ind.StageCache())
    x = torch.randn(5, 8)
    with traced_only():
        torch.testing.assert_close(stage(x), m(x))
    assert not calls and not stage.compiled and stage.uncompiled_calls == 0
    stage(x)  # outside the block the signature compiles as usual
    assert len(calls) == 1 and len(stage.compiled) == 1
    with traced_only():  # a signature compiled before keeps its compiled code
        stage(x)
    assert len(calls) == 1


class TwoOut(nn.Module):
    def forward(self, x):
        return torch.relu(x), x * 3


@pytest.mark.parametrize("cls", [NoComm, TwoOut])
def test_stage_returns_what_the_traced_graph_returns_for_every_signature(cls):
    m = cls()
    stage = InductorStage(fx.symbolic_trace(m), "unit 4 (test)")
    for rows in (3, 5):
        x = torch.randn(rows, 8)
        got, want = stage(x), m(x)
        assert type(got) is type(want)  # noqa: E721 - tensor stays tensor, tuple stays tuple
        torch.testing.assert_close(got, want)
    assert len(stage.compiled) == 2
    torch.testing.assert_close(stage.gm(torch.ones(2, 8)), m(torch.ones(2, 8)))  # graph untouched


@pytest.mark.parametrize("split", ["always", "never"])
def test_call_with_grad_enabled_compiles_an_inference_graph(split):
    torch._dynamo.reset()
    model, step = mc.build(mc.MIXED_CUT, layers=1)
    eager, _ = mc.eager_then_restore(model, step)
    compiled = torch.compile(model, backend="dbo",
                             options={"split": split, "compute_backend": "inductor"})
    out = compiled(step.input_ids, step.positions, step.attn_metadata)  # grad mode on
    art = last_artifact()
    assert (art.stats.split_steps if split == "always" else art.stats.unsplit_steps) == 1
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)


class AddsStep(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, step: int):  # an int value, not a size (a decode step counter)
        return torch.relu(self.lin(x)) + step


def test_int_value_input_runs_aten_instead_of_compiling_every_value(caplog):
    torch._dynamo.reset()
    m = AddsStep()
    compiled = torch.compile(m, backend="dbo", options={"compute_backend": "inductor"})
    x = torch.randn(4, 8)
    with caplog.at_level("WARNING", logger="dbo_compile"):  # grad mode on
        for step in range(6):
            out = compiled(x, step)
            assert not out.requires_grad  # the ATen fallback records no autograd history
            with torch.no_grad():
                torch.testing.assert_close(out, m(x, step))
    stage = last_artifact().unsplit  # Dynamo made `step` a SymInt input after its second value
    assert isinstance(stage, InductorStage) and stage.aten_reason is not None
    assert not stage.compiled and stage.uncompiled_calls >= 4
    assert any("values, not tensor sizes" in r.message for r in caplog.records)


def test_carveout_candidates_are_deduplicated():
    from dbo_compile import DboConfig

    assert DboConfig(sm_carveout_candidates=[16, 8, 16]).sm_carveout_candidates == (16, 8)


# -- symbolic sizes: one compilation for every bucket (issue 26) ------------------------------


def _rows_and_count(w, x, n):
    """``x``: [T, 8] rows; ``n``: T, a size the graph also takes (as a ubatch's row count)."""
    y = torch.relu(x @ w) + 1
    return y.view(n, 2, 4).sum(1), x[: n // 2]


def _symbolic_stage(name="unit 1 (L0.A0)", cache=None):
    from torch.fx.experimental.proxy_tensor import make_fx

    w = torch.randn(8, 8)
    gm = make_fx(_rows_and_count, tracing_mode="symbolic")(w, torch.randn(6, 8), 6)
    return w, InductorStage(gm, name, cache)


def _inductor_seeing_inputs(monkeypatch, guard=None) -> list:
    """Replace Inductor by the traced graph; the returned list gets the example inputs of each
    compilation. ``guard(inputs)``: a size test run at compile time (as Inductor's lowering
    tests sizes), which the shape env records as a guard."""
    import torch._inductor

    seen = []

    def fake_compile(gm, inputs):
        seen.append(inputs)
        if guard is not None:
            guard(inputs)
        return gm.forward

    monkeypatch.setattr(torch._inductor, "compile", fake_compile)
    return seen


def test_symbolic_sizes_compile_once_for_every_row_count(monkeypatch):
    seen = _inductor_seeing_inputs(monkeypatch)
    w, stage = _symbolic_stage()
    for rows in (6, 10, 4, 7, 12):
        x = torch.randn(rows, 8)
        torch.testing.assert_close(stage(w, x, rows), _rows_and_count(w, x, rows))
    assert len(seen) == 1 and stage.cache.compiles == 1
    _, x, n = seen[0]
    assert isinstance(x.shape[0], torch.SymInt) and isinstance(n, torch.SymInt)
    assert x.shape[1] == 8 and tuple(seen[0][0].shape) == (8, 8)  # the rest stays static
    assert len(stage.compiled) == 5 and set(stage.kinds.values()) == {"dynamic"}


def test_a_signature_the_guards_refuse_compiles_for_its_static_shapes(monkeypatch):
    seen = _inductor_seeing_inputs(monkeypatch, guard=lambda inputs: bool(inputs[1].shape[0] > 4))
    w, stage = _symbolic_stage()
    for rows in (8, 6, 3, 10):
        x = torch.randn(rows, 8)
        torch.testing.assert_close(stage(w, x, rows), _rows_and_count(w, x, rows))
    assert len(seen) == 2
    assert not isinstance(seen[1][1].shape[0], torch.SymInt)  # 3 rows: static
    assert [stage.kinds[k] for k in stage.compiled] == ["dynamic", "dynamic", "static", "dynamic"]


def test_stages_of_one_program_share_the_symbolic_compilation(monkeypatch):
    seen = _inductor_seeing_inputs(monkeypatch)
    cache = ind.StageCache()
    w, a = _symbolic_stage("unit 1 (u0.L0.A0)", cache)
    b = InductorStage(a.gm, "unit 2 (u1.L0.A0)", cache)  # the other ubatch's copy
    a(w, torch.randn(6, 8), 6)
    b(w, torch.randn(10, 8), 10)
    assert len(seen) == 1 and (cache.compiles, cache.reused) == (1, 1)
    assert b.kinds[next(iter(b.kinds))] == "dynamic"


def test_static_stages_and_the_recorded_kinds(monkeypatch):
    from dbo_compile.runtime.context import record_stage_calls, static_stages

    seen = _inductor_seeing_inputs(monkeypatch)
    monkeypatch.setattr(ind, "MAX_SIGNATURES", 1)
    w, stage = _symbolic_stage()
    with record_stage_calls() as kinds:
        stage(w, torch.randn(6, 8), 6)
    assert kinds == {"unit 1 (L0.A0)": "dynamic"}
    with record_stage_calls() as kinds, static_stages():
        stage(w, torch.randn(10, 8), 10)  # as vLLM's compile_sizes: its own compilation
    assert kinds == {"unit 1 (L0.A0)": "static"} and len(seen) == 2
    assert not isinstance(seen[1][1].shape[0], torch.SymInt)
    with record_stage_calls() as kinds, static_stages():
        stage(w, torch.randn(12, 8), 12)  # past MAX_SIGNATURES static compilations: ATen
        stage(w, torch.randn(6, 8), 6)  # a later compiled call does not hide the fallback
    assert kinds == {"unit 1 (L0.A0)": "aten"} and len(seen) == 2


def test_symbolic_stage_with_inductor_matches_the_traced_graph():
    """Real Inductor (CPU C++): one symbolic-size compilation, its guards checked per call."""
    w, stage = _symbolic_stage()
    for rows in (6, 10, 7):
        x = torch.randn(rows, 8)
        torch.testing.assert_close(stage(w, x, rows), _rows_and_count(w, x, rows))
    assert stage.cache.compiles == 1 and set(stage.kinds.values()) == {"dynamic"}
