"""The masked FP8 cast of the deep_gemm backend (dbo_compile.ops.fp8_cast, issue 28 item 4):
the Triton kernel under Triton's CPU interpreter against the torch reference cast
(per_token_cast_fp8): the rows below each expert's count equal the reference (values and
MN-major scales), the rows past the counts are not written, counts of 0 and of the full
capacity, the 2-D form with one count, and what it refuses. On CUDA the same checks compiled,
and the deep_gemm FP8 expert op reading it (``gpu``)."""

from __future__ import annotations

import pytest
import torch

from dbo_compile.errors import ExpertsOpError
from dbo_compile.ops import fp8_cast
from dbo_compile.ops.fp8_cast import per_token_cast_fp8, per_token_cast_fp8_masked

#: run under the interpreter (a fresh process: TRITON_INTERPRET is read at decoration);
#: ``check(device, exact)`` is shared with the GPU test
_CHECK = """
import torch
from dbo_compile.ops.fp8_cast import per_token_cast_fp8, per_token_cast_fp8_masked

def codes(t):
    return t.view(torch.uint8).int()

def same(q, rq, exact):
    # the codes of the kernel's q and the reference's rq agree, at most one code apart where
    # compiled (exact=False: the GPU's cvt.rn). The interpreter's float -> e4m3 conversion
    # (exact=True) departs from round-to-nearest-even in three ways, allowed here and nowhere
    # else: it rounds exact ties up (68 -> 72, RNE: 64), drops the carry of a mantissa that
    # rounds up to the next power of two (127.6 -> 64 instead of 128), and misrounds
    # subnormals (|q| < 2^-6: 3.94 * 2^-9 -> 2 * 2^-9)
    a, b = codes(q), codes(rq)
    if a.numel() == 0:
        return True
    near = (a - b).abs() <= 1
    if not exact:
        return bool(near.all())
    carry = ((b & 7) == 0) & (a == b - 8)
    subnormal = ((b & 0x78) == 0) & ((a & 0x80) == (b & 0x80))
    return bool((near | carry | subnormal).all()) and bool((a == b).float().mean() > 0.9)

def check(device, exact):
    g = torch.Generator().manual_seed(0)
    cases = [(3, 8, 256, [0, 8, 3]),          # an empty expert, a full one, a partial one
             (2, 12, 384, [12, 12]),          # full capacity everywhere
             (4, 6, 1152, [0, 0, 0, 0]),      # nothing to cast (9 groups: 3 programs of 4)
             (1, 5, 128, [2]),
             (2, 70, 1152, [70, 37])]         # row blocks of 16: five, three
    import dbo_compile.ops.fp8_cast as F
    for programs in (4096, 7):  # 7: fewer row programs than row blocks, each loops
        F._PROGRAMS = programs
        check_cases(device, exact, cases, g)
    F._PROGRAMS = 4096
    rest(device, exact, g)

def check_cases(device, exact, cases, g):
    for e, m, k, counts in cases:
        x = (torch.randn(e, m, k, generator=g) * 3).bfloat16()
        x[0, :, :128] *= 1e-6                 # a group below the amax clamp
        x = x.to(device)
        c = torch.tensor(counts, dtype=torch.int32, device=device)
        q, s = per_token_cast_fp8_masked(x, c)
        rq, rs = per_token_cast_fp8(x)
        assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape, (q.dtype, q.shape)
        assert s.shape == (e, m, k // 128) and s.stride() == (k // 128 * m, 1, m), s.stride()
        for i, n in enumerate(counts):
            assert same(q[i, :n], rq[i, :n], exact), (e, m, k, i)
            torch.testing.assert_close(s[i, :n], rs[i, :n], rtol=0 if exact else 1e-6, atol=0)

def rest(device, exact, g):
    # rows past the counts are not written: pre-filled outputs keep their bytes
    x = torch.randn(3, 8, 256, generator=g).bfloat16().to(device)
    x[:, 4:] = float("nan")  # undefined rows of the receive buffer
    c = torch.tensor([4, 0, 2], dtype=torch.int32, device=device)
    q0 = torch.full((3, 8, 256), 0x5A, dtype=torch.uint8, device=device)
    s0 = torch.full((3, 2, 8), -7.0, device=device).transpose(1, 2)
    q, s = per_token_cast_fp8_masked(x, c, out=(q0.view(torch.float8_e4m3fn), s0))
    assert q.data_ptr() == q0.data_ptr() and s.data_ptr() == s0.data_ptr()
    for i, n in enumerate([4, 0, 2]):
        assert (codes(q[i, n:]) == 0x5A).all(), i
        assert (s[i, n:] == -7.0).all(), i
        assert torch.isfinite(s[i, :n]).all() and (codes(q[i, :n]) != 0x5A).any() if n else True
    # 2-D rows with one count (the contiguous layout's rows below psum[-1])
    x2 = torch.randn(10, 256, generator=g).bfloat16().to(device)
    q, s = per_token_cast_fp8_masked(x2, torch.tensor([7], dtype=torch.int32, device=device))
    rq, rs = per_token_cast_fp8(x2)
    assert q.shape == (10, 256) and s.shape == (10, 2) and s.stride() == (1, 10)
    assert same(q[:7], rq[:7], exact)
    torch.testing.assert_close(s[:7], rs[:7], rtol=0 if exact else 1e-6, atol=0)
"""


#: the capacity of bench_experts' v2lite-ep8 row at 1024 tokens (issue 28: a 1.51 FP8 error
#: there): M = 8192 rows per expert, row programs a quarter of the row blocks (128 of 512, as
#: the GPU's launch at K=2048 has them: ITERS=4), counts at and past the passes' edges
_CAPACITY = """
def same_at_capacity(q, rq, exact):
    # same(), and the interpreter's dropped carry at the subnormal edge too (a value just below
    # 2^-6 -> 2^-7 instead of 2^-6: codes 0x04 for 0x08), which the 8192-row case meets
    if exact:
        a, b = codes(q), codes(rq)
        edge = ((b & 0x7F) == 0x08) & ((a & 0x7F) == 0x04) & ((a & 0x80) == (b & 0x80))
        q = torch.where(edge, rq.view(torch.uint8), q.view(torch.uint8)).view(q.dtype)
    return same(q, rq, exact)

def capacity(device, exact):
    import dbo_compile.ops.fp8_cast as F
    e, m, k = 4, 8192, 128
    F._PROGRAMS = e * 128  # 128 row programs per expert, 512 row blocks: four passes
    counts = [m, 2049, 2048, 767]  # every pass, one row past one pass, one pass, a partial one
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(e, m, k, generator=g) * 3).bfloat16()
    for i, n in enumerate(counts):
        x[i, n:] = float("nan")  # undefined rows of the receive buffer
    x = x.to(device)
    c = torch.tensor(counts, dtype=torch.int32, device=device)
    q0 = torch.full((e, m, k), 0x5A, dtype=torch.uint8, device=device)
    s0 = torch.full((e, 1, m), -7.0, device=device).transpose(1, 2)
    q, s = per_token_cast_fp8_masked(x, c, out=(q0.view(torch.float8_e4m3fn), s0))
    rq, rs = per_token_cast_fp8(x)
    for i, n in enumerate(counts):
        assert same_at_capacity(q[i, :n], rq[i, :n], exact), (i, n)
        torch.testing.assert_close(s[i, :n], rs[i, :n], rtol=0 if exact else 1e-6, atol=0)
        assert (codes(q[i, n:]) == 0x5A).all() and (s[i, n:] == -7.0).all(), (i, n)
    F._PROGRAMS = 4096
"""


def test_masked_cast_covers_a_large_capacity_in_interpreter():
    """Every valid row of an expert-major buffer of bench_experts' capacity (8192 rows per
    expert) when each row program loops over several row blocks; no row past the counts."""
    from triton_interp import run_interpreted

    out = run_interpreted(_CHECK + _CAPACITY + "\ncapacity('cpu', exact=True)\nprint('ok')\n")
    assert out.strip().endswith("ok")


def test_the_capacity_check_can_fail_in_interpreter():
    """A cast whose row programs stopped after one pass over the row blocks fails it."""
    from triton_interp import run_interpreted

    one_pass = _CHECK + _CAPACITY + """
import dbo_compile.ops.fp8_cast as F
triton, kernel = F.fp8_cast_kernels()
class OnePass:
    def __getitem__(self, grid):
        def launch(*args, ITERS, **kw):
            return kernel[grid](*args, ITERS=1, **kw)
        return launch
F.fp8_cast_kernels = lambda: (triton, OnePass())
try:
    capacity('cpu', exact=True)
except AssertionError:
    print('caught')
"""
    assert run_interpreted(one_pass).strip().endswith("caught")


def test_masked_cast_equals_the_reference_on_valid_rows_in_interpreter():
    from triton_interp import run_interpreted

    out = run_interpreted(_CHECK + "\ncheck('cpu', exact=True)\nprint('ok')\n")
    assert out.strip().endswith("ok")


def test_the_check_can_fail_in_interpreter():
    """A cast that wrote the rows past the counts, or one rounding differently, fails it."""
    from triton_interp import run_interpreted

    broken = _CHECK + """
import dbo_compile.ops.fp8_cast as F
good = F.per_token_cast_fp8_masked
def all_rows(x, counts, **kw):
    return good(x, torch.full_like(counts, x.shape[-2]), **kw)
F.per_token_cast_fp8_masked = all_rows
globals()['per_token_cast_fp8_masked'] = all_rows
try:
    check('cpu', exact=True)
except AssertionError:
    print('caught')
"""
    assert run_interpreted(broken).strip().endswith("caught")


def test_reference_cast_rule():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 256, generator=g)
    q, s = per_token_cast_fp8(x)
    torch.testing.assert_close(s, x.view(2, 4, 2, 128).abs().amax(-1) / 448)
    assert s.stride() == (8, 1, 4)


@pytest.mark.parametrize("k", [200, 100, 130])
def test_hidden_sizes_off_the_128_block_are_refused(k, monkeypatch):
    monkeypatch.setattr(fp8_cast, "fp8_cast_kernels", lambda: (None, None))
    x = torch.zeros(2, 4, k, dtype=torch.bfloat16)
    with pytest.raises(ExpertsOpError, match=f"K={k} is not a multiple of 128"):
        per_token_cast_fp8_masked(x, torch.zeros(2, dtype=torch.int32))


def test_counts_that_do_not_match_are_refused(monkeypatch):
    monkeypatch.setattr(fp8_cast, "fp8_cast_kernels", lambda: (None, None))
    x = torch.zeros(2, 4, 256, dtype=torch.bfloat16)
    with pytest.raises(ExpertsOpError, match=r"counts must be int32 \[2\]"):
        per_token_cast_fp8_masked(x, torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ExpertsOpError, match="counts must be int32"):
        per_token_cast_fp8_masked(x, torch.zeros(2, dtype=torch.int64))


def test_out_that_does_not_match_is_refused(monkeypatch):
    monkeypatch.setattr(fp8_cast, "fp8_cast_kernels", lambda: (None, None))
    x = torch.zeros(2, 4, 256, dtype=torch.bfloat16)
    q = torch.empty(2, 4, 256, dtype=torch.float8_e4m3fn)
    row_major = torch.empty(2, 4, 2)  # not the MN-major scales DeepGEMM reads
    with pytest.raises(ExpertsOpError, match="out must be"):
        per_token_cast_fp8_masked(x, torch.zeros(2, dtype=torch.int32), out=(q, row_major))


def test_without_triton_the_error_says_so(monkeypatch):
    monkeypatch.setattr(fp8_cast, "fp8_cast_kernels", lambda: None)
    with pytest.raises(ExpertsOpError, match="needs Triton"):
        per_token_cast_fp8_masked(torch.zeros(1, 2, 128), torch.zeros(1, dtype=torch.int32))


@pytest.mark.gpu
def test_masked_cast_on_cuda():
    pytest.importorskip("triton")
    scope: dict = {}
    exec(_CHECK, scope)
    scope["check"]("cuda", exact=False)
    exec(_CAPACITY, scope)
    scope["capacity"]("cuda", exact=False)


@pytest.mark.gpu
def test_deep_gemm_fp8_masked_expert_op_reads_the_masked_cast():
    """The deep_gemm FP8 expert op on the expert-major layout (rows past the counts NaN) with
    the masked cast: its valid rows stay within a few percent of bf16."""
    pytest.importorskip("deep_gemm")
    from dbo_compile.ops.experts import get_experts_backend

    g = torch.Generator().manual_seed(0)
    e, m, h, inter = 4, 128, 512, 256
    x = torch.randn(e, m, h, generator=g).bfloat16().cuda()
    counts = torch.tensor([5, 0, m, 77], dtype=torch.int32, device="cuda")
    for i, n in enumerate(counts.tolist()):
        x[i, n:] = float("nan")
    w13 = (torch.randn(e, 2 * inter, h, generator=g) * 0.05).bfloat16().cuda()
    w2 = (torch.randn(e, h, inter, generator=g) * 0.05).bfloat16().cuda()
    ranges = torch.zeros(e, 1, dtype=torch.int64, device="cuda")
    bf16 = get_experts_backend("deep_gemm").run(x, counts, ranges, w13, w2)
    fp8 = get_experts_backend("deep_gemm:fp8=true").run(x, counts, ranges, w13, w2)
    rows = [(i, n) for i, n in enumerate(counts.tolist())]
    bf16 = torch.cat([bf16[i, :n] for i, n in rows]).float()
    fp8 = torch.cat([fp8[i, :n] for i, n in rows]).float()
    assert torch.isfinite(fp8).all()
    rel = ((fp8 - bf16).norm() / bf16.norm()).item()
    assert 0 < rel < 0.08, rel
