"""The deep_ep comm backend (dbo_compile.ops.deep_ep) on CPU, against a reference of DeepEP's
documented semantics (dbo_compile.testing.fake_deep_ep, injected as ``deep_ep``): the
expert-major low-latency layout read order-insensitively (the reference permutes each
expert's rows per call, as the GPU's atomics do), the receive hook as a unit of its own that
must come before the next LL op (the reference raises where the GPU would hang), the normal
mode's handle packed through the op and its host-read-free dispatch (2 Gloo ranks), option
validation, and the fallbacks when DeepEP is missing (the real package cannot import here).
"""

from __future__ import annotations

import dataclasses
import logging
import sys

import pytest
import torch

import dbo_compile.ops  # noqa: F401
from conftest import last_artifact
from dbo_compile.errors import CommBackendError, CommOpError
from dbo_compile.models.batch import fill_kv_cache, make_step
from dbo_compile.models.deepseek import DeepseekMoEModel, get_config
from dbo_compile.ops import comm
from dbo_compile.ops.registry import comm_kind
from dbo_compile.testing import fake_deep_ep, run_multirank

LL = "deep_ep:max_tokens=64,mode=low_latency"
BF16 = dict(rtol=2e-2, atol=2e-2)


def _install_fake(monkeypatch=None):
    """``deep_ep`` = the reference; forget configured backends and buffers (test isolation)."""
    if monkeypatch is not None:
        monkeypatch.setitem(sys.modules, "deep_ep", fake_deep_ep)
    else:
        sys.modules["deep_ep"] = fake_deep_ep
    comm.clear_configured_comm_backends()
    from dbo_compile.ops import deep_ep as adapter

    adapter._BUFFERS.clear()
    fake_deep_ep._ALIVE_LL.clear()
    return adapter


@pytest.fixture
def fake(monkeypatch):
    adapter = _install_fake(monkeypatch)
    yield adapter
    adapter._BUFFERS.clear()
    fake_deep_ep._ALIVE_LL.clear()
    comm.clear_configured_comm_backends()


def _routing(t=20, e=8, k=2, h=2048, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).bfloat16()
    ids = torch.rand(t, e, generator=g).topk(k, -1).indices
    ids[3, 1] = -1  # a masked slot
    ids[5, :] = -1  # a token with no expert
    return x, ids, torch.rand(t, k, generator=g)


# --------------------------------------------------------------------------------------------
# The low-latency layout through the ops (one rank)
# --------------------------------------------------------------------------------------------


def test_ll_dispatch_gives_the_expert_major_layout(fake):
    """Rows [0, count[e]) of expert e are the tokens routed to it, in the reference's random
    order (``src_info`` says which), the rest are undefined; the ranges say where each source
    rank's block is."""
    x, ids, w = _routing()
    recv_x, count, layout, src = torch.ops.dbo.moe_dispatch(x, ids, w, 8, "", LL)
    assert recv_x.shape == (8, 64, 2048) and count.dtype == torch.int32 and count.shape == (8,)
    assert layout.shape == (8, 1) and layout.dtype == torch.int64 and src.shape == (8, 64)
    orders = []
    for e in range(8):
        n = int(count[e])
        rows = src[e, :n].long()
        assert sorted(rows.tolist()) == sorted((ids == e).any(1).nonzero().flatten().tolist())
        assert torch.equal(recv_x[e, :n], x[rows])
        assert int(layout[e, 0]) & 0xFFFFFFFF == n and int(layout[e, 0]) >> 32 == 0
        assert torch.isnan(recv_x[e, n:].float()).all()  # past the count: undefined
        orders.append(rows.tolist())
    again = torch.ops.dbo.moe_dispatch(x, ids, w, 8, "", LL)[3]
    assert any(again[e, :len(o)].tolist() != o for e, o in enumerate(orders)), \
        "the reference must vary the order within an expert, as the GPU does"


def test_ll_experts_and_combine_equal_the_rank_major_path(fake):
    """dbo.grouped_experts on the expert-major rows (unweighted) + the weighting combine ==
    the rank-major path of the local backend (weighted experts, summing combine)."""
    x, ids, w = _routing()
    g = torch.Generator().manual_seed(1)
    w13 = (torch.randn(8, 64, 2048, generator=g) * 0.02).bfloat16()
    w2 = (torch.randn(8, 2048, 32, generator=g) * 0.05).bfloat16()
    rx, cnt, lay, src = torch.ops.dbo.moe_dispatch(x, ids, w, 8, "", LL)
    y = torch.ops.dbo.grouped_experts(rx, cnt, lay, w13, w2)
    out = torch.ops.dbo.moe_combine(y, ids, w, cnt, lay, src, "", LL)
    rrx, rid, rw, h = torch.ops.dbo.moe_dispatch(x, ids, w, 8, "")
    ref = torch.ops.dbo.moe_combine(torch.ops.dbo.grouped_experts(rrx, rid, rw, w13, w2),
                                    ids, w, rid, rw, h, "")
    torch.testing.assert_close(out.float(), ref.float(), **BF16)
    assert out[5].abs().max() == 0  # no expert: zeros


def test_ll_a_layout_read_in_order_would_be_wrong(fake):
    """The check above can fail: reading expert e's rows as if they were its tokens in
    ascending order (what a rank-major re-pack would assume) gives wrong rows."""
    x, ids, w = _routing()
    rx, cnt, _, src = torch.ops.dbo.moe_dispatch(x, ids, w, 8, "", LL)
    wrong = 0
    for e in range(8):
        n = int(cnt[e])
        tokens = (ids == e).any(1).nonzero().flatten()
        wrong += int(not torch.equal(rx[e, :n], x[tokens]))
    assert wrong > 0


def test_ll_in_flight_rule_is_enforced_before_deepep_is_called(fake):
    """Two issues without the receive between: the adapter refuses the second (on the GPU
    the ranks would hang); the receive of a call that is not the oldest is refused too."""
    x, ids, w = _routing()
    first = torch.ops.dbo.moe_dispatch(x, ids, w, 8, "", LL, True)
    with pytest.raises(CommBackendError, match="in-flight"):
        torch.ops.dbo.moe_dispatch(x, ids, w, 8, "", LL, True)
    assert torch.isnan(first[0].float()).all()  # nothing received yet
    with pytest.raises(CommBackendError, match="not the oldest"):
        comm.comm_receive((torch.zeros(1),), LL)
    comm.comm_receive(first, LL)
    n = int(first[1][0])
    assert torch.equal(first[0][0, :n], x[first[3][0, :n].long()])
    torch.ops.dbo.moe_dispatch(x, ids, w, 8, "", LL, True)  # nothing in flight: allowed
    comm.abort_pending_receives()  # a failed step's left-over is received
    assert not fake._BUFFERS[("low_latency", "", 64, 2048, 8)]._ll_pending


def test_ll_limits_are_clear_errors(fake):
    x, ids, w = _routing(t=80)
    with pytest.raises(CommOpError, match="exceed the low-latency capacity max_tokens=64"):
        torch.ops.dbo.moe_dispatch(x, ids, w, 8, "", LL)
    x, ids, w = _routing(h=1024)
    with pytest.raises(CommOpError, match="hidden in"):
        torch.ops.dbo.moe_dispatch(x, ids, w, 8, "", LL)


@pytest.mark.parametrize("options, match", [
    ("mode=fast", "mode='fast'"), ("max_tokens=0", "max_tokens=0"),
    ("bogus=1", "unknown option"),
])
def test_option_validation(fake, options, match):
    with pytest.raises(CommBackendError, match=match):
        comm.get_comm_backend(f"deep_ep:{options}")


def test_without_deep_ep_the_error_names_the_package_and_the_fallback(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_ep", None)  # import deep_ep -> ImportError
    comm.clear_configured_comm_backends()
    with pytest.raises(CommBackendError) as info:
        comm.get_comm_backend("deep_ep:mode=low_latency")
    msg = str(info.value)
    assert "deep_ep" in msg and "pip install 'dbo_compile[deepep]'" in msg
    assert "torch 2.11" in msg and "CUDA 13" in msg and "comm_backend='torch'" in msg
    comm.clear_configured_comm_backends()


def test_auto_picks_torch_on_cpu_and_says_so(monkeypatch, caplog):
    """comm_backend='auto' with an EP group of 2 and no importable DeepEP: the ops keep torch,
    and the log says why (the bind pass only; no process group is needed)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from dbo_compile.config import DboConfig
    from dbo_compile.passes import bind

    monkeypatch.setitem(sys.modules, "deep_ep", None)
    monkeypatch.setattr(bind, "ep_world_size", lambda name: 2)
    comm.clear_configured_comm_backends()

    def layer(x, ids, w):
        rx, rid, rw, h = torch.ops.dbo.moe_dispatch(x, ids, w, 8, "g")
        return torch.ops.dbo.moe_combine(rx, ids, w, rid, rw, h, "g")

    x, ids, w = _routing(h=64)
    monkeypatch.setattr(comm.ops, "ep_world_size", lambda name: 1)  # trace with the local shapes
    gm = make_fx(layer, tracing_mode="fake")(x, ids, w)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and comm_kind(n)]
    with caplog.at_level(logging.INFO, logger="dbo_compile"):
        assert bind._choose_comm(gm, DboConfig(), nodes) is None
    assert "comm_backend=auto -> torch" in caplog.text and "deep_ep" in caplog.text
    comm.clear_configured_comm_backends()


# --------------------------------------------------------------------------------------------
# The compiled model (one rank, low latency)
# --------------------------------------------------------------------------------------------


def _ll_model(layers=2, **overrides):
    """A bf16 model of a hidden size DeepEP's low-latency kernels take (2048), 64 tokens."""
    cfg = get_config("tiny", num_layers=layers, hidden_size=2048, num_experts=8, top_k=2,
                     **overrides)
    model = DeepseekMoEModel(cfg, ep_group=None, dtype=torch.bfloat16, seed=0)
    step = make_step(cfg, decode_context_lens=[30 + i for i in range(24)], prefills=[(0, 40)],
                     block_size=16, seed=0)
    model.allocate_kv_cache(step.num_blocks, step.block_size)
    fill_kv_cache(model, step, seed=0)
    return model, step


def eager_and_compiled(model, step, **options):
    """The eager model's logits (the ops' own backends) and the compiled split step's with
    ``options`` (LL, max_tokens 64 by default), from the same KV cache."""
    caches = [c.clone() for c in model.kv_caches()]
    with torch.no_grad():
        eager = model(step.input_ids, step.positions, step.attn_metadata)
        for c, s in zip(model.kv_caches(), caches):
            c.copy_(s)
        compiled = torch.compile(model, backend="dbo", options={
            "split": "always", "comm_backend": "deep_ep", "schedule_candidates": False,
            "comm_backend_options": {"mode": "low_latency", "max_tokens": 64}, **options})
        out = compiled(step.input_ids, step.positions, step.attn_metadata)
    return eager, out


def test_compiled_model_on_ll_equals_eager_and_honours_the_in_flight_rule(fake):
    """The split program with comm_backend='deep_ep' (LL) equals the eager model on the local
    backend; its LL units are on the compute stream, each op's receive is a unit of its own,
    and the receive of op n comes before the issue of op n + 1 (the reference would raise)."""
    eager, out = eager_and_compiled(*_ll_model())
    art = last_artifact()
    assert art.is_split and art.stats.split_steps == 1, art.reason
    torch.testing.assert_close(out, eager, **BF16)
    sched = art.schedule
    comm_units = [u for u in sched.units if u.kind == "comm"]
    assert comm_units and all(u.stream == "compute" for u in comm_units)
    issues = [u for u in comm_units if u.phase == "issue"]
    receives = [u for u in comm_units if u.phase == "receive"]
    assert len(issues) == len(receives) == 8  # 2 layers x 2 ubatches x (dispatch, combine)
    order = [u.phase for u in comm_units]
    assert order == ["issue", "receive"] * 8, order  # one LL op in flight, in order
    assert all(i.latency_us > 0 for i in issues)
    (key,) = sched.pools
    assert sched.pools[key] == {"live": None, "in_flight": 1}
    assert any(u.kind == "compute" and issues[0].id < u.id < receives[0].id for u in sched.units), \
        "the other ubatch's compute runs between the first send and its receive"
    assert not sched.event_edges or all(
        sched.units[a].stream == sched.units[b].stream == "compute" for a, b in sched.event_edges)
    assert "(comm_receive,) = units[" in art.code  # the receive hook is a unit of its own
    # nothing ran on the comm stream: no join with it (a wait on an event recorded there
    # depends on work outside a CUDA-graph capture: cudaErrorStreamCaptureIsolation on the H200)
    assert "s_comm" not in art.code.split("units = self.units", 1)[1], art.code
    buf = fake._BUFFERS[("low_latency", "", 64, 2048, 8)]
    assert buf.ll_ops % 2 == 0  # an even number of LL ops per step (CUDA-graph parity)


def test_a_declaration_without_the_in_flight_rule_is_caught(fake):
    """The same backend registered without its pool: the list schedule issues the second
    ubatch's dispatch before the first's receive; the adapter refuses (no hang), the step
    fails with the project's error and the next step's backend is clean."""
    from dbo_compile.errors import UBatchExecutionError

    ll = comm.get_comm_backend(LL)
    comm.register_comm_backend(dataclasses.replace(ll, name="deep_ep_nopool", pools=()))
    model, step = _ll_model(layers=1)
    compiled = torch.compile(model, backend="dbo", options={
        "split": "always", "comm_backend": "deep_ep_nopool", "schedule_candidates": False})
    with torch.no_grad(), pytest.raises(UBatchExecutionError, match="in-flight"):
        compiled(step.input_ids, step.positions, step.attn_metadata)
    assert not ll.receive.__self__.pending  # the aborted step's call was received


# --------------------------------------------------------------------------------------------
# Two Gloo ranks: normal mode (HT) and low latency, auto
# --------------------------------------------------------------------------------------------


def _two_rank_body(rank, world_size):
    import torch.distributed as dist

    from dbo_compile.backend import compiled_artifacts, register, reset_artifacts

    register()
    adapter = _install_fake()
    out = {}
    for name, hidden, options in (("normal", 64, {"mode": "normal"}),
                                  ("auto", 64, {}),
                                  ("low_latency", 2048, {"mode": "low_latency", "max_tokens": 64})):
        torch._dynamo.reset()
        reset_artifacts()
        cfg = get_config("tiny", num_layers=2, hidden_size=hidden, num_experts=8, top_k=2)
        model = DeepseekMoEModel(cfg, ep_group=dist.group.WORLD, dtype=torch.bfloat16, seed=0)
        step = make_step(cfg, decode_context_lens=[20 + rank] * 6, prefills=[(0, 26)],
                         block_size=16, seed=rank)
        model.allocate_kv_cache(step.num_blocks, step.block_size)
        fill_kv_cache(model, step, seed=rank)
        caches = [c.clone() for c in model.kv_caches()]
        reads = fake_deep_ep.HOST_READS[0]
        with torch.no_grad():
            eager = model(step.input_ids, step.positions, step.attn_metadata)
            for c, s in zip(model.kv_caches(), caches):
                c.copy_(s)
            compiled = torch.compile(model, backend="dbo", options={
                "split": "always", "comm_backend": "deep_ep" if name != "auto" else "auto",
                "schedule_candidates": False, "comm_backend_options": options})
            got = compiled(step.input_ids, step.positions, step.attn_metadata)
        art = compiled_artifacts()[-1]
        out[name] = {"split": art.is_split and art.stats.split_steps == 1,
                     "reason": art.reason,
                     "err": (got.float() - eager.float()).abs().max().item(),
                     "scale": eager.float().abs().max().item(),
                     "backends": art.schedule.comm_backends if art.is_split else [],
                     "host_reads": fake_deep_ep.HOST_READS[0] - reads,
                     "code": art.code if art.is_split else ""}
        adapter._BUFFERS.clear()
        fake_deep_ep._ALIVE_LL.clear()
    return out


@pytest.mark.multirank
def test_two_ranks_normal_low_latency_and_auto_equal_eager():
    results = run_multirank(_two_rank_body, 2, timeout_s=600)
    for r in results:
        for name in ("normal", "auto", "low_latency"):
            res = r[name]
            assert res["split"], (name, res["reason"])
            assert res["err"] <= 0.05 * res["scale"], (name, res["err"], res["scale"])
        assert r["normal"]["host_reads"] == 0  # num_worst_tokens: no host read of the counts
        assert r["normal"]["backends"] == ["deep_ep:mode=normal"]
        assert r["auto"]["backends"] == ["deep_ep:mode=normal"]  # auto, 2 ranks: normal mode
        assert r["low_latency"]["backends"] == [LL]
    assert results[0]["low_latency"]["code"] == results[1]["low_latency"]["code"]
