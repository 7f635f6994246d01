"""The deep_gemm experts backend (dbo_compile.ops.deep_gemm) on CPU, against a reference of
DeepGEMM's documented semantics (dbo_compile.testing.fake_deep_gemm, injected as
``deep_gemm``): the masked GEMM fed straight from the expert-major layout (rows past the counts
NaN in and garbage out), the contiguous psum layout with 128-row-aligned segments (the
reference computes a misaligned segment with the wrong expert, as DeepGEMM does), FP8 block
scales against bf16, option validation, what it refuses, and the fallback without the
package. The compiled model with DeepEP low-latency (the reference deep_ep) and DeepGEMM equals
the eager model on the torch backends.
"""

from __future__ import annotations

import logging
import sys

import pytest
import torch

import dbo_compile.ops  # noqa: F401
from conftest import last_artifact
from dbo_compile.errors import ExpertsOpError
from dbo_compile.ops import experts
from dbo_compile.ops.experts import ExpertFn, experts_loop, get_experts_backend
from dbo_compile.ops.registry import bound_backend
from dbo_compile.testing import fake_deep_gemm

BF16 = dict(rtol=2e-2, atol=2e-2)


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_gemm", fake_deep_gemm)
    experts.clear_configured_experts_backends()
    fake_deep_gemm.CALLS.clear()
    yield fake_deep_gemm
    experts.clear_configured_experts_backends()


def _weights(e=4, h=256, inter=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(e, 2 * inter, h, generator=g) * 0.05).bfloat16()
    w2 = (torch.randn(e, h, inter, generator=g) * 0.05).bfloat16()
    return w13, w2


def _expert_major(e=4, m=64, h=256, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(e, m, h, generator=g).bfloat16()
    counts = torch.tensor([5, 0, m, 17][:e], dtype=torch.int32)
    for i in range(e):
        x[i, counts[i]:] = float("nan")  # undefined rows of the receive buffer
    return x, counts, torch.zeros(e, 1, dtype=torch.int64)


def _rank_major(n=50, k=3, e=4, h=256, seed=2):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g).bfloat16()
    ids = torch.randint(-1, e, (n, k), generator=g)
    ids[:4] = -1
    return x, ids, torch.rand(n, k, generator=g)


def test_masked_gemm_reads_the_expert_major_layout_as_it_is(fake):
    x, counts, ranges = _expert_major()
    w13, w2 = _weights()
    y = torch.ops.dbo.grouped_experts(x, counts, ranges, w13, w2, "deep_gemm")
    ref = experts_loop(x, counts, ranges, w13, w2)
    for e in range(4):
        n = int(counts[e])
        torch.testing.assert_close(y[e, :n].float(), ref[e, :n].float(), **BF16)
    assert fake.CALLS["bf16_masked"] == 2 and not fake.CALLS["bf16_contiguous"]


def test_contiguous_gemm_with_aligned_segments_equals_the_loop(fake):
    x, ids, w = _rank_major()
    w13, w2 = _weights()
    y = torch.ops.dbo.grouped_experts(x, ids, w, w13, w2, "deep_gemm")
    torch.testing.assert_close(y.float(), experts_loop(x, ids, w, w13, w2).float(), **BF16)
    assert y[:4].abs().max() == 0  # rows with no local slot
    assert fake.CALLS["bf16_contiguous"] == 2


def test_contiguous_gemm_ids_outside_the_local_experts_contribute_nothing(fake):
    """Issue 29, finding 8, on the deep_gemm path: slots whose id is outside ``[0, E_local)``
    contribute nothing (``dbo.grouped_experts``' rule). Before: such a slot kept its weight
    and read the spare row past the segments (clamped on CPU, out of bounds on CUDA)."""
    x, ids, w = _rank_major()
    w13, w2 = _weights()
    bad = ids.clone()
    bad[4:12, 0] = 4       # E_local: another rank's first expert
    bad[12:20, 1] = 2**20  # far past it
    bad[20:24, 2] = -5     # negative, not the padding -1
    y = torch.ops.dbo.grouped_experts(x, bad, w, w13, w2, "deep_gemm")
    local = torch.where((bad >= 0) & (bad < 4), bad, -1)
    torch.testing.assert_close(y.float(), experts_loop(x, local, w, w13, w2).float(), **BF16)
    assert torch.isfinite(y).all()


def test_misaligned_segments_would_be_wrong(fake, monkeypatch):
    """The check above can fail: segments laid out without DeepGEMM's 128-row alignment are
    computed with the wrong expert (silently, as on the GPU)."""
    x, ids, w = _rank_major(n=120)
    w13, w2 = _weights()
    monkeypatch.setattr(fake, "get_mk_alignment_for_contiguous_layout", lambda: 1)
    experts.clear_configured_experts_backends()
    y = torch.ops.dbo.grouped_experts(x, ids, w, w13, w2, "deep_gemm")
    ref = experts_loop(x, ids, w, w13, w2)
    assert not torch.allclose(y.float(), ref.float(), **BF16)


@pytest.mark.parametrize("layout", ["expert_major", "rank_major"])
def test_fp8_block_scales_stay_close_to_bf16(fake, layout):
    """FP8 e4m3 with 1x128 activation and 128x128 weight scales: within a few percent of the
    bf16 result (the GPU figures are in the benchmark); the FP8 kernels' names are the wheel's
    (``m_grouped_fp8_gemm_nt_masked`` does not exist there)."""
    w13, w2 = _weights()
    args = _expert_major() if layout == "expert_major" else _rank_major()
    bf16 = torch.ops.dbo.grouped_experts(*args, w13, w2, "deep_gemm")
    fp8 = torch.ops.dbo.grouped_experts(*args, w13, w2, "deep_gemm:fp8=true")
    if layout == "expert_major":
        rows = [(e, int(args[1][e])) for e in range(4)]
        bf16 = torch.cat([bf16[e, :n] for e, n in rows])
        fp8 = torch.cat([fp8[e, :n] for e, n in rows])
    rel = ((fp8.float() - bf16.float()).norm() / bf16.float().norm()).item()
    assert 0 < rel < 0.08, rel
    assert fake.CALLS["fp8_masked" if layout == "expert_major" else "fp8_contiguous"] == 2


def test_fp8_weights_are_quantised_once(fake):
    w13, w2 = _weights()
    backend = get_experts_backend("deep_gemm:fp8=true")
    args = _rank_major()
    backend.run(*args, w13, w2)
    backend.run(*args, w13, w2)
    impl = backend.run.__self__
    assert len(impl._weights) == 2  # w13 and w2, cast on the first call only
    w13.mul_(1.0)  # an in-place change: cast again
    backend.run(*args, w13, w2)
    assert len(impl._weights) == 3


def test_fp8_weights_at_a_reused_address_are_cast_again(fake):
    """A weight freed and a new one at its address (same shape, version 0: what the CUDA
    caching allocator does between bench_experts' calls) is not served the freed one's cast."""
    e, h, inter = 2, 256, 128
    buf = bytearray(e * 2 * inter * h * 2)  # one block of memory, two weights in turn

    def weight_in_buf(seed):
        fill = torch.frombuffer(buf, dtype=torch.bfloat16)
        fill.copy_((torch.randn(fill.numel(), generator=torch.Generator().manual_seed(seed))
                    * 0.05).bfloat16())
        del fill
        return torch.frombuffer(buf, dtype=torch.bfloat16).view(e, 2 * inter, h)  # version 0

    _, w2 = _weights(e, h, inter)
    x, counts, ranges = _expert_major(e, h=h)
    backend = get_experts_backend("deep_gemm:fp8=true")
    first = weight_in_buf(0)
    key = (first.data_ptr(), first._version)
    backend.run(x, counts, ranges, first, w2)
    del first
    second = weight_in_buf(1)
    assert (second.data_ptr(), second._version) == key  # the address and version collide
    got = backend.run(x, counts, ranges, second, w2)
    experts.clear_configured_experts_backends()
    want = get_experts_backend("deep_gemm:fp8=true").run(x, counts, ranges, second, w2)
    for i, n in enumerate(counts.tolist()):
        torch.testing.assert_close(got[i, :n], want[i, :n], rtol=0, atol=0)


def test_casts_follow_the_block_scale_rule():
    from dbo_compile.ops.deep_gemm import per_block_cast_fp8, per_token_cast_fp8

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, 256, generator=g)
    q, s = per_token_cast_fp8(x)
    assert s.shape == (3, 8, 2) and s.stride() == (16, 1, 8)  # MN-major
    torch.testing.assert_close(s, x.view(3, 8, 2, 128).abs().amax(-1) / 448)
    deq = (q.float().view(3, 8, 2, 128) * s.unsqueeze(-1)).view(3, 8, 256)
    assert ((deq - x).norm() / x.norm()) < 0.05
    w = torch.randn(2, 256, 384, generator=g)
    qw, sw = per_block_cast_fp8(w)
    assert sw.shape == (2, 2, 3) and qw.dtype == torch.float8_e4m3fn


def test_deep_gemm_refuses_what_it_does_not_compute(fake):
    backend = get_experts_backend("deep_gemm")
    assert "biases" in backend.supports({"activation": "gpt_oss", "bias": True})
    assert backend.supports({"activation": "silu", "bias": False, "dtype": torch.bfloat16,
                             "hidden": 2048, "intermediate": 1408}) is None
    assert "multiples of 128" in get_experts_backend("deep_gemm:fp8=true").supports(
        {"hidden": 2048, "intermediate": 1400})
    x, ids, w = _rank_major()
    w13, w2 = _weights()
    b13 = torch.zeros(4, 256, dtype=torch.bfloat16)
    with pytest.raises(ExpertsOpError, match="SwiGLU without biases"):
        backend.run(x, ids, w, w13, w2, fn=ExpertFn("silu", b13))


@pytest.mark.parametrize("spec, match", [("deep_gemm:fp8=yes", "fp8='yes'"),
                                         ("deep_gemm:expected_m=0", "expected_m=0"),
                                         ("deep_gemm:tile=3", "unknown option")])
def test_option_validation(fake, spec, match):
    with pytest.raises(ExpertsOpError, match=match):
        get_experts_backend(spec)


def test_without_deep_gemm_the_error_names_the_package_and_the_fallback(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_gemm", None)
    experts.clear_configured_experts_backends()
    with pytest.raises(ExpertsOpError) as info:
        get_experts_backend("deep_gemm")
    msg = str(info.value)
    assert "sgl-deep-gemm 0.1.5.post1" in msg and "CUDA 13" in msg
    assert "experts_backend='torch'" in msg
    experts.clear_configured_experts_backends()


# --------------------------------------------------------------------------------------------
# The compiled model: DeepEP low-latency (reference) + DeepGEMM (reference), and auto
# --------------------------------------------------------------------------------------------


def _close_rows(out, ref, max_rows_off=0.02):
    """bf16 through two layers: a near-tie in a router's top-k can flip one token's experts
    when the rounding changes (DeepGEMM rounds its GEMMs once), so a few rows may differ (as
    tests/test_gpu.py allows), nothing systematic."""
    diff = (out.float() - ref.float()).abs()
    rows_off = (diff.amax(-1) > 0.05 * ref.float().abs().amax(-1)).float().mean().item()
    assert rows_off <= max_rows_off and diff.median().item() < 1e-2, (rows_off, diff.max())


def _model():
    from test_deep_ep import _ll_model

    return _ll_model(moe_intermediate_size=128)


@pytest.mark.parametrize("experts_backend", ["deep_gemm", "auto"])
def test_compiled_model_on_deepep_ll_and_deepgemm_equals_eager(fake, monkeypatch, caplog,
                                                               experts_backend):
    from test_deep_ep import _install_fake, eager_and_compiled

    adapter = _install_fake(monkeypatch)
    with caplog.at_level(logging.INFO, logger="dbo_compile"):
        eager, out = eager_and_compiled(*_model(), experts_backend=experts_backend)
    art = last_artifact()
    assert art.is_split, art.reason
    _close_rows(out, eager)
    bound = {bound_backend(n) for n in art.split_gm.graph.nodes
             if n.target is torch.ops.dbo.grouped_experts.default}
    assert bound == {"deep_gemm"}, bound
    assert fake.CALLS["bf16_masked"] > 0 and not fake.CALLS["bf16_contiguous"]
    if experts_backend == "auto":
        assert "experts_backend=auto -> deep_gemm" in caplog.text
    adapter._BUFFERS.clear()


def test_auto_experts_keeps_torch_for_rank_major_rows_and_says_so(fake, caplog):
    from dbo_compile.models.deepseek import DeepseekMoEModel, get_config

    cfg = get_config("tiny", num_layers=1)
    model = DeepseekMoEModel(cfg, ep_group=None, seed=0)
    from dbo_compile.models.batch import make_step

    step = make_step(cfg, decode_context_lens=[], prefills=[(0, 16)], block_size=16, seed=0)
    model.allocate_kv_cache(step.num_blocks, step.block_size)
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="dbo_compile"):
        torch.compile(model, backend="dbo", options={"split": "always"})(
            step.input_ids, step.positions, step.attn_metadata)
    assert "experts_backend=auto -> torch for the rank-major rows" in caplog.text
    assert "comm_backend=auto -> local" in caplog.text


_MASKED_SILU_CHECK = """
import torch
import torch.nn.functional as F
from dbo_compile.ops.experts_kernels import expert_kernels as _triton_kernel
triton, kern = _triton_kernel()
e, m, inter = 3, 8, 48
h = torch.randn(e, m, 2 * inter)
counts = torch.tensor([0, 8, 3], dtype=torch.int32)
a = torch.full((e, m, inter), float("nan"))
kern["silu_mul"][(e * m, triton.cdiv(inter, 32))](h, a, counts, m, inter, BLOCK=32)
ref = F.silu(h[..., :inter]) * h[..., inter:]
for i in range(e):
    n = int(counts[i])
    torch.testing.assert_close(a[i, :n], ref[i, :n])
    assert torch.isnan(a[i, n:]).all()  # rows past the count: not touched
print("ok")
"""


def test_masked_silu_kernel_touches_only_rows_below_the_counts_in_interpreter():
    """The SiLU-and-multiply between DeepGEMM's masked GEMMs (the grouped path's kernel with
    a per-expert count) under Triton's CPU interpreter."""
    from triton_interp import run_interpreted

    assert run_interpreted(_MASKED_SILU_CHECK).strip().endswith("ok")
