"""The emulated EP-W comm backend (dbo_compile/ops/emulated/): its routing and remote share,
the replicated-expert world against the one-device reference, the static link capacity with
exact overflow, its options, and what the cost model reads of it. The host copies run on CPU
too; the Triton kernels run here under Triton's interpreter, on the GPU compiled."""

from __future__ import annotations

import pytest
import torch

import dbo_compile.ops  # noqa: F401 - registers torch.ops.dbo.*
from conftest import last_artifact
from dbo_compile.config import DboConfig
from dbo_compile.errors import CommBackendError, CommOpError, DboConfigError, dbo_error_of
from dbo_compile.models import DeepseekMoEModel, get_config, make_step
from dbo_compile.ops import emulated as E
from dbo_compile.ops.comm import ep_size_of_rows, get_comm_backend
from dbo_compile.ops.experts import experts_loop
from dbo_compile.ops.registry import bound_backend, comm_kind, op_info
from dbo_compile.passes.cost_model import CostModel
from dbo_compile.runtime.engine import run_step
from triton_interp import run_interpreted


def _routing(t=40, e=8, k=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    return ids, torch.rand(t, k, generator=g)


# -- routing and layout -----------------------------------------------------------------------


def test_slot_rows_follow_the_ranks_of_each_token():
    world = E.EmulatedWorld(4, 8, 3)  # E_local 2: ranks own experts {0,1} {2,3} {4,5} {6,7}
    ids = torch.tensor([[0, 5, 6],     # ranks 0, 2, 3: local row, remote rows 1 and 2
                        [3, 2, 7],     # ranks 1, 1, 3: both slots of rank 1 in one row
                        [-1, 4, 5],    # a masked slot; ranks 2, 2
                        [7, 8, 1]])    # rank 3; id 8 >= E: routed nowhere; rank 0
    assert E.slot_rows(ids, world).tolist() == [[0, 1, 2], [1, 1, 2], [-1, 1, 1], [1, -1, 0]]


def test_dispatch_sends_each_slot_once_with_its_local_id():
    world = E.EmulatedWorld(4, 8, 3)
    backend = get_comm_backend(E.register_emulated(world))
    ids, w = _routing()
    x = torch.randn(40, 16)
    rx, rids, rw = backend.dispatch(x, ids, w, 8, "")
    g = world.rows_per_token
    assert g == 4 and rx.shape == (40 * g, 16) and rids.shape == (40 * g, 3)
    for t in range(40):
        rows = slice(t * g, (t + 1) * g)
        ranks = sorted({int(i) // 2 for i in ids[t]})
        got = rids[rows]
        # one row per rank the token reaches: rank 0 in row 0, the others in rank order
        used = [r for r in range(g) if (got[r] >= 0).any()]
        assert len(used) == len(ranks) and (ranks[0] == 0) == (0 in used)
        for r in range(g):
            assert torch.equal(rx[t * g + r], x[t] if r in used else torch.zeros(16))
        # every slot exactly once, with id mod E_local and its weight
        slots = got >= 0
        assert int(slots.sum()) == 3
        assert torch.equal(got[slots].sort().values, (ids[t] % 2).sort().values)
        assert torch.allclose(rw[rows][slots].sum(), w[t].sum())


def test_the_remote_share_crosses_the_link(monkeypatch):
    """Rows for remote ranks come back through the link: a link that corrupts them changes the
    result, the local rows do not go out."""
    world = E.EmulatedWorld(4, 8, 3)
    backend = get_comm_backend(E.register_emulated(world))
    ids, w = _routing()
    x = torch.randn(40, 16)
    sent = []
    real = E.LINK.send

    def corrupting(src, wld):
        sent.append(src.shape[0])
        return E.Transfer(real(src, wld).finish() + 1)

    good = backend.dispatch(x, ids, w, 8, "")
    monkeypatch.setattr(E.LINK, "send", corrupting)
    bad = backend.dispatch(x, ids, w, 8, "")
    assert sent == [world.capacity(40)]  # one transfer of the capacity
    local = torch.arange(40) * world.rows_per_token
    assert torch.equal(bad[0][local], good[0][local])
    remote = (good[1] >= 0).any(-1)
    remote[local] = False
    assert remote.any() and not torch.equal(bad[0][remote], good[0][remote])


def test_deferred_calls_fill_their_results_at_the_receive():
    """An op issued with ``defer_receive`` sends its rows and returns; its receive (any
    order) completes the result in place: the same bits as the op run at once. Two may be in
    flight (the link's two host slots, the pool's in_flight=2); a third, or a receive of a
    value no call returned, is refused; abort receives what is left."""
    world = E.EmulatedWorld(4, 8, 3)
    backend = get_comm_backend(E.register_emulated(world))
    assert backend.pool_of("dispatch").in_flight == 2 and backend.receive is not None
    ids, w = _routing()
    x = torch.randn(40, 16)
    want = backend.dispatch(x, ids, w, 8, "")
    y = torch.randn_like(want[0]) * (want[1] >= 0).any(-1, keepdim=True)
    want_out = backend.combine(y, "")
    sent = []
    real = E.LINK.send

    def spy(src, wld):
        sent.append("send")
        return real(src, wld)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(E.LINK, "send", spy)
        d = backend.dispatch(x, ids, w, 8, "", defer_receive=True)
        c = backend.combine(y, "", defer_receive=True)
        assert sent == ["send", "send"]  # both on the link before either is received
        with pytest.raises(CommBackendError, match="2 calls are in flight"):
            backend.dispatch(x, ids, w, 8, "", defer_receive=True)
        backend.receive(c)  # out of issue order: each call has its own slot and event
        backend.receive(d)
    assert all(torch.equal(a, b) for a, b in zip(d, want)) and torch.equal(c, want_out)
    with pytest.raises(CommBackendError, match="no call in flight"):
        backend.receive(d)
    d = backend.dispatch(x, ids, w, 8, "", defer_receive=True)
    backend.abort()
    assert all(torch.equal(a, b) for a, b in zip(d, want))
    with pytest.raises(CommBackendError, match="no call in flight"):
        backend.receive(d)


def test_the_link_holds_two_transfers_at_most():
    world = E.EmulatedWorld(4, 8, 3)
    src = torch.randn(8, 4)
    a, b = E.LINK.send(src, world), E.LINK.send(src + 1, world)
    with pytest.raises(CommOpError, match="2 transfers are in flight"):
        E.LINK.send(src, world)
    assert torch.equal(a.finish(), src) and torch.equal(b.finish(), src + 1)
    E.LINK.send(src, world).finish()  # the slots are free again


def test_capacity_is_the_routed_volume_not_the_fixed_one():
    w8 = E.EmulatedWorld(8, 64, 6)  # DeepSeek-V2-Lite routing: a token reaches ~4.4 ranks
    assert 3.8 < w8.remote_ranks_per_token() < 4.2
    assert w8.capacity(1000) == pytest.approx(1000 * w8.remote_ranks_per_token() * 1.1, abs=1)
    v3 = E.EmulatedWorld(64, 256, 8)  # V3 at EP 64: ~7.5 ranks, fan-out 8
    assert 7.0 < v3.remote_ranks_per_token() < 8.0 and v3.fanout == 8
    assert v3.capacity(1000) <= 8000  # never more than the fan-out rows
    # bytes per direction: capacity rows of payload (dispatch) / hidden columns (combine)
    assert w8.link_bytes("combine", 1000, 2048, 2) == w8.capacity(1000) * 2048 * 2
    assert w8.link_bytes("dispatch", 1000, 2048, 2) == w8.capacity(1000) * (2048 + 24) * 2


def test_overflow_past_the_capacity_stays_exact_and_is_counted():
    """Every token routed to all remote ranks: twice the expected rows, half past the link
    capacity. The rows past it take the device-side copy: same answer, counted."""
    world = E.EmulatedWorld(4, 8, 3, capacity_factor=1.0)
    backend = get_comm_backend(E.register_emulated(world))
    t = 30
    ids = torch.tensor([[2, 4, 6]] * t)  # ranks 1, 2, 3
    w = torch.rand(t, 3)
    x = torch.randn(t, 16)
    E.reset_stats()
    rx, rids, rw = backend.dispatch(x, ids, w, 8, "")
    st = E.stats()["cpu"]
    assert st["dispatch_rows"] == 3 * t and st["dispatch_overflow"] == 3 * t - world.capacity(t) > 0
    y = torch.randn_like(rx) * (rids >= 0).any(-1, keepdim=True)
    out = backend.combine(y, "")
    torch.testing.assert_close(out, y.view(t, 4, 16).sum(1))
    assert E.stats()["cpu"]["combine_overflow"] == st["dispatch_overflow"]


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_dispatch_experts_combine_equals_the_replicated_reference(world_size):
    """Rank 0 of the emulated world, with its E/W experts, computes what E experts repeating
    every E/W compute on one device (fp32)."""
    e, k, h, inter = 8, 3, 16, 8
    world = E.EmulatedWorld(world_size, e, k)
    backend = get_comm_backend(E.register_emulated(world))
    g = torch.Generator().manual_seed(world_size)
    el = e // world_size
    w13 = torch.randn(el, 2 * inter, h, generator=g) / h ** 0.5
    w2 = torch.randn(el, h, inter, generator=g) / inter ** 0.5
    ids, w = _routing(t=33, e=e, k=k, seed=world_size)
    ids[0, 1] = -1
    x = torch.randn(33, h, generator=g)
    rx, rids, rw = backend.dispatch(x, ids, w, e, "")
    out = backend.combine(experts_loop(rx, rids, rw, w13, w2), "")
    ref = experts_loop(x, ids, w, w13.repeat(world_size, 1, 1), w2.repeat(world_size, 1, 1))
    torch.testing.assert_close(out, ref)


def test_empty_ubatch_issues_nothing_and_returns_empty():
    world = E.EmulatedWorld(4, 8, 3)
    backend = get_comm_backend(E.register_emulated(world))
    rx, rids, rw = backend.dispatch(torch.randn(0, 16), torch.zeros(0, 3, dtype=torch.int64),
                                    torch.zeros(0, 3), 8, "")
    assert rx.shape == (0, 16) and backend.combine(rx, "").shape == (0, 16)


def test_bad_calls_say_what_is_wrong():
    world = E.EmulatedWorld(4, 8, 3)
    backend = get_comm_backend(E.register_emulated(world))
    ids, w = _routing()
    with pytest.raises(CommOpError, match="bound for num_experts=8, top_k=3"):
        backend.dispatch(torch.randn(40, 16), ids[:, :2], w[:, :2], 8, "")
    with pytest.raises(CommOpError, match="ids must be < num_experts"):
        backend.dispatch(torch.randn(40, 16), ids + 8, w, 8, "")
    with pytest.raises(CommOpError, match="multiple of its 4 receive rows"):
        backend.combine(torch.randn(7, 16), "")
    with pytest.raises(CommBackendError, match="multiple of world_size=3"):
        E.EmulatedWorld(3, 8, 3)
    with pytest.raises(CommBackendError, match="emulate_world_size"):
        get_comm_backend("emulated").dispatch(torch.randn(4, 16), ids[:4], w[:4], 8, "")


# -- the compiled emulated world --------------------------------------------------------------


def _world_model(w=4, experts=8, top_k=3, layers=2):
    cfg = get_config("tiny", num_experts=experts, top_k=top_k, num_layers=layers)
    model = DeepseekMoEModel(cfg, emulated_world_size=w)
    ref = model.emulated_reference()
    for m in (model, ref):
        m.allocate_kv_cache(64, 16)
    step = make_step(cfg, decode_context_lens=[20, 37, 5, 60], prefills=[(0, 28)],
                     block_size=16)
    return model, ref, step


def _options(world_size=4, comm=None, **kw):
    """torch.compile options of the emulated EP world of ``world_size`` ranks: the emulated
    backend's options in ``comm_backend_options`` (``comm`` adds to them; the deprecated
    ``emulate_*`` spelling is tested in test_config / test_backend_choice), ``kw`` the rest."""
    return {"split": "always", "comm_backend": "emulated",
            "comm_backend_options": {"world_size": world_size, **(comm or {})}, **kw}


def test_compiled_emulated_world_equals_the_unsplit_reference():
    """The acceptance check on CPU: the split program of the emulated EP-4 world (4 of 8
    experts... 2 here, and the host copies) equals the one-device model with all experts."""
    model, ref, step = _world_model()
    cm = torch.compile(model, backend="dbo", options=_options(comm={"link_gbps": 25.0}))
    with torch.no_grad():
        out = run_step(cm, step.input_ids, step.positions, step.attn_metadata,
                       step.num_scheduled_tokens)
        want = ref(step.input_ids, step.positions, step.attn_metadata)
    art = last_artifact()
    assert art.is_split and art.stats.split_steps == 1
    torch.testing.assert_close(out, want)
    bound = {bound_backend(n) for n in art.split_gm.graph.nodes if comm_kind(n) is not None}
    assert bound == {E.EmulatedWorld(4, 8, 3, link_gbps=25.0).name}
    # the unsplit program (the baseline) runs the same world
    assert {bound_backend(n) for n in art.lowered_gm.graph.nodes
            if comm_kind(n) is not None} == bound


def test_comm_backend_options_configure_the_emulated_world():
    """``comm_backend_options`` (not the deprecated ``emulate_*`` fields) bind the same world
    and the same answer."""
    model, ref, step = _world_model()
    cm = torch.compile(model, backend="dbo", options={
        "split": "always", "comm_backend": "emulated",
        "comm_backend_options": {"world_size": 4, "link_gbps": 25.0}})
    with torch.no_grad():
        out = run_step(cm, step.input_ids, step.positions, step.attn_metadata,
                       step.num_scheduled_tokens)
        want = ref(step.input_ids, step.positions, step.attn_metadata)
    art = last_artifact()
    assert art.is_split
    torch.testing.assert_close(out, want)
    assert {bound_backend(n) for n in art.split_gm.graph.nodes if comm_kind(n) is not None
            } == {E.EmulatedWorld(4, 8, 3, link_gbps=25.0).name}


def test_split_program_sends_the_next_op_before_receiving_the_last():
    """The emulated ops' receives are units of their own (their transfer in flight while the
    comm stream packs the next op): the schedule issues a comm op before the previous one's
    receive, never three at once (the pool), and the model holds the link for one transfer at
    a time."""
    model, ref, step = _world_model()
    cm = torch.compile(model, backend="dbo", options=_options())
    with torch.no_grad():
        out = run_step(cm, step.input_ids, step.positions, step.attn_metadata,
                       step.num_scheduled_tokens)
        want = ref(step.input_ids, step.positions, step.attn_metadata)
    torch.testing.assert_close(out, want)
    sched = last_artifact().split_program.schedule
    comm = [u for u in sched.units if u.kind == "comm"]
    in_flight, most, overlapped = 0, 0, False
    for u in comm:  # host order = comm stream order
        in_flight += 1 if u.phase == "issue" else -1
        most = max(most, in_flight)
        overlapped |= u.phase == "issue" and in_flight == 2
    assert overlapped and most == 2, [u.name for u in comm]
    # the transfers hold the link one after another, in issue order: the receive of each
    # starts no earlier than its issue's end and every transfer before it
    t_link = 0.0
    for u in (u for u in comm if u.phase == "issue"):
        assert u.latency_us > 0
        t_link = max(t_link, u.end_us) + u.latency_us
        r = next(r for r in comm if r.phase == "receive" and r.label == u.label
                 and r.ubatch == u.ubatch and r.layer == u.layer)
        assert r.start_us >= t_link - 1e-6, (u.name, r.start_us, t_link)


def test_emulate_options_are_in_the_fingerprint():
    a = DboConfig(comm_backend="emulated", comm_backend_options={"world_size": 8})
    b = DboConfig(comm_backend="emulated",
                  comm_backend_options={"world_size": 8, "link_gbps": 25.0})
    c = DboConfig(comm_backend="emulated", comm_backend_options={"world_size": 16})
    assert len({a.fingerprint(), b.fingerprint(), c.fingerprint()}) == 3


def test_a_model_built_for_another_world_size_is_refused():
    model, _, step = _world_model(w=4)
    cm = torch.compile(model, backend="dbo", options=_options(world_size=8))
    with pytest.raises(Exception, match="built for an emulated world of 4 ranks") as info:
        with torch.no_grad():
            run_step(cm, step.input_ids, step.positions, step.attn_metadata,
                     step.num_scheduled_tokens)
    cause = info.value
    while cause is not None and not isinstance(cause, CommBackendError):
        cause = cause.__cause__ or cause.__context__
    assert isinstance(cause, CommBackendError)


def _compile_error(fn):
    """The DboError a compile inside ``fn()`` raised (Dynamo wraps it)."""
    with pytest.raises(Exception) as info:
        fn()
    err = dbo_error_of(info.value)
    assert err is not None, info.value
    return err


@pytest.mark.parametrize("w", [2, 4, 8])
def test_a_model_not_built_for_an_emulated_world_is_refused(w):
    """Issue 29, finding 2: a plain model (every expert local) compiled with
    comm_backend="emulated" ran its first E/W experts on every slot and returned logits off by
    2.3-2.6, without an error. The expert op holds E experts, not rank 0's E/W: refused at
    compile time, naming the model to build and what another model must provide."""
    cfg = get_config("tiny", num_experts=8, top_k=3, num_layers=2)
    model = DeepseekMoEModel(cfg)
    model.allocate_kv_cache(64, 16)
    step = make_step(cfg, decode_context_lens=[20, 37, 5, 60], prefills=[(0, 28)],
                     block_size=16)
    cm = torch.compile(model, backend="dbo", options=_options(world_size=w))
    with torch.no_grad():
        err = _compile_error(lambda: run_step(cm, step.input_ids, step.positions,
                                              step.attn_metadata, step.num_scheduled_tokens))
    msg = str(err)
    assert isinstance(err, CommBackendError), err
    assert f"DeepseekMoEModel(..., emulated_world_size={w})" in msg, msg
    assert "holds 8 experts" in msg and f"= {8 // w}" in msg, msg
    assert f"register_emulated(EmulatedWorld({w}, 8, 3))" in msg, msg


def test_a_model_naming_the_world_but_holding_every_expert_is_refused():
    """Naming the emulated instance is not enough where the expert op shows otherwise."""
    cfg = get_config("tiny", num_experts=8, top_k=3, num_layers=2)
    model = DeepseekMoEModel(cfg)
    name = E.register_emulated(E.EmulatedWorld(4, 8, 3))
    for layer in model.layers:
        layer.mlp.comm_backend = name
    model.allocate_kv_cache(64, 16)
    step = make_step(cfg, decode_context_lens=[20, 37], prefills=[], block_size=16)
    cm = torch.compile(model, backend="dbo", options=_options())
    with torch.no_grad():
        err = _compile_error(lambda: run_step(cm, step.input_ids, step.positions,
                                              step.attn_metadata, step.num_scheduled_tokens))
    assert "holds 8 experts" in str(err) and "EP-4" in str(err), err


class _RankMajorMoe(torch.nn.Module):
    """Experts written in other ops than dbo.grouped_experts (rank-major rows, scaled)."""

    def __init__(self, backend: str = ""):
        super().__init__()
        self.backend = {"backend": backend} if backend else {}

    def forward(self, x):
        w, ids = torch.topk(torch.softmax(x[:, :8], -1), 3)
        rx, rid, rw = torch.ops.dbo.dispatch(x, ids, w.float(), 8, "", **self.backend)
        return torch.ops.dbo.combine(rx * 2, "", **self.backend) + x


def test_experts_in_other_ops_need_the_models_declaration():
    """Where no expert op shows the model's expert count, the comm ops must name the emulated
    instance (the model's declaration that it is rank 0's); with it the graph compiles."""
    x = torch.randn(16, 8)
    torch._dynamo.mark_dynamic(x, 0)
    cm = torch.compile(_RankMajorMoe(), backend="dbo", options=_options())
    err = _compile_error(lambda: cm(x))
    assert "reach no dbo.grouped_experts and it names no emulated instance" in str(err), err
    assert "DeepseekMoEModel(..., emulated_world_size=4)" in str(err), err
    torch._dynamo.reset()
    declared = _RankMajorMoe(E.register_emulated(E.EmulatedWorld(4, 8, 3)))
    cm = torch.compile(declared, backend="dbo", options=_options())
    assert cm(x).shape == x.shape


def test_a_model_of_a_real_ep_group_is_refused():
    """A model built for a real EP group holds its rank's experts, not rank 0's of the
    emulated world (DeepseekMoEModel refuses ep_group with emulated_world_size too)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from dbo_compile.ops.registry import set_op_arg

    world = E.EmulatedWorld(4, 8, 3)
    gm = make_fx(_RankMajorMoe(E.register_emulated(world)), tracing_mode="fake")(
        torch.randn(16, 8))
    E.check_built_for(gm.graph, world)  # one device, declared: built for the world
    for n in gm.graph.nodes:
        if comm_kind(n) is not None:
            set_op_arg(n, "group_name", "ep0")
    with pytest.raises(CommBackendError, match="runs over the EP process group 'ep0'"):
        E.check_built_for(gm.graph, world)


@pytest.mark.parametrize("options, match", [
    ({"emulate_world_size": 8}, "applies only with comm_backend='emulated'"),
    ({"comm_backend": "torch", "emulate_link_gbps": 25.0}, "applies only with comm_backend"),
    ({"comm_backend": "emulated"}, "needs the emulated EP world size"),
    ({"comm_backend": "emulated", "emulate_world_size": 0}, "emulate_world_size.*>= 1"),
    ({"comm_backend": "emulated", "emulate_world_size": True}, "emulate_world_size.*int"),
    ({"comm_backend": "emulated", "emulate_world_size": 8, "emulate_link_gbps": 0},
     "emulate_link_gbps.*> 0"),
    ({"comm_backend": "emulated", "emulate_world_size": 8, "emulate_latency_us": -1.0},
     "emulate_latency_us.*>= 0"),
    ({"comm_backend": "emulated", "emulate_world_size": 8, "emulate_capacity_factor": 0.5},
     "emulate_capacity_factor.*>= 1"),
    ({"comm_backend": "emulated", "emulate_world_size": 8, "emulate_copy_gbps": float("inf")},
     "emulate_copy_gbps.*finite"),
    ({"comm_backend": "emulated", "emulate_world_size": 8, "emulate_comm_sms": -2},
     "emulate_comm_sms.*>= 0"),
])
def test_options_are_validated(options, match):
    with pytest.raises(DboConfigError, match=match):
        DboConfig(**options)


def test_world_size_that_does_not_divide_the_experts_fails_the_compile():
    from torch import nn

    class Moe(nn.Module):
        def forward(self, x):
            w, ids = torch.topk(torch.softmax(x[:, :8], -1), 3)
            rx, rid, rw = torch.ops.dbo.dispatch(x, ids, w.float(), 8, "")
            return torch.ops.dbo.combine(rx * 2, "") + x

    x = torch.randn(16, 8)
    torch._dynamo.mark_dynamic(x, 0)
    cm = torch.compile(Moe(), backend="dbo", options=_options(world_size=3))
    with pytest.raises(Exception, match="multiple of world_size=3"):
        cm(x)


# -- the cost model -----------------------------------------------------------------------------


def test_cost_model_reads_the_link_bytes_and_the_expert_rows():
    """Comm cost: latency + the link capacity's bytes / link_gbps (not the receive rows'
    bytes), the transfer of an issue whose receive is a unit of its own (the issue and the
    receive cost a launch); the experts' FLOPs count each slot once (rows / G), also for the
    joined call."""
    model, _, step = _world_model()
    cm = torch.compile(model, backend="dbo", options=_options(
        link_gbps=10.0, comm_latency_us=3.0, cost_model_tokens=64, join_experts=True,
        schedule_candidates=False))
    with torch.no_grad():
        run_step(cm, step.input_ids, step.positions, step.attn_metadata,
                 step.num_scheduled_tokens)
    art = last_artifact()
    prog = art.split_program
    assert prog.schedule.meta["joined_calls"] == 2
    cost = CostModel(art.config, art.token_symbols, 2)
    world = E.EmulatedWorld(4, 8, 3)
    h = model.config.hidden_size
    comm = [u for u in prog.schedule.units if u.kind == "comm"]
    assert sorted(u.phase for u in comm) == ["issue"] * 8 + ["receive"] * 8
    for unit in comm:
        kind = "dispatch" if unit.label == "D" else "combine"
        want = 3.0 + world.link_bytes(kind, 32, h, 4) / 10e3 if unit.phase == "issue" else 0.0
        assert unit.cost_us == art.config.launch_us, unit.name
        assert unit.latency_us == pytest.approx(want, rel=1e-3), unit.name
    joined = [n for n in prog.split_gm.graph.nodes if n.op == "call_function"
              and op_info(n.target) is op_info(torch.ops.dbo.grouped_experts.default)]
    assert len(joined) == 2
    cfg = model.config
    for n in joined:  # both ubatches' rows: 64 tokens x 4 rows, each slot once
        assert n.args[0].target is torch.ops.aten.cat.default
        assert cost.flops(n) == pytest.approx(6.0 * 64 * cfg.top_k * cfg.moe_intermediate_size * h)


def test_joined_rows_know_their_dispatch():
    """The known defect: the joined experts call (a cat of both ubatches' received rows) got
    EP size 1 in the FLOP formula, and so did every experts call of a split graph (its rows
    are a getitem of the dispatch's wait); both now find the dispatch."""
    import operator

    import torch.fx as fx

    from dbo_compile.ops.registry import comm_wait

    g = fx.Graph()
    x = g.placeholder("x")
    d = g.call_function(torch.ops.dbo.dispatch.default,
                        (x, x, x, 8, "", E.register_emulated(E.EmulatedWorld(4, 8, 3))))
    r0 = g.call_function(operator.getitem, (d, 0))
    w = g.call_function(comm_wait, (d,))
    r1 = g.call_function(operator.getitem, (w, 0))
    cat = g.call_function(torch.ops.aten.cat.default, ([r1, r1], 0))
    assert ep_size_of_rows(r0) == ep_size_of_rows(r1) == ep_size_of_rows(cat) == 4
    assert ep_size_of_rows(x) == 1


# -- the Triton kernels (interpreter) -------------------------------------------------------------


def test_triton_kernels_match_the_torch_path():
    """Dispatch bit for bit; the combine bit for bit in fp32 (the interpreter rounds bf16
    differently from the GPU: within one bf16 ulp there), incl. overflow and world size 1;
    issued together and finished later, the same."""
    out = run_interpreted(r'''
import torch
from dbo_compile.ops import emulated as E
torch.manual_seed(0)
for W, Ex, K, T, H, dtype, cf in [(4, 8, 3, 37, 40, torch.float32, 1.1),
                                  (8, 64, 6, 30, 64, torch.bfloat16, 1.1),
                                  (4, 8, 3, 30, 40, torch.float32, 1.0),
                                  (1, 4, 2, 5, 24, torch.float32, 1.1)]:
    world = E.EmulatedWorld(W, Ex, K, capacity_factor=cf)
    x = torch.randn(T, H).to(dtype)
    ids = torch.stack([torch.randperm(Ex)[:K] for _ in range(T)])
    if cf == 1.0:  # every token to 3 remote ranks: past the capacity
        ids = torch.tensor([[2, 4, 6]] * T)
    ids[0, 0] = -1
    w = torch.rand(T, K)
    counts = []
    for path in ("torch", "triton"):
        if E.LINK.counters:
            E.reset_stats()
        paths = {"torch": E.routing, "triton": E.kernels}[path]
        d = getattr(paths, "dispatch_" + path)(world, x, ids, w)
        y = torch.randn(d[0].shape, generator=torch.Generator().manual_seed(1)).abs().to(dtype)
        y = y * (d[1] >= 0).any(-1, keepdim=True)
        c = getattr(paths, "combine_" + path)(world, y)
        counts.append(E.stats()["cpu"])
        if path == "torch":
            a, ca = d, c
    # issued both, then received in the other order: the same bits
    (d2, fin_d), (c2, fin_c) = (E.kernels.dispatch_triton_issue(world, x, ids, w),
                                E.kernels.combine_triton_issue(world, y))
    fin_c()
    fin_d()
    assert all(torch.equal(u, v) for u, v in zip(d, d2)) and torch.equal(c, c2), W
    assert all(torch.equal(u, v) for u, v in zip(a, d)), W
    torch.testing.assert_close(c, ca, rtol=0 if dtype == torch.float32 else 2 ** -7, atol=0)
    assert counts[0] == counts[1], counts
    assert (counts[0]["dispatch_overflow"] > 0) == (cf == 1.0), counts
print("OK")
''')
    assert "OK" in out


# -- GPU -----------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_emulated_world_equals_reference_eager_and_replayed():
    """bf16 on one GPU: the DBO split program of an emulated EP-8 world (V2-Lite-like, 2
    layers) equals the one-device reference, run eagerly and replayed from CUDA graphs, also
    with a new step copied in without recapture."""
    from dbo_compile.runtime.cudagraph_runner import CudaGraphRunner
    from dbo_compile.testing import moe as H

    dev = "cuda"
    H.install_kernels("cuda", experts="grouped", attention="fused")
    model = H.build_model("deepseek-v2-lite", 2, None, dev, emulated_world_size=8,
                          vocab_size=4096, first_k_dense_replace=0, hidden_size=1024,
                          moe_intermediate_size=512, num_heads=8, num_kv_heads=8)
    ref = model.emulated_reference()
    steps = [H.make_bucket_step(model.config, "decode", 96, dev, seed=1),
             H.make_bucket_step(model.config, "prefill", 96, dev, seed=2)]
    blocks = max(s.num_blocks for s in steps)
    for m in (model, ref):
        m.allocate_kv_cache(blocks, 16)
    cm = torch.compile(model, backend="dbo", options=_options(
        world_size=8, compute_backend="aten", sm_carveout_candidates=(),
        schedule_candidates=("list+join",)))
    runner = CudaGraphRunner(cm, [128], max_blocks_per_req=int(steps[0].attn_metadata.block_table.shape[1]),
                             block_size=16, vocab_size=4096, timing_iters=2, keep_candidates=True)
    with torch.no_grad():
        runner.capture()
        b = runner.graphs[128]
        for step in steps:
            want = ref(step.input_ids, step.positions, step.attn_metadata).float()
            eager = run_step(cm, step.input_ids, step.positions, step.attn_metadata,
                             step.num_scheduled_tokens).float()
            errs = {"eager": H.rel_err(eager, want)}
            for name in b.graphs:
                runner.load_step(128, step.input_ids, step.positions, step.attn_metadata,
                                 step.num_scheduled_tokens, split=name != "unsplit")
                b.graphs[name].replay()
                torch.cuda.synchronize()
                errs[name] = H.rel_err(b.outs[name][0][:96], want)
            for name, e in errs.items():
                assert e["finite"] and e["max_rel"] < 0.05 and e["rows_off_5pct"] <= 0.02, (name, e)
