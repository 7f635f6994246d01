"""The Triton kernel of ``dbo.attention`` against the reference ``paged_attention``.

- Interpreter tests (CPU): Triton's interpreter runs the kernel on CPU tensors; small cases,
  several tile shapes. ``TRITON_INTERPRET=1`` must be set before triton is imported, so a
  module fixture runs every case in one subprocess (this file as a script) and the tests check
  what it returns.
- GPU tests (marker ``gpu``): DeepSeek-V2-Lite attention shapes (Hq = 16, D = 128, block_size
  16) and GQA, the op as registered on CUDA, and a CUDA graph replayed with new metadata.

The whole module is skipped without Triton. Run::

    python -m pytest -q tests/test_attention_kernel.py            # interpreter (+ GPU if CUDA)
    python -m pytest -q -m gpu tests/test_attention_kernel.py     # GPU only
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest
import torch
from torch.testing import assert_close

triton = pytest.importorskip("triton")

import dbo_compile.ops  # noqa: E402,F401
from dbo_compile.models.batch import make_step  # noqa: E402

attention_mod = importlib.import_module("dbo_compile.ops.attention")

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class _Cfg:
    vocab_size = 10


class _Inputs:
    """One step's attention inputs: metadata from ``make_step`` (shuffled, non-contiguous block
    tables in a pool with spare blocks), random q/k/v and cache.

    ``cache`` already holds this step's k/v (written by ``write_kv``, as the op does before
    attending), so ``kernel(...)`` and ``reference()`` read the same cache.
    """

    def __init__(self, decodes, prefills, hq, hkv, d, block_size, pad_to=None,
                 dtype=torch.float32, device="cpu", seed=0, spare_blocks=5, meta_dtype=None,
                 num_blocks=None):
        needed = sum(-(-(c + q) // block_size) for c, q in
                     [(c, 1) for c in decodes] + list(prefills))
        nb = num_blocks if num_blocks is not None else needed + spare_blocks
        step = make_step(_Cfg, decode_context_lens=decodes, prefills=prefills,
                         block_size=block_size, num_blocks=nb, seed=seed, pad_to=pad_to)
        md = step.attn_metadata
        self.step = step
        meta = [x.to(device, meta_dtype or x.dtype)
                for x in (md.query_start_loc, md.seq_lens, md.block_table)]
        self.qsl, self.seq_lens, self.block_table = meta
        self.slot_mapping = md.slot_mapping.to(device)
        t = step.num_tokens
        gen = torch.Generator(device=device).manual_seed(seed + 1)  # drawn where they live

        def randn(*shape):
            return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

        self.q, self.k, self.v = randn(t, hq, d), randn(t, hkv, d), randn(t, hkv, d)
        self.cache0 = randn(2, nb, block_size, hkv, d)
        self.cache = self.cache0.clone()
        attention_mod.write_kv(self.cache, self.k, self.v, self.slot_mapping)
        self.scale = d ** -0.5
        self.num_actual = step.num_actual_tokens

    def meta(self):
        return self.qsl, self.seq_lens, self.block_table

    def pad_requests(self, num_reqs: int) -> "_Inputs":
        """Pad the request dim to ``num_reqs`` with zero-length requests, as the CUDA-graph
        runner pads a step to its captured request capacity (``query_start_loc`` repeats its
        last value, ``seq_lens`` 0, block-table rows 0)."""
        extra = num_reqs - self.seq_lens.shape[0]
        self.qsl = torch.cat([self.qsl, self.qsl[-1:].expand(extra)])
        self.seq_lens = torch.cat([self.seq_lens, self.seq_lens.new_zeros(extra)])
        self.block_table = torch.cat(
            [self.block_table, self.block_table.new_zeros(extra, self.block_table.shape[1])])
        return self

    def kernel(self, config=None):
        return attention_mod.paged_attention_triton(self.q, self.cache, *self.meta(), self.scale,
                                                    config=config)

    def reference(self):
        return attention_mod.paged_attention(self.q, self.cache, *self.meta(), self.scale)


def _check(inp: _Inputs, out: torch.Tensor, atol: float, rtol: float) -> None:
    assert out.shape == inp.q.shape and out.dtype == inp.q.dtype
    assert torch.isfinite(out).all()
    assert_close(out.float(), inp.reference().float(), atol=atol, rtol=rtol)
    assert torch.count_nonzero(out[inp.num_actual:]) == 0, "padding rows must be zero"


# ------------------------------------------------------------------------------------------
# interpreter (CPU)
# ------------------------------------------------------------------------------------------
# Triton reads TRITON_INTERPRET when it decorates a function, and triton.language's own helpers
# (tl.zeros, tl.max, tl.sum) are decorated when triton is imported: the variable must be set
# before the process imports triton. So one subprocess (this file run as a script, CPU only)
# runs every case below and saves outputs and references; the tests check them here.

#: small cases: block_size 4 (contexts span many pages), D 16 (tl.dot's minimum on GPU)
SMALL = {
    "prefill_mha": dict(decodes=[], prefills=[(0, 7), (0, 19), (0, 3)], hq=4, hkv=4),
    "decode_gqa": dict(decodes=[0, 5, 37, 100, 16, 63], prefills=[], hq=4, hkv=2),
    "chunked_mixed_gqa": dict(decodes=[13, 0, 40], prefills=[(9, 5), (16, 12), (0, 6)],
                              hq=4, hkv=2),
    "mqa_padding": dict(decodes=[5, 21], prefills=[(3, 4)], hq=4, hkv=1, pad_to=15),
    "gqa3_padding": dict(decodes=[30, 2], prefills=[(7, 9)], hq=6, hkv=2, pad_to=16),
    "decode_padding": dict(decodes=[70, 17, 1], prefills=[], hq=4, hkv=4, pad_to=8),
}

#: tile shapes: the launcher's choice, one token per program (many query blocks per request,
#: tiles of 16 keys), several tokens per program with wide key tiles; ``_pN``: N programs per KV
#: head, each looping over the query blocks (the persistent grid a large request dim gets)
CONFIGS = {"auto": None, "m1_n16": (1, 16, 4, 1), "m8_n32": (8, 32, 4, 1),
           "m1_n16_p1": (1, 16, 4, 1, 1), "m8_n32_p3": (8, 32, 4, 1, 3)}


def _config(name):
    c = CONFIGS[name]
    return None if c is None else attention_mod.KernelConfig(*c)


def _record(inp: _Inputs, out: torch.Tensor, ref: torch.Tensor, tol: float) -> dict:
    return {"out": out, "ref": ref, "num_actual": inp.num_actual, "tol": tol}


def _case_small(name, config):
    inp = _Inputs(**SMALL[name], d=16, block_size=4)
    return _record(inp, inp.kernel(_config(config)), inp.reference(), 2e-5)


def _case_bf16(name):
    inp = _Inputs(**SMALL[name], d=32, block_size=4, dtype=torch.bfloat16)
    return _record(inp, inp.kernel(), inp.reference(), 2e-2)


def _case_int64_metadata():
    """``query_start_loc`` / ``seq_lens`` / ``block_table`` may be int64 (the op accepts both)."""
    inp = _Inputs(decodes=[40, 3], prefills=[(18, 20)], hq=4, hkv=2, d=16, block_size=16,
                  meta_dtype=torch.int64, pad_to=26)
    return _record(inp, inp.kernel(_config("m8_n32")), inp.reference(), 2e-5)


def _case_no_requests(tokens):
    """R = 0 with ``tokens`` padding rows (0: T = 0 too)."""
    q, cache = torch.randn(tokens, 4, 16), torch.randn(2, 3, 4, 2, 16)
    meta = (torch.zeros(1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
            torch.zeros(0, 1, dtype=torch.int32))
    out = attention_mod.paged_attention_triton(q, cache, *meta, 0.25)
    ref = attention_mod.paged_attention(q, cache, *meta, 0.25)
    return {"out": out, "ref": ref, "num_actual": 0, "tol": 0.0}


def _case_no_real_tokens():
    """R = 2 requests with empty queries (``query_start_loc`` all 0): every row is padding."""
    inp = _Inputs(decodes=[3, 9], prefills=[], hq=4, hkv=2, d=16, block_size=4)
    inp.qsl = torch.zeros_like(inp.qsl)
    inp.num_actual = 0
    return _record(inp, inp.kernel(), inp.reference(), 0.0)


def _case_never_reads_past_context():
    """Cache slots outside every request's context (spare blocks, the unused tail of a block)
    hold NaN, and block-table entries past a request's blocks are out of range: the kernel's
    output stays finite and equal to the reference's on the clean cache."""
    inp = _Inputs(decodes=[6, 13], prefills=[(2, 5)], hq=4, hkv=2, d=16, block_size=4,
                  spare_blocks=3)
    ref = inp.reference()
    poisoned = torch.full_like(inp.cache, float("nan"))
    flat_p = poisoned.view(2, -1, *inp.cache.shape[3:])
    flat_c = inp.cache.view(2, -1, *inp.cache.shape[3:])
    bt = inp.block_table.long()
    for i, s in enumerate(inp.seq_lens.tolist()):
        pos = torch.arange(s)
        slots = bt[i][pos // 4] * 4 + pos % 4
        flat_p[:, slots] = flat_c[:, slots]
        inp.block_table[i, -(-s // 4):] = 10**6  # past the request's blocks
    inp.cache = poisoned
    return _record(inp, inp.kernel(_config("m8_n32")), ref, 2e-5)


def _case_table_narrower_than_context():
    """Metadata a serving engine should not send but the runner's warm-up steps do: requests
    longer than the block table is wide, and an id outside the pool among a request's blocks.
    The kernel never reads out of bounds and agrees with the reference (keys past the table's
    width are absent, ids are clamped into the pool)."""
    inp = _Inputs(decodes=[], prefills=[(0, 12), (0, 9)], hq=4, hkv=2, d=16, block_size=4)
    inp.block_table = inp.block_table[:, :2].clone()  # 8 keys of 12 / 9
    inp.block_table[1, 1] = 10**6
    return _record(inp, inp.kernel(_config("m8_n32")), inp.reference(), 2e-5)


def _case_padded_requests(config):
    """The request dim padded past the tokens (every program past the last real block returns
    after two loads): one launch of each tile shape equals the reference."""
    inp = _Inputs(decodes=[5, 0, 9], prefills=[(3, 10), (0, 7)], hq=4, hkv=2, d=16,
                  block_size=4, pad_to=22).pad_requests(30)
    return _record(inp, inp.kernel(_config(config)), inp.reference(), 2e-5)


def _case_empty_requests_between(config):
    """Zero-length requests between real ones and after them (a request whose tokens all went
    to the other ubatch): every program skips their query blocks and covers the real ones."""
    inp = _Inputs(decodes=[11, 3], prefills=[(2, 9), (0, 5)], hq=4, hkv=2, d=16,
                  block_size=4, pad_to=20)
    qsl, seq, bt = inp.qsl, inp.seq_lens, inp.block_table
    # empty requests at 0, between requests 1 and 2, and at the end
    inp.qsl = torch.cat([qsl[:1], qsl[:2], qsl[1:], qsl[-1:]])
    inp.seq_lens = torch.cat([seq.new_zeros(1), seq[:1], seq.new_full((1,), 7), seq[1:],
                              seq.new_zeros(1)])
    inp.block_table = torch.cat([bt[:1], bt[:1], bt[1:2], bt[1:], bt[:1]])
    return _record(inp, inp.kernel(_config(config)), inp.reference(), 2e-5)


def _case_padded_tile_gate(kind):
    was, attention_mod.GATED_MIN_TOKENS = attention_mod.GATED_MIN_TOKENS, 64  # the case's T
    try:
        return _padded_tile_gate(kind)
    finally:
        attention_mod.GATED_MIN_TOKENS = was


def _padded_tile_gate(kind):
    """The request dim padded far past the requests, as the runner pads it: the shapes look
    like decode (T <= 2 R), so two launches are planned and the step's real tokens and requests
    pick one at run time: ``prefill`` (long requests: the 64-row launch runs), ``decode`` (one
    token per request: the 16-row launch runs)."""
    if kind == "prefill":
        inp = _Inputs(decodes=[], prefills=[(3, 40), (0, 70)], hq=4, hkv=2, d=16,
                      block_size=4, pad_to=128).pad_requests(64)
    else:
        inp = _Inputs(decodes=[5, 30, 0, 61, 17], prefills=[], hq=4, hkv=2, d=16,
                      block_size=4, pad_to=128).pad_requests(64)
    return _record(inp, inp.kernel(), inp.reference(), 2e-5)


INTERP_CASES = {
    **{f"{n}/{c}": (lambda n=n, c=c: _case_small(n, c)) for n in SMALL for c in CONFIGS},
    **{f"bf16/{n}": (lambda n=n: _case_bf16(n)) for n in ("chunked_mixed_gqa", "mqa_padding")},
    "int64_metadata": _case_int64_metadata,
    "T0_R0": lambda: _case_no_requests(0),
    "R0_padding": lambda: _case_no_requests(3),
    "no_real_tokens": _case_no_real_tokens,
    "never_reads_past_context": _case_never_reads_past_context,
    "table_narrower_than_context": _case_table_narrower_than_context,
    **{f"padded_requests/{c}": (lambda c=c: _case_padded_requests(c)) for c in CONFIGS},
    **{f"empty_requests_between/{c}": (lambda c=c: _case_empty_requests_between(c))
       for c in CONFIGS},
    **{f"padded_tile_gate/{k}": (lambda k=k: _case_padded_tile_gate(k))
       for k in ("prefill", "decode")},
}


def _run_interpreter_cases(path: str) -> None:
    """Subprocess entry (``TRITON_INTERPRET=1``): every case's record, or its error."""
    import traceback

    assert os.environ.get("TRITON_INTERPRET") == "1"
    res = {}
    for name, fn in INTERP_CASES.items():
        try:
            res[name] = fn()
        except Exception as e:  # noqa: BLE001
            res[name] = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"}
    torch.save(res, path)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    path = tmp_path_factory.mktemp("attention_interp") / "results.pt"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), str(path)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    return torch.load(path)


@pytest.mark.parametrize("name", list(INTERP_CASES))
def test_interpreter_kernel_matches_reference(interpreted, name):
    rec = interpreted[name]
    assert "error" not in rec, rec.get("error")
    out, ref = rec["out"], rec["ref"]
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all()
    assert_close(out.float(), ref.float(), atol=rec["tol"], rtol=rec["tol"])
    assert torch.count_nonzero(out[rec["num_actual"]:]) == 0, "padding rows must be zero"


def test_kernel_supports():
    """The CUDA op runs the kernel only where it is defined: power-of-two head dim in
    [16, 256], bf16/fp16/fp32 q and cache; CPU tensors always take the reference."""
    for d, dtype, ok in [(64, torch.bfloat16, True), (128, torch.float32, True),
                         (16, torch.float16, True), (96, torch.bfloat16, False),
                         (8, torch.float32, False), (512, torch.bfloat16, False),
                         (64, torch.float64, False)]:
        assert attention_mod._kernel_supports(d, dtype, dtype) is ok, (d, dtype)
    assert not attention_mod._kernel_supports(64, torch.bfloat16, torch.float64)
    assert not attention_mod._fused_ok(torch.zeros(2, 4, 64), torch.zeros(2, 1, 16, 2, 64))


def test_grid_does_not_grow_with_the_request_padding():
    """Axis 0 of the launch grid: ``T // BLOCK_M + R`` query-block programs while that is at most
    the device's share per KV head, else that share, each program looping over the blocks (a
    CUDA-graph runner pads the request dim to its capacity: 1,024 zero-length requests must not
    launch 1,024 programs per head)."""
    cfg16 = attention_mod.KernelConfig(block_m=16, tile_n=64)
    share = attention_mod.programs_per_head(cfg16, num_tokens=1024, num_reqs=1024, hkv=128,
                                            num_sms=132)
    assert share == -(-132 * attention_mod.PROGRAMS_PER_SM // 128)
    # a small, unpadded prefill keeps one program per query block
    cfg64 = attention_mod.KernelConfig(block_m=64, tile_n=64)
    assert attention_mod.programs_per_head(cfg64, 1024, 1, hkv=128, num_sms=132) == 17
    assert attention_mod.programs_per_head(cfg64, 64, 3, hkv=2, num_sms=132) == 4
    # an explicit count is taken as given, but never above the blocks
    fixed = attention_mod.KernelConfig(block_m=16, tile_n=64, programs=5)
    assert attention_mod.programs_per_head(fixed, 1024, 1024, hkv=128, num_sms=132) == 5
    assert attention_mod.programs_per_head(fixed, 16, 1, hkv=128, num_sms=132) == 2
    with pytest.raises(attention_mod.AttentionOpError, match="programs"):
        attention_mod.KernelConfig(block_m=16, tile_n=64, programs=0)


def test_launch_plan_picks_the_tile_at_run_time_where_the_shapes_cannot():
    """Shapes that look like prefill (T > 2 R) get one 64-row launch; shapes that look like
    decode get the 16-row launch and, where a 64-row tile fits in the token dim, a 64-row
    launch too, each gated on the step's real tokens and requests (``TILE_GATE``): a prefill
    step padded to the runner's request capacity then runs 64-row tiles. An explicit config is
    one launch, ungated."""
    plan = attention_mod.launch_plan
    (only,) = plan(1024, 4, 1, torch.bfloat16)
    assert only == (attention_mod.KernelConfig(64, 64), attention_mod.GATE_NONE)
    rows = plan(1024, 1024, 1, torch.bfloat16)
    assert rows == [(attention_mod.KernelConfig(64, 64), attention_mod.GATE_PREFILL),
                    (attention_mod.KernelConfig(16, 64), attention_mod.GATE_DECODE)]
    # GQA packs G_PAD heads per token: tiles of 64 / 16 rows are 16 / 4 tokens at G_PAD 4
    rows = plan(2048, 2048, 4, torch.float32)
    assert [c.block_m for c, _ in rows] == [16, 4] and rows[0][0].tile_n == 32
    # below GATED_MIN_TOKENS the decode launch runs alone, ungated
    (only,) = plan(attention_mod.GATED_MIN_TOKENS - 1, 1024, 1, torch.bfloat16)
    assert only == (attention_mod.KernelConfig(16, 64), attention_mod.GATE_NONE)
    cfg = attention_mod.KernelConfig(8, 32)
    assert plan(1024, 1024, 1, torch.bfloat16, cfg) == [(cfg, attention_mod.GATE_NONE)]


@pytest.mark.parametrize("block_m,gate", [(64, 0), (64, 1), (16, 2)])
def test_kernel_compiles_for_sm90_without_a_gpu(block_m, gate):
    """The CUDA kernel (not the interpreter's) compiles for sm_90 to a cubin on this CPU-only
    host, with each of ``launch_plan``'s gates: Triton's compiler refuses constructs its
    interpreter runs (a loop around early exits, a gate on a constexpr)."""
    triton = pytest.importorskip("triton")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError:
        pytest.skip("this Triton has no ahead-of-time compile API")
    built = attention_mod._triton_kernel()
    if built is None or built[2]:
        pytest.skip("Triton missing, or this process runs its interpreter")
    ptr, i32 = "*bf16", "i32"
    sig = {"out_ptr": ptr, "q_ptr": ptr, "k_ptr": ptr, "v_ptr": ptr, "qsl_ptr": "*i32",
           "seq_lens_ptr": "*i32", "bt_ptr": "*i32", "scale_log2": "fp32", "num_reqs": i32,
           "bt_width": i32, "num_blocks": i32, **{k: i32 for k in (
               "stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_kb", "stride_ks",
               "stride_kh", "stride_bt")}}
    consts = {"G": 1, "G_PAD": 1, "BLOCK_M": block_m, "TILE_N": 64, "HEAD_DIM": 128,
              "BLOCK_SIZE": 16, "DOT_FP32": False, "TILE_GATE": gate}
    sig.update({k: "constexpr" for k in consts})
    src = ASTSource(fn=built[1], signature=sig,
                    constexprs={(list(sig).index(k),): v for k, v in consts.items()})
    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": 4, "num_stages": 2})
    except FileNotFoundError as e:  # no ptxas beside this Triton
        pytest.skip(f"no CUDA toolchain for the cubin: {e}")
    assert compiled.asm["cubin"] and "mma" in compiled.asm["ptx"]  # tensor cores (wgmma at 64)


# ------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------


def _decode_ctx(n, lo, hi, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi + 1, (n,), generator=g).tolist()


#: DeepSeek-V2-Lite attention (Hq = Hkv = 16, D = 128, block_size 16) and GQA variants
GPU_CASES = {
    "decode1024": dict(decodes=_decode_ctx(1024, 128, 2048, 0), prefills=[], hq=16, hkv=16),
    "prefill2048": dict(decodes=[], prefills=[(0, 512)] * 4, hq=16, hkv=16),
    "chunked_mixed": dict(decodes=_decode_ctx(200, 1, 1500, 1),
                          prefills=[(0, 300), (700, 256), (1024, 77), (15, 1)], hq=16, hkv=16,
                          pad_to=1024),
    "gqa_decode": dict(decodes=_decode_ctx(512, 128, 2048, 2), prefills=[], hq=16, hkv=4),
    "gqa_mixed": dict(decodes=_decode_ctx(64, 0, 900, 3), prefills=[(0, 257), (33, 190)],
                      hq=16, hkv=2, pad_to=600),
    "gqa3_mixed": dict(decodes=_decode_ctx(32, 0, 300, 4), prefills=[(5, 100)], hq=12, hkv=4),
}


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(GPU_CASES))
def test_gpu_kernel_matches_reference_bf16(name):
    inp = _Inputs(**GPU_CASES[name], d=128, block_size=16, dtype=torch.bfloat16, device="cuda")
    _check(inp, inp.kernel(), atol=2e-2, rtol=2e-2)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_kernel_dtypes(dtype, d):
    tol = 2e-5 if dtype == torch.float32 else 5e-3
    inp = _Inputs(decodes=_decode_ctx(40, 0, 700, 5), prefills=[(0, 130), (61, 70)], hq=8,
                  hkv=4, d=d, block_size=16, dtype=dtype, device="cuda", pad_to=260)
    _check(inp, inp.kernel(), atol=tol, rtol=tol)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("g", [1, 4])
def test_gpu_prefill_padded_to_the_runners_request_capacity(g):
    """V2-Lite heads (GQA ``g``), 1024 tokens of two prefill chunks and 24 decodes, the request
    dim padded to 512 as the runner's capture of a 1024-token ubatch is: equal to the
    reference (the padding programs return early)."""
    inp = _Inputs(decodes=_decode_ctx(24, 0, 700, 7), prefills=[(0, 600), (100, 400)],
                  hq=16, hkv=16 // g, d=128, block_size=16, dtype=torch.bfloat16,
                  device="cuda").pad_requests(512)
    _check(inp, inp.kernel(), atol=2e-2, rtol=2e-2)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_gpu_kernel_tile_shapes(config):
    inp = _Inputs(**GPU_CASES["gqa_mixed"], d=128, block_size=16, dtype=torch.bfloat16,
                  device="cuda")
    _check(inp, inp.kernel(_config(config)), atol=2e-2, rtol=2e-2)


@needs_cuda
@pytest.mark.gpu
def test_gpu_op_runs_kernel_and_writes_cache(monkeypatch):
    """``torch.ops.dbo.attention`` on CUDA writes the KV cache, then runs the kernel (the
    reference is not called)."""
    inp = _Inputs(**GPU_CASES["gqa_mixed"], d=128, block_size=16, dtype=torch.bfloat16,
                  device="cuda")
    ref = inp.reference()

    def no_reference(*a, **k):
        raise AssertionError("the CUDA op fell back to the reference")

    monkeypatch.setattr(attention_mod, "paged_attention", no_reference)
    cache = inp.cache0.clone()
    out = torch.ops.dbo.attention(inp.q, inp.k, inp.v, cache, inp.slot_mapping, *inp.meta(),
                                  inp.scale)
    assert torch.equal(cache, inp.cache), "KV write differs from write_kv"
    assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@needs_cuda
@pytest.mark.gpu
def test_gpu_op_falls_back_for_other_head_dims():
    """Head dim 80 (not a power of two): the CUDA op runs the reference; results still right."""
    inp = _Inputs(decodes=[50, 3], prefills=[(4, 20)], hq=4, hkv=2, d=80, block_size=16,
                  dtype=torch.bfloat16, device="cuda")
    assert not attention_mod._fused_ok(inp.q, inp.cache)
    cache = inp.cache0.clone()
    out = torch.ops.dbo.attention(inp.q, inp.k, inp.v, cache, inp.slot_mapping, *inp.meta(),
                                  inp.scale)
    assert torch.equal(cache, inp.cache)
    assert_close(out, inp.reference())


@needs_cuda
@pytest.mark.gpu
def test_gpu_opcheck():
    inp = _Inputs(decodes=[20, 3], prefills=[(5, 17)], hq=4, hkv=2, d=64, block_size=16,
                  dtype=torch.bfloat16, device="cuda", pad_to=24)
    torch.library.opcheck(torch.ops.dbo.attention.default,
                          (inp.q, inp.k, inp.v, inp.cache0.clone(), inp.slot_mapping,
                           *inp.meta(), inp.scale))


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("hkv", [16, 4])
def test_gpu_cuda_graph_replay_new_metadata(hkv):
    """Capture the op once (KV write + kernel), then replay with new tokens, new KV contents
    and new metadata copied into the static tensors: longer contexts, another prefill/decode
    mix, other block tables (same T, R, block-table width and pool). Every replay matches the
    eager reference on the same inputs, and the cache holds the step's K/V."""
    from dbo_compile.runtime.capture import capture

    t, pool, bs, d = 768, 12000, 16, 128
    steps = [
        dict(decodes=_decode_ctx(96, 100, 600, 10), prefills=[(0, 300), (40, 200), (0, 4)]),
        dict(decodes=_decode_ctx(96, 900, 2000, 11), prefills=[(0, 500), (1, 3), (700, 1)]),
        dict(decodes=_decode_ctx(96, 0, 40, 12), prefills=[(0, 1), (0, 1), (3000, 600)]),
    ]
    width = max(-(-(c + q) // bs) for s in steps
                for c, q in [(c, 1) for c in s["decodes"]] + s["prefills"])
    inputs = [_Inputs(**s, hq=16, hkv=hkv, d=d, block_size=bs, dtype=torch.bfloat16,
                      device="cuda", pad_to=t, num_blocks=pool, seed=20 + i)
              for i, s in enumerate(steps)]
    first = inputs[0]
    static = {
        "q": first.q.clone(), "k": first.k.clone(), "v": first.v.clone(),
        "cache": first.cache0.clone(), "slots": first.slot_mapping.clone(),
        "qsl": first.qsl.clone(), "seq": first.seq_lens.clone(),
        "bt": torch.zeros(first.block_table.shape[0], width, dtype=torch.int32, device="cuda"),
    }
    static["bt"][:, :first.block_table.shape[1]] = first.block_table

    def step():
        return torch.ops.dbo.attention(static["q"], static["k"], static["v"], static["cache"],
                                       static["slots"], static["qsl"], static["seq"],
                                       static["bt"], first.scale)

    graph, out = capture(step, warmup=2)
    for inp in inputs:
        assert inp.q.shape[0] == t and inp.qsl.shape == static["qsl"].shape
        for key, new in (("q", inp.q), ("k", inp.k), ("v", inp.v), ("cache", inp.cache0),
                         ("slots", inp.slot_mapping), ("qsl", inp.qsl), ("seq", inp.seq_lens)):
            static[key].copy_(new)
        static["bt"].zero_()
        static["bt"][:, :inp.block_table.shape[1]] = inp.block_table
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static["cache"], inp.cache), "KV write in the graph"
        _check(inp, out, atol=2e-2, rtol=2e-2)


if __name__ == "__main__":
    _run_interpreter_cases(sys.argv[1])
