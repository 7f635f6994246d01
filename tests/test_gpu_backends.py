"""GPU tests (marker ``gpu``, one GPU, 1 EP rank) of the production backends: DeepEP
low-latency (``comm_backend="deep_ep"``) and DeepGEMM (``experts_backend="deep_gemm"``)
against the torch backends, the split program under the CUDA sanitizer, the Hugging Face
families on the grouped expert path in bf16, and DeepGEMM's kernels at DeepSeek-V2-Lite
shapes. Skipped without CUDA, or without the packages (``pip install
'dbo_compile[deepep,deepgemm]'``) where a test needs them. Run::

    PYTHONPATH=$PWD python -m pytest -q -m gpu tests/test_gpu_backends.py

One process holds one DeepEP low-latency buffer (NVSHMEM): every test here uses
``max_tokens=256``.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

_HERE = os.path.dirname(os.path.abspath(__file__))
MAX_REL, MAX_ROWS_OFF = 0.05, 0.02  # as tests/test_gpu.py: bf16 through 2 layers, top-6 of 64
LL_OPTIONS = {"comm_backend": "deep_ep", "experts_backend": "deep_gemm",
              "comm_backend_options": {"mode": "low_latency", "max_tokens": 256}}
BASE = {"split": "always", "schedule_candidates": False, "compute_backend": "aten",
        "sm_carveout_candidates": ()}


def _importable(name: str) -> bool:
    try:
        __import__(name)
        return True
    except Exception:  # noqa: BLE001 - no CUDA libraries, no nvcc: not importable
        return False


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_stack = pytest.mark.skipif(
    not torch.cuda.is_available() or not _importable("deep_ep") or not _importable("deep_gemm"),
    reason="needs CUDA, deep_ep and deep_gemm")


@pytest.fixture(scope="module", autouse=True)
def _release_deep_ep_buffers():
    """Destroy the NVSHMEM buffer before the interpreter exits (DeepEP warns of hangs in
    destructors run during exception handling)."""
    yield
    mod = sys.modules.get("dbo_compile.ops.deep_ep")
    if mod is not None:
        mod.release_buffers()


def _harness():
    from dbo_compile.testing import moe as H

    H.install_kernels("cuda", experts="grouped", attention="fused")
    return H


def _check(err: dict, what: str) -> None:
    assert err["finite"], (what, err)
    assert err["max_rel"] < MAX_REL and err["rows_off_5pct"] <= MAX_ROWS_OFF, (what, err)


@needs_stack
def test_ll_deepgemm_equals_torch_eagerly_and_replayed_from_a_cuda_graph():
    """DeepSeek-V2-Lite shapes, 2 MoE layers, a 256-token decode step: the split program on
    DeepEP LL + DeepGEMM equals the eager model on torch (local dispatch, torch grouped GEMM)
    and the split program on torch/torch, called eagerly and replayed from one CUDA graph; a
    new step's tokens, positions and metadata copied into the static buffers replay without
    recapture and equal that step's eager model."""
    from dbo_compile import backend as B
    from dbo_compile.runtime import capture as cg_capture
    from dbo_compile.runtime.engine import run_step
    from dbo_compile.testing import measure as cg

    H = _harness()
    B.register()
    model = H.build_model("deepseek-v2-lite", 2, None, "cuda", vocab_size=4096,
                          first_k_dense_replace=0)
    step = H.make_bucket_step(model.config, "decode", 256, "cuda", seed=1)
    new = H.make_bucket_step(model.config, "decode", 256, "cuda", seed=2, decode_ctx=130)
    model.allocate_kv_cache(max(step.num_blocks, new.num_blocks), step.block_size)
    g = torch.Generator(device="cuda").manual_seed(7)
    for c in model.kv_caches():
        c.normal_(generator=g)
    kv0 = [c.clone() for c in model.kv_caches()]
    ids, pos, md = step.input_ids, step.positions, step.attn_metadata
    qlens = step.num_scheduled_tokens

    def restore(kv):
        for c, c0 in zip(model.kv_caches(), kv):
            c.copy_(c0)

    outs = {}
    with torch.no_grad():
        ref = model(ids, pos, md).clone()
        for name, opts in (("torch", {}), ("ll", LL_OPTIONS)):
            torch._dynamo.reset()
            restore(kv0)
            cm = torch.compile(model, backend="dbo", options={**BASE, **opts})
            outs[name] = run_step(cm, ids, pos, md, qlens).clone()
            art = B.compiled_artifacts()[-1]
            assert art.is_split and art.stats.split_steps >= 1, art.reason
        _check(H.rel_err(outs["ll"], ref), "eager vs torch eager model")
        _check(H.rel_err(outs["ll"], outs["torch"]), "eager vs torch/torch split")
        sched = art.schedule
        assert sched.comm_backends == ["deep_ep:max_tokens=256,mode=low_latency"]
        assert any(u.phase == "receive" for u in sched.units)
        restore(kv0)
        sstep = cg.SplitStep(art, lambda: run_step(cm, ids, pos, md, qlens))
        restore(kv0)
        graph, gout = cg_capture.capture(sstep, warmup=2)
        restore(kv0)
        graph.replay()
        torch.cuda.synchronize()
        _check(H.rel_err(gout[0], ref), "graph replay")
        ids.copy_(new.input_ids)
        pos.copy_(new.positions)
        for name, t in md.tensors().items():
            nt = getattr(new.attn_metadata, name)
            if nt.shape == t.shape:
                t.copy_(nt)
        for c in model.kv_caches():
            c.normal_(generator=g)
        kv1 = [c.clone() for c in model.kv_caches()]
        ref2 = model(ids, pos, md).clone()
        restore(kv1)
        sstep.refresh()
        graph.replay()
        torch.cuda.synchronize()
        _check(H.rel_err(gout[0], ref2), "graph replay, new step")
        assert H.rel_err(gout[0], ref)["max_rel"] > 0.05  # the new step really is different


@needs_cuda
@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"])
def test_hf_family_bf16_grouped_experts_equal_the_unmodified_model(model_type, monkeypatch):
    """The expert-parallel block (1 EP rank) on the grouped expert path (never the dense loop:
    it raises here), eagerly and compiled with the split, against the unmodified model in
    bf16; the error is compared with the bf16 noise (unmodified bf16 vs fp32)."""
    pytest.importorskip("transformers")
    from dbo_compile import backend as B
    from dbo_compile.models.hf import EPMoEBlock, make_expert_parallel
    from dbo_compile.ops import experts
    from dbo_compile.testing.hf import tiny_hf_model

    def no_loop(*a, **k):
        raise AssertionError("the dense loop ran on CUDA")

    monkeypatch.setattr(experts, "experts_loop", no_loop)
    monkeypatch.setattr(EPMoEBlock, "_dense_experts", no_loop)
    B.register()
    ref32 = tiny_hf_model(model_type, seed=0, device="cuda")
    ref = tiny_hf_model(model_type, seed=0, dtype=torch.bfloat16, device="cuda")
    model = make_expert_parallel(copy.deepcopy(ref), None)
    ids = torch.randint(0, ref.config.vocab_size, (6, 9), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(1))
    with torch.no_grad():
        expected = ref(input_ids=ids, use_cache=False).logits.float()
        noise = (expected - ref32(input_ids=ids, use_cache=False).logits.float()).abs().max()
        eager = model(input_ids=ids, use_cache=False).logits.float()
        torch._dynamo.mark_dynamic(ids, 0)
        compiled = torch.compile(model, backend="dbo", options=BASE)(
            input_ids=ids, use_cache=False).logits.float()
    art = B.compiled_artifacts()[-1]
    assert art.is_split and art.stats.split_steps == 1, art.reason
    bound = 4 * float(noise) + 2e-2
    for what, got in (("eager", eager), ("compiled", compiled)):
        err = float((got - expected).abs().max())
        assert err <= bound, (model_type, what, err, float(noise))


@needs_stack
def test_deepgemm_kernels_at_deepseek_v2_lite_shapes():
    """DeepGEMM masked (on a DeepEP LL receive) and contiguous (on rank-major rows) against
    torch's grouped path, bf16 and FP8 (block scales: a few percent, printed)."""
    from dbo_compile.ops.experts import grouped_reference

    g = torch.Generator(device="cuda").manual_seed(0)
    e, h, inter, t, k = 64, 2048, 1408, 200, 6
    w13 = (torch.randn(e, 2 * inter, h, device="cuda", generator=g) / h ** 0.5).bfloat16()
    w2 = (torch.randn(e, h, inter, device="cuda", generator=g) / inter ** 0.5).bfloat16()
    x = torch.randn(t, h, device="cuda", generator=g).bfloat16()
    ids = torch.rand(t, e, device="cuda", generator=g).topk(k, -1).indices
    w = torch.rand(t, k, device="cuda", generator=g)
    rx, rid, rw, _ = torch.ops.dbo.moe_dispatch(x, ids, w, e, "")
    ref = grouped_reference(rx, rid, rw, w13, w2).float()
    errs = {}
    for spec in ("deep_gemm", "deep_gemm:fp8=true"):
        got = torch.ops.dbo.grouped_experts(rx, rid, rw, w13, w2, spec).float()
        errs["contiguous " + spec] = float((got - ref).norm() / ref.norm())
    ll = "deep_ep:max_tokens=256,mode=low_latency"
    lx, cnt, lay, src = torch.ops.dbo.moe_dispatch(x, ids, w, e, "", ll)
    ref_m = grouped_reference(lx, cnt, lay, w13, w2).float()
    rows = [(i, int(cnt[i])) for i in range(e)]
    pick = lambda y: torch.cat([y[i, :n] for i, n in rows])  # noqa: E731
    for spec in ("deep_gemm", "deep_gemm:fp8=true"):
        got = torch.ops.dbo.grouped_experts(lx, cnt, lay, w13, w2, spec).float()
        errs["masked " + spec] = float((pick(got) - pick(ref_m)).norm() / pick(ref_m).norm())
    print(errs)
    assert errs["contiguous deep_gemm"] < 0.01 and errs["masked deep_gemm"] < 0.01, errs
    assert errs["contiguous deep_gemm:fp8=true"] < 0.1 and errs["masked deep_gemm:fp8=true"] < 0.1


_SANITIZER = r"""
import json, sys
import torch
import torch.cuda._sanitizer as csan
from torch.utils._python_dispatch import _disable_current_modes
from dbo_compile import backend as B
from dbo_compile.runtime.engine import run_step
from dbo_compile.testing import measure as cg
from dbo_compile.testing import moe as H

options = json.loads(sys.argv[1])
res = {"csan_enabled": bool(csan.cuda_sanitizer.enabled)}
B.register()
H.install_kernels("cuda", experts="grouped", attention="ref")
model = H.build_model("deepseek-v2-lite", 2, None, "cuda", vocab_size=4096,
                      first_k_dense_replace=0)
step = H.make_bucket_step(model.config, "prefill", 256, "cuda", seed=1, prompt=128)
model.allocate_kv_cache(step.num_blocks, step.block_size)
ids, pos, md = step.input_ids, step.positions, step.attn_metadata
with torch.no_grad():
    for name, opts in options.items():
        with _disable_current_modes():  # Dynamo does not compile under a dispatch mode
            torch._dynamo.reset()
            cm = torch.compile(model, backend="dbo", options=opts)
            run_step(cm, ids, pos, md, step.num_scheduled_tokens)
            art = B.compiled_artifacts()[-1]
            sstep = cg.SplitStep(art, lambda: run_step(cm, ids, pos, md,
                                                       step.num_scheduled_tokens))
        try:
            art.split_program(*sstep.split_args)
            torch.cuda.synchronize()
            res[name] = "ok"
        except Exception as e:
            res[name] = type(e).__name__ + ": " + str(e)[:1500]
        if name == "torch":  # negative control: the torch program without its event waits
            program = art.split_program
            waits = program._fn.__globals__["wait"]
            program._fn.__globals__["wait"] = lambda stream, event: None
            try:
                program(*sstep.split_args)
                torch.cuda.synchronize()
                res["torch/no_waits"] = "not reported"
            except Exception as e:
                res["torch/no_waits"] = type(e).__name__
            program._fn.__globals__["wait"] = waits
print("RESULT " + json.dumps(res), flush=True)
"""


@needs_stack
def test_ll_split_program_under_cuda_sanitizer():
    """TORCH_CUDA_SANITIZER=1 in a fresh process: the DeepEP LL + DeepGEMM split program
    reports no unsynchronized access (its LL units share the compute stream); the control:
    the torch/torch split program without its event waits is reported."""
    options = {"ll": {**BASE, **LL_OPTIONS},
               "torch": {**BASE}}
    env = dict(os.environ, TORCH_CUDA_SANITIZER="1",
               PYTHONPATH=os.pathsep.join([os.path.dirname(_HERE), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _SANITIZER, json.dumps(options)],
                          env=env, capture_output=True, text=True, timeout=300)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line, f"rc={proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    res = json.loads(line[len("RESULT "):])
    print(res)
    assert res["csan_enabled"] and res["ll"] == "ok", res
    assert res["torch"] == "ok" and res["torch/no_waits"] == "CUDASanitizerErrors", res
