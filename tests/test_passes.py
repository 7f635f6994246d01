"""Pass behaviour on the FX graphs of the tiny MoE model (single process, local comm ops)."""

from __future__ import annotations

import networkx as nx
import pytest
import torch
import torch.fx as fx

from conftest import last_artifact
from dbo_compile.ops.registry import comm_kind
from dbo_compile.ops.registry import is_wait
from dbo_compile.passes.meta import dbo_meta
from dbo_compile.schedule import COMM, COMPUTE, STREAM_INDEX
from moe_cases import MIXED_CUT, build, eager_and_compiled


@pytest.fixture(scope="module")
def compiled_3layer():
    torch._dynamo.reset()
    model, step = build(MIXED_CUT, layers=3)
    # cost figures of a comm-heavy link (the regime DBO is for): all-to-all ~ a compute stage
    eager, out, _, _ = eager_and_compiled(model, step, {"split": "always", "link_gbps": 0.5})
    art = last_artifact()
    return art, eager, out


def _count_comm(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if comm_kind(n) is not None)


@pytest.mark.quick
def test_split_doubles_comm_ops(compiled_3layer):
    art, _, _ = compiled_3layer
    n = _count_comm(art.lowered_gm)
    assert n == 6  # 3 layers x (dispatch + combine)
    assert _count_comm(art.split_gm) == 2 * n
    per_ubatch = {}
    for node in art.split_gm.graph.nodes:
        if comm_kind(node):
            per_ubatch.setdefault(dbo_meta(node)["ubatch"], []).append(node)
    assert sorted(per_ubatch) == [0, 1] and all(len(v) == n for v in per_ubatch.values())


@pytest.mark.quick
def test_each_ubatch_reads_only_its_slice_and_shared_weights(compiled_3layer):
    art, _, _ = compiled_3layer
    graph = art.split_gm.graph
    placeholders = {n: dbo_meta(n).get("ubatch") for n in graph.nodes if n.op == "placeholder"}
    # weights and KV caches appear once (shared), per-ubatch inputs once per ubatch
    shared = [n for n, u in placeholders.items() if u is None]
    assert len(shared) == len({n.name for n in shared})
    roots: dict[fx.Node, set] = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            roots[node] = {node}
            continue
        acc = set()
        for a in node.all_input_nodes:
            acc |= roots[a]
        roots[node] = acc
        u = dbo_meta(node).get("ubatch")
        if node.op == "output" or u is None:
            continue
        foreign = {p.name for p in acc if placeholders[p] not in (None, u)}
        assert not foreign, f"{node.name} (ubatch {u}) reads {foreign}"
    # weights are graph inputs used by both ubatches, never copied into the split module
    assert sum(1 for _ in art.split_gm.parameters()) == 0
    w = next(n for n, u in placeholders.items()
             if u is None and n.meta["val"].dim() == 3)  # a stacked expert weight
    assert {dbo_meta(user).get("ubatch") for user in w.users} <= {None, 0, 1}


@pytest.mark.quick
def test_every_comm_op_has_issue_and_wait_on_comm_stream(compiled_3layer):
    art, _, _ = compiled_3layer
    for node in art.split_gm.graph.nodes:
        if comm_kind(node):
            meta = dbo_meta(node)
            assert meta["phase"] == "issue"
            assert dbo_meta(node)["stream"] == COMM
            assert node.meta["custom"]["stream"] == STREAM_INDEX[COMM]  # Inductor's int contract
            waits = [u for u in node.users if is_wait(u)]
            assert len(waits) == 1 and list(node.users) == waits
            assert dbo_meta(waits[0])["phase"] == "wait"
        elif node.op == "call_function" and not is_wait(node):
            assert dbo_meta(node)["stream"] == COMPUTE
            assert node.meta.get("custom", {}).get("stream") is STREAM_INDEX[COMPUTE]


@pytest.mark.quick
def test_other_ubatch_computes_between_issue_and_wait(compiled_3layer):
    art, _, _ = compiled_3layer
    sched = art.schedule
    consumers: dict[int, list[int]] = {}
    for a, b in sched.deps:
        consumers.setdefault(a, []).append(b)
    hidden = 0
    comm_units = [u for u in sched.units if u.kind == COMM]
    for u in comm_units:
        first = min(consumers[u.id])
        between = sched.units[u.id + 1:first]
        if any(b.kind == COMPUTE and b.ubatch not in (u.ubatch, None) for b in between):
            hidden += 1
    # every comm op but (at most) the very last combine has other-ubatch compute behind it
    assert hidden >= len(comm_units) - 1, [u.name for u in sched.units]


def _happens_before(sched, drop=None) -> nx.DiGraph:
    g = nx.DiGraph()
    g.add_nodes_from(u.id for u in sched.units)
    last = {}
    for u in sched.units:
        if u.stream in last:
            g.add_edge(last[u.stream], u.id)
        last[u.stream] = u.id
    g.add_edges_from(e for e in sched.event_edges if e != drop)
    return g


@pytest.mark.quick
def test_event_edges_are_necessary_and_sufficient(compiled_3layer):
    art, _, _ = compiled_3layer
    sched = art.schedule
    stream = {u.id: u.stream for u in sched.units}
    g = _happens_before(sched)
    for a, b in sched.deps:
        assert nx.has_path(g, a, b), f"dep {a}->{b} not ordered"
    assert sched.event_edges
    for a, b in sched.event_edges:
        assert stream[a] != stream[b]
        assert not nx.has_path(_happens_before(sched, drop=(a, b)), a, b), f"event {a}->{b} implied"


@pytest.mark.quick
def test_kv_cache_write_precedes_other_ubatch_read(compiled_3layer):
    art, _, _ = compiled_3layer
    sched = art.schedule
    by_id = {u.id: u for u in sched.units}
    kv = [(by_id[a], by_id[b]) for a, b in sched.hidden_deps]
    assert len(kv) == 3  # one per layer
    for a, b in kv:
        assert (a.ubatch, b.ubatch) == (0, 1) and a.label == b.label == "A"
        assert a.id < b.id


@pytest.mark.quick
def test_cross_layer_overlap(compiled_3layer):
    """ubatch 1's combine of layer l runs beside ubatch 0's work of layer l + 1."""
    art, _, _ = compiled_3layer
    units = art.schedule.units
    for layer in range(2):
        combine = next(u for u in units if u.label == "C" and u.ubatch == 1 and u.layer == layer)
        nxt = [u for u in units if u.kind == COMPUTE and u.ubatch == 0 and u.layer == layer + 1]
        assert any(u.start_us < combine.end_us and combine.start_us < u.end_us for u in nxt), (
            layer, [(u.name, u.start_us, u.end_us) for u in units])


@pytest.mark.quick
def test_split_numerics_equal_eager(compiled_3layer):
    art, eager, out = compiled_3layer
    assert art.stats.split_steps == 1
    torch.testing.assert_close(out, eager, rtol=0, atol=1e-5)



def _stream_marks(graph: fx.Graph) -> dict[str, tuple]:
    return {n.name: (dbo_meta(n).get("unit"), dbo_meta(n).get("stream"),
                     n.meta.get("custom", {}).get("stream")) for n in graph.nodes}


def test_only_the_chosen_schedule_is_written_onto_the_split_graph(monkeypatch):
    """Scheduling a candidate leaves the graph's nodes as they are; the schedule chosen (the
    primary) is written onto its graph once, so the driver may schedule in any order."""
    from dbo_compile.errors import ScheduleError
    from dbo_compile.passes import stream_assign

    real = stream_assign.stream_assign
    touched = []

    def spy(graph, *args, **kwargs):
        before = _stream_marks(graph)
        schedule = real(graph, *args, **kwargs)
        touched.append(_stream_marks(graph) != before)
        return schedule

    monkeypatch.setattr(stream_assign, "stream_assign", spy)
    torch._dynamo.reset()
    model, step = build(MIXED_CUT, layers=2)
    eager_and_compiled(model, step, {"split": "always", "link_gbps": 2.0,
                                     "schedule_candidates": ("list@link/16", "naive")})
    art = last_artifact()
    assert len(touched) == 3 and not any(touched)
    marks = _stream_marks(art.split_gm.graph)
    for u in art.schedule.units:
        for name in u.nodes:
            assert marks[name][:2] == (u.id, u.stream), name
    with pytest.raises(ScheduleError, match="lacks"):  # a schedule of another graph
        stream_assign.annotate_streams(art.lowered_gm.graph, art.schedule)

def test_generated_code_is_deterministic():
    codes = []
    for _ in range(2):
        torch._dynamo.reset()
        model, step = build(MIXED_CUT, layers=2)
        eager_and_compiled(model, step, {"split": "always"})
        codes.append(last_artifact().code)
    assert codes[0] == codes[1]
    assert "wait(s_compute" in codes[0] and "with use(s_comm)" in codes[0]


def test_list_scheduler_never_worse_than_naive_order_in_the_model():
    """The whole-graph list schedule is never predicted slower than the per-layer naive order,
    and strictly faster where comm and compute are comparable (link figure 0.1 GB/s here)."""
    model, step = build(MIXED_CUT, layers=3)
    strict = False
    for link in (0.05, 0.1, 0.3):
        spans = {}
        for scheduler in ("naive", "list"):
            torch._dynamo.reset()
            # the cost model evaluates the schedule at cost_model_tokens (not at this step's
            # size): 64 tokens per rank keeps comm and compute comparable at these links
            eager_and_compiled(model, step, {"split": "always", "scheduler": scheduler,
                                             "link_gbps": link, "cost_model_tokens": 64})
            sched = last_artifact().schedule
            spans[scheduler] = (sched.predicted_step_us, sched.serial_us)
        assert spans["list"][0] <= spans["naive"][0], (link, spans)
        assert spans["list"][1] == pytest.approx(spans["naive"][1])
        strict |= spans["list"][0] < spans["naive"][0]
    assert strict


def test_a_valid_candidate_with_a_bad_carve_out_says_what_to_fix():
    """``"list@link/4+sms0"`` was refused as an unknown candidate though its name is valid:
    the carve-out is what is wrong, and the message says so."""
    from dbo_compile.config import DboConfig
    from dbo_compile.errors import DboConfigError

    for bad in ("list@link/4+sms0", "list+join+sms", "staged+sms-2", "list+smsX"):
        with pytest.raises(DboConfigError, match=r"carve-out.*int >= 1.*\+sms16") as info:
            DboConfig(schedule_candidates=("naive", bad))
        assert "unknown" not in str(info.value) and repr(bad) in str(info.value)
    with pytest.raises(DboConfigError, match="unknown candidate") as info:
        DboConfig(schedule_candidates=("lst+sms0",))  # the name itself is wrong


def test_schedule_candidates_are_distinct_orders_of_the_same_program():
    """``schedule_candidates`` compiles alternative orders (list under slower links, naive);
    each is a different host order of the same units, and each computes what eager does."""
    from dbo_compile.candidates import SCHEDULE_CANDIDATES, candidates_of
    from dbo_compile.config import DboConfig
    from dbo_compile.errors import DboConfigError

    names = [c.name for c in candidates_of(DboConfig(schedule_candidates=True))]
    assert names == ["list", "list@link/4", "list@link/16", "naive", "list+join",
                     "list@link/16+join", "staged", "staged-d2"]
    assert [c.name for c in candidates_of(DboConfig(schedule_candidates=False))] == ["list"]
    assert [c.name for c in candidates_of(DboConfig(schedule_candidates=False,
                                                      join_experts=True))] == ["list+join"]
    assert [c.name for c in candidates_of(
        DboConfig(schedule_candidates=True))] == list(SCHEDULE_CANDIDATES)
    # the default: the measured winners (docs/config.md, "Why the defaults")
    assert [c.name for c in candidates_of(DboConfig())] == [
        "list", "list@link/4", "list@link/16", "list+join", "list@link/16+join", "staged"]
    picked = DboConfig(schedule_candidates=["list@link/16+join", "naive", "naive"])
    assert picked.schedule_candidates == ("naive", "list@link/16+join")  # canonical order
    assert picked.fingerprint() == DboConfig(
        schedule_candidates=("naive", "list@link/16+join")).fingerprint()
    assert DboConfig(schedule_candidates=()).fingerprint() == DboConfig(
        schedule_candidates=False).fingerprint()
    assert [c.name for c in candidates_of(picked)] == ["list", "naive", "list@link/16+join"]
    assert picked.fingerprint() != DboConfig().fingerprint()
    assert [c.name for c in candidates_of(DboConfig(schedule_candidates=("list",)))] == ["list"]
    for bad in (("list+joined",), "list+join", 1, [["naive"]]):
        with pytest.raises(DboConfigError, match="schedule_candidates"):
            DboConfig(schedule_candidates=bad)
    model, step = build(MIXED_CUT, layers=3)
    eager, _, _, _ = eager_and_compiled(model, step, {"split": "always", "link_gbps": 2.0})
    art = last_artifact()
    assert art.candidates["list"] is art.split_program and len(art.candidates) >= 2
    orders = {tuple(tuple(u.nodes) for u in p.schedule.units) for p in art.candidates.values()}
    assert len(orders) == len(art.candidates)  # duplicates were dropped
    modules: dict = {}
    for joined in (False, True):  # same units, other order (joined: another graph)
        plain = [p for n, p in art.candidates.items() if n.endswith("+join") == joined]
        units = {frozenset(tuple(u.nodes) for u in p.schedule.units) for p in plain}
        assert len(units) == 1
        for p in plain:  # each unit's module is built once for every variant of its graph
            for u, fn in zip(p.schedule.units, p.units):
                assert modules.setdefault((joined, tuple(u.nodes)), fn) is fn, u.name
    from dbo_compile.testing.measure import SplitStep
    from dbo_compile.runtime.padding import join_ubatch_outputs

    compiled = torch.compile(model, backend="dbo", options={"split": "always", "link_gbps": 2.0})
    with torch.no_grad():
        saved = [c.clone() for c in model.kv_caches()]
        sstep = SplitStep(art, lambda: compiled(step.input_ids, step.positions, step.attn_metadata))
        for name, program in art.candidates.items():
            for c, s in zip(model.kv_caches(), saved):
                c.copy_(s)
            got = join_ubatch_outputs(program(*sstep.split_args), art.signature.outputs)[0]
            torch.testing.assert_close(got, eager, rtol=0, atol=1e-5, msg=name)


def test_sm_carveout_candidates_add_a_copy_of_each_schedule():
    from dbo_compile.config import DboConfig
    from dbo_compile.errors import DboConfigError

    model, step = build(MIXED_CUT, layers=2)
    eager, out, _, _ = eager_and_compiled(model, step, {"split": "always",
                                                        "schedule_candidates": True,
                                                        "sm_carveout_candidates": [16]})
    art = last_artifact()
    base = [n for n in art.candidates if "+sms" not in n]
    assert sorted(art.candidates) == sorted(base + [f"{n}+sms16" for n in base])
    for name, program in art.candidates.items():
        assert program.carveout_sms == (16 if name.endswith("+sms16") else None)
        if name.endswith("+sms16"):  # same generated code and units as its base
            assert program.code == art.candidates[name[:-6]].code
    torch.testing.assert_close(out, eager, rtol=0, atol=1e-5)
    with pytest.raises(DboConfigError, match="sm_carveout_candidates"):
        DboConfig(sm_carveout_candidates=(0,))


def test_default_candidates_pair_the_carveout_with_the_slow_link_schedule():
    """The default captures 6 split graphs per bucket on CUDA (issue 17, issue 28): the
    primary, ``list@link/4``, ``list@link/16`` with the carve-out, the two joined schedules
    without it and the staged order."""
    from dbo_compile.candidates import DEFAULT_CANDIDATES, program_variants
    from dbo_compile.config import DboConfig
    from dbo_compile.errors import DboConfigError

    cuda = DboConfig(sm_carveout_candidates=(16,))
    assert cuda.schedule_candidates == DEFAULT_CANDIDATES
    assert program_variants(cuda) == [
        ("list", "list", None), ("list@link/4", "list@link/4", None),
        ("list@link/16+sms16", "list@link/16", 16),
        ("list+join", "list+join", None), ("list@link/16+join", "list@link/16+join", None),
        ("staged", "staged", None)]
    # no carve-out where torch cannot carve SMs out: the schedule alone
    assert [v[0] for v in program_variants(DboConfig(sm_carveout_candidates=()))] == [
        "list", "list@link/4", "list@link/16", "list+join", "list@link/16+join", "staged"]
    # a tuple without carve-out names keeps the cross product; True is every candidate
    assert len(program_variants(DboConfig(schedule_candidates=("list+join",),
                                          sm_carveout_candidates=(16,)))) == 4
    assert len(program_variants(DboConfig(schedule_candidates=True,
                                          sm_carveout_candidates=(16,)))) == 16
    assert DboConfig(schedule_candidates=["list+join", "list@link/16+sms16", "list+join"]
                     ).schedule_candidates == ("list@link/16+sms16", "list+join")
    with pytest.raises(DboConfigError, match="schedule_candidates"):
        DboConfig(schedule_candidates=("list+sms0",))
    model, step = build(MIXED_CUT, layers=2)
    eager, out, _, _ = eager_and_compiled(model, step, {"split": "always", "link_gbps": 2.0,
                                                        "sm_carveout_candidates": [16]})
    art = last_artifact()
    assert list(art.candidates) == ["list", "list@link/4", "list@link/16+sms16", "list+join",
                                    "list@link/16+join", "staged"]
    assert {n: p.carveout_sms for n, p in art.candidates.items()} == {
        "list": None, "list@link/4": None, "list@link/16+sms16": 16, "list+join": None,
        "list@link/16+join": None, "staged": None}
    torch.testing.assert_close(out, eager, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------------
# join_experts
# ------------------------------------------------------------------------------------------


def _grouped_copies_graph(sizes, hidden=8, k=2, experts=3, inter=4):
    """A split-graph fragment: one ``dbo.grouped_experts`` copy per ubatch (token counts
    ``sizes``) on shared weights, annotated as split_ubatch leaves it; returns the graph module
    and real inputs."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    import dbo_compile.ops  # noqa: F401

    mode = FakeTensorMode(shape_env=ShapeEnv())
    g = fx.Graph()
    gen = torch.Generator().manual_seed(0)
    real = {"w13": torch.randn(experts, 2 * inter, hidden, generator=gen),
            "w2": torch.randn(experts, hidden, inter, generator=gen)}
    shared = {}
    for name in ("w13", "w2"):
        shared[name] = g.placeholder(name)
        shared[name].meta["val"] = mode.from_tensor(real[name])
        dbo_meta(shared[name])["ubatch"] = None
    outs = []
    for u, n in enumerate(sizes):
        ins = []
        for name, t in (("x", torch.randn(n, hidden, generator=gen)),
                        ("ids", torch.randint(-1, experts, (n, k), generator=gen)),
                        ("w", torch.rand(n, k, generator=gen))):
            ph = g.placeholder(f"{name}_u{u}")
            ph.meta["val"] = mode.from_tensor(t)
            dbo_meta(ph).update(ubatch=u, origin=name, token_dim=0)
            real[f"{name}_u{u}"] = t
            ins.append(ph)
        y = g.call_function(torch.ops.dbo.grouped_experts.default,
                            (*ins, shared["w13"], shared["w2"]))
        with mode:
            y.meta["val"] = torch.empty(n, hidden)
        dbo_meta(y).update(ubatch=u, origin="grouped_experts", token_dim=0)
        outs.append(y)
    g.output(tuple(outs))
    gm = fx.GraphModule(torch.nn.Module(), g)
    args = [real[n.name] for n in g.nodes if n.op == "placeholder"]
    return gm, args


@pytest.mark.quick
@pytest.mark.parametrize("sizes", [(3, 5), (4, 4), (0, 2), (2, 3, 1)])
def test_join_experts_one_call_on_all_rows(sizes):
    """The ubatch copies become one call on the concatenated rows; each ubatch gets its own
    rows back (unequal ubatches, an empty one, three ubatches). Not bit for bit on CPU: the
    matmul blocks differently for another row count."""
    from dbo_compile.passes.join_experts import join_experts

    gm, args = _grouped_copies_graph(sizes)
    expected = gm(*args)
    assert join_experts(gm, len(sizes)) == 1
    calls = [n for n in gm.graph.nodes if n.target is torch.ops.dbo.grouped_experts.default]
    assert len(calls) == 1
    (call,) = calls
    assert dbo_meta(call)["ubatch"] is None and dbo_meta(call)["join"] == "grouped_experts"
    cats = call.args[:3]
    assert all(c.target is torch.ops.aten.cat.default and len(c.args[0]) == len(sizes)
               for c in cats)
    assert [dbo_meta(a)["ubatch"] for a in cats[0].args[0]] == list(range(len(sizes)))
    got = gm(*args)
    assert [tuple(t.shape) for t in got] == [(n, 8) for n in sizes]
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.quick
def test_join_experts_rejects_a_missing_copy():
    from dbo_compile.errors import ScheduleError
    from dbo_compile.passes.join_experts import join_experts

    gm, _ = _grouped_copies_graph((3, 5))
    with pytest.raises(ScheduleError, match="expected one per ubatch"):
        join_experts(gm, 3)


def test_joined_schedule_reads_expert_weights_once_per_layer():
    """``join_experts=True``: one routed-expert call per layer, in a stage of its own (no
    ubatch) that waits for both ubatches' dispatch and precedes both combines; the step equals
    eager, KV caches included."""
    model, step = build(MIXED_CUT, layers=3)
    eager, out, eager_caches, caches = eager_and_compiled(
        model, step, {"split": "always", "join_experts": True, "schedule_candidates": False})
    art = last_artifact()
    assert list(art.candidates) == ["list+join"]
    program = art.split_program
    units = program.schedule.units
    mlp = [u for u in units if u.label == "MLP"]
    assert len(mlp) == 3 and all(u.ubatch is None for u in mlp)
    deps = set(program.schedule.deps)
    for u in mlp:
        d = [c.id for c in units if c.label == "D" and c.layer == u.layer]
        c = [c.id for c in units if c.label == "C" and c.layer == u.layer]
        assert len(d) == 2 and len(c) == 2
        assert all((i, u.id) in deps for i in d) and all((u.id, i) in deps for i in c)
    calls = [n for u in units for n in u.nodes if n.startswith("grouped_experts")]
    assert len(calls) == 3 and all(any(n in u.nodes for u in mlp) for n in calls)
    unjoined = art.split_gm  # the graph the unjoined candidates schedule: one call per ubatch
    assert sum(n.target is torch.ops.dbo.grouped_experts.default
               for n in unjoined.graph.nodes) == 6
    torch.testing.assert_close(out, eager, rtol=0, atol=1e-5)
    for a, b in zip(caches, eager_caches):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.quick
def test_join_experts_without_expert_calls_compiles_unjoined():
    """A model without ``dbo.grouped_experts`` compiles unjoined under ``join_experts=True``
    (and its joined candidates are not compiled); a non-bool option is refused."""
    from dbo_compile.config import DboConfig
    from dbo_compile.errors import DboConfigError

    class LinearExperts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            ids = torch.zeros(x.shape[0], 1, dtype=torch.int64)
            recv, _, rw = torch.ops.dbo.dispatch(self.lin(x), ids, torch.ones(x.shape[0], 1),
                                                 1, "")
            return torch.ops.dbo.combine(self.lin(recv) * rw, "")

    torch._dynamo.reset()
    model, x = LinearExperts(), torch.randn(16, 8)
    torch._dynamo.mark_dynamic(x, 0)
    out = torch.compile(model, backend="dbo", options={"split": "always",
                                                       "join_experts": True})(x)
    torch.testing.assert_close(out, model(x))
    art = last_artifact()
    # the config is never rewritten (the DP vote compares its fingerprint): the fact that
    # there was nothing to join is the schedule's
    assert art.config.join_experts
    assert art.schedule.meta["join_experts"] == "no routed-expert call to join"
    assert "list" in art.candidates and not any(n.endswith("+join") for n in art.candidates)
    with pytest.raises(DboConfigError, match="join_experts"):
        DboConfig(join_experts=1)


def test_comm_sms_on_a_cpu_graph_warns_that_it_does_nothing(caplog):
    """A newcomer's probe: ``comm_sms=16`` on CPU was accepted without a word; an SM carve-out
    is a CUDA feature, so the compile says once that it has no effect."""
    torch._dynamo.reset()
    model, step = build(MIXED_CUT, layers=1)
    with caplog.at_level("WARNING", logger="dbo_compile"):
        eager_and_compiled(model, step, {"split": "always", "comm_sms": 16})
    said = [r for r in caplog.records if "comm_sms=16 has no effect" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
